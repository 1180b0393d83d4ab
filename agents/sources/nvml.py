"""NVML source: every SCHEMA field of every GPU on this host, and XIDs as they happen.

XID events come from an NVML event set waited on by a thread of its own, so an
XID logged between two samples is never missed. Any field a GPU or driver does
not support reads as None (a blank field), never as an error.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

from agents.sources.base import Source
from telemetry import schema as S

log = logging.getLogger(__name__)

NO_DRIVER_HINT = "To run without a GPU, use --source sim (the fleet simulator) or --source replay."


class NvmlUnavailable(RuntimeError):
    """No NVIDIA driver or NVML library on this host."""


def _nvml():
    try:
        import pynvml
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise NvmlUnavailable(f"nvidia-ml-py is not installed ({e}). {NO_DRIVER_HINT}") from None
    return pynvml


class NvmlSource(Source):
    """Reads GPUs through NVML; ``node`` defaults to this host's short name."""

    def __init__(self, node: str | None = None, xid_wait_ms: int = 500):
        super().__init__()
        nv = self._nv = _nvml()
        try:
            nv.nvmlInit()
        except nv.NVMLError as e:
            raise NvmlUnavailable(f"NVML is not available on this host ({e}): no NVIDIA driver loaded? "
                                  f"{NO_DRIVER_HINT}") from None
        self.node = node or socket.gethostname().split(".")[0]
        self._handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        self._uuid = [self._get(nv.nvmlDeviceGetUUID, h) for h in self._handles]
        self._name = [self._get(nv.nvmlDeviceGetName, h) or "unknown" for h in self._handles]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch_xids, args=(xid_wait_ms,), name="agents-nvml-xid",
                                        daemon=True)
        self._thread.start()

    def _get(self, fn: Callable, *args):
        """Call an NVML getter; None when the GPU or driver does not support it."""
        try:
            v = fn(*args)
        except self._nv.NVMLError as e:
            if e.value != self._nv.NVML_ERROR_NOT_SUPPORTED:
                log.debug("%s failed: %s", fn.__name__, e)
            return None
        return v.decode() if isinstance(v, bytes) else v

    def _fields(self, h) -> dict[int, float | None]:
        """Field values read in one call (memory temperature, NVLink CRC over all lanes)."""
        nv = self._nv
        ids = [nv.NVML_FI_DEV_MEMORY_TEMP, nv.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL]
        values = self._get(nv.nvmlDeviceGetFieldValues, h, ids)
        out: dict[int, float | None] = dict.fromkeys(ids)
        members = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")
        for v in values or ():
            if v.nvmlReturn == nv.NVML_SUCCESS and 0 <= v.valueType < len(members):
                out[v.fieldId] = float(getattr(v.value, members[v.valueType]))
        return out

    def _nvlink_crc_by_link(self, h) -> float | None:
        """Fallback for drivers without the total field: sum the per-link counters."""
        nv, total, seen = self._nv, 0, False
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            v = self._get(nv.nvmlDeviceGetNvLinkErrorCounter, h, link, nv.NVML_NVLINK_ERROR_DL_CRC_FLIT)
            if v is not None:
                total, seen = total + v, True
        return float(total) if seen else None

    def read(self) -> list[dict]:
        nv, now, rows = self._nv, int(time.time() * 1000), []
        for i, h in enumerate(self._handles):
            fields = self._fields(h)
            power_mw = self._get(nv.nvmlDeviceGetPowerUsage, h)
            reasons = self._get(getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons",
                                        nv.nvmlDeviceGetCurrentClocksThrottleReasons), h)
            remap = self._get(nv.nvmlDeviceGetRemappedRows, h)  # (correctable, uncorrectable, pending, failed)
            nvlink = fields[nv.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL]

            def ecc(kind: int, h=h):
                return self._get(nv.nvmlDeviceGetTotalEccErrors, h, kind, nv.NVML_VOLATILE_ECC)

            values = {
                S.GPU_TEMP: self._get(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
                S.MEMORY_TEMP: fields[nv.NVML_FI_DEV_MEMORY_TEMP],
                S.POWER: None if power_mw is None else power_mw / 1000.0,
                S.SM_CLOCK: self._get(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
                S.THROTTLE: reasons,
                S.SBE: ecc(nv.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                S.DBE: ecc(nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
                S.REMAP_CORR: None if remap is None else remap[0],
                S.REMAP_UNCORR: None if remap is None else remap[1],
                S.REMAP_FAILURE: None if remap is None else float(bool(remap[3])),
                S.PCIE_REPLAY: self._get(nv.nvmlDeviceGetPcieReplayCounter, h),
                S.NVLINK_CRC: nvlink if nvlink is not None else self._nvlink_crc_by_link(h),
            }
            row = {"timestamp": now, "node": self.node, "gpu": i, "uuid": self._uuid[i]}
            row.update({k: None if v is None else float(v) for k, v in values.items()})
            rows.append(row)
        return rows

    def _watch_xids(self, wait_ms: int) -> None:
        nv = self._nv
        try:
            events = nv.nvmlEventSetCreate()
        except nv.NVMLError as e:
            log.warning("NVML event sets unavailable (%s): XID events will not be reported", e)
            return
        index = {}
        for i, h in enumerate(self._handles):
            try:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, events)
                index[self._uuid[i]] = i
            except nv.NVMLError as e:
                log.warning("GPU %d: cannot watch XID events (%s)", i, e)
        try:
            while not self._stop.is_set():
                try:
                    data = nv.nvmlEventSetWait_v2(events, wait_ms)
                except nv.NVMLError as e:
                    if e.value != nv.NVML_ERROR_TIMEOUT:
                        log.warning("waiting for XID events failed: %s", e)
                        self._stop.wait(1.0)
                    continue
                if data.eventType & nv.nvmlEventTypeXidCriticalError:
                    gpu = index.get(self._get(nv.nvmlDeviceGetUUID, data.device))
                    if gpu is None:
                        gpu = self._get(nv.nvmlDeviceGetIndex, data.device)
                    if gpu is None:  # the wire format needs a GPU index; say so rather than send -1
                        log.error("XID %d from a GPU NVML cannot identify: not reported", data.eventData)
                        continue
                    self._xids.append({"timestamp": int(time.time() * 1000), "node": self.node,
                                       "gpu": int(gpu), "xid": int(data.eventData)})
        finally:
            nv.nvmlEventSetFree(events)

    def model_name(self, node: str, gpu: int) -> str:
        return self._name[gpu] if 0 <= gpu < len(self._name) else "unknown"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self._nv.nvmlShutdown()
        except self._nv.NVMLError:
            pass

"""A dcgm-exporter stand-in: pages in its exact text format, served on 127.0.0.1.

The page layout follows NVIDIA dcgm-exporter's output: HELP and TYPE per field, labels
in its order (gpu, UUID, pci_bus_id, device, modelName, Hostname, then label fields such
as DCGM_FI_DRIVER_VERSION), integers without a decimal point, the exporter's XID series
carrying an ``xid`` label. The default field set is that of its etc/default-counters.csv.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler

from telemetry import dcgm as D
from telemetry import schema as S
from tests.procs import LoopbackHTTP, write_dripping

MODEL = "NVIDIA H100 80GB HBM3"
# name: (type, help) as dcgm-exporter's default-counters.csv writes them, fields we do not map included
DEFAULT_COUNTERS = {
    S.SM_CLOCK: ("gauge", "SM clock frequency (in MHz)."),
    "DCGM_FI_DEV_MEM_CLOCK": ("gauge", "Memory clock frequency (in MHz)."),
    S.MEMORY_TEMP: ("gauge", "Memory temperature (in C)."),
    S.GPU_TEMP: ("gauge", "GPU temperature (in C)."),
    S.POWER: ("gauge", "Power draw (in W)."),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": ("counter", "Total energy consumption since boot (in mJ)."),
    S.PCIE_REPLAY: ("counter", "Total number of PCIe retries."),
    "DCGM_FI_DEV_GPU_UTIL": ("gauge", "GPU utilization (in %)."),
    S.XID_ERRORS: ("gauge", "Value of the last XID error encountered."),
    "DCGM_FI_DEV_FB_USED": ("gauge", "Framebuffer memory used (in MiB)."),
    S.REMAP_UNCORR: ("counter", "Number of remapped rows for uncorrectable errors"),
    S.REMAP_CORR: ("counter", "Number of remapped rows for correctable errors"),
    S.REMAP_FAILURE: ("gauge", "Whether remapping of rows has failed"),
}
EXTRA_COUNTERS = {
    S.SBE: ("counter", "Total number of single-bit volatile ECC errors."),
    S.DBE: ("counter", "Total number of double-bit volatile ECC errors."),
    S.NVLINK_CRC: ("counter", "Total number of NVLink flow-control CRC errors."),
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": ("gauge", "Current clock event reasons (bitmask)."),
}


@dataclass
class Gpu:
    """One GPU as the page shows it; ``values`` by DCGM field name (absent: not on the page)."""

    index: int
    uuid: str
    last_xid: int = 0
    xid_totals: dict[int, int] = field(default_factory=dict)  # xid -> DCGM_EXP_XID_ERRORS_TOTAL
    values: dict[str, float] = field(default_factory=dict)


def gpu(index: int, node_salt: str = "a", **overrides: float) -> Gpu:
    """A healthy busy H100 with every default field, and ECC/NVLink/throttle values for the extras."""
    values = {S.SM_CLOCK: 1980, "DCGM_FI_DEV_MEM_CLOCK": 2619, S.MEMORY_TEMP: 45 + index, S.GPU_TEMP: 38 + index,
              S.POWER: 612.5 + index, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 912345678, S.PCIE_REPLAY: index,
              "DCGM_FI_DEV_GPU_UTIL": 97, "DCGM_FI_DEV_FB_USED": 71234, S.REMAP_UNCORR: 0, S.REMAP_CORR: 2,
              S.REMAP_FAILURE: 0, S.SBE: 10 + index, S.DBE: 0, S.NVLINK_CRC: 3,
              "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": 0x4}
    values.update(overrides)
    return Gpu(index, f"GPU-{node_salt}{index:07d}-1111-2222-3333-444455556666", values=values)


def render(host: str, gpus: list[Gpu], *, extra_fields: bool = False, xid_totals: bool = False) -> str:
    """The page dcgm-exporter would serve for these GPUs."""
    def labels(g: Gpu) -> str:
        return (f'gpu="{g.index}",UUID="{g.uuid}",pci_bus_id="00000000:{0x18 + 0x10 * g.index:02X}:00.0",'
                f'device="nvidia{g.index}",modelName="{MODEL}",Hostname="{host}",DCGM_FI_DRIVER_VERSION="550.54.15"')

    def number(v: float) -> str:
        return str(int(v)) if float(v).is_integer() else repr(float(v))

    counters = {**DEFAULT_COUNTERS, **(EXTRA_COUNTERS if extra_fields else {})}
    lines = []
    for name, (kind, doc) in counters.items():
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
        for g in gpus:
            value = g.last_xid if name == S.XID_ERRORS else g.values.get(name)
            if value is not None:
                lines.append(f"{name}{{{labels(g)}}} {number(value)}")
    if xid_totals:
        lines += [f"# HELP {D.XID_TOTAL} Total XID errors observed since exporter start.",
                  f"# TYPE {D.XID_TOTAL} counter"]
        for g in gpus:
            for xid, n in sorted(g.xid_totals.items()):
                lines.append(f'{D.XID_TOTAL}{{{labels(g)},xid="{xid}"}} {n}')
    return "\n".join(lines) + "\n"


class FakeExporter:
    """Serves ``page`` at /metrics; ``status``, ``delay_s`` (before answering) and ``drip_s``
    (between 256-byte pieces of the body) make it fail, hang or crawl."""

    def __init__(self, page: str = ""):
        self.page, self.status, self.delay_s, self.drip_s, self.requests = page, 200, 0.0, 0.0, 0
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                exporter.requests += 1
                if exporter.delay_s:
                    time.sleep(exporter.delay_s)
                body = exporter.page.encode()
                self.send_response(exporter.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                write_dripping(self.wfile, [body], exporter.drip_s)

        self._http = LoopbackHTTP(Handler)
        self.url = f"{self._http.base_url}/metrics"

    def stop(self) -> None:
        self._http.stop()

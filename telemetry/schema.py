"""The trace layout of ../shared/telemetry/SCHEMA.md, in one place.

Agents (sources, simulator, sender, exporter) and the predictor (features, wire
validation, XID rules) name DCGM fields and classify XIDs through this module, so
a field or an XID class added to the contract is added once.
"""
from __future__ import annotations

import pyarrow as pa

from telemetry.failure_modes import FAILURE_MODES as FAILURE_MODES  # re-exported: S.FAILURE_MODES

#: What every dcgm-exporter device field name starts with.
DCGM_PREFIX = "DCGM_FI_DEV_"
GPU_TEMP = "DCGM_FI_DEV_GPU_TEMP"
MEMORY_TEMP = "DCGM_FI_DEV_MEMORY_TEMP"
POWER = "DCGM_FI_DEV_POWER_USAGE"
SM_CLOCK = "DCGM_FI_DEV_SM_CLOCK"
THROTTLE = "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"
SBE = "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"
DBE = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
REMAP_CORR = "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"
REMAP_UNCORR = "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"
REMAP_FAILURE = "DCGM_FI_DEV_ROW_REMAP_FAILURE"
PCIE_REPLAY = "DCGM_FI_DEV_PCIE_REPLAY_COUNTER"
NVLINK_CRC = "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"
#: dcgm-exporter's gauge of a GPU's last XID (the agents' exporter mirrors it).
XID_ERRORS = "DCGM_FI_DEV_XID_ERRORS"

#: Gauges (float32 in traces, as in the shared sample).
GAUGES = (GPU_TEMP, MEMORY_TEMP, POWER)
#: Clock, bitmask and counters (float64: counters must stay exact past 2**24).
COUNTERS = (SBE, DBE, REMAP_CORR, REMAP_UNCORR, REMAP_FAILURE, PCIE_REPLAY, NVLINK_CRC)
METRICS = GAUGES + (SM_CLOCK, THROTTLE) + COUNTERS

#: NVML clocks-event reason bits that SCHEMA.md names.
THROTTLE_IDLE = 0x1
THROTTLE_SW_POWER_CAP = 0x4
THROTTLE_HW_SLOWDOWN = 0x8
THROTTLE_SW_THERMAL = 0x20
THROTTLE_HW_THERMAL = 0x40
THROTTLE_HW_POWER_BRAKE = 0x80

#: XIDs raised by applications; frequent and harmless to the hardware.
APPLICATION_XIDS = frozenset({13, 31, 43, 45})
#: XIDs after which the GPU must be reset or drained.
CRITICAL_XIDS = frozenset({48, 62, 64, 74, 79, 94, 95, 119, 120})
#: Warnings: a row remap was recorded (63), high single-bit ECC rate (92).
WARNING_XIDS = frozenset({63, 92})


def is_critical_xid(xid: int) -> bool:
    """Whether this XID code means the GPU is lost (reset or drain)."""
    return int(xid) in CRITICAL_XIDS

TIMESTAMP = pa.timestamp("ms", tz="UTC")
#: GPU indices are 0..MAX_GPUS_PER_NODE-1: the predictor refuses a batch with any other, so
#: whoever builds batches from a source it does not control (a dcgm-exporter page) drops those rows.
MAX_GPUS_PER_NODE = 64

TELEMETRY_SCHEMA = pa.schema(
    [
        pa.field("timestamp", TIMESTAMP, nullable=False),
        pa.field("node", pa.string(), nullable=False),
        pa.field("gpu", pa.int16(), nullable=False),
        pa.field("uuid", pa.string()),
    ]
    + [pa.field(m, pa.float32()) for m in GAUGES]
    + [pa.field(m, pa.float64()) for m in (SM_CLOCK, THROTTLE) + COUNTERS]
)

XID_SCHEMA = pa.schema(
    [
        pa.field("timestamp", TIMESTAMP, nullable=False),
        pa.field("node", pa.string(), nullable=False),
        pa.field("gpu", pa.int16(), nullable=False),
        pa.field("xid", pa.int32(), nullable=False),
    ]
)

FAILURE_SCHEMA = pa.schema(
    [
        pa.field("timestamp", TIMESTAMP, nullable=False),
        pa.field("node", pa.string(), nullable=False),
        pa.field("gpu", pa.int16(), nullable=False),
        pa.field("mode", pa.string(), nullable=False),
        pa.field("xid", pa.int32(), nullable=False),
        pa.field("precursor_s", pa.float64(), nullable=False),
    ]
)

#: The failure mode an XID points to, where it points to one (HBM errors, NVLink); 79 "fallen
#: off the bus", GSP and the rest end several modes. For labels derived from XIDs alone.
XID_FAILURE_MODE = {48: "hbm", 63: "hbm", 64: "hbm", 92: "hbm", 94: "hbm", 95: "hbm", 74: "nvlink"}

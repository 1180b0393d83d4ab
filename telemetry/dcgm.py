"""dcgm-exporter's names and labels, mapped onto the trace layout, in one place.

Whoever reads DCGM data that did not come from our own agents (a dcgm-exporter's
``/metrics`` page, the same series in Prometheus) maps it through this module, so the
agents' scraper and the predictor's Prometheus reader agree on which series fills which
column, what a label means, and which XID changes are events.

Field names are those of NVIDIA's dcgm-exporter (etc/default-counters.csv); its
default field list serves only part of SCHEMA.md's columns (DEFAULT_FIELDS).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from telemetry import schema as S

#: Labels dcgm-exporter puts on every device series.
GPU_LABEL = "gpu"                # GPU index on the node
UUID_LABEL = "UUID"
NODE_LABEL = "Hostname"          # the exporter's host name; configurable (Prometheus relabelling often renames it)
MODEL_LABEL = "modelName"
#: The label that carries the XID code on the exporter's own XID series.
XID_LABEL = "xid"

#: Other names a DCGM field goes by: newer DCGM calls the throttle reasons "clocks event reasons".
FIELD_ALIASES = {"DCGM_FI_DEV_CLOCKS_EVENT_REASONS": S.THROTTLE}

#: SCHEMA.md columns that dcgm-exporter's default counter list serves (etc/default-counters.csv):
#: clocks, temperatures, power, PCIe replays, remapped rows and the last-XID gauge.
DEFAULT_FIELDS = (S.SM_CLOCK, S.GPU_TEMP, S.MEMORY_TEMP, S.POWER, S.PCIE_REPLAY,
                  S.REMAP_CORR, S.REMAP_UNCORR, S.REMAP_FAILURE)
#: Columns that a default exporter does not serve (commented out there): ECC, NVLink, throttle reasons.
NOT_IN_DEFAULT = tuple(m for m in S.METRICS if m not in DEFAULT_FIELDS)

#: XID series, best first. The exporter's own counters (off by default, enabled in its counter
#: CSV): a running total per (GPU, XID) since the exporter started, and a count per (GPU, XID)
#: over a sliding window. The DCGM field itself is a gauge of the *last* XID only.
XID_TOTAL = "DCGM_EXP_XID_ERRORS_TOTAL"
XID_WINDOW = "DCGM_EXP_XID_ERRORS_COUNT"
XID_LAST = S.XID_ERRORS
XID_SERIES = (XID_TOTAL, XID_WINDOW, XID_LAST)


def column_for(name: str) -> str | None:
    """The telemetry.parquet column a DCGM series fills, or None (a field the schema does not use)."""
    return name if name in S.METRICS else FIELD_ALIASES.get(name)


def gpu_identity(labels: Mapping[str, str], node_label: str = NODE_LABEL) -> tuple[str | None, int | None, str | None]:
    """(node, gpu index, uuid) of a series; None where its label is absent or not a number."""
    try:
        gpu = int(labels[GPU_LABEL])
    except (KeyError, ValueError):
        gpu = None
    return labels.get(node_label) or None, gpu, labels.get(UUID_LABEL) or None


def new_xid_events(series: str, prev: float | None, cur: float) -> int:
    """How many new XID events one more reading of an XID series shows.

    ``prev`` is the previous reading of the same series (same GPU and, for the exporter's
    counters, same ``xid`` label); None when there was none *after a first look at the
    source*: a series that appears later is new. The very first reading of a source is a
    baseline and must not be passed here: a value present then is history, not an event.

    - XID_TOTAL: the increase; a decrease means the exporter restarted and counts again from 0.
    - XID_WINDOW: the increase (events leaving the window while others enter are missed).
    - XID_LAST: 1 when the code changed to a non-zero one: the same XID again, or several
      XIDs between two readings, show as at most one event.
    """
    cur = float(cur)
    if series == XID_LAST:
        return int(cur != 0 and (prev is None or cur != prev))
    if prev is None:
        return max(int(cur), 0)
    if series == XID_TOTAL and cur < prev:
        return max(int(cur), 0)
    return max(int(cur - prev), 0)


def xid_changes(values: Sequence[float], previous: float | None) -> list[bool]:
    """Which samples of one GPU's last-XID gauge (time order, NaN = no reading) are new XIDs,
    by ``new_xid_events``' rule. With no reading before (``previous`` None) the first value
    is a baseline, not an event: a stale XID is not a new one."""
    out, prev = [], previous
    for v in values:
        v = float(v)
        if v != v:  # NaN: a failed read changes nothing
            out.append(False)
            continue
        out.append(prev is not None and bool(new_xid_events(XID_LAST, prev, v)))
        prev = v
    return out

"""dcgm-exporter's side of the contract: the labels it puts on every series and how its
XID gauge reads as events.

The metric names need no mapping (the trace columns *are* the DCGM field names,
schema.py); what a reader of dcgm-exporter pages or of their Prometheus history needs
beyond them is here, once: the live scraper (agents) and the history reader
(predictor/prometheus_source.py) agree on it.
"""
from __future__ import annotations

import numpy as np

#: The labels dcgm-exporter sets by default (the node label is configurable in readers:
#: Kubernetes setups often relabel it, e.g. to `kubernetes_node`).
NODE_LABEL = "Hostname"
GPU_LABEL = "gpu"
UUID_LABEL = "UUID"
MODEL_LABEL = "modelName"


def xid_changes(values: np.ndarray, previous: float | None) -> np.ndarray:
    """Mask of the samples of one GPU's `DCGM_FI_DEV_XID_ERRORS` gauge (time order) that are
    new XIDs: a non-zero value that differs from the sample before.

    The gauge holds the last XID only, so a repeat of the same code, and all but the last of
    several XIDs between two samples, cannot be seen. With no sample before (`previous`
    None) the first value is a baseline, not an event: a stale XID is not a new one."""
    values = np.asarray(values, dtype=np.float64)
    ok = ~np.isnan(values)
    # the last readable value before each sample (a failed read, NaN, changes nothing)
    seen = np.concatenate([[np.nan if previous is None else previous], values])
    last = np.maximum.accumulate(np.where(np.r_[previous is not None, ok], np.arange(len(seen)), 0))
    before = seen[last[:-1]]
    first = np.isnan(before)
    before[first] = values[first]          # nothing readable before: a baseline
    return ok & (values != 0) & (values != before)

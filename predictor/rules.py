"""Rules that need no model: a critical XID means the GPU must be reset or drained.

The driver has already said the GPU is lost, so risk is 1 regardless of what the
model thinks, until the GPU is replaced or reset (new UUID / counters restarted)
or the hold time passes without another critical XID.
"""
from __future__ import annotations

import numpy as np

CRITICAL_XIDS = frozenset({48, 62, 64, 74, 79, 94, 95, 119, 120})
#: How long a critical XID keeps a GPU at risk 1 when no replacement is seen.
CRITICAL_HOLD_S = 3600.0


def is_critical(xid: int) -> bool:
    """Whether this XID code means the GPU is lost (reset or drain)."""
    return int(xid) in CRITICAL_XIDS


def critical_mask(critical_t: np.ndarray, t_ms: np.ndarray) -> np.ndarray:
    """Which GPUs are held at risk 1 at `t_ms` by a recent critical XID."""
    return (critical_t >= 0) & (t_ms >= critical_t) & (t_ms - critical_t <= CRITICAL_HOLD_S * 1000)


def critical_reason(xid: int) -> str:
    return f"critical XID {int(xid)}"

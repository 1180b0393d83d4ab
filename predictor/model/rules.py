"""Rules that need no model.

A critical XID means the GPU must be reset or drained: the driver has already said
the GPU is lost, so risk is 1 regardless of what the model thinks, until the GPU is
replaced or reset (new UUID / counters restarted) or the hold time passes without
another critical XID.

A precursor ramp that its own events date to end within half an hour (at the upper
end of their uncertainty, see ramps.ramp_left_min) also sets risk to 1: alone, it
catches 0.57 of the shared sample's predictable failures with one false alarm in 256
node-days (docs/research/predictor-experiments.md), about what the model reaches at no false alarm.
"""
from __future__ import annotations

import numpy as np

from predictor.model.features import COUNTERS, FEATURE_NAMES, short_name

#: How long a critical XID keeps a GPU at risk 1 when no replacement is seen.
CRITICAL_HOLD_S = 3600.0


def critical_mask(critical_t: np.ndarray, t_ms: np.ndarray) -> np.ndarray:
    """Which GPUs are held at risk 1 at `t_ms` by a recent critical XID."""
    return (critical_t >= 0) & (t_ms >= critical_t) & (t_ms - critical_t <= CRITICAL_HOLD_S * 1000)


def critical_reason(xid: int) -> str:
    return f"critical XID {int(xid)}"


#: A ramp is due when its events date its end within this many minutes (upper bound) ...
RAMP_DUE_MIN = 30.0
#: ... and it holds at least this many events (fewer date it too loosely).
RAMP_MIN_EVENTS = 10.0
_SHORT = [short_name(c) for c in COUNTERS]
_LEFT_HI = [FEATURE_NAMES.index(f"{c}_ramp_left_hi") for c in _SHORT]
_EVENTS = [FEATURE_NAMES.index(f"{c}_ramp_events") for c in _SHORT]


def ramp_due(features: np.ndarray) -> np.ndarray:
    """Per row, the counter whose ramp is due (index into COUNTERS), or -1."""
    left = np.expm1(features[:, _LEFT_HI])
    events = np.expm1(features[:, _EVENTS])
    due = (left <= RAMP_DUE_MIN) & (events >= RAMP_MIN_EVENTS - 1e-6)
    return np.where(due.any(axis=1), np.argmax(due, axis=1), -1)


def ramp_reason(counter: int, features: np.ndarray) -> str:
    """Why a ramp is due, for one feature row."""
    left = np.expm1(features[_LEFT_HI[counter]])
    events = np.expm1(features[_EVENTS[counter]])
    return f"{_SHORT[counter]} ramp of {events:.0f} events ends in <= {max(left, 1):.0f} min"

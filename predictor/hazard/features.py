"""What is known about each GPU in service at a time, and what happened to it next.

Features use only rows before the as-of time ``t`` (events strictly before it, stays begun
at or before it); the outcome uses only what comes after. A removal without an event is
censoring, not a failure.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from predictor.hazard.history import History

DAY = 86400.0
NO_EVENT_DAYS = 5000.0   # "days since the last event" of a GPU that never had one
RECENT_DAYS = 180.0
FEATURE_NAMES = (
    "age_days", "col", "row", "cage", "slot", "node",
    "past_events", "past_dbe", "days_since_event", "stays", "days_in_slot",
    "lot_failed_share", "lot_recent_share", "slot_other_failures",
)


@dataclass
class Snapshot:
    """The GPUs in service at ``t``: their features (rows of ``x``), serial and slot."""

    t: float
    gpu: np.ndarray
    stay: np.ndarray
    x: np.ndarray

    @property
    def n(self) -> int:
        return len(self.gpu)


def in_service(h: History, t: float) -> np.ndarray:
    """Indices of the stays in service at ``t`` (a stay ending exactly at ``t`` without going out still is)."""
    live = (h.stay_in <= t) & ((h.stay_out_t > t) | ((h.stay_out_t == t) & ~h.stay_out))
    idx = np.flatnonzero(live)
    # one stay per GPU: the latest begun (overlaps were resolved when reading)
    order = idx[np.lexsort((-h.stay_in[idx], h.stay_gpu[idx]))]
    _, first = np.unique(h.stay_gpu[order], return_index=True)
    return order[first]


def _per_lot_share(lot: np.ndarray, members: np.ndarray, hits: np.ndarray, n_lots: int) -> np.ndarray:
    """Share of a lot's ``members`` with a hit, shrunk toward the fleet's share (lots of a few GPUs)."""
    m = np.bincount(lot[members], minlength=n_lots).astype(float)
    k = np.bincount(lot[members & hits], minlength=n_lots).astype(float)
    prior = k.sum() / max(m.sum(), 1.0)
    return (k + 20.0 * prior) / (m + 20.0)


def snapshot(h: History, t: float) -> Snapshot:
    """Features as of ``t`` of every GPU in service at ``t``."""
    stays = in_service(h, t)
    gpu = h.stay_gpu[stays]
    n_gpu = len(h.serials)
    before = h.event_t < t
    past = np.bincount(h.event_gpu[before], minlength=n_gpu)
    past_dbe = np.bincount(h.event_gpu[before & (h.event_kind == "DBE")], minlength=n_gpu)
    last = np.full(n_gpu, -np.inf)
    np.maximum.at(last, h.event_gpu[before], h.event_t[before])
    begun = h.stay_in <= t
    first = np.full(n_gpu, np.inf)
    np.minimum.at(first, h.stay_gpu[begun], h.stay_in[begun])
    n_stays = np.bincount(h.stay_gpu[begun], minlength=n_gpu)

    lot_names, lot = np.unique(h.lots, return_inverse=True)
    seen = np.isfinite(first)
    failed = past > 0
    recent = np.zeros(n_gpu, bool)
    recent[h.event_gpu[before & (h.event_t >= t - RECENT_DAYS * DAY)]] = True
    live = np.zeros(n_gpu, bool)
    live[gpu] = True
    lot_failed = _per_lot_share(lot, seen, failed, len(lot_names))
    lot_recent = _per_lot_share(lot, live | recent, recent, len(lot_names))

    slot_fail: dict[str, set[int]] = {}
    for g, loc in zip(h.event_gpu[before], h.event_location[before]):
        slot_fail.setdefault(loc, set()).add(int(g))
    others = np.array([len(slot_fail.get(loc, ())) - (g in slot_fail.get(loc, ()))
                       for g, loc in zip(gpu.tolist(), h.stay_location[stays])], dtype=float)

    since = np.where(np.isfinite(last[gpu]), (t - last[gpu]) / DAY, NO_EVENT_DAYS)
    x = np.column_stack([
        (t - first[gpu]) / DAY, h.stay_loc[stays].astype(float),
        past[gpu], past_dbe[gpu], since, n_stays[gpu], (t - h.stay_in[stays]) / DAY,
        lot_failed[lot[gpu]], lot_recent[lot[gpu]], others,
    ]).astype(float)
    return Snapshot(t=t, gpu=gpu, stay=stays, x=x)


def outcome(h: History, snap: Snapshot, until: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(days from ``t`` to the GPU's next DBE/OTB or its censoring, whether it was an event).

    Censoring: the GPU's last time in service (a removal without an event) or ``until``
    (default: the record's end); nothing after ``until`` is looked at."""
    t = snap.t
    until = h.end_t if until is None else min(until, h.end_t)
    after = (h.event_t > t) & (h.event_t <= until)
    nxt = np.full(len(h.serials), np.inf)
    np.minimum.at(nxt, h.event_gpu[after], h.event_t[after])
    last_seen = np.full(len(h.serials), -np.inf)
    known = h.stay_in <= until
    np.maximum.at(last_seen, h.stay_gpu[known], np.minimum(h.stay_out_t[known], until))
    ev = np.isfinite(nxt[snap.gpu])
    end = np.where(ev, nxt[snap.gpu], np.maximum(last_seen[snap.gpu], t))
    return (end - t) / DAY, ev


def label_within(days: np.ndarray, event: np.ndarray, horizon_days: float) -> np.ndarray:
    """1 where a DBE or OTB came within the horizon; a GPU removed healthy before it counts as 0."""
    return (event & (days <= horizon_days)).astype(int)

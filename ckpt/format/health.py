"""Sound state, not only sound bytes (invariant 16): what a commit record says about the
soundness of its checkpoint, and what that makes of each checkpoint of a listing.

A commit (``save/commit.py``) records a ``health`` object: ``{"state": S, "reason": ...,
"culprits": [{"rank", "node", "gpu"}, ...]}`` with S one of

* ``ok``: every data-parallel replica's digest agreed and no compared value was NaN/Inf;
* ``suspect``: replicas disagreed (``culprits``: the minority with three or more replicas,
  both with two);
* ``unhealthy``: a value was NaN or Inf (``culprits``: the ranks that held it);
* ``unchecked``: nothing to compare (one replica, or an older writer).

A listing then derives, per checkpoint id, one *status* (``classify``): ``verified`` (ok, and
a later ok checkpoint of the same generation is at least ``verify_steps`` steps newer: the
steps after it ran clean), ``ok``, ``unchecked``, ``suspect``, ``unhealthy``, and ``tainted``
(newer than a suspect or unhealthy checkpoint of its generation: a replica that went wrong
feeds every replica's next gradient, so what follows is not trusted either). A plain restore
never picks ``suspect``, ``unhealthy`` or ``tainted`` (``restore/plan.py``); retention never
deletes the newest ``verified`` one (``save/commit.py``).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, TypeVar

from ..errors import ManifestError

STATES = ("ok", "suspect", "unhealthy", "unchecked")
UNSOUND = frozenset({"suspect", "unhealthy", "tainted", "avoided"})  # avoided: after a failed canary
VERIFY_STEPS = 2  # default k: an ok checkpoint is verified once an ok one k or more steps newer exists

Id = TypeVar("Id")  # a CheckpointId (ordered by generation, then step)


def check_health(doc: Any, what: str) -> dict | None:
    """A commit record's ``health`` (None when absent), refused when not of the shape above."""
    if doc is None:
        return None
    if not isinstance(doc, dict) or doc.get("state") not in STATES or not isinstance(doc.get("reason", ""), str) \
            or not isinstance(doc.get("culprits", []), list) \
            or not all(isinstance(c, dict) and type(c.get("rank")) is int for c in doc.get("culprits", [])):
        raise ManifestError(f"{what}: bad 'health' (expected {{'state': one of {', '.join(STATES)}, ...}})")
    return doc


def classify(health: Mapping[Id, dict | None], verify_steps: int = VERIFY_STEPS) -> dict[Id, str]:
    """Each id's status (module docstring); ``health``: id -> its commit record's health (None:
    no record says, e.g. a memory slot not drained yet)."""
    out: dict[Id, str] = {}
    bad_since: dict[int, int] = {}  # generation -> its oldest suspect/unhealthy step
    for i, h in health.items():
        if h is not None and h["state"] in ("suspect", "unhealthy"):
            g = i.generation  # type: ignore[attr-defined]
            bad_since[g] = min(bad_since.get(g, i.step), i.step)  # type: ignore[attr-defined]
    ok_steps: dict[int, list[int]] = {}
    for i, h in health.items():
        if h is not None and h["state"] == "ok":
            ok_steps.setdefault(i.generation, []).append(i.step)  # type: ignore[attr-defined]
    for i, h in health.items():
        g, s = i.generation, i.step  # type: ignore[attr-defined]
        state = "unchecked" if h is None else h["state"]
        if state in ("suspect", "unhealthy"):
            out[i] = state
        elif g in bad_since and s > bad_since[g]:
            out[i] = "tainted"
        elif state == "ok" and any(t >= s + verify_steps and (g not in bad_since or t < bad_since[g])
                                   for t in ok_steps.get(g, ())):
            out[i] = "verified"
        else:
            out[i] = state
    return out


def newest_verified(statuses: Mapping[Id, str]) -> Id | None:
    """The newest verified id (what retention keeps whatever the count), or None."""
    return max((i for i, s in statuses.items() if s == "verified"), default=None)


def merged_health(rows: Iterable[tuple[Id, dict | None]]) -> dict[Id, dict | None]:
    """One health per id from several tiers' rows: a record that says something beats none,
    and an unsound verdict beats a sound one (each volume's leader records the same verdict)."""
    out: dict[Id, dict | None] = {}
    rank = {None: 0, "unchecked": 1, "ok": 2, "unhealthy": 3, "suspect": 4}
    for i, h in rows:
        if i not in out or rank[h and h["state"]] > rank[out[i] and out[i]["state"]]:
            out[i] = h
    return out

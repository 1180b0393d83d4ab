"""Detectors' verdicts as evictions: in in-process mode a lost GPU costs its rank, not the job.

Under ``ckpt.resumable`` a "node_failed" event from the predictor (a critical XID) ends every
rank (``recovery.watchdog.on_node_failed``: exit 87, relaunch). Here it asks the launcher to
evict only the workers on the lost GPU (``membership.evict``); the survivors keep their
processes. Each worker announces where it runs (node as peer placement names it, GPU index
``LOCAL_RANK``) so any listener can map the event's node and GPU to worker ids.
"""
from __future__ import annotations

import json
import logging
from typing import Callable

from ..control import Control
from . import membership

log = logging.getLogger(__name__)


def place_key(worker: int) -> str:
    return f"{membership.PREFIX}/place/{worker}"


def announce_place(ctl: Control, worker: int, node: str, gpu: int) -> None:
    """Record where ``worker`` runs, for whoever maps a failed node or GPU to workers."""
    ctl.put(place_key(worker), json.dumps({"node": node, "gpu": gpu}))


def workers_on(ctl: Control, workers: list[int], node: str, gpu: int | None) -> list[int]:
    """Those of ``workers`` on ``node`` (on its GPU ``gpu`` when given) that announced a place."""
    places = {w: json.loads(v) for w, v in zip(workers, ctl.many([place_key(w) for w in workers])) if v is not None}
    return [w for w, p in places.items() if p["node"] == node and (gpu is None or p["gpu"] == gpu)]


def on_node_failed(ctl: Control) -> Callable[[dict], None]:
    """The in-process reaction to a predictor "node_failed" event (``RiskListener.on_node_failed``):
    evict the current members on the failed GPU (on the whole node when the event names no GPU)."""
    def evict(event: dict) -> None:
        node, gpu = event.get("node"), event.get("gpu")
        if not isinstance(node, str):
            log.warning("node_failed event without a node name ignored: %s", event)
            return
        current = membership.latest_after(ctl, -1)
        members = list(current.members) if current is not None else []
        culprits = workers_on(ctl, members, node, gpu if isinstance(gpu, int) else None)
        reason = f"the predictor reports node {node} failed ({event.get('reason')})"
        if not culprits:
            log.warning("%s: no member of round %s runs there; nothing evicted", reason,
                        current.round if current is not None else "?")
        for w in culprits:
            log.critical("%s: evicting worker %d", reason, w)
            membership.evict(ctl, w, reason, current.round)
    return evict

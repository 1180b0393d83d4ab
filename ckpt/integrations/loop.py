"""``resumable``: a plain training loop that restores at start-up and saves on a policy.

    for step in ckpt.resumable(mgr, state, total=10_000, every=50):
        train_step(step)

The checkpoint of step ``s`` holds the state after ``s`` completed steps, so a
restored run continues at ``s``. Saves are agreed across ranks at step boundaries
(one tiny all-reduce), so an urgent request on any rank (``requests.request()``, a
predictor alarm, SIGTERM) makes every rank save the same step. ``save_at_boundary``
is that decision, shared by every integration (plain loop, Lightning, Hugging Face).
"""
from __future__ import annotations

import logging
import threading
from contextlib import nullcontext
from typing import Any, Callable, Iterator, Mapping

from ..errors import Preempted
from ..manager import CheckpointManager
from ..peers.placement import node_name
from ..policy import IntervalPolicy
from ..recovery.watchdog import HangDetection, Watchdog, on_node_failed, start_watchdog
from ..save.drain import SaveHandle
from .risk import RiskListener, read_token
from .urgency import SaveRequests

log = logging.getLogger(__name__)


def save_at_boundary(mgr: CheckpointManager, requests: SaveRequests, step: int,
                     state: Callable[[], Mapping[str, Any]], every: int | IntervalPolicy | None, *,
                     listener: RiskListener | None = None, elevated_every: int | None = None,
                     watchdog: Watchdog | None = None) -> bool:
    """Save ``step`` if the periodic policy says so (``elevated_every`` while the predictor
    reports the job's nodes at risk; an ``IntervalPolicy`` decides by the clock, scaled by
    the job's hazard ratio where the predictor states one) or any
    rank asked for an urgent save; after a preemption, wait until durable and raise
    ``Preempted`` (a SystemExit with status 143) for the framework to unwind.
    Every flag is agreed across ranks in one all-reduce (with ``peer_avoid_at_risk``, also
    which nodes are at risk, so peer placement avoids them). ``state`` is called only when saving.
    ``watchdog`` (the hang detector) learns here that this rank reached a boundary."""
    if watchdog is not None:
        watchdog.boundary()
    at_risk = listener is not None and listener.elevated
    ratio = listener.hazard_ratio if listener is not None else None
    due = isinstance(every, IntervalPolicy) and every.should_save(elevated=at_risk, hazard_ratio=ratio)
    ring = mgr.peering.ring if mgr.peering is not None and mgr.peering.avoid_at_risk else []
    risky = listener.at_risk_nodes if listener is not None else set()
    urgent, preempted, elevated, due, *avoid = mgr.agree(requests.take(), requests.preempted, at_risk, due,
                                                         *(n in risky for n in ring))
    if ring:  # the same all-reduce tells every rank which nodes the predictor reports at risk
        mgr.peering.avoid({n for n, flag in zip(ring, avoid) if flag})
    interval = elevated_every if elevated and elevated_every else every
    if not (urgent or due or (isinstance(interval, int) and step % interval == 0)):
        return False
    if preempted and watchdog is not None:
        watchdog.close()  # the durable save and unwinding may take long: that is no hang
    with watchdog.saving() if watchdog is not None else nullcontext():  # a save's blocking time: not a step's
        handle = mgr.save(step, state(), urgent=urgent)
    if isinstance(every, IntervalPolicy):
        every.saved(blocking_s=handle.blocking_s)
    if urgent:
        log.warning("urgent checkpoint at step %d", step)
        threading.Thread(target=_report_durable, args=(handle,), daemon=True).start()
    if preempted:
        for tier in handle.tiers:  # a peer's memory goes with the preempted job: no grace period spent on it
            if tier != "peer":
                handle.wait(tier)
        mgr.flush()
        mgr.restart_expected = True  # close() keeps the memory slots: the requeued job restores from them
        log.warning("preempted: step %d is durable; exiting", step)
        raise Preempted(step)
    return True


def resumable(mgr: CheckpointManager, state: dict, *, total: int, every: int | IntervalPolicy | None = None,
              requests: SaveRequests | None = None, preemption: bool = True, save_at_end: bool = True,
              predictor: str | None = None, predictor_token: str | None = None,
              elevated_every: int | None = None, hang: HangDetection | None = None,
              fresh_ok: bool | None = None) -> Iterator[int]:
    """Yield step indices from the restored position to ``total``; save on ``every`` (steps,
    or an ``IntervalPolicy``), at urgent requests ("checkpoint now" from ``predictor``,
    ``requests.request()``), on SIGTERM (then exit 143), and at the end. Under
    torch.distributed a hung rank ends the job (``hang`` tunes or disables the detector:
    ``ckpt.watchdog``). Checkpoints it cannot restore raise rather than train from scratch
    beside them, unless ``fresh_ok`` (``CheckpointManager.restore``)."""
    requests = requests or SaveRequests()
    if preemption:
        requests.catch_sigterm()
    listener = _listen(mgr, predictor, predictor_token, requests) if predictor else None
    restored = mgr.restore(state, fresh_ok=fresh_ok)
    start = restored or 0
    log.info("training from step %d%s", start, " (restored)" if restored is not None else "")
    watchdog = start_watchdog(mgr, hang)
    if listener is not None:
        listener.on_node_failed = on_node_failed(watchdog)
    finished = False
    try:
        for step in range(start, total):
            yield step
            save_at_boundary(mgr, requests, step + 1, lambda: state, every, listener=listener,
                             elevated_every=elevated_every, watchdog=watchdog)
        finished = True
    finally:
        if watchdog is not None:
            watchdog.close(finished=finished)
    if save_at_end and total > start and not (isinstance(every, int) and total % every == 0):
        mgr.save(total, state)
    mgr.flush()  # the newest step off-node too, if an upload was pending when it was saved
    mgr.wait()
    if listener is not None:
        listener.close()


def _report_durable(handle: SaveHandle) -> None:
    try:
        handle.wait()
        log.warning("urgent checkpoint of step %d durable in every tier %.2f s after save() (%s)", handle.step,
                    max(handle.durable_s.values(), default=0.0),
                    ", ".join(f"{t} {s:.2f} s" for t, s in handle.durable_s.items()))
    except Exception as e:  # the next save()/wait() raises it too
        log.error("urgent checkpoint of step %d failed: %s", handle.step, e)


def _listen(mgr: CheckpointManager, url: str, token: str | None, requests: SaveRequests) -> RiskListener | None:
    """Rank 0 registers every rank's node (as peer placement names it: CKPT_GUARD_NODE,
    else the host name) with the predictor and listens for the job."""
    hosts = mgr.coord.gather(mgr.peering.node if mgr.peering is not None else node_name())
    if mgr.rank != 0:
        return None
    return RiskListener(url, hosts, requests, token=token or read_token(), name=mgr.run).start()

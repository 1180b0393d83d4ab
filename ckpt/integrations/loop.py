"""``resumable``: a plain training loop that restores at start-up and saves on a policy.

    for step in ckpt.resumable(mgr, state, total=10_000, every=50):
        train_step(step)

The checkpoint of step ``s`` holds the state after ``s`` completed steps, so a
restored run continues at ``s``. Saves are agreed across ranks at step boundaries
(one tiny all-reduce), so an urgent request on any rank (``request_save()``, SIGTERM)
makes every rank save the same step.
"""
from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import Any, Callable, Iterator, Mapping

from ..manager import CheckpointManager

log = logging.getLogger(__name__)


class SaveRequests:
    """Urgent-save requests from other threads or signal handlers, read at step boundaries."""

    def __init__(self) -> None:
        self._urgent = threading.Event()
        self.preempted = False

    def request(self) -> None:
        self._urgent.set()

    def take(self) -> bool:
        wanted = self._urgent.is_set()
        self._urgent.clear()
        return wanted

    def on_sigterm(self, signum: int, frame: object) -> None:
        self.preempted = True
        self._urgent.set()

    def catch_sigterm(self) -> None:
        """Turn SIGTERM into an urgent save and an exit (signals reach the main thread only)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.on_sigterm)


def save_at_boundary(mgr: CheckpointManager, requests: SaveRequests, step: int,
                     state: Callable[[], Mapping[str, Any]], every: int | None) -> bool:
    """The step-boundary policy every integration shares: save ``step`` if it is a
    multiple of ``every`` or any rank asked for an urgent save; after a preemption, wait
    until the save is durable and exit 143. ``state`` is called only when saving."""
    periodic = every is not None and step % every == 0
    urgent, preempted = mgr.agree(requests.take(), requests.preempted)
    if not (periodic or urgent):
        return False
    handle = mgr.save(step, state(), urgent=urgent)
    if urgent:
        log.warning("urgent checkpoint at step %d", step)
    if preempted:
        handle.wait()
        log.warning("preempted: step %d is durable; exiting", step)
        mgr.close()
        sys.exit(143)
    return True


def resumable(mgr: CheckpointManager, state: dict, *, total: int, every: int | None = None,
              requests: SaveRequests | None = None, preemption: bool = True,
              save_at_end: bool = True) -> Iterator[int]:
    """Yield step indices from the restored position to ``total``; save every ``every``
    completed steps, at urgent requests, on SIGTERM (then exit 143), and at the end."""
    requests = requests or SaveRequests()
    if preemption:
        requests.catch_sigterm()
    restored = mgr.restore(state)
    start = restored or 0
    log.info("training from step %d%s", start, " (restored)" if restored is not None else "")
    for step in range(start, total):
        yield step
        save_at_boundary(mgr, requests, step + 1, lambda: state, every)
    if save_at_end and total > start and (every is None or total % every != 0):
        mgr.save(total, state)
    mgr.wait()

"""Where the sound-state checks' CPU goes, per step and per thread (issue 49 point 6): the
deterministic figure beside ``sound_bench.py --mode overhead``'s paired wall-time blocks, which
a shared machine's load moves far more than it moves a thread's own CPU time.

Each check's functions are wrapped for the run with ``time.thread_time`` (that thread's CPU
seconds, not the wall): the finite check on each piece the checksum threads read
(``Inspection.visit``'s closures), the replica digest and its report on the drain thread
(``Inspection.report``), finding the compared paths (``soundness._scope_now``, first use, on the
drain thread) and the per-save scope on the trainer's (``scope_of``), and the canary
(``Canary.record``, ``Canary.saved``) on the trainer's. The wrappers cost about a microsecond a
call (some forty calls a step), so this run is kept apart from the timed blocks.
"""
from __future__ import annotations

import re
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from ckpt.save import canary, save_path, soundness


class CheckClock:
    """Thread CPU seconds spent in each check, by check and by kind of thread."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self._lock = threading.Lock()

    def timed(self, check: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.thread_time() - t0
                kind = re.sub(r"[-_]?\d+", "", threading.current_thread().name)  # pool threads by their pool
                with self._lock:
                    self.seconds[(check, kind)] += spent
        return wrapper

    def per_step(self, steps: int) -> dict[str, Any]:
        """ms per step: by check and thread, on the trainer's thread, and in all."""
        by = {f"{check} ({kind})": 1e3 * s / steps for (check, kind), s in sorted(self.seconds.items())}
        trainer = sum(s for (_, kind), s in self.seconds.items() if kind == "MainThread")
        return {"by_check_ms": by, "trainer_thread_ms": 1e3 * trainer / steps,
                "checks_ms": 1e3 * sum(self.seconds.values()) / steps}


@contextmanager
def clocked() -> Iterator[CheckClock]:
    """Every check's functions wrapped for the ``with`` block, put back after."""
    clock = CheckClock()
    visit, report = soundness.Inspection.visit, soundness.Inspection.report
    originals = [(soundness.Inspection, "report", report), (soundness, "_scope_now", soundness._scope_now),
                 (save_path, "scope_of", save_path.scope_of), (canary.Canary, "record", canary.Canary.record),
                 (canary.Canary, "saved", canary.Canary.saved), (soundness.Inspection, "visit", visit)]

    def visit_clocked(self: soundness.Inspection, entry: Any) -> Callable[[memoryview], None] | None:
        check = visit(self, entry)
        return None if check is None else clock.timed("finite", check)

    for owner, name, fn in originals[:-1]:
        setattr(owner, name, clock.timed(name.strip("_"), fn))
    soundness.Inspection.visit = visit_clocked
    try:
        yield clock
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)

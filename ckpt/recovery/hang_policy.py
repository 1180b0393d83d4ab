"""When a rank is hung: the hang detector's knobs and its deadline policy.

A rank is declared hung when its training thread has not reached a step boundary for

* ``factor`` × the median of its measured step times, at least ``floor_s`` (10 s), or a
  fixed ``deadline_s``; never under ``OBSERVE_INTERVALS`` beats (the time it takes to
  tell a frozen rank);
* at least ``first_steps_s`` (600 s) until ``warmup_steps`` step times are measured, in
  every incarnation: compilation and data loading warming up;
* plus, while a blocking save runs on some rank (``Watchdog.saving``), that save's
  allowance: ``factor`` × the longest save measured on that rank, or ``first_steps_s``
  before one was (the first save allocates and pre-faults its slots). The saving rank
  says so in its beat, so a peer that finished its own save and waits for the slow one
  in the next collective waits as long.

**Why the floor stays at 10 s for a live rank.** A rank whose process runs but does not
reach a boundary (a stuck kernel or collective, a dead GPU the predictor did not report)
looks exactly like a legitimately slow stretch: an epoch-end data loader restart, an
evaluation or a rank-0-only write inside the loop body, a long garbage collection.
Below 10 s those happen in healthy jobs, and a false trip costs a restart and a
quarantine strike on a healthy node. What the floor need not cover is covered apart:
first steps, saves, evaluation batches (Lightning, Hugging Face: ``progress()``).

**A frozen rank is declared sooner** (``frozen_fast``): a rank whose watchdog thread has
stopped beating is not running at all (stopped, its node frozen or cut off), which no
slow step explains. Once this rank has waited past twice the median step (at least one
interval) after warm-up, a peer whose beat stays unchanged for ``FROZEN_POLLS`` polls is
declared frozen then, without waiting for the deadline (about 4 s at the default
interval). Its one false trip: a rank whose own C call holds the interpreter lock for
that long (``pickle.dumps`` of a multi-GB array; ``torch.save`` releases it) while its
peers wait; ``frozen_fast=False`` turns it off.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

OBSERVE_INTERVALS = 4  # start reading peers' beats this many intervals before the deadline
FROZEN_POLLS = 3  # a beat unchanged over this many polls: that rank's process is not running


@dataclass(frozen=True)
class HangDetection:
    """The hang detector's knobs (see the module docstring); ``enabled=False`` turns it off."""

    enabled: bool = True
    factor: float = 5.0
    floor_s: float = 10.0
    deadline_s: float | None = None  # fixed deadline, replaces factor × median and the floor
    warmup_steps: int = 3
    first_steps_s: float = 600.0
    frozen_fast: bool = True  # a frozen peer is declared before the deadline (module docstring)
    interval_s: float = 1.0
    poll_s: float = 0.25  # how often each node looks for a "job failed" key (node_failed)
    kill_grace_s: float = 1.0  # time the culprit gets to dump its stacks before SIGKILL
    quarantine_strikes: int = 3  # a node blamed this often (0: never) ...
    quarantine_window_s: float = 3600.0  # ... within this window is kept out of restarts (ckpt.quarantine)

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.poll_s <= 0 or self.factor <= 0 or self.floor_s < 0 or self.warmup_steps < 0:
            raise ValueError(f"invalid hang detection settings: {self}")
        if self.deadline_s is not None and self.deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {self.deadline_s}")

    def deadline(self, step_times: list[float]) -> float:
        """Seconds a rank may spend between two boundaries, given the step times measured;
        never under ``OBSERVE_INTERVALS`` beats, the time it takes to tell a frozen rank."""
        steady = self.deadline_s if self.deadline_s is not None else max(
            self.floor_s, self.factor * statistics.median(step_times) if step_times else 0.0)
        steady = max(steady, OBSERVE_INTERVALS * self.interval_s)
        return steady if len(step_times) >= self.warmup_steps else max(steady, self.first_steps_s)

    def save_allowance(self, save_times: list[float]) -> float:
        """Seconds added to the deadline while a blocking save runs, given the saves measured."""
        return self.factor * max(save_times) if save_times else self.first_steps_s

    def frozen_watch(self, step_times: list[float]) -> float | None:
        """Seconds without a boundary after which this rank looks for a frozen peer; None:
        only near the deadline (warming up, or ``frozen_fast`` off)."""
        if not self.frozen_fast or not step_times or len(step_times) < self.warmup_steps:
            return None
        return max(self.interval_s, 2 * statistics.median(step_times))

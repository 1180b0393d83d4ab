"""The watchdog's "behind" rule in two levels, so that no launcher reads every rank's step.

The job launcher reads every member's step key once a ``BEAT_S`` and publishes the lowest and
highest step taken in the round (``membership.STEPS_KEY``); each node launcher reads that one
key and its own members' steps. A member of a node at the job's lowest step, while others are
further, for longer than the progress deadline is left behind (``node.py``). The store then
serves N + N/8 step reads a ``BEAT_S`` job-wide, not every node every step (N²/8).
"""
from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field

from ..control import Control
from . import membership


@dataclass
class Steps:
    """The steps seen of some members in one round: each one's step and when it last changed
    (only steps written in the round count: a survivor's key from the round before, before it
    steps again, is stale), and how long a step took (read once a ``BEAT_S``, a member may be
    several steps further: each of them counts, at their mean). The deadline needs a few step
    times to leave its warm-up (``hang_policy``): steps faster than the reads must count too."""

    steps: dict[int, tuple[int, float]] = field(default_factory=dict)
    times: deque = field(default_factory=lambda: deque(maxlen=64))

    def new_round(self) -> None:
        """Survivors restore an earlier step: progress is judged afresh each round."""
        self.steps.clear()

    def read(self, ctl: Control, members: list[int], round_id: int, now: float) -> dict[int, tuple[int, float]]:
        """Read ``members``' step keys (one ``many``); those written in round ``round_id`` (the
        worker signs its step with its round), as (step, since when)."""
        for w, found in zip(members, ctl.many_signed([membership.step_key(w) for w in members])):
            if found is None or found.round != round_id:
                continue
            step, since = self.steps.get(w, (None, now))
            if int(found.payload) != step:
                if step is not None and int(found.payload) > step:  # k steps since: each took 1/k of the time
                    k = int(found.payload) - step
                    self.times.extend([(now - since) / k] * min(k, self.times.maxlen))
                self.steps[w] = (int(found.payload), now)
        return {w: self.steps[w] for w in members if w in self.steps}


def publish(ctl: Control, round_id: int, reached: dict[int, tuple[int, float]]) -> None:
    """The job launcher's part: the lowest and highest step taken in round ``round_id``."""
    found = [s for s, _ in reached.values()]
    ctl.put(membership.STEPS_KEY, json.dumps({"low": min(found), "high": max(found)} if found else {}),
            round=round_id)


def job_range(ctl: Control, round_id: int) -> tuple[int, int] | None:
    """The job's (lowest, highest) step in round ``round_id`` as last published; None before any."""
    found = ctl.signed(membership.STEPS_KEY)
    if found is None or found.round != round_id:
        return None
    span = json.loads(found.payload)
    return (span["low"], span["high"]) if span else None

"""Who is in the job, round by round, agreed through the launcher's store.

The launcher sees every worker's exit first hand, so it is the one to decide membership:
it publishes round ``r + 1`` (the members in rank order, the spares left, the reason) when a
member dies or is killed. A survivor whose collective failed waits, bounded, for that round;
a warm spare waits for a round that names it. No agreement protocol runs among the ranks.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

PREFIX = "ckpt-guard/inprocess"
DONE_KEY = f"{PREFIX}/done"
RELAUNCH_KEY = f"{PREFIX}/relaunch"  # set before DONE_KEY when the job is launched again: every node takes part
ATTEMPT_ENV = "CKPT_INPROCESS_ATTEMPT"
_POLL_S = 0.005


def of_attempt(store: "dist.Store", attempt: int) -> "dist.Store":
    """The job's store as one launch of it sees it: a relaunch (``attempt`` > 0) starts on
    keys of its own, on the same store server, so that every node launcher finds it there."""
    return store if attempt == 0 else dist.PrefixStore(f"ckpt-guard/attempt/{attempt}", store)


def worker_store(timeout_s: float) -> "dist.Store":
    """A worker's own connection to its launch's store (MASTER_ADDR, MASTER_PORT, the attempt)."""
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s))
    return of_attempt(base, int(os.environ.get(ATTEMPT_ENV, "0")))


def round_key(round_id: int) -> str:
    return f"{PREFIX}/round/{round_id}"


def beat_key(worker: int) -> str:
    """A counter each worker's beat thread adds to: a stopped process stops counting."""
    return f"{PREFIX}/beat/{worker}"


def step_key(worker: int) -> str:
    """The step index this worker reached last (set after each step): the launcher's progress
    deadline names a member left behind by the others (alive and beating, not stepping)."""
    return f"{PREFIX}/step/{worker}"


def ready_key(worker: int) -> str:
    """Set by a spare once warmed up: only a ready spare is called in (one still importing
    torch would hold every survivor at the next group's rendezvous)."""
    return f"{PREFIX}/ready/{worker}"


def evict_key(worker: int) -> str:
    return f"{PREFIX}/evict/{worker}"


def host_key(worker: int) -> str:
    """The node (``--node-rank``) whose node launcher runs ``worker``: set by the job launcher
    before the round that first names the worker."""
    return f"{PREFIX}/host/{worker}"


def exit_key(worker: int) -> str:
    """How ``worker`` ended (JSON: exit code, cause), set by its node launcher: the job launcher
    turns it into the next round."""
    return f"{PREFIX}/exit/{worker}"


def node_key(node: int) -> str:
    """A counter each node launcher adds to every ``BEAT_S``: a silent node is a lost node."""
    return f"{PREFIX}/node/{node}"


def left_key(node: int) -> str:
    """Set by a node launcher once its workers are gone at the job's end."""
    return f"{PREFIX}/left/{node}"


def evict(store: "dist.Store", worker: int, reason: str) -> None:
    """Ask the launcher to end ``worker`` and go on without it (a predicted node failure, an
    XID 79 on its GPU): it never resumes in place."""
    store.set(evict_key(worker), reason)


@dataclass(frozen=True)
class Membership:
    """One round: ``members`` are worker ids in rank order."""

    round: int
    members: tuple[int, ...]
    spares: tuple[int, ...]
    reason: str
    fault_time: float  # wall clock of the fault that ended the previous round (0 for the first)

    def rank_of(self, worker: int) -> int | None:
        return self.members.index(worker) if worker in self.members else None

    def to_json(self) -> str:
        return json.dumps({"members": list(self.members), "spares": list(self.spares),
                           "reason": self.reason, "fault_time": self.fault_time})

    @classmethod
    def from_json(cls, round_id: int, text: bytes) -> "Membership":
        d = json.loads(text)
        return cls(round_id, tuple(d["members"]), tuple(d["spares"]), d["reason"], d["fault_time"])


def publish(store: "dist.Store", m: Membership) -> None:
    store.set(round_key(m.round), m.to_json())


def changed(store: "dist.Store", round_id: int) -> bool:
    """Whether the launcher has published a round after ``round_id`` (one store round trip)."""
    return store.check([round_key(round_id + 1)])


def wait_round(store: "dist.Store", round_id: int, timeout_s: float) -> Membership | None:
    """Round ``round_id`` once published, or None after ``timeout_s`` or when the job is over.
    Polls (a check is a few µs on the launcher's store; a blocking wait with a timeout logs a
    warning each time it expires)."""
    deadline = time.monotonic() + timeout_s
    key = round_key(round_id)
    while not store.check([key]):
        if store.check([DONE_KEY]) or time.monotonic() >= deadline:
            return None
        time.sleep(_POLL_S)
    return Membership.from_json(round_id, store.get(key))


def latest_after(store: "dist.Store", round_id: int) -> Membership | None:
    """The newest published round after ``round_id`` (several faults may have passed), if any."""
    found = None
    while store.check([round_key(round_id + 1)]):
        round_id += 1
        found = Membership.from_json(round_id, store.get(round_key(round_id)))
    return found

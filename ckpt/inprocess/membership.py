"""Who is in the job, round by round, agreed through the launcher's store.

The launcher sees every worker's exit first hand, so it is the one to decide membership:
it publishes round ``r + 1`` (the members in rank order, the spares left, the reason) when a
member dies or is killed (each node's launcher reads only its node's part of it: its members'
ranks, its spares, the world size), or the same members again when one found the newest snapshot
unsound (``rewind``: every rank goes back to the newest sound step together). A survivor
whose collective failed waits, bounded, for that round; a warm spare waits for a round that
names it. No agreement protocol runs among the ranks.
Every key here is read and written signed (``control.Control``): a round, an eviction or a
done mark that is not the job's own is ignored.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ..control import Control, control_key

PREFIX = "ckpt-guard/inprocess"
DONE_KEY = f"{PREFIX}/done"
RELAUNCH_KEY = f"{PREFIX}/relaunch"  # set before DONE_KEY when the job is launched again: every node takes part
# set (unsigned) by a node launcher that reported an exit, or a worker that asked to rewind, deleted by the job
# launcher, which then reads every node's beat (they list the exits) and the round's rewind key at once rather
# than within a BEAT_S: an outsider who sets it costs reads
EXITS_KEY = f"{PREFIX}/exits"
STEPS_KEY = f"{PREFIX}/steps"  # the job's lowest and highest step in the round (``progress.py``)
ATTEMPT_ENV = "CKPT_INPROCESS_ATTEMPT"
_POLL_S = 0.005


def of_attempt(store: "dist.Store", attempt: int, key: bytes) -> Control:
    """The job's store as one launch of it sees it, signed under the control ``key``: a relaunch
    (``attempt`` > 0) starts on keys of its own, on the same store server, so that every node
    launcher finds it there."""
    return Control(store if attempt == 0 else dist.PrefixStore(f"ckpt-guard/attempt/{attempt}", store), key,
                   attempt)


def worker_store(timeout_s: float) -> Control:
    """A worker's own connection to its launch's store (MASTER_ADDR, MASTER_PORT, the attempt;
    the job's secret from the environment its launcher gave it)."""
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s))
    return of_attempt(base, int(os.environ.get(ATTEMPT_ENV, "0")), control_key())


def round_key(round_id: int) -> str:
    """The whole round (``Membership``), which the workers read."""
    return f"{PREFIX}/round/{round_id}"


def node_round_key(round_id: int, node: int) -> str:
    """``node``'s part of round ``round_id`` (``NodeRound``): its launcher reads this, a few ids,
    not the whole round (N/8 node launchers reading N ids each, N^2/8 a round)."""
    return f"{PREFIX}/round/{round_id}/node/{node}"


def beat_key(worker: int) -> str:
    """Each worker's beat thread writes it anew (a higher sequence number each time): a stopped
    process stops beating."""
    return f"{PREFIX}/beat/{worker}"


def step_key(worker: int) -> str:
    """The step index this worker reached last (set after each step, signed with its round): the
    launcher's progress deadline names a member left behind by the others (alive and beating,
    not stepping)."""
    return f"{PREFIX}/step/{worker}"


def ready_key(worker: int) -> str:
    """Set by a spare once warmed up: only a ready spare is called in (one still importing
    torch would hold every survivor at the next group's rendezvous)."""
    return f"{PREFIX}/ready/{worker}"


def evict_key(worker: int) -> str:
    return f"{PREFIX}/evict/{worker}"


def exit_key(worker: int) -> str:
    """How ``worker`` ended (JSON: exit code, cause), set by its node launcher: the job launcher
    turns it into the next round."""
    return f"{PREFIX}/exit/{worker}"


def fallback_key(worker: int) -> str:
    """Why ``worker`` asked for a relaunch (``EXIT_FALLBACK``) or stopped the job (``EXIT_STOP``):
    the launcher's last line says it."""
    return f"{PREFIX}/fallback/{worker}"


def node_key(node: int) -> str:
    """Each node launcher writes it anew every ``BEAT_S`` and at each exit of its workers (the
    payload: the workers whose exit it reported, a JSON list): a silent node is a lost node."""
    return f"{PREFIX}/node/{node}"


def left_key(node: int) -> str:
    """Set by a node launcher once its workers are gone at the job's end."""
    return f"{PREFIX}/left/{node}"


def rewind_key(round_id: int) -> str:
    """Set by a member that found the newest snapshot unsound in round ``round_id``: the job
    launcher starts the next round with the same members, and every rank restores the newest
    sound step in its process (a key a round: a request of an older round is never acted on)."""
    return f"{PREFIX}/rewind/{round_id}"


def rewind(ctl: Control, reason: str, round_id: int) -> None:
    """Ask the launcher for a round in which every member goes back to the newest sound step
    (``UnsoundState``: a verdict every rank may meet at another step, so the ranks go back
    together, not each on its own), and wake it at once."""
    ctl.put(rewind_key(round_id), reason, round=round_id)
    ctl.store.set(EXITS_KEY, b"1")


def evict(ctl: Control, worker: int, reason: str, round_id: int = 0) -> None:
    """Ask the launcher to end ``worker`` and go on without it (a predicted node failure, an
    XID 79 on its GPU): it never resumes in place."""
    ctl.put(evict_key(worker), reason, round=round_id)


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


@dataclass(frozen=True)
class NodeRound:
    """One node's part of a round: its members as (worker, rank) in rank order, its spares, and
    the world size. Each part is whole in itself: a node launcher that missed rounds reads the
    newest one's part and has a consistent view, no chain of changes to replay."""

    round: int
    members: tuple[tuple[int, int], ...]
    spares: tuple[int, ...]
    world: int

    @classmethod
    def from_json(cls, round_id: int, text: bytes) -> "NodeRound":
        d = json.loads(text)
        return cls(round_id, tuple((w, r) for w, r in d["members"]), tuple(d["spares"]), d["world"])


def publish(ctl: Control, m: Membership, hosts: Mapping[int, int] | None = None, nodes: int = 0) -> None:
    """Publish round ``m``: first each of the ``nodes`` nodes' part of it (``hosts``: worker ->
    node; a node that runs none of the round's workers gets an empty part), then the whole round.
    Each part is one signed value, so a node launcher acts on all of its part or none of it."""
    parts: dict[int, tuple[list[list[int]], list[int]]] = {k: ([], []) for k in range(nodes)}
    if hosts is not None:
        for rank, w in enumerate(m.members):
            parts.setdefault(hosts[w], ([], []))[0].append([w, rank])
        for s in m.spares:
            parts.setdefault(hosts[s], ([], []))[1].append(s)
    for k, (mine, spares) in sorted(parts.items()):
        ctl.put(node_round_key(m.round, k), json.dumps({"members": mine, "spares": spares, "world": len(m.members)}),
                round=m.round)
    ctl.put(round_key(m.round), m.to_json(), round=m.round)


def _round(ctl: Control, round_id: int, node: int | None = None) -> Membership | NodeRound | None:
    """Round ``round_id`` (or ``node``'s part of it) if the launcher published it (a value signed
    for that round under that key)."""
    found = ctl.signed(round_key(round_id) if node is None else node_round_key(round_id, node))
    if found is None or found.round != round_id:
        return None
    return Membership.from_json(round_id, found.payload) if node is None else NodeRound.from_json(round_id,
                                                                                                 found.payload)


def changed(ctl: Control, round_id: int) -> bool:
    """Whether the launcher has published a round after ``round_id`` (one store round trip
    while none is there)."""
    return ctl.store.check([round_key(round_id + 1)]) and _round(ctl, round_id + 1) is not None


def wait_round(ctl: Control, round_id: int, timeout_s: float, node: int | None = None) -> Membership | NodeRound | None:
    """Round ``round_id`` (``node``'s part of it, when given) once published, or None after
    ``timeout_s`` or when the job is over.
    Polls (a check is a few µs on the launcher's store; a blocking wait with a timeout logs a
    warning each time it expires)."""
    deadline = time.monotonic() + timeout_s
    while (found := _round(ctl, round_id, node)) is None:
        if ctl.has(DONE_KEY) or time.monotonic() >= deadline:
            return None
        time.sleep(_POLL_S)
    return found


def latest_after(ctl: Control, round_id: int, node: int | None = None) -> Membership | NodeRound | None:
    """The newest published round after ``round_id`` (``node``'s part of it, when given; several
    faults may have passed), if any."""
    found = None
    while (newer := _round(ctl, round_id + 1, node)) is not None:
        found, round_id = newer, round_id + 1
    return found

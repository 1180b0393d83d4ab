"""Policy (f): recovering in-process. The survivors keep their processes, CUDA contexts and
compiled model; on a fault they abort the process group, agree on the new membership
through the store, build a new group (a warm spare's ranks, already running in the job,
take a lost node's place) and restore from memory or a peer. That replaces the relaunch
(new processes, CUDA contexts, model build, a rendezvous of thousands of agents) for every
fault but the share ``relaunch_share``, which still goes through (e)'s restart.

Defaults: ``data/inprocess_nvrx.json``, a source per figure (docs/research/goodput-model.md).
"""
from __future__ import annotations

from dataclasses import dataclass

PHASES = ("abort", "drain", "agree", "new_group", "first_step")  # after detection, before the restore


@dataclass(frozen=True)
class InProcessCosts:
    """What an in-process recovery costs at the run's scale, in seconds, and how often (f)
    snapshots: its blocking cost per snapshot, at most once a step."""

    relaunch_share: float  # faults the in-process path cannot take: they relaunch as under (e)
    abort_s: float  # destroy the process group, wait for concurrent faults
    drain_s: float  # the pending CUDA kernels finish: about a step
    agree_s: float  # rank assignment and the store barrier
    new_group_s: float  # new NCCL communicators over the new membership
    first_step_s: float  # what the first step costs beyond a step (connections, allocator)
    step_s: float  # a training step: snapshots come at most once per step
    snapshot_block_s: float  # what one snapshot blocks the training thread

    def __post_init__(self) -> None:
        if not 0.0 <= self.relaunch_share <= 1.0:
            raise ValueError("relaunch_share must be within [0, 1]")
        if self.step_s <= 0:
            raise ValueError("step_s must be > 0")

    def phases(self) -> dict[str, float]:
        """Seconds of each phase of one in-process recovery (``PHASES``)."""
        return {p: getattr(self, f"{p}_s") for p in PHASES}

    @property
    def total_s(self) -> float:
        """Detection to training again, before the restore."""
        return sum(self.phases().values())

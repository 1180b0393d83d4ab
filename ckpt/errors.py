"""Exceptions raised by the checkpoint engine.

Callers catch ``CheckpointError``; the subclasses say what went wrong precisely
enough for an operator to act (which step, which file).
"""
from __future__ import annotations

import errno


class CheckpointError(Exception):
    """Base class: anything the checkpoint engine refuses or fails to do."""


class ManifestError(CheckpointError):
    """A manifest is malformed, hostile or of an unknown format version."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint's bytes do not match its manifest (flipped, truncated, missing)."""

    def __init__(self, step: int, file: str, reason: str, tier: str = "") -> None:
        self.step, self.file, self.reason, self.tier = step, file, reason, tier
        where = f" in tier {tier}" if tier else ""
        super().__init__(f"step {step}{where}: {file}: {reason}")


class StateMismatch(CheckpointError):
    """The state to restore into does not have the checkpoint's layout (shapes, dtypes,
    keys): a user error, not damage, so restore must not fall back to an older step."""


class BackgroundError(CheckpointError):
    """A background drain (disk, object store) failed; raised at the next save()/wait()."""


NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # the errnos of a tier without room (TierFull)


class TierFull(CheckpointError):
    """A durable tier has no room for a step (ENOSPC, EDQUOT, EFBIG on any rank): a failure of
    that tier, not of a rank. The job trains on with its other tiers and tries it again at the
    next save."""


class Preempted(SystemExit):
    """Raised at the step boundary after a preemption notice (SIGTERM), once the urgent
    checkpoint is durable: training frameworks unwind it like any exception (their
    teardown runs), and a process that lets it through ends with status 143, as a
    process killed by SIGTERM would."""

    def __init__(self, step: int) -> None:
        super().__init__(143)
        self.step = step

    def __str__(self) -> str:
        return f"preempted: step {self.step} is durable"


class Abandoned(CheckpointError):
    """A background wait on other ranks ended because the job's membership changed
    (``ckpt.inprocess``): expected at every in-process recovery, so logged as news, not as an error."""


class SnapshotChanged(CheckpointError):
    """An overlapped snapshot (``overlap=True``) was refused its seal: a saved tensor was
    written in place while it was being copied, before ``wait_staged()`` or the next
    ``optimizer.step()``. The previous sealed snapshot stays the newest."""


class UnsoundState(CheckpointError):
    """A committed step's replicas disagreed, or it held NaN/Inf (``ckpt/save/soundness.py``):
    raised by the next ``save()`` so the job restarts from the newest step whose replicas
    agreed. ``health``: the verdict (state, reason, culprits: rank, node, gpu)."""

    def __init__(self, message: str, health: dict) -> None:
        super().__init__(message)
        self.health = health

"""One run per checkpoint root (disk directory or object-store prefix).

Two jobs on one root would mix up their checkpoints: each one's retention deletes the
other's, and a restarted job restores the other's state. So the first job to use a
root records its run id there (``.ckpt-guard-run``), and a job with another run id
refuses to start on it. The run id is the job's identity across its own restarts,
replacement nodes and resizes, all of which pass the same one.
"""
from __future__ import annotations

import json
import socket
import time
from typing import TYPE_CHECKING, Sequence

from ..errors import CheckpointError
from ..tiers.base import DurableTier

if TYPE_CHECKING:
    from ..restore.execute import Agreement

RUN_MARKER = ".ckpt-guard-run"
_MAX_MARKER_BYTES = 4096


def owner_run(tier: DurableTier) -> str | None:
    """The run recorded in ``tier``, or None when none is."""
    raw = tier.read_marker(RUN_MARKER)
    if raw is None:
        return None
    try:
        run = json.loads(raw[:_MAX_MARKER_BYTES]).get("run")
    except (ValueError, AttributeError, RecursionError):
        run = None
    if not isinstance(run, str):
        raise CheckpointError(f"{tier.location}/{RUN_MARKER} is unreadable; remove it if this root is yours")
    return run


def claim(tier: DurableTier, run: str) -> str | None:
    """Record ``run`` as the owner of ``tier`` unless another run is; returns that other run."""
    record = json.dumps({"run": run, "claimed": time.time(), "host": socket.gethostname()}).encode()
    if tier.create_marker(RUN_MARKER, record):
        return None
    owner = owner_run(tier)
    return None if owner == run else owner


def claim_for_job(coord: Agreement, tiers: Sequence[DurableTier], run: str) -> None:
    """``claim`` each of a job's tiers; raise on every rank alike when any rank found one of
    them another run's (a rank that found none says "another run": the others name it)."""
    others = [(t, claim(t, run)) for t in tiers]
    if coord.any(any(other is not None for _, other in others))[0]:
        tier, other = next(((t, o) for t, o in others if o is not None), (tiers[0], "another run"))
        raise refusal(tier, run, other)


def refusal(tier: DurableTier, run: str, other: str) -> CheckpointError:
    return CheckpointError(
        f"{tier.location} belongs to run {other!r}; this job is run {run!r}. Two runs on one root would delete and "
        f"restore each other's checkpoints: give this job its own root (or prefix), pass run={other!r} if it is "
        f"that job, or remove {tier.location}/{RUN_MARKER} once run {other!r} is retired")

"""The canary after a restore (docs/sound-state.md): the first step after a restore must
reproduce what the run recorded for it.

The training loop calls ``CheckpointManager.record(loss, grad_norm=None)`` once per step
(the loop helper's user, the in-process runner's step, the Lightning and HF callbacks). The
first record after a save of step s is the loss computed on exactly s's parameters: it is
the *reference* for s, and rides the next save's commit announcement into that commit's
health record (``canary``: by rank, a few numbers in the commit's small JSON, no file per
step). After a restore of s, the first record is checked against that reference:

* bitwise, when the run is reproducible as recorded: the same world size and thread count,
  and ``torch.use_deterministic_algorithms(True)`` both times (the data order and RNG are
  restored by the loop helper: ``integrations/data.py``, ``integrations/rng.py``);
* else within ``RTOL`` (relative) of the reference;
* "no reference" (s was the newest step, or the next save was never committed, or the world
  size changed: each rank's share of the batch is another) is a state, not a failure.

A failed canary (on any rank: the ranks agree) is written to ``<root>/canary-<run>.json``
and raises ``CanaryFailed``: the job restarts and a plain restore skips that checkpoint and
every later one of its generation, taking the newest verified one before it. A second
failure stops the job (``CanaryFailed.stop``): going back again would only loop.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

from ..errors import CheckpointError
from ..format.bounded_json import loads_bounded
from ..tiers.base import CheckpointId, TierReader

log = logging.getLogger(__name__)

RTOL = 1e-3  # the tolerance when the run is not bitwise reproducible as recorded


class CanaryFailed(CheckpointError):
    """The first step after a restore did not reproduce the recorded loss. ``stop``: a
    canary failed before in this run, so the job stops rather than go back again."""

    def __init__(self, message: str, stop: bool) -> None:
        super().__init__(message)
        self.stop = stop


def record_path(root: str | os.PathLike, run: str) -> Path:
    return Path(root) / f"canary-{run}.json"


def failures(path: Path) -> list[dict]:
    """The failed canaries recorded for the run ({"generation", "step", "reason", "t"}); []
    when none or when the record is unreadable (logged): a damaged record never stops a job."""
    try:
        doc = loads_bounded(path.read_bytes(), f"canary record {path}", 4, 1 << 20)
    except FileNotFoundError:
        return []
    except (OSError, CheckpointError) as e:
        log.warning("canary record ignored: %s", e)
        return []
    got = doc.get("failed") if isinstance(doc, dict) else None
    return [f for f in got if isinstance(f, dict) and type(f.get("generation")) is int
            and type(f.get("step")) is int] if isinstance(got, list) else []


def avoided(path: Path) -> Callable[[CheckpointId], bool]:
    """Whether a plain restore must skip an id: a failed canary's checkpoint and every later
    one of its generation."""
    failed = failures(path)
    return lambda i: any(i.generation == f["generation"] and i.step >= f["step"] for f in failed)


def reference(tiers: list[TierReader], restored: CheckpointId, rank: int) -> dict | None:
    """This rank's recorded reference for the first step after ``restored`` (None: no reference)."""
    for tier in tiers:
        for info in tier.list():
            canary = (info.health or {}).get("canary") if info.complete else None
            if isinstance(canary, dict) and canary.get("after") == restored.step \
                    and info.id.generation == restored.generation:
                ref = (canary.get("by_rank") or {}).get(str(rank))
                if isinstance(ref, dict) and isinstance(ref.get("loss"), (int, float)):
                    return ref
    return None


def _facts(loss: float, grad_norm: float | None, world: int) -> dict[str, Any]:
    import torch

    return {"loss": float(loss), "grad_norm": None if grad_norm is None else float(grad_norm),
            "threads": torch.get_num_threads(), "deterministic": torch.are_deterministic_algorithms_enabled(),
            "world": world}


def compare(got: dict, ref: dict) -> str | None:
    """None when ``got`` reproduces ``ref`` (bitwise when reproducible, else within RTOL); else why not."""
    exact = ref.get("deterministic") and got["deterministic"] and ref.get("world") == got["world"] \
        and ref.get("threads") == got["threads"]
    for key in ("loss", "grad_norm"):
        a, b = got.get(key), ref.get(key)
        if a is None or not isinstance(b, (int, float)):
            continue
        if not math.isfinite(a):
            return f"{key} {a} is not finite"
        if (a != b) if exact else abs(a - b) > RTOL * max(abs(b), 1e-12):
            return f"{key} {a!r} != recorded {b!r} ({'bitwise' if exact else f'rtol {RTOL}'})"
    return None


def figures(out: Any) -> tuple[float, float | None] | None:
    """A step's loss (and grad norm) from what a step or a ``training_step`` returned: a number,
    a 0-d tensor, ``(loss, grad_norm)``, or a dict with "loss" (and "grad_norm"); else None."""
    if isinstance(out, dict):
        out = (out.get("loss"), out.get("grad_norm"))
    loss, grad = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
    try:
        return float(loss), None if grad is None else float(grad)
    except (TypeError, ValueError, RuntimeError):  # not a scalar: nothing to record
        return None


class Canary:
    """One rank's canary state: the reference being taken for the last save, and the check
    pending after a restore."""

    def __init__(self, rank: int, world: int, path: Path, agree_any: Callable[[bool], list[bool]]) -> None:
        self.rank, self.world, self.path, self._any = rank, world, path, agree_any
        self._after: int | None = None  # the last saved step
        self._ref: dict | None = None  # its reference, once the first step after it recorded one
        self._pending: tuple[CheckpointId, dict | None] | None = None  # (restored, its reference)
        self.last: str | None = None  # the last check's outcome: "passed", "no reference"

    def saved(self, step: int) -> dict | None:
        """At a save of ``step``: returns the reference for the previous save (it rides this one)."""
        ref, self._after, self._ref = self._ref, step, None
        return ref

    def restored(self, ckpt_id: CheckpointId, ref: dict | None) -> None:
        self._after, self._ref, self._pending = ckpt_id.step, None, (ckpt_id, ref)

    def record(self, loss: float, grad_norm: float | None = None) -> str | None:
        """One step's figures; after a restore, the check's outcome ("passed", "no reference")
        or ``CanaryFailed``. Every rank calls it at the same step (the check agrees across ranks)."""
        got = _facts(loss, grad_norm, self.world)
        if self._after is not None and self._ref is None:
            self._ref = {"after": self._after, **got}
        if self._pending is None:
            return None
        (ckpt_id, ref), self._pending = self._pending, None
        # another world size splits the batch otherwise: this rank's loss is not the one recorded
        why = "no reference" if ref is None or ref.get("world", self.world) != self.world else compare(got, ref)
        failed = why not in (None, "no reference")
        before = failures(self.path)  # read by every rank before any writes
        if not self._any(failed)[0]:
            self.last = why or "passed"
            log.info("canary after restoring step %d: %s", ckpt_id.step, self.last)
            return self.last
        why = why if failed else "another rank's first step did not reproduce its recorded figures"
        self._write([*before, {"generation": ckpt_id.generation, "step": ckpt_id.step, "reason": why[:300],
                               "t": time.time()}])
        msg = (f"CANARY FAILED after restoring step {ckpt_id.step} (generation {ckpt_id.generation}) on rank "
               f"{self.rank}: {why}")
        if before:
            raise CanaryFailed(f"{msg}; a canary failed before in this run ({len(before)}x): stopping the job "
                               f"rather than going back again (record: {self.path})", stop=True)
        raise CanaryFailed(f"{msg}; the next restore skips it and every later step of its generation and takes "
                           f"the newest verified one before it (record: {self.path})", stop=False)

    def _write(self, failed: list[dict]) -> None:
        if os.environ.get("LOCAL_RANK", "0") != "0":
            return  # one writer per node
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"failed": failed}, indent=1))
        os.replace(tmp, self.path)

"""The one restore path: agree on the newest checkpoint every rank can read, read it
(each shard from its fastest sound source), agree that every rank succeeded, else
skip that checkpoint, say why, and try the next.

A single process is the one-rank case (``LOCAL``), so ``CheckpointManager.restore``,
``ckpt.load`` and ``ckpt restore`` all go through ``restore_agreed``; only what is done
with a plan differs (load into a state, or copy into another tier).
"""
from __future__ import annotations

import logging
import sys
from contextlib import suppress
from functools import partial
from typing import Any, Callable, Protocol, TypeVar

from ..errors import CheckpointError, DamagedCheckpoint, ManifestError, StateMismatch
from ..format.manifest import Manifest, ShardManifest
from ..format.verify import Progress
from ..tiers.base import CheckpointId, ShardReader, TierReader
from .plan import Inventory, Needs, RestorePlan, ShardPlan, plans

log = logging.getLogger(__name__)

#: "This copy is damaged, try the next": the one list, for every restore and verify.
DAMAGE = (DamagedCheckpoint, ManifestError, OSError, EOFError)
T = TypeVar("T")


class Agreement(Protocol):
    """What restore needs of the ranks (``distributed.Coordinator``; ``LOCAL`` when alone)."""

    world_size: int

    def gather(self, obj: Any) -> list[Any]: ...

    def all(self, flag: bool) -> bool: ...

    def any(self, *flags: bool) -> list[bool]: ...


class _Alone:
    world_size = 1

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def all(self, flag: bool) -> bool:
        return flag

    def any(self, *flags: bool) -> list[bool]:
        return list(flags)


LOCAL: Agreement = _Alone()


def restore_agreed(coord: Agreement, inventory: Inventory, needs: Needs,
                   execute: Callable[[RestorePlan], T], *, step: int | None = None,
                   on_skip: Callable[[CheckpointId, str], None] | None = None) -> tuple[RestorePlan, T] | None:
    """Run ``execute`` on the newest plan that succeeds on every rank; None when no
    checkpoint is there. Each checkpoint skipped is logged with its reason (and passed to
    ``on_skip``). Raises CheckpointError when checkpoints exist but none can be read
    (every one damaged). ``inventory`` is what the tiers list, fastest first (the caller
    may keep it to explain, when nothing is found, what was there)."""
    rejected: dict[CheckpointId, str] = {}
    while True:
        mine = plans(inventory, needs, step, skip=rejected)
        chosen = _agree(coord, mine, received(needs, coord.world_size))
        if chosen is None:
            _nothing_left(coord, step, rejected)
            return None
        result: T | None = None
        error: str | None = None
        mismatch: StateMismatch | None = None
        try:
            result = execute(chosen)
        except StateMismatch as e:  # the job's state is wrong, not the checkpoint: no fallback
            error, mismatch = str(e), e
        except (CheckpointError, *DAMAGE) as e:
            error = str(e)
        failed, mismatched = coord.any(error is not None, mismatch is not None)
        if mismatched:
            raise mismatch or StateMismatch(f"step {chosen.ckpt_id.step}: another rank's state does not match "
                                            "the checkpoint (see its log)")
        if not failed:
            return chosen, result  # type: ignore[return-value]
        reason = error or "another rank could not read it"
        log.warning("skipping step %d (generation %d): %s", chosen.ckpt_id.step, chosen.ckpt_id.generation, reason)
        if on_skip is not None:
            on_skip(chosen.ckpt_id, reason)
        rejected[chosen.ckpt_id] = reason


def received(needs: Needs, world: int) -> frozenset[str] | None:
    """The keys this rank takes from another for a step that no tier it reads lists, when its
    state is all replicated (every need optional or sent: a spare or a rank whose node was
    lost); None when it must read something itself."""
    wanted = needs(world)
    if not wanted or not all(n.optional or n.sent for n in wanted):
        return None
    return frozenset().union(*(n.keys for n in wanted if n.sent and n.keys is not None)) or None


def _agree(coord: Agreement, mine: list[RestorePlan], anything: frozenset[str] | None) -> RestorePlan | None:
    """The newest id every rank can restore, with its sender when some rank receives keys:
    each rank says which ids it can read and whether whole (a rank lacking replicated keys,
    ``plan.receive``, gets them from one that read them; ``anything``: this rank can take any
    step saved at this world size that way), and an id needs one rank that reads it whole."""
    world = coord.world_size
    seen = coord.gather(([(p.ckpt_id, not p.receive, p.world_size) for p in mine], anything is not None))
    whole = {i: w for ids, _ in seen for i, complete, w in ids if complete}
    takes = [{i for i, _, _ in ids} | ({i for i, w in whole.items() if w == world} if flexible else set())
             for ids, flexible in seen]
    common = set.intersection(*takes) & whole.keys()
    if not common:
        return None
    best = max(common)
    chosen = next((p for p in mine if p.ckpt_id == best), None) or RestorePlan(best, world, [], anything or frozenset())
    if any((best, False, world) in ids or not any(i == best for i, _, _ in ids) for ids, _ in seen):
        chosen.sender = next(r for r, (ids, _) in enumerate(seen) if any(i == best and c for i, c, _ in ids))
    return chosen


def _nothing_left(coord: Agreement, step: int | None, rejected: dict[CheckpointId, str]) -> None:
    """After the last candidate: raise (on every rank alike) if checkpoints were there."""
    if coord.any(bool(rejected))[0]:
        what = "" if step is None else f" for step {step}"
        lines = [f"step {i.step} (generation {i.generation}): {why}"
                 for i, why in sorted(rejected.items(), reverse=True)]
        raise CheckpointError(f"no valid checkpoint{what}; every candidate is damaged:\n  " + "\n  ".join(lines or
                              ["(on another rank)"]))


def log_restored(plan: RestorePlan, seconds: float, rank: int, world_size: int) -> None:
    """One line per rank saying where each shard came from: the first question after a restart.
    Logged at INFO; where the program configured no logging at all, it goes to stderr anyway,
    since a resume that says nothing looks like a run that started over."""
    if world_size == 1:
        first = plan.shards[0].sources[0]
        line = f"restored step {plan.ckpt_id.step} from {first.name} ({first.location}) in {seconds:.2f} s"
    else:
        sources = ", ".join([*(f"shard {s.rank} from {s.sources[0].name}" for s in plan.shards),
                             *([f"{', '.join(sorted(plan.receive))} from rank {plan.sender}"] if plan.receive else [])])
        line = f"rank {rank} restored step {plan.ckpt_id.step} ({sources}) in {seconds:.2f} s"
    log.info("%s", line)
    if not log.hasHandlers():
        print(f"ckpt-guard: {line}", file=sys.stderr, flush=True)


class OpenShards:
    """One restore's saved shards, each opened once (its manifest read and parsed once): the
    layout check before any byte lands (``manifest``) and the read (``take``) share the
    reader. Whoever takes a reader reads and closes it inside that shard's fallback (a
    memory slot re-checks its seal at close); leaving the block closes those never read."""

    def __init__(self, ckpt_id: CheckpointId) -> None:
        self.ckpt_id = ckpt_id
        self._open: dict[tuple[TierReader, int], ShardReader] = {}
        self._commits: dict[TierReader, Manifest] = {}  # each tier's commit record, read once (it lists N shards)

    def manifest(self, tier: TierReader, rank: int) -> ShardManifest:
        if (tier, rank) not in self._open:
            self._open[(tier, rank)] = self._shard(tier, rank)
        return self._open[(tier, rank)].manifest

    def take(self, tier: TierReader, rank: int) -> ShardReader:
        reader = self._open.pop((tier, rank), None)
        return reader if reader is not None else self._shard(tier, rank)

    def _shard(self, tier: TierReader, rank: int) -> ShardReader:
        if tier not in self._commits:
            self._commits[tier] = tier.read_manifest(self.ckpt_id)
        return open_shard(tier, self.ckpt_id, rank, self._commits[tier])

    def __enter__(self) -> "OpenShards":
        return self

    def __exit__(self, *exc: object) -> None:
        for reader in self._open.values():
            with suppress(*DAMAGE):  # nothing was read from it
                reader.close()
        self._open.clear()


def read_shard(tier: TierReader, ckpt_id: CheckpointId, rank: int, *, threads: int = 4,
               progress: Progress | None = None, opened: OpenShards | None = None) -> dict:
    """Read and verify one saved rank's shard into new tensors and plain values."""
    from ..format.state import unflatten
    from ..format.tensor_io import read_tensors

    reader = opened.take(tier, rank) if opened is not None else open_shard(tier, ckpt_id, rank)
    try:
        tensors = read_tensors(reader, step=ckpt_id.step, tier=tier.name, threads=threads, progress=progress)
        values = unflatten(reader.manifest.tree, lambda i: tensors[i])
    finally:
        reader.close()
    if not isinstance(values, dict):
        raise ManifestError(f"step {ckpt_id.step}: the checkpoint's top level is not a dict")
    return values


def open_shard(tier: TierReader, ckpt_id: CheckpointId, rank: int, commit: Manifest | None = None) -> ShardReader:
    """Saved rank ``rank``'s shard in ``tier``, as its commit record (``commit``, else read now) lists it."""
    ref = next((s for s in (commit or tier.read_manifest(ckpt_id)).shards if s.rank == rank), None)
    if ref is None:
        raise FileNotFoundError(f"step {ckpt_id.step}: rank {rank}'s shard is not in {tier.location}")
    return tier.open_shard(ckpt_id, ref)


def first_sound(shard: ShardPlan, ckpt_id: CheckpointId, read: Callable[[TierReader], T]) -> T:
    """``read`` from the shard's sources in order, past damaged ones (each logged)."""
    failures = []
    for tier in shard.sources:
        try:
            return read(tier)
        except DAMAGE as e:
            log.warning("step %d: shard %d in %s (%s) is damaged: %s", ckpt_id.step, shard.rank, tier.name,
                        tier.location, e)
            failures.append(f"{tier.name}: {e}")
    raise CheckpointError(f"no valid copy of shard {shard.rank} of step {ckpt_id.step} ({'; '.join(failures)})")


def load_plan(plan: RestorePlan, *, threads: int = 4, progress: Progress | None = None) -> dict:
    """Execute ``plan`` into new tensors and plain values, with no target to match (inspection,
    export, a copy): a restore into a live state goes through ``reshard.load_values``, which
    normalises the saved state against it first (invariant 14)."""
    values: dict = {}
    with OpenShards(plan.ckpt_id) as opened:
        for shard in plan.shards:
            got = first_sound(shard, plan.ckpt_id, partial(read_shard, ckpt_id=plan.ckpt_id, rank=shard.rank,
                                                           threads=threads, progress=progress, opened=opened))
            values.update(got if shard.keys is None else {k: v for k, v in got.items() if k in shard.keys})
    return values


def shard_manifest(shard: ShardPlan, ckpt_id: CheckpointId, opened: OpenShards | None = None) -> ShardManifest:
    """The saved shard's manifest, from its first sound source (no tensor bytes read); with
    ``opened``, that source stays open for the read."""
    if opened is not None:
        return first_sound(shard, ckpt_id, partial(opened.manifest, rank=shard.rank))
    reader = first_sound(shard, ckpt_id, partial(open_shard, ckpt_id=ckpt_id, rank=shard.rank))
    try:
        return reader.manifest
    finally:
        reader.close()

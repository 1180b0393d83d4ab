"""One row per checkpoint across tiers: what ``ckpt ls`` and ``CheckpointManager.list`` show.

``peer`` in a row: the saved ranks whose shards of that step this node holds as peer
replicas for other nodes (``peer_bytes`` of them); a step held here only as such
replicas has status "replica"."""
from __future__ import annotations

from typing import Sequence

from ..format.health import classify, merged_health
from ..tiers.base import CheckpointId, CheckpointInfo, TierReader
from ..tiers.memory import MemoryTier
from ..tiers.memory.namespace import slot_file_bytes
from ..tiers.peer import PeerTier
from .execute import DAMAGE
from .optim_names import saved_layouts


def merge_listing(tiers: Sequence[TierReader], listed: Sequence[list[CheckpointInfo]] | None = None) -> list[dict]:
    """Step, generation, time, size, the tiers holding it, its status and its ``health``
    (``format/health.py``: verified, ok, unchecked, suspect, unhealthy, tainted); newest last.
    ``listed``: each tier's ``list()``, when the caller has it already."""
    rows: dict[CheckpointId, dict] = {}
    listed = [tier.list() for tier in tiers] if listed is None else listed
    for tier, infos in zip(tiers, listed):
        for info in infos:
            row = rows.setdefault(info.id, {"step": info.id.step, "generation": info.id.generation,
                                            "created": info.created, "bytes": info.bytes, "tiers": [], "damaged": {},
                                            "peer": [], "peer_bytes": 0})
            if info.complete and tier.name == "peer":
                row["peer"] = sorted(set(row["peer"]) | info.ranks)
                row["peer_bytes"] += info.bytes
            if info.complete:
                if tier.name not in row["tiers"]:
                    row["tiers"].append(tier.name)
                row["bytes"] = max(row["bytes"], info.bytes)
            else:
                row["damaged"][tier.name] = info.error
    health = merged_health((i.id, i.health) for tier_rows in listed for i in tier_rows if i.complete)
    status = classify(health)
    for cid, row in rows.items():
        row["status"] = ("replica" if row["tiers"] == ["peer"] else "complete") if row["tiers"] else "damaged"
        row["health"] = status.get(cid, "unchecked")  # format/health.py: verified, ok, suspect, ...
        if health.get(cid):
            row["culprits"] = health[cid].get("culprits", [])
            row["reason"] = health[cid].get("reason", "")
    return [rows[k] for k in sorted(rows)]


def shm_usage(tiers: Sequence[TierReader]) -> dict[str, int]:
    """Bytes of shared memory the slot files of these tiers take on this node: the job's
    own slots ("memory") and the replica slots it holds for other nodes ("peer")."""
    own = {t.dir.parent for t in tiers if isinstance(t, MemoryTier)}
    return {"memory": sum(slot_file_bytes(ns) for ns in own),
            "peer": sum(slot_file_bytes(t.ns) for t in tiers if isinstance(t, PeerTier))}


def optimizer_layouts(tiers: Sequence[TierReader], row: dict,
                      listed: Sequence[list[CheckpointInfo]] | None = None) -> dict[str, str] | None:
    """How each optimizer of a listed checkpoint is keyed ("by name" / "by position"), from
    the first shard manifest of the first tier holding it; None when none can be read.
    ``listed``: each tier's ``list()``, whose first shard spares reading the commit record again."""
    ckpt_id = CheckpointId(row["generation"], row["step"])
    for k, tier in enumerate(tiers):
        if tier.name not in row["tiers"]:
            continue
        known = next((i.first for i in (listed[k] if listed else ()) if i.id == ckpt_id and i.complete), None)
        try:
            reader = tier.open_shard(ckpt_id, known or tier.read_manifest(ckpt_id).shards[0])
        except DAMAGE:
            continue
        try:
            return saved_layouts(reader.manifest.tree, reader.manifest.param_names)
        finally:
            reader.close()
    return None

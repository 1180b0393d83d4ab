"""One row per checkpoint across tiers: what ``ckpt ls`` and ``CheckpointManager.list`` show."""
from __future__ import annotations

from typing import Sequence

from .tiers.base import CheckpointId, TierReader


def merge_listing(tiers: Sequence[TierReader]) -> list[dict]:
    """Step, generation, time, size, the tiers holding it and its status; newest last."""
    rows: dict[CheckpointId, dict] = {}
    for tier in tiers:
        for info in tier.list():
            row = rows.setdefault(info.id, {"step": info.id.step, "generation": info.id.generation,
                                            "created": info.created, "bytes": info.bytes, "tiers": [], "damaged": {}})
            if info.complete:
                if tier.name not in row["tiers"]:
                    row["tiers"].append(tier.name)
                row["bytes"] = max(row["bytes"], info.bytes)
            else:
                row["damaged"][tier.name] = info.error
    for row in rows.values():
        row["status"] = "complete" if row["tiers"] else "damaged"
    return [rows[k] for k in sorted(rows)]

"""What ``ckpt verify`` last found of each step, kept beside the checkpoints so ``ckpt ls``
shows it: the commit's seal covers the manifests, not the data, so a step whose bytes
rotted still lists as ``complete`` until something reads every byte; once verify has,
ls says ``damaged`` (or ``checked``, with when: every checksum matched; not the HEALTH column's
``verified``, which is about the state's values, docs/sound-state.md).

One small JSON file in a local root (``.ckpt-verdicts.json``), written atomically; a file
that is unreadable or hostile counts as no record (ls never fails on it).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..tiers.base import CheckpointId
from ..tiers.fsutil import atomic_write

VERDICTS_FILE = ".ckpt-verdicts.json"
_MAX_BYTES = 4 << 20


def read_verdicts(root: str | os.PathLike) -> dict[str, dict[str, dict]]:
    """``{step dir name: {tier: {"status", "at", "reason"?}}}``; {} when there is none or it is unreadable."""
    try:
        with open(Path(root) / VERDICTS_FILE, "rb") as f:
            data = json.loads(f.read(_MAX_BYTES + 1)[:_MAX_BYTES])
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: {t: v for t, v in tiers.items() if isinstance(v, dict) and isinstance(v.get("status"), str)}
            for k, tiers in data.items() if isinstance(tiers, dict)}


def record_verdicts(root: str | os.PathLike, results: list[dict]) -> None:
    """Merge verify's rows (step, generation, tier, status, reason) into the root's record."""
    data = read_verdicts(root)
    now = time.time()
    for r in results:
        entry = {"status": "damaged" if r["status"] == "damaged" else "ok" if r["status"] == "ok" else "unverified",
                 "at": now}
        if r.get("reason"):
            entry["reason"] = str(r["reason"])[:500]
        data.setdefault(CheckpointId(r["step"], r["generation"]).name, {})[r["tier"]] = entry
    atomic_write(Path(root) / VERDICTS_FILE, json.dumps(data).encode())


def apply_verdicts(rows: list[dict], verdicts: dict[str, dict[str, dict]]) -> list[dict]:
    """Rows of ``merge_listing`` with what verify found: a tier it found damaged moves to
    ``damaged``; ``checked``: when every tier left was found sound (``checked_at``: the oldest check)."""
    for row in rows:
        seen = verdicts.get(CheckpointId(row["step"], row["generation"]).name, {})
        for tier in [t for t in row["tiers"] if seen.get(t, {}).get("status") == "damaged"]:
            row["tiers"].remove(tier)
            row["damaged"][tier] = f"found damaged by ckpt verify: {seen[tier].get('reason', '')}"
        ok = [seen[t].get("at") for t in row["tiers"] if seen.get(t, {}).get("status") == "ok"]
        if not row["tiers"]:
            row["status"] = "damaged"
        elif len(ok) == len(row["tiers"]) and row["status"] == "complete":
            row["status"] = "checked"
            row["checked_at"] = min((a for a in ok if isinstance(a, (int, float))), default=None)
    return rows

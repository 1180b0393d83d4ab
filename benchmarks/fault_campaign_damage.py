"""What the fault campaign (benchmarks/fault_campaign.py) does to a killed job's checkpoints
before it is started again: one byte flipped in the middle of the bytes, the way bit rot or a
bad DIMM would, never the names or sizes (those are other faults' business)."""
from __future__ import annotations

import shutil
from pathlib import Path


def flip_middle_byte(path: Path) -> None:
    """Invert the byte in the middle of ``path`` in place."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def damage_memory_slots(memory_dir: Path, disk_root: Path, min_bytes: int = 64 << 10) -> list[str]:
    """Every memory slot's payload (files of ``min_bytes`` or more in the memory tier): one byte
    flipped in each. The restore must notice and read the disk tier."""
    hit = sorted(p for p in memory_dir.rglob("*") if p.is_file() and p.stat().st_size >= min_bytes)
    for p in hit:
        flip_middle_byte(p)
    return [str(p.relative_to(memory_dir)) for p in hit]


def damage_disk_shard(memory_dir: Path, disk_root: Path) -> list[str]:
    """The memory tier gone (a rebooted host) and the largest shard of the newest sealed step on
    disk (rank 0's: it alone saves the replicated keys) with one byte flipped: the restore must
    skip that step for the one before."""
    for p in memory_dir.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    newest = max((p for p in disk_root.glob("step-*") if (p / "manifest.json").exists()), key=lambda p: p.name)
    shard = max(newest.glob("rank-*.bin"), key=lambda p: p.stat().st_size)
    flip_middle_byte(shard)
    return [str(shard.relative_to(disk_root))]

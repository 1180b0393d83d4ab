"""Memory tier, read side: the sealed shared-memory slots of one rank.

Writing happens through ``memory.SlotPool.snapshot`` (the trainer's copy), so this
tier is never a drain target. A reader in another process (``ckpt`` after a crash)
maps the slot read-only and re-checks the seal when done, so a slot being
overwritten meanwhile is reported, never returned torn.
"""
from __future__ import annotations

import mmap
import os
import warnings
from pathlib import Path

import numpy as np
import torch

from ..checksum import crc32c_of
from ..errors import DamagedCheckpoint, ManifestError
from ..manifest import Manifest, ShardManifest, ShardRef
from ..memory import SlotPool, rank_dir
from .base import CheckpointId, CheckpointInfo, ShardReader, Tier


class SlotReader(ShardReader):
    def __init__(self, meta_path: Path, data_path: Path, manifest: ShardManifest, buffer: torch.Tensor | None,
                 *, seal: int | None) -> None:
        """``seal``: the inode of the seal ``manifest`` was read from (None: do not re-check)."""
        self.manifest, self.location = manifest, str(data_path)
        self._meta_path = meta_path
        self._seal = seal
        self._mmap = None
        if buffer is None:
            fd = os.open(data_path, os.O_RDONLY)
            try:
                if os.fstat(fd).st_size < manifest.data_bytes:
                    raise DamagedCheckpoint(manifest.step, str(data_path), "shorter than its seal says", "memory")
                self._mmap = mmap.mmap(fd, manifest.data_bytes, mmap.MAP_SHARED, mmap.PROT_READ) if manifest.data_bytes else None
            finally:
                os.close(fd)
            with warnings.catch_warnings():  # read-only on purpose: nothing writes through it
                warnings.simplefilter("ignore", UserWarning)
                buffer = torch.from_numpy(np.frombuffer(self._mmap, dtype=np.uint8)) if self._mmap else torch.empty(0, dtype=torch.uint8)
        self._buf = buffer
        self._view = memoryview(buffer.numpy()) if buffer.numel() else memoryview(b"")

    def view(self, offset: int, nbytes: int) -> memoryview:
        return self._view[offset : offset + nbytes]

    def tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        return self._buf[offset : offset + nbytes]

    def read_into(self, offset: int, out: memoryview) -> None:
        n = len(out)
        dst = torch.frombuffer(out, dtype=torch.uint8) if n else None
        if dst is not None:
            dst.copy_(self._buf[offset : offset + n])  # releases the GIL, unlike a memoryview copy

    def close(self) -> None:
        try:
            still = self._seal is None or self._meta_path.stat().st_ino == self._seal
        except FileNotFoundError:
            still = False
        self._view.release()
        self._buf = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # a caller still holds a view; the GC unmaps it later
                pass
            self._mmap = None
        if not still:
            raise DamagedCheckpoint(self.manifest.step, str(self._meta_path), "slot was overwritten while being read", "memory")


class MemoryTier(Tier):
    name = "memory"

    def __init__(self, ns: Path, rank: int = 0, pool: SlotPool | None = None) -> None:
        self.dir = rank_dir(ns, rank)
        self.rank = rank
        self.pool = pool

    @property
    def location(self) -> str:
        return str(self.dir)

    def _sealed(self) -> list[tuple[Path, ShardManifest | None, str | None, int]]:
        """(seal path, its manifest or None, why not, the seal's inode). The inode is taken
        from the file the manifest was read from: a reseal is a new inode, so a reader
        can tell later whether the slot still holds what this manifest describes."""
        out = []
        for meta in sorted(self.dir.glob("slot-*.json")) if self.dir.is_dir() else []:
            try:
                with open(meta, "rb") as f:
                    ino, raw = os.fstat(f.fileno()).st_ino, f.read()
            except FileNotFoundError:
                continue
            try:
                out.append((meta, ShardManifest.from_bytes(raw, str(meta)), None, ino))
            except ManifestError as e:
                out.append((meta, None, str(e), ino))
        return out

    def list(self) -> list[CheckpointInfo]:
        infos = []
        for meta, man, _, _ in self._sealed():
            if man is None:
                continue  # an unreadable seal is an invalid slot, not a checkpoint
            try:
                sealed_at = meta.stat().st_mtime
            except FileNotFoundError:
                continue  # unsealed since it was read: a live job is overwriting the slot
            infos.append(CheckpointInfo(CheckpointId(man.generation, man.step), self.name, sealed_at,
                                        man.data_bytes, man.world_size, checksummed=man.has_checksums))
        return sorted(infos, key=lambda i: i.id)

    def _find(self, ckpt_id: CheckpointId) -> tuple[Path, ShardManifest, int]:
        for meta, man, _, ino in self._sealed():
            if man is not None and (man.generation, man.step) == (ckpt_id.generation, ckpt_id.step):
                return meta, man, ino
        raise FileNotFoundError(f"step {ckpt_id} is not in memory ({self.dir})")

    def read_manifest(self, ckpt_id: CheckpointId) -> Manifest:
        meta, man, _ = self._find(ckpt_id)
        # A slot holds one rank's shard: the manifest lists just that one.
        return Manifest(man.step, man.generation, man.world_size,
                        [ShardRef(man.rank, crc32c_of(meta.read_bytes()), man.data_bytes)], created=meta.stat().st_mtime)

    def open_shard(self, ckpt_id: CheckpointId, ref: ShardRef) -> ShardReader:
        meta, man, seal = self._find(ckpt_id)
        data = meta.with_suffix(".bin")
        live = None
        if self.pool is not None:
            live = next((s.buffer for s in self.pool.slots if s.meta_path == meta and s.buffer is not None), None)
        return SlotReader(meta, data, man, live, seal=seal)

    def write_shard(self, ckpt_id: CheckpointId, source: ShardReader) -> ShardRef:
        raise NotImplementedError("the memory tier is written by snapshots (SlotPool.snapshot), not copied into")

    def written_shards(self, ckpt_id: CheckpointId) -> dict[int, ShardRef]:
        raise NotImplementedError("memory slots are per rank; nothing is committed across ranks here")

    def commit(self, ckpt_id: CheckpointId, manifest: Manifest) -> None:
        raise NotImplementedError("a memory slot is committed by its seal")

    def delete(self, ckpt_id: CheckpointId) -> None:
        meta, _, _ = self._find(ckpt_id)
        meta.unlink(missing_ok=True)

    def cleanup(self, min_age_s: float = 0.0) -> list[str]:
        return []

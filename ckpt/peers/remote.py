"""Replicas held by *other* ranks, as a restore source: a rank whose own shard is gone
(a replacement node) reads it from the rank holding its replica, over the peer
connection. The listing comes from every rank's gathered inventory (torchrun may
renumber nodes after a restart, so holders are found, not recomputed); the bytes are
checked against the shard manifest's chunk checksums where they land (``tensor_io``)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..errors import DamagedCheckpoint
from ..format.checksum import crc32c_of
from ..format.manifest import Manifest, ShardManifest, ShardRef
from ..tiers.base import CheckpointId, CheckpointInfo, ShardReader, TierReader
from . import wire


@dataclass(frozen=True)
class Held:
    """One replica some rank holds: whose shard, where to ask for it."""

    holder: int
    addr: str
    world_size: int
    ref: ShardRef


class FetchedShard(ShardReader):
    """A shard fetched whole into this process's memory."""

    def __init__(self, manifest: ShardManifest, data: torch.Tensor, location: str) -> None:
        self.manifest, self.location, self._data = manifest, location, data  # uint8, data_bytes long
        self._view = memoryview(data.numpy())

    def view(self, offset: int, nbytes: int) -> memoryview:
        return self._view[offset : offset + nbytes]

    def tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        return self._data[offset : offset + nbytes]

    def read_into(self, offset: int, out: memoryview) -> None:
        out[:] = self.view(offset, len(out))


class RemoteTier(TierReader):
    name = "remote-peer"

    def __init__(self, held: dict[CheckpointId, dict[int, Held]], secret: bytes, *, timeout_s: float) -> None:
        self.held, self._secret, self.timeout_s = held, secret, timeout_s
        self.fetched: list[tuple[CheckpointId, Held, float]] = []  # what restore read from here, and how long it took

    @property
    def location(self) -> str:
        return "peers: " + ", ".join(sorted({h.addr for by_rank in self.held.values() for h in by_rank.values()}))

    def list(self) -> list[CheckpointInfo]:
        return [CheckpointInfo(i, self.name, 0.0, sum(h.ref.data_bytes for h in by_rank.values()),
                               next(iter(by_rank.values())).world_size, ranks=frozenset(by_rank))
                for i, by_rank in sorted(self.held.items())]

    def read_manifest(self, ckpt_id: CheckpointId) -> Manifest:
        by_rank = self.held.get(ckpt_id)
        if not by_rank:
            raise FileNotFoundError(f"step {ckpt_id}: no peer holds a replica")
        world = next(iter(by_rank.values())).world_size
        return Manifest(ckpt_id.step, ckpt_id.generation, world, [h.ref for h in by_rank.values()], created=0.0)

    def open_shard(self, ckpt_id: CheckpointId, ref: ShardRef) -> ShardReader:
        held = self.held.get(ckpt_id, {}).get(ref.rank)
        if held is None:
            raise FileNotFoundError(f"step {ckpt_id}: no peer holds rank {ref.rank}'s shard")
        where = f"rank {held.holder}'s replica of rank {ref.rank} ({held.addr})"
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        with wire.connect(held.addr, self._secret, self.timeout_s) as session:
            session.send_frame({"op": "get", "rank": ref.rank, "generation": ckpt_id.generation,
                                "step": ckpt_id.step}, deadline=deadline)
            reply = session.recv_frame(deadline=deadline)
            if not reply.get("ok"):
                raise FileNotFoundError(f"step {ckpt_id}: {where}: {str(reply.get('error'))[:500]}")
            raw = str(reply.get("manifest", "")).encode("utf-8", "replace")
            if crc32c_of(raw) != held.ref.manifest_crc32c:
                raise DamagedCheckpoint(ckpt_id.step, where, "manifest does not match the holder's inventory",
                                        self.name)
            man = ShardManifest.from_bytes(raw, where)
            if (man.rank, man.step, man.generation) != (ref.rank, ckpt_id.step, ckpt_id.generation) \
                    or not man.has_checksums:
                raise DamagedCheckpoint(ckpt_id.step, where, "manifest is not of this shard, or has no checksums",
                                        self.name)
            data = torch.empty(man.data_bytes, dtype=torch.uint8)  # not zeroed: every byte is received
            session.recv_data(memoryview(data.numpy()), deadline=deadline)
        self.fetched.append((ckpt_id, held, time.monotonic() - t0))
        return FetchedShard(man, data, where)  # restore opens each shard once (restore.OpenShards)

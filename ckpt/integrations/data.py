"""A sampler that remembers where it is, so a resumed run sees exactly the batches
the interrupted one had not yet consumed."""
from __future__ import annotations

from typing import Iterator, Sized

import torch
import torch.distributed as dist
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    """Shuffled per epoch from ``seed``, split across ranks like DistributedSampler,
    and Stateful: ``state_dict()`` holds the epoch and how many indices were consumed."""

    def __init__(self, dataset: Sized, *, seed: int = 0, shuffle: bool = True,
                 rank: int | None = None, world_size: int | None = None) -> None:
        active = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if active else 0)
        self.world_size = world_size if world_size is not None else (dist.get_world_size() if active else 1)
        self.n, self.seed, self.shuffle = len(dataset), seed, shuffle
        self.epoch, self.consumed = 0, 0

    def __len__(self) -> int:
        return self.n // self.world_size

    def _order(self) -> list[int]:
        if not self.shuffle:
            order = list(range(self.n))
        else:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        return order[self.rank : len(self) * self.world_size : self.world_size]

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        while self.consumed < len(order):
            self.consumed += 1
            yield order[self.consumed - 1]
        self.epoch, self.consumed = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.epoch, self.consumed = int(sd["epoch"]), int(sd["consumed"])

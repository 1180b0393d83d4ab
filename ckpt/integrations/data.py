"""A sampler and a data loader that remember where they are, so a resumed run sees
exactly the batches the interrupted one had not yet consumed."""
from __future__ import annotations

from typing import Any, Iterator, Sized

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, Sampler


class ResumableSampler(Sampler[int]):
    """Shuffled per epoch from ``seed``, split across ranks like DistributedSampler,
    and Stateful: ``state_dict()`` holds the epoch, how many indices each rank consumed
    and the world size. Loaded at another world size (elastic training continuing on
    fewer nodes), the rest of the epoch is split anew: the ranks had consumed the first
    ``consumed x world`` indices of the epoch's order together, and the new ranks share
    what follows, so no sample is seen twice or skipped."""

    def __init__(self, dataset: Sized, *, seed: int = 0, shuffle: bool = True,
                 rank: int | None = None, world_size: int | None = None) -> None:
        active = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if active else 0)
        self.world_size = world_size if world_size is not None else (dist.get_world_size() if active else 1)
        self.n, self.seed, self.shuffle = len(dataset), seed, shuffle
        self.epoch, self.consumed = 0, 0
        self.start = 0  # indices of this epoch's order taken before a change of world size

    def __len__(self) -> int:
        return (self.n - self.start) // self.world_size

    def _order(self) -> list[int]:
        if not self.shuffle:
            order = list(range(self.n))
        else:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        return order[self.start + self.rank : self.start + len(self) * self.world_size : self.world_size]

    def __iter__(self) -> Iterator[int]:
        # The next epoch starts when a new pass begins, not when the last index is
        # taken: loops that stop after len() batches (Lightning, HF) never ask again.
        if self.consumed >= len(self):
            self.epoch, self.consumed, self.start = self.epoch + 1, 0, 0
        order = self._order()
        while self.consumed < len(order):
            self.consumed += 1
            yield order[self.consumed - 1]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed, "start": self.start, "world_size": self.world_size}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.epoch, self.consumed, self.start = int(sd["epoch"]), int(sd["consumed"]), int(sd.get("start", 0))
        saved_world = int(sd.get("world_size", self.world_size))
        if saved_world != self.world_size:
            self.start, self.consumed = self.start + self.consumed * saved_world, 0


class ResumableDataLoader(DataLoader):
    """A DataLoader over a ``ResumableSampler`` whose position is the batches it has
    *delivered*: workers prefetching ahead do not move the resume point. Stateful, so
    Lightning keeps it in its loop state and reloads it before iterating; a plain loop
    puts it in the checkpointed state. Its own ``generator`` (seeded from the sampler)
    keeps starting a pass from drawing on the global torch RNG, so a resumed run, which
    starts one pass more, draws the same random numbers as an uninterrupted one."""

    def __init__(self, dataset: Dataset, *, sampler: ResumableSampler, batch_size: int, **kwargs: Any) -> None:
        kwargs.setdefault("generator", torch.Generator().manual_seed(sampler.seed))
        super().__init__(dataset, sampler=sampler, batch_size=batch_size, **kwargs)
        self._delivered: int | None = None  # batches handed out in the current pass

    def __iter__(self) -> Iterator[Any]:
        s = self.sampler
        self._delivered = 0 if s.consumed >= len(s) else s.consumed // self.batch_size
        for batch in super().__iter__():
            self._delivered += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        if self._delivered is None:  # no pass yet: wherever the sampler was put
            return self.sampler.state_dict()
        done = len(self.sampler) if self._delivered >= len(self) else self._delivered * self.batch_size
        return {**self.sampler.state_dict(), "consumed": done}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.sampler.load_state_dict(sd)
        self._delivered = None

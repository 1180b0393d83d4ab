"""The model every row of the recovery benchmark trains, whichever engine recovers it: the
tiny GPT of examples/train_torchrun.py, AdamW at 3e-3, its synthetic corpus, a global batch
of 12 (3, 2 and 1 ranks split it evenly; each sample is the same whatever the world size),
one intra-op thread per rank (3 ranks share this machine's 2 cores)."""
from __future__ import annotations

import torch

from examples.gpt import GPT, GPTConfig
from examples.train_torchrun import synthetic_corpus

GLOBAL_BATCH, MAX_STEPS = 12, 60
_data: list = []


def model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    gpt = GPT(GPTConfig.tiny())
    return gpt, torch.optim.AdamW(gpt.parameters(), lr=3e-3)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of global batch ``step``."""
    if not _data:
        _data.append(synthetic_corpus(GLOBAL_BATCH * MAX_STEPS, GPTConfig.tiny()))
    x, y = _data[0][step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]
    share = GLOBAL_BATCH // world
    return x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]


def loss(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = net(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

"""Every random number generator a training step draws from, as one Stateful object."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


class RNGState:
    """Put it in the checkpointed state (``state["rng"] = RNGState()``): saving captures
    the torch (CPU and CUDA), numpy and Python generators, loading puts them back."""

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                              "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = torch.cuda.get_rng_state_all()
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        torch.set_rng_state(sd["torch"])
        np.random.set_state(sd["numpy"])
        random.setstate(sd["python"])
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(sd["cuda"])

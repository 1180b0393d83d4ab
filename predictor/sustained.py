"""A model risk that stays high is an alarm: the model's sustained tier.

The sensitive threshold is chosen on single crossings, and what raises false alarms there is a
risk that spikes on a GPU that then does not fail. A risk that holds at SUSTAINED_RISK or above
for SUSTAINED_S is rarer on such GPUs (as a Prometheus alert rule's ``for:``): the scorer raises
it to the sensitive threshold, so a job checkpoints; the strict threshold, which pages
operators, stays above it. Measured on held-out traces in docs/predictor.md ("This round: a
sustained risk").
"""
from __future__ import annotations

import numpy as np

SUSTAINED_RISK = 0.9
SUSTAINED_S = 600.0


class Sustained:
    """Per GPU slot, since when its risk has been at SUSTAINED_RISK or above (-1: it is not)."""

    def __init__(self) -> None:
        self.since = np.empty(0, np.int64)

    def grow(self, cap: int) -> None:
        if len(self.since) < cap:
            self.since = np.concatenate([self.since, np.full(cap - len(self.since), -1, np.int64)])

    def reset(self, slots: np.ndarray) -> None:
        """A new board in these slots: the old one's risk says nothing of it."""
        self.since[slots] = -1

    def update(self, slots: np.ndarray, t_ms: np.ndarray, risk: np.ndarray) -> np.ndarray:
        """Fold in one instant's risk per GPU (each slot once, in time order across calls);
        which rows have now held SUSTAINED_RISK for SUSTAINED_S."""
        high = risk >= SUSTAINED_RISK
        held = self.since[slots]
        since = np.where(high, np.where(held >= 0, held, t_ms), -1)
        self.since[slots] = since
        return high & (t_ms - since >= SUSTAINED_S * 1000)


def sustained_reason(model_reason: str) -> str:
    return f"risk >= {SUSTAINED_RISK:g} for {SUSTAINED_S / 60:g} min: {model_reason}"

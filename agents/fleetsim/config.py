"""Knobs of the fleet model: GPU profiles, rates, and scheduled (demo) failures."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timezone

from telemetry.failure_modes import FAILURE_MODES


@dataclass(frozen=True)
class GpuProfile:
    """Electrical and thermal envelope of one GPU model (vendor data sheets)."""

    model_name: str
    tdp_w: float
    idle_w: float
    max_sm_mhz: float
    idle_sm_mhz: float
    slowdown_c: float  # software thermal slowdown starts
    hw_slowdown_c: float  # hardware slowdown / thermal brake
    r_th: float  # °C above inlet per watt at steady state (air-cooled SXM)


PROFILES = {
    "h100": GpuProfile("NVIDIA H100 80GB HBM3", 700.0, 72.0, 1980.0, 345.0, 87.0, 92.0, 0.066),
    "h200": GpuProfile("NVIDIA H200", 700.0, 78.0, 1980.0, 345.0, 87.0, 92.0, 0.064),
    "a100": GpuProfile("NVIDIA A100-SXM4-80GB", 400.0, 58.0, 1410.0, 210.0, 85.0, 90.0, 0.095),
}

_DURATION = re.compile(r"^\+?(\d+(?:\.\d+)?)([smhd]?)$")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """Seconds from '90', '90s', '10m', '1.5h' or '2d'."""
    m = _DURATION.match(text.strip())
    if not m:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 10m, 2h, 1d)")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


@dataclass(frozen=True)
class ScheduledFailure:
    """A failure placed by hand, e.g. for a demo: ``node0003/gpu2/hbm@+10m``.

    ``at_s`` is wall-clock seconds after the start of the trace or live run;
    the precursor is shortened if needed so that it starts after the start.
    """

    node: str
    gpu: int
    mode: str
    at_s: float

    @classmethod
    def parse(cls, spec: str) -> "ScheduledFailure":
        m = re.match(r"^([^/@\s]+)/(?:gpu)?(\d+)/([a-z]+)@(.+)$", spec.strip())
        if not m:
            raise ValueError(f"bad failure spec {spec!r}: expected NODE/gpuN/MODE@+OFFSET, e.g. node0003/gpu2/hbm@+10m")
        node, gpu, mode, when = m.groups()
        if mode not in FAILURE_MODES:
            raise ValueError(f"bad failure mode {mode!r} in {spec!r}: one of {', '.join(FAILURE_MODES)}")
        return cls(node, int(gpu), mode, parse_duration(when))


def _default_mode_weights() -> dict[str, float]:
    # Among failures with a precursor. Llama 3 Table 5: HBM3 is the largest single
    # cause that shows itself in telemetry, thermal interface the smallest.
    return {"hbm": 0.45, "nvlink": 0.2, "pcie": 0.2, "thermal": 0.15}


@dataclass
class FleetConfig:
    """Everything that shapes a simulated fleet; defaults describe an enriched H100 fleet."""

    nodes: int = 32
    gpus_per_node: int = 8
    days: float | None = 8.0  # None: unbounded (live source)
    interval_s: float = 60.0
    seed: int = 0
    start: datetime = field(default_factory=lambda: datetime(2026, 5, 4, tzinfo=timezone.utc))
    gpu_model: str = "h100"
    temp_offset_c: float = 0.0
    failure_rate_per_gpu_day: float = 0.05
    sudden_share: float = 1 / 3
    mode_weights: dict[str, float] = field(default_factory=_default_mode_weights)
    scheduled: tuple[ScheduledFailure, ...] = ()
    node_names: tuple[str, ...] | None = None
    time_scale: float = 1.0
    hot_node_share: float = 0.12
    noisy_gpu_share: float = 0.04  # per kind: steady SBE, PCIe replays, NVLink CRC
    storms_per_node_day: float = 0.3
    sample_drop_p: float = 0.003
    blank_field_p: float = 0.0008

    def __post_init__(self) -> None:
        if self.gpu_model not in PROFILES:
            raise ValueError(f"unknown GPU model {self.gpu_model!r}: one of {', '.join(PROFILES)}")
        if self.interval_s <= 0 or self.time_scale <= 0:
            raise ValueError("interval and time scale must be positive")
        if not 0 <= self.sudden_share <= 1:
            raise ValueError("sudden share must lie in [0, 1]")
        unknown = set(self.mode_weights) - set(FAILURE_MODES[:-1])
        if unknown or sum(self.mode_weights.values()) <= 0:
            raise ValueError(f"mode weights need positive weights for hbm/thermal/pcie/nvlink, got {self.mode_weights}")
        names = self.names()
        for f in self.scheduled:
            if f.node not in names:
                fleet = f"node {names[0]!r} (set --node-name)" if len(names) == 1 else f"{names[0]} ... {names[-1]}"
                raise ValueError(f"scheduled failure on {f.node!r}, which is not in this fleet: {fleet}")
            if not 0 <= f.gpu < self.gpus_per_node:
                raise ValueError(f"scheduled failure on GPU {f.gpu}: this fleet has GPUs 0-{self.gpus_per_node - 1}")

    @property
    def profile(self) -> GpuProfile:
        return PROFILES[self.gpu_model]

    def names(self) -> tuple[str, ...]:
        if self.node_names is not None:
            return self.node_names
        return tuple(f"node{i:04d}" for i in range(self.nodes))

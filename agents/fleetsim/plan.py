"""What happens on one node and when: jobs, storms, reboots, failures, repairs.

The plan is a list of timed events in *model* seconds since the start (see
``time_scale`` in the package docstring), drawn ahead of the samples and
extended lazily, so a live source can run without end while a trace is drawn in
chunks. ``node.NodeSim`` turns the plan into samples.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from agents.fleetsim.config import FleetConfig

DAY = 86400.0
PLAN_SPAN = DAY  # how far ahead events are drawn at a time

# (median seconds, log-sigma) of each mode's precursor duration: minutes to hours.
# Medians near the shared sample's (hbm 65, pcie 70, nvlink 25, thermal 71 min).
PRECURSOR_DURATION = {"hbm": (4000.0, 0.8), "thermal": (4000.0, 0.7), "pcie": (4200.0, 0.9), "nvlink": (1800.0, 0.8)}
TERMINAL_XIDS = {
    "hbm": ((48, 94, 95, 64), (0.45, 0.2, 0.15, 0.2)),
    "thermal": ((79,), (1.0,)),
    "pcie": ((79,), (1.0,)),
    "nvlink": ((74,), (1.0,)),
    # Llama 3 Table 5: SRAM (48) 19, GSP (119/120) 17, faulty GPU (79, 62) most of 148.
    "sudden": ((79, 48, 119, 120, 62), (0.35, 0.2, 0.2, 0.1, 0.15)),
}
# Peak precursor rate (events per model second) at the failure, log-uniform range, and
# the thermal mode's peak temperature rise (°C, uniform), both times the strength.
# Matched to the shared fleet sample: its last ten minutes before an HBM failure show
# 0.01-0.07 SBE/s, PCIe 0.06-0.35 replays/s, NVLink 0.07-0.9 CRC/s, thermal +7-40 °C.
PEAK_RATE = {"hbm": (0.02, 0.06), "pcie": (0.12, 0.35), "nvlink": (0.2, 0.9)}
THERMAL_PEAK_C = (11.0, 24.0)
# Growth g of the rate's rise, expm1(g * progress) / expm1(g), uniform: fitted per failure
# to the shared sample's events (as a pure exponential), long ramps, where the fit is tight,
# give 3.5-4.4, median 4.0; this range fits the simulator's own ramps to the same.
RAMP_GROWTH = (3.1, 4.1)
APP_STORM_XIDS = ((13, 31, 43), (0.3, 0.45, 0.25))


@dataclass
class Failure:
    """One GPU failure: terminal XID at ``t``, precursor over ``[t - duration, t)``."""

    gpu: int
    mode: str
    t: float
    duration: float
    strength: float
    xid: int
    peak: float
    growth: float
    last_xid92: float = -np.inf

    def progress(self, t: np.ndarray) -> np.ndarray:
        """0 before the precursor, rising to 1 at the failure, 0 after it."""
        x = (t - (self.t - self.duration)) / max(self.duration, 1e-9)
        return np.where((x >= 0) & (t < self.t), np.clip(x, 0, 1), 0.0)

    def rate(self, t: np.ndarray) -> np.ndarray:
        """Precursor event rate: exponential rise to ``peak * strength``."""
        p = self.progress(t)
        ramp = np.expm1(self.growth * p) / np.expm1(self.growth)
        return np.where(p > 0, self.peak * self.strength * ramp, 0.0)


@dataclass
class Outage:
    """A GPU absent over [start, end); it returns reset (same UUID) or replaced."""

    gpu: int
    start: float
    end: float
    replace: bool


@dataclass
class NodePlan:
    cfg: FleetConfig
    rng: np.random.Generator
    until: float = 0.0
    # workload: busy segments (start, end, intensity, stall period, stall length)
    jobs: list[tuple[float, float, float, float, float]] = field(default_factory=list)
    idle_windows: list[tuple[float, float]] = field(default_factory=list)  # forced idle (job died)
    absent_windows: list[tuple[float, float]] = field(default_factory=list)  # whole node silent
    reboots: list[float] = field(default_factory=list)  # volatile counters restart here
    brakes: list[tuple[float, float]] = field(default_factory=list)  # HW power brake
    storms: list[tuple[float, int, int]] = field(default_factory=list)  # application XIDs: (t, gpu, xid)
    failures: list[Failure] = field(default_factory=list)
    outages: list[Outage] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._job_end = -self.rng.uniform(0, 6 * 3600)
        self._gpu_free = np.zeros(self.cfg.gpus_per_node)  # a GPU may fail again only after it returns

    def extend(self, t1: float) -> None:
        """Draw events up to model time ``t1`` (idempotent for earlier times)."""
        while self.until < t1:
            t0, self.until = self.until, self.until + PLAN_SPAN
            self._plan_jobs(self.until)
            self._plan_node_events(t0, self.until)
            self._plan_failures(t0, self.until)

    def add_scheduled(self, gpu: int, mode: str, t: float) -> None:
        """A demo failure: its precursor is never faint or short (it peaks at the top of its
        mode's range), and starts after the start."""
        self._add_failure(gpu, mode, t, max_duration=0.9 * t)
        f = self.failures[-1]
        f.strength = max(f.strength, 1.0)
        if mode in PRECURSOR_DURATION:
            f.duration = min(max(f.duration, PRECURSOR_DURATION[mode][0]), 0.9 * t)
        f.peak = PEAK_RATE.get(f.mode, THERMAL_PEAK_C)[1]

    # -- drawing ---------------------------------------------------------------

    def _plan_jobs(self, t1: float) -> None:
        rng = self.rng
        while self._job_end < t1:
            start = self._job_end + rng.lognormal(np.log(900), 1.2)  # idle gap
            length = rng.lognormal(np.log(8 * 3600), 0.9)
            end = start + length
            self.jobs.append((start, end, rng.uniform(0.72, 1.0), rng.uniform(900, 3600), rng.uniform(40, 200)))
            if rng.random() < 0.2:  # the job ends by crashing: an application XID storm
                self._storm(end)
            self._job_end = end

    def _storm(self, t: float) -> None:
        rng, g = self.rng, self.cfg.gpus_per_node
        gpus = np.arange(g) if rng.random() < 0.5 else rng.choice(g, size=rng.integers(1, 3), replace=False)
        code = int(rng.choice(APP_STORM_XIDS[0], p=APP_STORM_XIDS[1]))
        for gpu in gpus:
            for _ in range(rng.integers(1, 3)):
                self.storms.append((t + rng.uniform(0, 20), int(gpu), code))
            self.storms.append((t + rng.uniform(20, 60), int(gpu), 45))

    def _plan_node_events(self, t0: float, t1: float) -> None:
        rng, span = self.rng, t1 - t0
        for t in t0 + rng.uniform(0, span, rng.poisson(self.cfg.storms_per_node_day * 0.5 * span / DAY)):
            self._storm(t)  # storms mid-job; the job restarts after a short idle
            self.idle_windows.append((t, t + rng.uniform(120, 1200)))
        for t in t0 + rng.uniform(0, span, rng.poisson(span / DAY / 6)):  # reboot every ~6 node-days
            down = rng.uniform(180, 900)
            self.absent_windows.append((t, t + down))
            self.reboots.append(t + down)
        for t in t0 + rng.uniform(0, span, rng.poisson(span / DAY / 4)):  # agent stalls
            self.absent_windows.append((t, t + rng.uniform(60, 1800)))
        for t in t0 + rng.uniform(0, span, rng.poisson(span / DAY / 8)):  # power shelf brake
            self.brakes.append((t, t + rng.uniform(5, 120)))
        rate = self.cfg.failure_rate_per_gpu_day / 200  # maintenance swaps, no failure
        for gpu in range(self.cfg.gpus_per_node):
            for t in t0 + rng.uniform(0, span, rng.poisson(rate * span / DAY)):
                if t >= self._gpu_free[gpu]:
                    self._add_outage(gpu, t, replace=True)

    def _plan_failures(self, t0: float, t1: float) -> None:
        cfg, rng = self.cfg, self.rng
        modes = list(cfg.mode_weights)
        w = np.array([cfg.mode_weights[m] for m in modes], dtype=float)
        for gpu in range(cfg.gpus_per_node):
            n = rng.poisson(cfg.failure_rate_per_gpu_day * (t1 - t0) / DAY)
            for t in np.sort(rng.uniform(t0, t1, n)):
                if t < self._gpu_free[gpu]:
                    continue
                mode = "sudden" if rng.random() < cfg.sudden_share else str(rng.choice(modes, p=w / w.sum()))
                self._add_failure(gpu, mode, float(t), max_duration=t - self._gpu_free[gpu])

    def _add_failure(self, gpu: int, mode: str, t: float, max_duration: float) -> None:
        rng = self.rng
        xids, p = TERMINAL_XIDS[mode]
        duration = strength = peak = 0.0
        growth = 1.0
        if mode != "sudden":
            median, sigma = PRECURSOR_DURATION[mode]
            duration = float(np.clip(rng.lognormal(np.log(median), sigma), 60, 8 * 3600))
            duration = max(0.0, min(duration, max_duration))
            strength = float(rng.lognormal(0.0, 0.8))
            growth = float(rng.uniform(*RAMP_GROWTH))
            if mode in PEAK_RATE:
                lo, hi = PEAK_RATE[mode]
                peak = float(np.exp(rng.uniform(np.log(lo), np.log(hi))))
            else:  # thermal: peak temperature rise in °C
                peak = float(rng.uniform(*THERMAL_PEAK_C))
        self.failures.append(Failure(gpu, mode, t, duration, strength, int(rng.choice(xids, p=p)), peak, growth))
        self.idle_windows.append((t, t + rng.uniform(600, 3600)))  # the job died with the GPU
        self._add_outage(gpu, t, replace=rng.random() < (0.85 if mode == "hbm" else 0.4))

    def _add_outage(self, gpu: int, t: float, replace: bool) -> None:
        end = t + float(np.clip(self.rng.lognormal(np.log(3 * 3600), 0.9), 1800, 24 * 3600))
        self.outages.append(Outage(gpu, t, end, replace))
        self._gpu_free[gpu] = end

"""One simulated node: turns its plan into samples, XID events and failure labels.

Vectorised over (GPU, step); state that must survive between calls (counter
totals, the thermal lag, UUIDs, the plan) lives on the object, so a trace is
drawn in chunks of hours and a live source one step at a time by the same code.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from agents.fleetsim.config import FleetConfig
from agents.fleetsim.plan import NodePlan
from telemetry import schema as S

THERMAL_TAU_S = 100.0
LAG_BLOCK = 64
VOLATILE = (S.SBE, S.DBE, S.PCIE_REPLAY, S.NVLINK_CRC)  # restart at a reset or reboot
PERSISTENT = (S.REMAP_CORR, S.REMAP_UNCORR, S.REMAP_FAILURE)  # stored on the GPU: restart only when replaced
XID92_EVERY_S = 4 * 3600.0
XID92_RATE = 0.012  # SBE per second above which the driver reports XID 92
REMAPS_PER_SBE = 0.05  # the shared sample remaps about one row per 20 SBE before an HBM failure


@dataclass
class Chunk:
    """Rows of consecutive steps of one node, time-major, GPU-minor; absent rows removed."""

    timestamp_ms: np.ndarray
    gpu: np.ndarray
    uuid: np.ndarray  # index into NodeSim.uuids
    metrics: dict[str, np.ndarray]
    xid_ms: np.ndarray
    xid_gpu: np.ndarray
    xid: np.ndarray
    failures: list[dict]


def _in_windows(t: np.ndarray, windows) -> np.ndarray:
    hit = np.zeros(t.shape, bool)
    for a, b in windows:
        if a <= t[-1] and b > t[0]:
            hit |= (t >= a) & (t < b)
    return hit


class NodeSim:
    """A node of ``cfg.gpus_per_node`` GPUs named ``name``; ``index`` seeds its traits."""

    def __init__(self, cfg: FleetConfig, name: str, index: int):
        self.cfg, self.name, self.prof = cfg, name, cfg.profile
        self.rng = np.random.default_rng([cfg.seed, index])
        rng, g = self.rng, cfg.gpus_per_node
        self.dt = cfg.interval_s * cfg.time_scale  # model seconds per step
        self.step = 0
        self.plan = NodePlan(cfg, np.random.default_rng([cfg.seed, index, 1]))
        for f in cfg.scheduled:
            if f.node == name:
                self.plan.add_scheduled(f.gpu, f.mode, f.at_s * cfg.time_scale)
        # node traits
        self.offset_ms = int(rng.integers(0, int(cfg.interval_s * 1000)))
        self.inlet = rng.normal(33.0, 1.5) + cfg.temp_offset_c  # busy GPUs near 71 °C, as the sample
        if rng.random() < cfg.hot_node_share:
            self.inlet += rng.uniform(4, 11)
        self.diurnal = (rng.uniform(0.3, 2.0), rng.uniform(0, 2 * np.pi))
        self.unsupported = [m for m in (S.MEMORY_TEMP, S.NVLINK_CRC, S.REMAP_FAILURE) if rng.random() < 0.01]
        # GPU traits
        self.temp_offset = rng.normal(0, 1.0, g)   # GPUs of a node within about ±3.5 °C (as the sample)
        self.mem_offset = rng.normal(4.0, 1.2, g)
        self.r_th = self.prof.r_th * rng.normal(1, 0.02, g)
        self.eff = rng.normal(1, 0.04, g)

        def noisy(lo: float, hi: float) -> np.ndarray:
            return np.where(rng.random(g) < cfg.noisy_gpu_share, np.exp(rng.uniform(np.log(lo), np.log(hi), g)), 0.0)

        self.base_rate = {  # events per model second; look-alike rates as in the shared sample
            S.SBE: noisy(3 / 3600, 13 / 3600) + rng.exponential(0.004 / 3600, g),
            S.PCIE_REPLAY: noisy(0.8 / 3600, 4.5 / 3600),
            S.NVLINK_CRC: noisy(0.7 / 3600, 2.5 / 3600) + rng.exponential(0.06 / 3600, g),
        }
        self.pcie_bursts_per_s = 1 / (15 * 86400)
        self.uuids: list[str] = []
        self.gpu_uuid = np.array([self._new_uuid() for _ in range(g)])
        self.totals = {m: np.zeros(g) for m in VOLATILE + PERSISTENT}
        self.temp_state: np.ndarray | None = None
        self.pending_uncorr = np.zeros(g)  # an uncorrectable remap lands at the next reset

    def _new_uuid(self) -> int:
        b = self.rng.integers(0, 256, 16, dtype=np.uint8).tobytes().hex()
        self.uuids.append(f"GPU-{b[:8]}-{b[8:12]}-{b[12:16]}-{b[16:20]}-{b[20:]}")
        return len(self.uuids) - 1

    def wall_ms(self, t_model: np.ndarray | float) -> np.ndarray:
        """Epoch milliseconds of a model time on this node's clock."""
        start = int(self.cfg.start.timestamp() * 1000) + self.offset_ms
        return start + np.round(np.asarray(t_model) / self.cfg.time_scale * 1000).astype(np.int64)

    def advance(self, n: int) -> Chunk:
        """Draw the next ``n`` steps."""
        cfg, prof, rng, g = self.cfg, self.prof, self.rng, self.cfg.gpus_per_node
        k = self.step + np.arange(n)
        t = k * self.dt
        t_open = t[0] - self.dt  # this call covers model time (t_open, t[-1]]
        self.plan.extend(t[-1] + self.dt)
        self.step += n

        util = self._node_util(t)[None, :] * np.clip(rng.normal(1, 0.03, (g, n)), 0.8, 1.05)
        util = np.clip(util, 0, 1)
        out = np.zeros((g, n), bool)
        for o in self.plan.outages:
            if o.start <= t[-1] and o.end > t[0]:
                out[o.gpu] |= (t >= o.start) & (t < o.end)
        util[out] = 0

        demand = prof.idle_w + (prof.tdp_w * 0.93 - prof.idle_w) * util * self.eff[:, None]
        demand += rng.normal(0, 0.018 * prof.tdp_w, (g, n)) * (0.2 + util)
        heat = np.zeros((g, n))
        rates = {m: np.broadcast_to(r[:, None], (g, n)).copy() for m, r in self.base_rate.items()}
        rates[S.PCIE_REPLAY] *= 0.3 + util
        rates[S.NVLINK_CRC] *= 0.1 + util
        inc = {m: np.zeros((g, n)) for m in VOLATILE + PERSISTENT}
        xids: list[tuple[float, int, int]] = []
        failures: list[dict] = []
        for f in self.plan.failures:
            if f.t - f.duration > t[-1] or f.t <= t_open:
                continue
            self._precursor(f, t, inc, heat, xids)
            if f.t <= t[-1]:
                xids.append((f.t, f.gpu, f.xid))
                failures.append(self._label(f))
                # the error that kills the GPU may show in its last sample
                j = min(int(np.searchsorted(t, f.t - self.rng.uniform(0, 2 * self.dt))), n - 1)
                if f.xid == 64:
                    inc[S.REMAP_FAILURE][f.gpu, j] = 1
                elif f.xid in (48, 94, 95):
                    inc[S.DBE][f.gpu, j] += 1
                    self.pending_uncorr[f.gpu] += f.mode == "hbm"  # remapped at the next reset

        metrics = self._gauges(t, util, demand, heat)
        for m, r in rates.items():
            inc[m] += rng.poisson(r * self.dt) * ~out
        inc[S.PCIE_REPLAY] += rng.poisson(self.pcie_bursts_per_s * self.dt, (g, n)) * rng.integers(1, 50, (g, n)) * ~out
        self._noisy_gpu_events(t, inc, xids)
        uuid = np.broadcast_to(self.gpu_uuid[:, None], (g, n)).copy()
        self._counters(t, inc, metrics, uuid)

        present = ~out & ~_in_windows(t, self.plan.absent_windows)[None, :]
        present &= rng.random((1, n)) >= cfg.sample_drop_p  # whole-node sample lost
        present &= rng.random((g, n)) >= cfg.sample_drop_p / 10
        for m, v in metrics.items():
            v = v.astype(float)
            v[rng.random((g, n)) < cfg.blank_field_p] = np.nan
            if m in self.unsupported:
                v[:] = np.nan
            metrics[m] = v.T[present.T]  # rows time-major, GPU-minor
        for ts, gpu, code in self.plan.storms:
            if t_open < ts <= t[-1]:
                xids.append((ts, gpu, code))
        xids = [x for x in xids if not self._gpu_out(x[1], x[0])]

        stamp = self.wall_ms(t)[:, None] + rng.normal(0, 25, (n, 1)).astype(np.int64) + np.zeros((1, g), np.int64)
        gpu_idx = np.broadcast_to(np.arange(g, dtype=np.int16)[None, :], (n, g))
        xt = np.array([x[0] for x in xids], float)
        return Chunk(
            stamp[present.T], gpu_idx[present.T], uuid.T[present.T].astype(np.int32), metrics,
            self.wall_ms(xt) if len(xids) else np.zeros(0, np.int64),
            np.array([x[1] for x in xids], np.int16), np.array([x[2] for x in xids], np.int32), failures,
        )

    # -- pieces of a step --------------------------------------------------------

    def _gauges(self, t: np.ndarray, util: np.ndarray, demand: np.ndarray, heat: np.ndarray) -> dict[str, np.ndarray]:
        """Temperatures, power, SM clock and clocks-event reasons from load and extra heat."""
        prof, rng, (g, n) = self.prof, self.rng, util.shape
        inlet = self.inlet + self.diurnal[0] * np.sin(2 * np.pi * t / 86400 + self.diurnal[1])
        target = inlet[None, :] + self.r_th[:, None] * demand + self.temp_offset[:, None] + heat
        temp = self._lag(target) + rng.normal(0, 0.35, (g, n))

        throttle = np.zeros((g, n))
        clock = np.full((g, n), prof.max_sm_mhz) - 15 * rng.binomial(2, 0.15, (g, n))
        idle = util < 0.05
        capped = demand > prof.tdp_w
        clock = np.where(capped, clock * np.clip(1 - 0.8 * (demand / prof.tdp_w - 1), 0.6, 1), clock)
        throttle += np.where(capped, S.THROTTLE_SW_POWER_CAP, 0)
        sw_hot, hw_hot = temp >= prof.slowdown_c, temp >= prof.hw_slowdown_c
        clock = np.where(sw_hot, clock * np.clip(1 - 0.04 * (temp - prof.slowdown_c), 0.55, 1), clock)
        clock = np.where(hw_hot, clock * 0.5, clock)
        throttle += (np.where(sw_hot, S.THROTTLE_SW_THERMAL, 0)
                     + np.where(hw_hot, S.THROTTLE_HW_THERMAL | S.THROTTLE_HW_SLOWDOWN, 0))
        brake = _in_windows(t, self.plan.brakes)[None, :] & ~idle
        clock = np.where(brake, clock * 0.45, clock)
        throttle += np.where(brake, S.THROTTLE_HW_POWER_BRAKE, 0)
        clock = np.where(idle, prof.idle_sm_mhz, np.round(clock / 15) * 15)
        throttle += np.where(idle, S.THROTTLE_IDLE, 0)
        power = (np.minimum(demand, prof.tdp_w * rng.uniform(0.97, 1.0, (g, n)))
                 * (clock / prof.max_sm_mhz) ** np.where(idle, 0, 1.3))
        power = np.maximum(power, prof.idle_w * 0.8)
        mem_temp = temp + self.mem_offset[:, None] + 5 * util + rng.normal(0, 0.4, (g, n))
        return {S.GPU_TEMP: np.round(temp, 1), S.MEMORY_TEMP: np.round(mem_temp, 1), S.POWER: np.round(power, 1),
                S.SM_CLOCK: clock, S.THROTTLE: throttle}

    def _node_util(self, t: np.ndarray) -> np.ndarray:
        util = np.zeros(t.shape)
        for start, end, level, period, stall in self.plan.jobs:
            if start > t[-1] or end <= t[0]:
                continue
            on = (t >= start) & (t < end)
            stalled = ((t - start) % period) < stall
            util = np.where(on, np.where(stalled, 0.2 * level, level), util)
        return np.where(_in_windows(t, self.plan.idle_windows), 0.0, util)

    def _lag(self, target: np.ndarray) -> np.ndarray:
        """First-order thermal lag y[k] = a x[k] + (1 - a) y[k-1], continued across calls.

        Computed in blocks: inside a block the response is one matrix product,
        only the carry between blocks is a Python loop (n / 64 iterations).
        """
        a = 1 - np.exp(-self.dt / THERMAL_TAU_S)
        g, n = target.shape
        if self.temp_state is None:
            self.temp_state = target[:, 0].copy()
        i = np.arange(LAG_BLOCK)
        weights = np.where(i[:, None] >= i[None, :], a * (1 - a) ** np.maximum(i[:, None] - i[None, :], 0), 0.0)
        x = np.pad(target, ((0, 0), (0, -n % LAG_BLOCK)), mode="edge").reshape(g, -1, LAG_BLOCK)
        y = x @ weights.T
        decay = (1 - a) ** (i + 1)
        prev = self.temp_state
        for b in range(y.shape[1]):
            y[:, b] += prev[:, None] * decay
            prev = y[:, b, -1]
        y = y.reshape(g, -1)[:, :n]
        self.temp_state = y[:, -1].copy()
        return y

    def _precursor(self, f, t, inc, heat, xids) -> None:
        """Add one failure's precursor to this chunk."""
        if f.mode == "sudden" or f.duration <= 0:
            return
        if f.mode == "thermal":
            heat[f.gpu] += f.peak * np.clip(f.strength, 0.7, 1.3) * f.progress(t) ** 1.5
        else:
            counter = {"hbm": S.SBE, "pcie": S.PCIE_REPLAY, "nvlink": S.NVLINK_CRC}[f.mode]
            r = f.rate(t)
            inc[counter][f.gpu] += self.rng.poisson(r * self.dt)
            if f.mode == "hbm":
                rm = self.rng.poisson(r * self.dt * REMAPS_PER_SBE)
                inc[S.REMAP_CORR][f.gpu] += rm
                for ti in t[rm > 0]:
                    xids.append((ti - self.rng.uniform(0, self.dt), f.gpu, 63))
                for ti in t[r > XID92_RATE]:
                    if ti - f.last_xid92 >= XID92_EVERY_S:
                        f.last_xid92 = ti
                        xids.append((ti - self.rng.uniform(0, self.dt), f.gpu, 92))

    def _label(self, f) -> dict:
        """precursor_s is the precursor's duration, as in the shared sample: its first visible
        event comes later (at about 0.8 of it there), and a faint one may never show."""
        lead = f.duration / self.cfg.time_scale
        return {"timestamp": int(self.wall_ms(f.t)), "node": self.name, "gpu": f.gpu, "mode": f.mode,
                "xid": f.xid, "precursor_s": lead}

    def _gpu_out(self, gpu: int, t: float) -> bool:
        return any(o.gpu == gpu and o.start < t < o.end for o in self.plan.outages)

    def _counters(self, t, inc, metrics, uuid) -> None:
        """Cumulative counters with restarts at reboots (volatile) and repairs."""
        n = len(t)
        resets: list[tuple[float, int | None, bool]] = [(r, None, False) for r in self.plan.reboots
                                                        if t[0] - self.dt < r <= t[-1]]
        resets += [(o.end, o.gpu, o.replace) for o in self.plan.outages if t[0] - self.dt < o.end <= t[-1]]
        cums = {m: np.cumsum(inc[m], axis=1) for m in inc}
        base = {m: np.broadcast_to(self.totals[m][:, None], cums[m].shape).copy() for m in inc}
        for when, gpu, replaced in sorted(resets, key=lambda r: r[0]):
            j = int(np.searchsorted(t, when))
            gpus = range(self.cfg.gpus_per_node) if gpu is None else [gpu]
            for gi in gpus:
                for m in inc:
                    if m in VOLATILE or replaced:
                        before = base[m][gi, j - 1] + cums[m][gi, j - 1] if j > 0 else base[m][gi, 0]
                        base[m][gi, j:] -= before
                if replaced:
                    uuid[gi, j:] = self.gpu_uuid[gi] = self._new_uuid()
                    self.pending_uncorr[gi] = 0
                elif gpu is not None and self.pending_uncorr[gi]:
                    base[S.REMAP_UNCORR][gi, j:] += self.pending_uncorr[gi]
                    self.pending_uncorr[gi] = 0
        for m in inc:
            v = base[m] + cums[m]
            if m == S.REMAP_FAILURE:
                v = np.minimum(v, 1)
            metrics[m] = v
            self.totals[m] = v[:, -1].copy() if n else self.totals[m]

    def _noisy_gpu_events(self, t, inc, xids) -> None:
        """Healthy GPUs with a steady SBE rate now and then report XID 92 or remap a row (63)."""
        noisy = np.flatnonzero(self.base_rate[S.SBE] > 0.5 / 3600)
        span = len(t) * self.dt
        for gpu in noisy:
            for code, per_day in ((92, 0.3), (63, 0.2)):
                for _ in range(self.rng.poisson(per_day * span / 86400)):
                    when = t[0] - self.dt + self.rng.uniform(0, span)
                    xids.append((when, int(gpu), code))
                    if code == 63:
                        inc[S.REMAP_CORR][gpu, min(int(np.searchsorted(t, when)), len(t) - 1)] += 1

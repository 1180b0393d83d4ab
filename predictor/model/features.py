"""Incremental per-GPU feature state: the one place telemetry becomes model input.

Every statistic is exponentially decayed with a time constant in *seconds*, so a
10 s, 30 s, 60 s or irregular trace yields comparable features and the state is
O(1) per GPU. Levels are always relative (to the same node's other GPUs or to the
GPU's own past), so a fleet that runs 4 °C warmer looks the same. The state only
ever moves forward in time: a sample is scored from data up to its own timestamp.

Updates are vectorised over a *chunk*: at most one sample per GPU, and one
timestamp per node, so that node-relative features never see a later sample.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from predictor.model.ramps import Ramps
from telemetry import schema as S

#: The features' groupings of the contract's fields (the clock is a level here, the remap
#: failure a flag).
GAUGES = (S.GPU_TEMP, S.MEMORY_TEMP, S.POWER, S.SM_CLOCK)
COUNTERS = (S.SBE, S.DBE, S.REMAP_CORR, S.REMAP_UNCORR, S.PCIE_REPLAY, S.NVLINK_CRC)
#: The metric columns, in the order of `Chunk.values`.
METRICS = GAUGES + COUNTERS + (S.THROTTLE, S.REMAP_FAILURE)

GAUGE_TAUS_S = (300.0, 3600.0, 21600.0)      # short / medium / long memory of a level
RATE_TAUS_S = (600.0, 3600.0, 21600.0)       # counter-rate windows
THROTTLE_TAUS_S = (600.0, 3600.0)
XID_TAUS_S = (1800.0, 21600.0)
INTERVAL_TAU_S = 3600.0                      # memory of a GPU's usual sample interval
NULL_TAU_S = 1800.0
ACTIVE_EVENTS = 1.0                          # a counter is "active" at >= 1 event in its 1 h window
NODE_STALE_S = 600.0                         # a sibling silent this long is not a reference
THERMAL_BITS = S.THROTTLE_SW_THERMAL | S.THROTTLE_HW_THERMAL
SLOWDOWN_BITS = S.THROTTLE_HW_SLOWDOWN | S.THROTTLE_HW_POWER_BRAKE
_LOG_GAUGES = (False, False, True, True)     # power and clock compare as ratios (log)
_NODE_COLS = 2 * len(GAUGES) + 1              # short level and trend per gauge, thermal share
#: GPU indices per node are 0..MAX_GPUS_PER_NODE-1 (the service refuses others): the index
#: look-up table grows with the widest index, so one bad index must not size it for a thousand.
MAX_GPUS_PER_NODE = S.MAX_GPUS_PER_NODE


def short_name(metric: str) -> str:
    """A DCGM field's name as feature names spell it: DCGM_FI_DEV_GPU_TEMP -> gpu_temp."""
    return metric.removeprefix(S.DCGM_PREFIX).lower()


def _feature_names() -> tuple[str, ...]:
    names = []
    for g in GAUGES:
        short = short_name(g)
        names += [f"{short}_trend_5m_1h", f"{short}_trend_1h_6h", f"{short}_vs_node",
                  f"{short}_trend_vs_node"]
    for c in COUNTERS:
        short = short_name(c)
        names += [f"{short}_rate_{int(t // 60)}m" for t in RATE_TAUS_S]
        names += [f"{short}_accel_10m_1h", f"{short}_accel_1h_6h", f"{short}_active_for",
                  f"{short}_since_onset", f"{short}_rate_vs_onset", f"{short}_spread_10m",
                  f"{short}_ramp_left", f"{short}_ramp_left_hi", f"{short}_ramp_events"]
    names += [f"slowdown_throttle_{int(t // 60)}m" for t in THROTTLE_TAUS_S]
    names += ["thermal_throttle_vs_node", "row_remap_failure", "null_share", "gap_ratio",
              "age", "warning_xids_30m", "warning_xids_6h", "application_xids_30m"]
    return tuple(names)


FEATURE_NAMES = _feature_names()


@dataclass
class Chunk:
    """Samples to apply together: slot indices unique, one timestamp per node."""

    slots: np.ndarray    # int64 [n]
    t_ms: np.ndarray     # int64 [n]
    values: np.ndarray   # float64 [n, len(METRICS)], NaN = missing
    uuids: np.ndarray | None = None   # object [n]: str, or None where not reported


def _nanmedian_of_peers(peers: np.ndarray) -> np.ndarray:
    """`np.nanmedian(peers, axis=1)`, bit for bit, at a fraction of its cost: [n, G, cols] → [n, cols]."""
    s = np.sort(peers.transpose(0, 2, 1), axis=2)             # NaN sorts last
    k = np.count_nonzero(~np.isnan(s), axis=2)[..., None]     # values per column (0: NaN result)
    lo = np.take_along_axis(s, np.maximum(k - 1, 0) // 2, axis=2)[..., 0]
    hi = np.take_along_axis(s, k // 2, axis=2)[..., 0]
    with np.errstate(invalid="ignore", over="ignore"):
        return (lo + hi) / 2 + 0.0                            # + 0.0: a zero median is +0, as nanmedian's


def _decay(dt_s: np.ndarray, taus: tuple[float, ...]) -> np.ndarray:
    return np.exp(-np.maximum(dt_s, 0.0)[:, None] / np.asarray(taus)[None, :])


class FleetState:
    """Per-GPU decayed statistics for a whole fleet, in flat numpy arrays."""

    def __init__(self, capacity: int = 1024, ramps: Ramps | None = None):
        """`ramps`: where counters' ramps are dated (a subclass may record them, see benchmarks/)."""
        self.ramps = ramps or Ramps(len(COUNTERS))
        self.slot_of: dict[tuple[str, int], int] = {}
        self.node_of: dict[str, int] = {}
        self.node_names: list[str] = []
        self.node_slots: list[list[int]] = []
        self.slot_key: list[tuple[str, int]] = []
        self._cap = 0
        self._node_cap = 0
        self._gpu_cap = 8
        self._width = 8                              # most GPUs registered on one node
        self._grow(capacity)
        self._grow_nodes(64, self._gpu_cap, self._width)

    # ------------------------------------------------------------ registry
    def slots_for(self, nodes: list[str], gpus: np.ndarray, codes: np.ndarray | None = None) -> np.ndarray:
        """Slot index of each (node, gpu), registering new GPUs (in row order). With `codes`,
        row i's node is nodes[codes[i]]: one look-up per distinct node, not per row."""
        codes = np.arange(len(nodes)) if codes is None else codes
        nid = np.fromiter((self.node_of.get(n, -1) for n in nodes), np.int64, len(nodes))[codes]
        known = (nid >= 0) & (gpus >= 0) & (gpus < self._gpu_cap)
        out = np.full(len(codes), -1, dtype=np.int64)
        out[known] = self.slot_at[nid[known], gpus[known]]
        get = self.slot_of.get
        for i in np.flatnonzero(out < 0).tolist():
            key = (nodes[codes[i]], int(gpus[i]))
            s = get(key)
            out[i] = self._register(key) if s is None else s
        return out

    def _register(self, key: tuple[str, int]) -> int:
        node, gpu = key
        if not 0 <= gpu < MAX_GPUS_PER_NODE:
            raise ValueError(f"GPU index {gpu} on {node}: at most {MAX_GPUS_PER_NODE} GPUs per node")
        if node not in self.node_of:
            self.node_of[node] = len(self.node_names)
            self.node_names.append(node)
            self.node_slots.append([])
        slot = len(self.slot_key)
        if slot >= self._cap:
            self._grow(2 * self._cap)
        nid = self.node_of[node]
        member = len(self.node_slots[nid])
        if nid >= self._node_cap or gpu >= self._gpu_cap or member >= self._width:
            self._grow_nodes(max(2 * self._node_cap, nid + 1) if nid >= self._node_cap else self._node_cap,
                             max(self._gpu_cap, gpu + 1), max(self._width, member + 1))
        self.slot_of[key] = slot
        self.slot_at[nid, gpu] = slot
        self.members[nid, member] = slot
        self.slot_key.append(key)
        self.node_slots[nid].append(slot)
        self.node_idx[slot] = nid
        self.gpu_idx[slot] = gpu
        return slot

    def _grow(self, cap: int) -> None:
        def grow(name, shape_tail, fill, dtype=np.float64):
            new = np.full((cap,) + shape_tail, fill, dtype=dtype)
            old = getattr(self, name, None)
            if old is not None:
                new[: len(old)] = old
            setattr(self, name, new)
        nk, ng = len(COUNTERS), len(GAUGES)
        grow("node_idx", (), 0, np.int64)
        grow("gpu_idx", (), 0, np.int64)
        grow("last_t", (), -1, np.int64)
        grow("start_t", (), -1, np.int64)
        grow("interval_s", (), np.nan)
        grow("level", (ng, len(GAUGE_TAUS_S)), np.nan)
        grow("counter_last", (nk,), np.nan)
        grow("counter_t", (nk,), -1, np.int64)
        grow("counted", (nk, len(RATE_TAUS_S)), 0.0)
        grow("active_since", (nk,), -1, np.int64)
        grow("onset_events", (nk,), 0.0)
        grow("largest_jump", (nk,), 0.0)
        grow("throttle", (2, len(THROTTLE_TAUS_S)), 0.0)
        grow("null_share", (), 0.0)
        grow("remap_failure", (), 0.0)
        grow("xid_t", (), -1, np.int64)
        grow("warning_xids", (len(XID_TAUS_S),), 0.0)
        grow("application_xids", (), 0.0)
        grow("critical_xid", (), 0, np.int64)
        grow("critical_t", (), -1, np.int64)
        grow("uuid", (), None, object)
        grow("published", (_NODE_COLS,), np.nan)      # short level and trend, as the node's peers see them
        grow("published_t", (), -1, np.int64)
        self.ramps.grow(cap)
        self._cap = cap

    def _grow_nodes(self, node_cap: int, gpu_cap: int, width: int) -> None:
        """Per node: slot by GPU index (int64, at most MAX_GPUS_PER_NODE wide) and its GPUs' slots
        (as wide as the most GPUs on one node), the two tables whose size grows with nodes."""
        slot_at = np.full((node_cap, gpu_cap), -1, dtype=np.int64)
        members = np.full((node_cap, width), -1, dtype=np.int64)
        if self._node_cap:
            slot_at[: self._node_cap, : self._gpu_cap] = self.slot_at
            members[: self._node_cap, : self._width] = self.members
        self.slot_at, self.members = slot_at, members
        self._node_cap, self._gpu_cap, self._width = node_cap, gpu_cap, width

    # ------------------------------------------------------------ updates
    def reset(self, slots: np.ndarray) -> None:
        """Forget a GPU's history: it was replaced (new UUID) or its counters restarted."""
        self.last_t[slots] = -1
        self.start_t[slots] = -1
        self.interval_s[slots] = np.nan
        self.level[slots] = np.nan
        self.counter_last[slots] = np.nan
        self.counter_t[slots] = -1
        self.counted[slots] = 0.0
        self.active_since[slots] = -1
        self.onset_events[slots] = 0.0
        self.largest_jump[slots] = 0.0
        self.ramps.reset(slots)
        self.throttle[slots] = 0.0
        self.null_share[slots] = 0.0
        self.remap_failure[slots] = 0.0
        self.xid_t[slots] = -1
        self.warning_xids[slots] = 0.0
        self.application_xids[slots] = 0.0
        self.critical_xid[slots] = 0
        self.critical_t[slots] = -1
        self.published[slots] = np.nan
        self.published_t[slots] = -1

    def replaced(self, chunk: Chunk) -> np.ndarray:
        """Mask of chunk rows whose GPU is a new board: a new UUID or a counter that went back."""
        s = chunk.slots
        c = chunk.values[:, len(GAUGES): len(GAUGES) + len(COUNTERS)]
        went_back = np.any(c < self.counter_last[s] - 0.5, axis=1)
        if chunk.uuids is not None:
            u, known = chunk.uuids, self.uuid[s]
            reported = u != None                                        # noqa: E711 (elementwise)
            went_back |= reported & (known != None) & (known != u)      # noqa: E711
            self.uuid[s[reported]] = u[reported]
        return went_back

    def apply(self, chunk: Chunk) -> np.ndarray:
        """Fold a chunk into the state; return its feature matrix [n, len(FEATURE_NAMES)].

        Rows must be newer than their GPU's last sample (the scorer filters)."""
        s, t, v = chunk.slots, chunk.t_ms, chunk.values
        first = self.last_t[s] < 0
        dt = np.where(first, 0.0, (t - self.last_t[s]) / 1000.0)
        self.start_t[s] = np.where(first, t, self.start_t[s])
        self.last_t[s] = t
        ng, nk = len(GAUGES), len(COUNTERS)
        gap_ratio = self._fold_interval(s, dt, first)
        nulls = np.isnan(v).mean(axis=1)
        a_null = 1.0 - np.exp(-dt / NULL_TAU_S)
        self.null_share[s] = np.where(first, nulls, self.null_share[s] + a_null * (nulls - self.null_share[s]))
        self._fold_levels(s, v[:, :ng], dt)
        self._fold_counters(s, t, v[:, ng: ng + nk])
        self._fold_throttle(s, v[:, ng + nk], dt, first)
        rf = v[:, ng + nk + 1]
        self.remap_failure[s] = np.where(np.isnan(rf), self.remap_failure[s], rf)
        return self._feature_matrix(s, t, self._vs_node(s, t), gap_ratio)

    def _fold_interval(self, s: np.ndarray, dt: np.ndarray, first: np.ndarray) -> np.ndarray:
        """Update the usual sample interval; return this sample's gap against it (log ratio)."""
        prev_iv = self.interval_s[s]
        a_iv = 1.0 - np.exp(-dt / INTERVAL_TAU_S)
        iv = np.where(np.isnan(prev_iv), dt, prev_iv + a_iv * (dt - prev_iv))
        self.interval_s[s] = np.where(first, np.nan, iv)
        return np.where(first | np.isnan(prev_iv), 0.0,
                        np.log(np.maximum(dt, 1e-3) / np.maximum(np.nan_to_num(prev_iv, nan=1.0), 1e-3)))

    def _fold_levels(self, s: np.ndarray, gauges: np.ndarray, dt: np.ndarray) -> None:
        """Gauge levels at three memories (log for power/clock, so comparisons are ratios)."""
        g = gauges.copy()
        for j, is_log in enumerate(_LOG_GAUGES):
            if is_log:
                g[:, j] = np.log(np.maximum(g[:, j], 1.0))
        lv = self.level[s]                                   # [n, ng, 3]
        alpha = 1.0 - _decay(dt, GAUGE_TAUS_S)               # [n, 3]
        upd = lv + alpha[:, None, :] * (g[:, :, None] - lv)
        upd = np.where(np.isnan(lv), g[:, :, None], upd)     # first valid value seeds
        upd = np.where(np.isnan(g)[:, :, None], lv, upd)     # missing keeps the old level
        self.level[s] = upd

    def _fold_counters(self, s: np.ndarray, t: np.ndarray, c: np.ndarray) -> None:
        """Decayed event counts (→ rates), onset, largest jump and ramp; a missing read keeps the baseline."""
        last = self.counter_last[s]
        cdt = np.where(self.counter_t[s] < 0, 0.0, (t[:, None] - self.counter_t[s]) / 1000.0)
        delta = np.where(np.isnan(c) | np.isnan(last), 0.0, np.maximum(c - last, 0.0))
        dec = np.exp(-cdt[:, :, None] / np.asarray(RATE_TAUS_S)[None, None, :])
        ok = ~np.isnan(c)
        cnt = self.counted[s]
        self.counted[s] = np.where(ok[:, :, None], cnt * dec + delta[:, :, None], cnt)
        # the largest single-sample jump, decayed like the 10 min count: a one-off burst of
        # replays puts the whole window in one sample, a precursor spreads over many
        self.largest_jump[s] = np.where(ok, np.maximum(self.largest_jump[s] * dec[:, :, 0], delta),
                                        self.largest_jump[s])
        # since when each counter has been active, and how many events since then: a rate
        # that keeps rising above its own average since onset is a precursor nearing its end,
        # long-standing steady errors are not
        hour = self.counted[s][:, :, 1]
        since = self.active_since[s]
        onset = (hour >= ACTIVE_EVENTS) & (since < 0)
        since = np.where(onset, t[:, None], since)
        quiet = hour < ACTIVE_EVENTS / 2
        self.active_since[s] = np.where(quiet, -1, since)
        ev = np.where(onset, hour, self.onset_events[s] + delta)
        self.onset_events[s] = np.where(quiet, 0.0, ev)
        # the events the 10 min rate predicts for this read bound what a ramp may count
        self.ramps.update(s, t, ok, delta, cnt[:, :, 0] * dec[:, :, 0] / RATE_TAUS_S[0] * cdt, cdt)
        self.counter_last[s] = np.where(ok, c, last)
        self.counter_t[s] = np.where(ok, t[:, None], self.counter_t[s])

    def _fold_throttle(self, s: np.ndarray, reasons: np.ndarray, dt: np.ndarray, first: np.ndarray) -> None:
        bits = np.nan_to_num(reasons, nan=0.0).astype(np.int64)
        hits = np.stack([(bits & THERMAL_BITS) != 0, (bits & SLOWDOWN_BITS) != 0], axis=1).astype(float)
        a_th = 1.0 - _decay(dt, THROTTLE_TAUS_S)
        th = self.throttle[s]
        self.throttle[s] = np.where(first[:, None, None], hits[:, :, None],
                                    th + a_th[:, None, :] * (hits[:, :, None] - th))

    def _vs_node(self, s: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Publish each GPU's short level and trend; return them against the node's median."""
        lv = self.level[s]
        trend = lv[:, :, 0] - lv[:, :, 1]
        pub = np.concatenate([lv[:, :, 0], trend, self.throttle[s][:, 0, :1]], axis=1)
        self.published[s] = pub
        self.published_t[s] = t
        # one timestamp per node in a chunk: a node's rows share their peers, so once per node
        nids, first_row, row_node = np.unique(self.node_idx[s], return_index=True, return_inverse=True)
        members = self.members[nids]                         # [nodes, width], -1 past a node's GPUs
        peers = self.published[members]                      # [nodes, width, cols], a copy
        peer_t = np.where(members < 0, -1, self.published_t[members])
        stale = (t[first_row, None] - peer_t) > NODE_STALE_S * 1000
        peers[stale | (peer_t < 0)] = np.nan
        return np.nan_to_num(pub - _nanmedian_of_peers(peers)[row_node], nan=0.0)

    def _feature_matrix(self, s: np.ndarray, t: np.ndarray, vs_node: np.ndarray,
                        gap_ratio: np.ndarray) -> np.ndarray:
        ng, nk = len(GAUGES), len(COUNTERS)
        lv = self.level[s]
        feats = np.empty((len(s), len(FEATURE_NAMES)))
        col = 0
        for j in range(ng):
            feats[:, col] = lv[:, j, 0] - lv[:, j, 1]
            feats[:, col + 1] = lv[:, j, 1] - lv[:, j, 2]
            feats[:, col + 2] = vs_node[:, j]
            feats[:, col + 3] = vs_node[:, ng + j]
            col += 4
        rates = self.counted[s] / np.asarray(RATE_TAUS_S)[None, None, :] * 3600.0   # per hour
        for k in range(nk):
            feats[:, col: col + 3] = np.log1p(rates[:, k])
            feats[:, col + 3] = np.log((rates[:, k, 0] + 0.1) / (rates[:, k, 1] + 0.1))
            feats[:, col + 4] = np.log((rates[:, k, 1] + 0.1) / (rates[:, k, 2] + 0.1))
            since = self.active_since[s, k]
            active = since >= 0
            feats[:, col + 5] = np.where(active, np.log1p((t - since) / 60000.0), -1.0)
            ev = self.onset_events[s, k]
            feats[:, col + 6] = np.log1p(ev)
            # onset counts a window's worth of events at once: average over at least that hour
            per_h = ev / np.maximum((t - since) / 3.6e6 + 1.0, 1.0)
            feats[:, col + 7] = np.where(active, np.log((rates[:, k, 0] + 0.1) / (per_h + 0.1)), 0.0)
            feats[:, col + 8] = np.log((self.counted[s, k, 0] + 1.0) / (self.largest_jump[s, k] + 1.0))
            feats[:, col + 9: col + 12] = self.ramps.features(s, t, k)
            col += 12
        th = self.throttle[s]
        feats[:, col: col + 2] = th[:, 1]
        feats[:, col + 2] = vs_node[:, 2 * ng]
        feats[:, col + 3] = self.remap_failure[s]
        feats[:, col + 4] = self.null_share[s]
        feats[:, col + 5] = gap_ratio
        feats[:, col + 6] = np.log1p((t - self.start_t[s]) / 60000.0)
        w, app = self.xid_counts_at(s, t)
        feats[:, col + 7: col + 9] = np.log1p(w)
        feats[:, col + 9] = np.log1p(app)
        feats[~np.isfinite(feats)] = 0.0                       # NaN and ±inf: 0
        return feats

    # ------------------------------------------------------------ XIDs
    def xid_counts_at(self, slots: np.ndarray, t_ms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Decayed warning and application XID counts as seen at `t_ms` (never grows forward)."""
        age = np.where(self.xid_t[slots] < 0, 0.0, np.maximum(t_ms - self.xid_t[slots], 0) / 1000.0)
        w = self.warning_xids[slots] * _decay(age, XID_TAUS_S)
        app = self.application_xids[slots] * np.exp(-age / XID_TAUS_S[0])
        return w, app

    def add_xid(self, slot: int, t_ms: int, xid: int, critical: bool) -> None:
        """Record one XID event. Events older than the GPU's XID clock are folded in decayed."""
        ref = int(self.xid_t[slot])
        if ref < 0:
            ref = t_ms
        if t_ms > ref:                                        # move the XID clock forward
            age = (t_ms - ref) / 1000.0
            self.warning_xids[slot] *= np.exp(-age / np.asarray(XID_TAUS_S))
            self.application_xids[slot] *= np.exp(-age / XID_TAUS_S[0])
            ref = t_ms
        self.xid_t[slot] = ref
        weight_w = np.exp(-(ref - t_ms) / 1000.0 / np.asarray(XID_TAUS_S))
        if xid in S.WARNING_XIDS:
            self.warning_xids[slot] += weight_w
        elif xid in S.APPLICATION_XIDS:
            self.application_xids[slot] += weight_w[0]
        if critical and t_ms >= self.critical_t[slot]:
            self.critical_xid[slot] = xid
            self.critical_t[slot] = t_ms

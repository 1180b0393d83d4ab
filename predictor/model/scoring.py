"""The one online scorer: telemetry and XIDs in, per-GPU risk out.

`predictor score`/`eval` replay a trace through it and `predictor serve` feeds it
live batches, so offline numbers are the numbers the service produces. It sees a
sample only once, in time order per GPU: a sample no newer than its GPU's last
one is late or a duplicate and is counted and dropped.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from predictor.ingest.wire import timestamps_ms
from predictor.model import rules
from predictor.model.features import FEATURE_NAMES, METRICS, Chunk, FleetState
from predictor.model.model_io import Model
from telemetry.schema import is_critical_xid


@dataclass
class Scored:
    """Risk computed for the rows of one batch (after dropping late/duplicate rows)."""

    slots: np.ndarray
    t_ms: np.ndarray
    risk: np.ndarray
    features: np.ndarray
    critical: np.ndarray     # bool: risk set to 1 by a critical XID
    reasons: list[str]       # why, for rows at or above the scorer's reasons_from ("" below)
    dropped: int = 0


@dataclass
class Xids:
    """XID events: epoch ms, node names, GPU indices, codes."""

    t_ms: np.ndarray
    nodes: list[str]
    gpus: np.ndarray
    codes: np.ndarray

    @staticmethod
    def from_table(table: pa.Table) -> "Xids":
        return Xids(timestamps_ms(table.column("timestamp")), _strings(table.column("node")),
                    np.asarray(table.column("gpu").to_numpy(zero_copy_only=False), np.int64),
                    np.asarray(table.column("xid").to_numpy(zero_copy_only=False), np.int64))

    def __len__(self) -> int:
        return len(self.t_ms)


def _strings(col: pa.ChunkedArray | pa.Array) -> list[str]:
    return pc.cast(col, pa.string()).to_pylist()


def metric_matrix(table: pa.Table) -> np.ndarray:
    """[n, len(METRICS)] float64; an absent column reads as missing everywhere."""
    out = np.full((table.num_rows, len(METRICS)), np.nan)
    names = set(table.column_names)
    for j, m in enumerate(METRICS):
        if m in names:
            out[:, j] = pc.cast(table.column(m), pa.float64()).to_numpy(zero_copy_only=False)
    return out


class Scorer:
    """Fleet state + model + rules; the live risk of every GPU it has seen."""

    def __init__(self, model: Model | None, capacity: int = 1024, reasons_from: float | None = None):
        """`model=None` computes features only (training); risk is then 0 unless a rule fires.
        Rows at or above `reasons_from` (default: the sensitive threshold) get a reason."""
        self.model = model
        self.reasons_from = (model.sensitive if model is not None else np.inf) if reasons_from is None \
            else reasons_from
        self.state = FleetState(capacity)
        self.risk = np.zeros(capacity)
        self.risk_t = np.full(capacity, -1, dtype=np.int64)
        self.reason: dict[int, str] = {}
        self.samples = 0
        self.dropped = 0

    # ------------------------------------------------------------ inputs
    def score_table(self, table: pa.Table, xids: Xids | None = None) -> Scored:
        """Score a telemetry batch (SCHEMA telemetry columns; any order, any nodes) and XIDs."""
        t = timestamps_ms(table.column("timestamp"))
        node = pc.dictionary_encode(pc.cast(table.column("node"), pa.string()).combine_chunks())
        gpus = np.asarray(table.column("gpu").to_numpy(zero_copy_only=False), dtype=np.int64)
        uuids = pc.cast(table.column("uuid"), pa.string()).to_numpy(zero_copy_only=False) \
            if "uuid" in table.column_names else None
        return self.score_rows(t, node.dictionary.to_pylist(), gpus, metric_matrix(table), uuids, xids,
                               codes=node.indices.to_numpy())

    def add_xids(self, xids: Xids) -> Scored:
        """Record XID events alone (the /v1/xid endpoint)."""
        return self.score_rows(np.empty(0, np.int64), [], np.empty(0, np.int64), np.empty((0, len(METRICS))),
                               None, xids)

    def score_rows(self, t: np.ndarray, nodes: list[str], gpus: np.ndarray, values: np.ndarray,
                   uuids: Sequence[str | None] | None = None, xids: Xids | None = None,
                   codes: np.ndarray | None = None) -> Scored:
        """Fold samples and XID events into the state in time order per GPU, then score.
        With `codes`, row i's node is nodes[codes[i]] (else nodes[i]).

        The model runs once per call over every chunk: risk never feeds back into the
        state, so batching the prediction changes its cost and nothing else."""
        slots = self.state.slots_for(nodes, gpus, codes)
        x_slots = self.state.slots_for(xids.nodes, xids.gpus) if xids is not None and len(xids) else None
        self._fit_capacity()
        order = np.lexsort((slots, t))
        t, slots, values = t[order], slots[order], values[order]
        uuids = np.asarray(uuids, dtype=object)[order] if uuids is not None else None
        # one sample per GPU and instant; then nothing at or before the GPU's last sample
        keep = np.ones(len(t), bool)
        keep[1:] = (t[1:] != t[:-1]) | (slots[1:] != slots[:-1])
        keep &= t > self.state.last_t[slots]
        dropped = int(len(t) - keep.sum())
        self.dropped += dropped
        if not keep.all():
            t, slots, values = t[keep], slots[keep], values[keep]
            uuids = uuids[keep] if uuids is not None else None
        # chunk r holds each node's r-th distinct timestamp of this batch
        rank = _rank_within(self.state.node_idx[slots], t)
        n_chunks = int(rank.max()) + 1 if len(rank) else 0
        x_rank = _xid_chunks(x_slots, xids, slots, t, rank, n_chunks)
        parts, events = [], []
        for r in range(n_chunks + 1):
            if x_rank is not None:
                events += self._apply_xids(np.flatnonzero(x_rank == r), x_slots, xids)
            if r < n_chunks:
                sel = np.flatnonzero(rank == r)
                parts.append(self._features(Chunk(slots[sel], t[sel], values[sel],
                                                  uuids[sel] if uuids is not None else None)))
        out = self._risk(parts, events)
        out.dropped = dropped
        self.samples += len(t)
        return out

    # ------------------------------------------------------------ core
    def _apply_xids(self, rows: np.ndarray, x_slots: np.ndarray, xids: Xids) -> list[tuple[int, int, str]]:
        """Record XIDs in time order; (slot, t, reason) of the critical ones."""
        crit = []
        for i in rows[np.argsort(xids.t_ms[rows], kind="stable")].tolist():
            code, slot, te = int(xids.codes[i]), int(x_slots[i]), int(xids.t_ms[i])
            is_crit = is_critical_xid(code)
            self.state.add_xid(slot, te, code, is_crit)
            if is_crit:
                crit.append((slot, te, rules.critical_reason(code)))
        return crit

    def _features(self, chunk: Chunk) -> tuple[Chunk, np.ndarray, np.ndarray]:
        """The chunk's features and, per row, the critical XID holding it at risk 1 (0:
        none), read now: a later chunk of the same call may reset a replaced GPU."""
        st = self.state
        fresh = st.replaced(chunk)
        if fresh.any():
            st.reset(chunk.slots[fresh])
        feats = st.apply(chunk)
        held = rules.critical_mask(st.critical_t[chunk.slots], chunk.t_ms)
        return chunk, feats, np.where(held, st.critical_xid[chunk.slots], 0)

    def _risk(self, parts: list, events: list[tuple[int, int, str]]) -> Scored:
        """One model call for all chunks; critical XIDs (as events and as holds) and due
        precursor ramps force risk 1."""
        ev_slots = np.asarray([e[0] for e in events], np.int64)
        slots = np.concatenate([c.slots for c, _, _ in parts] + [ev_slots])
        t = np.concatenate([c.t_ms for c, _, _ in parts] + [np.asarray([e[1] for e in events], np.int64)])
        feats = np.concatenate([f for _, f, _ in parts] + [np.zeros((len(events), len(FEATURE_NAMES)))])
        crit_xid = np.concatenate([x for _, _, x in parts] + [np.zeros(len(events), np.int64)])
        crit = np.concatenate([x != 0 for _, _, x in parts] + [np.ones(len(events), bool)])
        n_samples = len(t) - len(events)
        risk = np.ones(len(t))
        if n_samples and self.model is not None:
            risk[:n_samples] = self.model.predict(feats[:n_samples])
        elif n_samples:
            risk[:n_samples] = 0.0
        due = np.concatenate([rules.ramp_due(feats[:n_samples]), np.full(len(events), -1)])
        risk[crit | (due >= 0)] = 1.0
        reasons = [""] * n_samples + [e[2] for e in events]
        hot = np.flatnonzero(risk[:n_samples] >= self.reasons_from)
        if len(hot):
            model_hot = hot[~crit[hot] & (due[hot] < 0)]
            texts = self.model.reasons(feats[model_hot]) if len(model_hot) else []
            for i, text in zip(model_hot.tolist(), texts):
                reasons[i] = text
            for i in hot[~crit[hot] & (due[hot] >= 0)].tolist():
                reasons[i] = rules.ramp_reason(int(due[i]), feats[i])
            for i in hot[crit[hot]].tolist():
                reasons[i] = rules.critical_reason(crit_xid[i])
        self._remember(slots, t, risk, reasons)
        for slot, te, why in events:        # news whatever the GPU's newest sample: risk 1 now
            self.risk[slot] = 1.0
            self.risk_t[slot] = max(int(self.risk_t[slot]), te)
            self.reason[slot] = why
        return Scored(slots, t, risk, feats, crit, reasons)

    def _remember(self, slots: np.ndarray, t: np.ndarray, risk: np.ndarray, reasons: list[str]) -> None:
        """The newest row per GPU becomes its current risk (and reason)."""
        if not len(t):
            return
        order = np.lexsort((np.arange(len(t)), t, slots))
        last = order[np.r_[slots[order][1:] != slots[order][:-1], True]]
        last = last[t[last] >= self.risk_t[slots[last]]]
        self.risk[slots[last]] = risk[last]
        self.risk_t[slots[last]] = t[last]
        for i in last.tolist():
            if reasons[i]:
                self.reason[int(slots[i])] = reasons[i]

    def _fit_capacity(self) -> None:
        cap = len(self.state.last_t)
        if len(self.risk) < cap:
            self.risk = np.concatenate([self.risk, np.zeros(cap - len(self.risk))])
            self.risk_t = np.concatenate([self.risk_t, np.full(cap - len(self.risk_t), -1, np.int64)])

    # ------------------------------------------------------------ outputs
    def node_risk(self, node: str) -> dict | None:
        """Risk per GPU of one node, the node's risk (its worst GPU) and why."""
        nid = self.state.node_of.get(node)
        if nid is None:
            return None
        gpus = []
        risk = self.risk                     # the scorer thread may grow it meanwhile
        for s in [s for s in self.state.node_slots[nid] if s < len(risk)]:
            risky = risk[s] >= self.model.sensitive
            gpus.append({"gpu": int(self.state.gpu_idx[s]), "risk": round(float(risk[s]), 6),
                         "at_ms": int(self.risk_t[s]), "reason": self.reason.get(s, "") if risky else "",
                         "uuid": self.state.uuid[s]})
        if not gpus:
            return None
        worst = max(gpus, key=lambda g: g["risk"])
        return {"node": node, "risk": worst["risk"], "worst_gpu": worst["gpu"], "reason": worst["reason"],
                "sensitive": self.model.sensitive, "strict": self.model.strict,
                "gpus": sorted(gpus, key=lambda g: g["gpu"])}


def _rank_within(group: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Dense rank of each row's timestamp among the rows of its group (rows sorted by t)."""
    if len(t) == 0:
        return np.empty(0, np.int64)
    order = np.lexsort((t, group))
    g, tt = group[order], t[order]
    new_group = np.r_[True, g[1:] != g[:-1]]
    new_time = new_group | np.r_[True, tt[1:] != tt[:-1]]
    csum = np.cumsum(new_time)
    start = np.maximum.accumulate(np.where(new_group, csum, 0))
    rank = np.empty(len(t), np.int64)
    rank[order] = csum - start
    return rank


def _xid_chunks(x_slots: np.ndarray | None, xids: Xids | None, slots: np.ndarray, t: np.ndarray,
                rank: np.ndarray, n_chunks: int) -> np.ndarray | None:
    """Each XID goes just before the chunk with its GPU's first sample at or after it (or last)."""
    if x_slots is None:
        return None
    out = np.full(len(x_slots), n_chunks, np.int64)
    for i, (s, te) in enumerate(zip(x_slots.tolist(), xids.t_ms.tolist())):
        later = np.flatnonzero((slots == s) & (t >= te))
        if len(later):
            out[i] = rank[later].min()
    return out

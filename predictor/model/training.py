"""Training: features from replayed traces, labels from failures.parquet, two thresholds.

Labels: a sample is positive when a failure with a visible precursor follows on the
same GPU within half the horizon and the precursor has begun; the rest of the
horizon, and samples before a failure whose signs are not (yet) visible, are left
out rather than called healthy. An alarm more than the horizon early is a false alarm (EVAL.md), so the
hours before the horizon are kept in full as negatives. Validation holds out whole nodes: the model is
fitted on the others, calibrated on the held-out ones, and the thresholds are picked by replaying the
held-out nodes through the online scorer and scoring alarms as EVAL.md does; the node probabilities
behind job-level risk (job_risk.py) are calibrated on the same held-out nodes.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from predictor.ingest.wire import timestamps_ms
from predictor.model import evaluation, job_risk
from predictor.model.features import FEATURE_NAMES
from predictor.model.model_io import Model, fit_estimator
from predictor.model.replay import replay, score_trace
from predictor.model.scoring import Scored, Scorer

HORIZON_S = evaluation.HORIZON_S
MIN_LEAD_S = evaluation.MIN_LEAD_S
#: Positives are the last half of the horizon; the first half is left out. An alarm more
#: than the horizon early is a false alarm, one 30-60 min early is a catch, so the model
#: should be sure inside 30 min and is not pushed either way before that.
LABEL_HORIZON_S = HORIZON_S / 2
VALIDATION_SHARE = 0.25
NEGATIVES_PER_TRACE = 250_000        # negatives kept per trace and split (subsampled)
FALSE_ALARM_BUDGET = 1.0             # per 1000 node-days on validation: half the target, for margin
                                     # (at least one false episode is allowed: a validation set of a few
                                     # hundred node-days cannot resolve a rate below one per its size)
#: Samples of a failing GPU this long before its failure, but before the horizon, are all
#: kept as negatives: they teach the model "not yet", where early alarms come from.
HARD_NEGATIVE_S = 6 * 3600.0
ALARM_FLOOR = 1e-3                   # validation replay keeps alarms above this for the sweep
#: A failure whose precursor is unknown (NaN: labels derived from the telemetry, predictor.model.labels)
#: is trained on as if its signs spanned the horizon: positive over the last LABEL_HORIZON_S, and
#: counted as predictable when the thresholds are picked.
UNKNOWN_PRECURSOR_S = HORIZON_S


def known_precursor_s(values) -> np.ndarray:
    """precursor_s with unknown (NaN) read as UNKNOWN_PRECURSOR_S."""
    p = np.asarray(values, dtype=float)
    return np.where(np.isnan(p), UNKNOWN_PRECURSOR_S, p)


def is_validation_node(node: str, share: float = VALIDATION_SHARE) -> bool:
    """Deterministic node split, stable across traces and runs."""
    return (zlib.crc32(node.encode()) % 1000) < share * 1000


def validation_nodes(trace: Path) -> set[str]:
    """The nodes of a trace that training holds out."""
    return {n for n in pc.unique(pc.cast(pq.read_table(trace / "telemetry.parquet", columns=["node"])
                                            .column("node"), pa.string())).to_pylist() if is_validation_node(n)}


@dataclass
class Dataset:
    x: np.ndarray
    y: np.ndarray


class _Collector:
    """Gathers labelled feature rows of one trace during replay, split by node."""

    def __init__(self, scorer: Scorer, failures: pa.Table, keep_negative: tuple[float, float], seed: int):
        self.scorer, self.keep_negative = scorer, keep_negative
        self.rng = np.random.default_rng(seed)
        t = timestamps_ms(failures.column("timestamp"))
        keys = list(zip(pc.cast(failures.column("node"), pa.string()).to_pylist(), failures.column("gpu").to_pylist()))
        pre = known_precursor_s(failures.column("precursor_s").to_pylist())
        order = np.argsort(t)
        self.fail: dict[tuple[str, int], tuple[list[int], list[float]]] = {}
        for i in order.tolist():
            f = self.fail.setdefault(keys[i], ([], []))
            f[0].append(int(t[i]))
            f[1].append(float(pre[i]))
        self.is_val = np.zeros(0, bool)
        self.parts: dict[bool, tuple[list, list]] = {False: ([], []), True: ([], [])}

    def _labels(self, slots: np.ndarray, t_ms: np.ndarray) -> np.ndarray:
        """1 positive, 0 negative, -1 left out, 2 negative worth keeping (see module doc)."""
        label = np.zeros(len(slots), np.int8)
        keys = self.scorer.state.slot_key
        for i in np.flatnonzero([keys[s] in self.fail for s in slots.tolist()]).tolist():
            times, pre = self.fail[keys[int(slots[i])]]
            j = int(np.searchsorted(times, t_ms[i], side="right"))
            if j == len(times):
                continue
            lead_s = (times[j] - t_ms[i]) / 1000.0
            if lead_s <= LABEL_HORIZON_S:
                label[i] = 1 if pre[j] >= MIN_LEAD_S and lead_s <= pre[j] else -1
            elif lead_s <= HORIZON_S:
                label[i] = -1
            elif lead_s <= HARD_NEGATIVE_S:
                label[i] = 2
        return label

    def __call__(self, scored: Scored) -> None:
        keys = self.scorer.state.slot_key
        if len(self.is_val) < len(keys):
            self.is_val = np.array([is_validation_node(k[0]) for k in keys], bool)
        label = self._labels(scored.slots, scored.t_ms)
        val = self.is_val[scored.slots]
        draw = self.rng.random(len(label))
        for part in (False, True):
            keep = (val == part) & ~scored.critical & (
                (label >= 1) | ((label == 0) & (draw < self.keep_negative[part])))
            if keep.any():
                self.parts[part][0].append(scored.features[keep].astype(np.float32))
                self.parts[part][1].append((label[keep] == 1).astype(np.int8))

    def dataset(self, validation: bool) -> Dataset:
        xs, ys = self.parts[validation]
        if not xs:
            return Dataset(np.empty((0, len(FEATURE_NAMES)), np.float32), np.empty(0, np.int8))
        return Dataset(np.concatenate(xs), np.concatenate(ys))


def collect(trace_dir: str | Path, seed: int = 0, progress: bool | None = None) -> tuple[Dataset, Dataset]:
    """Labelled feature rows of one trace: (training nodes, validation nodes)."""
    trace_dir = Path(trace_dir)
    failures = pq.read_table(trace_dir / "failures.parquet")
    rows = pq.ParquetFile(trace_dir / "telemetry.parquet").metadata.num_rows
    keep = tuple(min(1.0, NEGATIVES_PER_TRACE / max(rows * share, 1))
                 for share in (1 - VALIDATION_SHARE, VALIDATION_SHARE))
    scorer = Scorer(None)
    col = _Collector(scorer, failures, keep, seed)
    replay(trace_dir, scorer, col, progress=progress)
    return col.dataset(False), col.dataset(True)


class _Sweep:
    """EVAL.md catches and false episodes of thresholded alarms, fast enough to try hundreds
    of thresholds: it jumps from episode to episode instead of visiting every alarm.
    (Same definitions as the reference scorer; tests hold the two to equal numbers.)"""

    def __init__(self, alarms: pa.Table, truth: evaluation.Truth, level: str):
        key = (lambda n, g: n) if level == "node" else (lambda n, g: (n, int(g)))
        t = timestamps_ms(alarms.column("timestamp"))
        score = alarms.column("score").to_numpy()
        self.alarms: dict = {}
        for i, k in enumerate(map(key, alarms.column("node").to_pylist(), alarms.column("gpu").to_pylist())):
            self.alarms.setdefault(k, []).append(i)
        self.alarms = {k: (t[i], score[i]) for k, i in ((k, np.asarray(v)) for k, v in self.alarms.items())}
        f = truth.failures
        pre = known_precursor_s(f["precursor_s"])
        self.fails: dict = {}
        for i in range(len(f["timestamp"])):
            self.fails.setdefault(key(f["node"][i], f["gpu"][i]), []).append(
                (int(f["timestamp"][i]), pre[i] >= MIN_LEAD_S))
        self.node_days = truth.node_days

    def __call__(self, thr: float) -> tuple[int, int, int]:
        """(caught predictable failures, predictable failures, false episodes) at `thr`."""
        H, L = HORIZON_S * 1000, MIN_LEAD_S * 1000
        caught = predictable = false = 0
        for k, fl in self.fails.items():
            t_all, s_all = self.alarms.get(k, (np.empty(0, np.int64), np.empty(0)))
            a = np.sort(t_all[s_all >= thr])
            for T, ok in fl:
                predictable += ok
                i = int(np.searchsorted(a, T - H))
                caught += ok and i < len(a) and a[i] <= T - L
        for k, (t_all, s_all) in self.alarms.items():
            a = np.sort(t_all[s_all >= thr])
            f = np.sort(np.asarray([T for T, _ in self.fails.get(k, [])], dtype=np.int64))
            i = 0
            while i < len(a):
                t = a[i]
                cover = f[(f <= t) & (t <= f + H)]
                if len(cover):                                  # reports a failure: not an episode
                    i = int(np.searchsorted(a, cover.max() + H, side="right"))
                    i = max(i, int(np.searchsorted(a, t, side="right")))
                    continue
                false += not np.any((f >= t) & (f <= t + H))
                i = int(np.searchsorted(a, t + H, side="right"))
        return caught, predictable, false


def choose_thresholds(held_out: dict[Path, set[str]], model: Model,
                      progress: bool | None = None) -> tuple[float, float, dict]:
    """Sensitive: most recall within the false-alarm budget (node level); strict: no false GPU alarm.

    Both are searched on alarms from replaying each trace's validation nodes (`held_out`) through
    the online scorer."""
    node_sweeps, gpu_sweeps, scores = [], [], [np.array([1.0])]
    for trace, nodes in held_out.items():
        alarms = score_trace(trace, Scorer(model), threshold=ALARM_FLOOR, progress=progress, nodes=nodes)
        truth = evaluation.load_truth(trace, nodes)
        node_sweeps.append(_Sweep(alarms, truth, "node"))
        gpu_sweeps.append(_Sweep(alarms, truth, "gpu"))
        scores.append(alarms.column("score").to_numpy())
    days = sum(s.node_days for s in node_sweeps)
    # a grid even in log-odds: as fine near 1 (where the sensitive threshold usually is) as in the middle
    scores = np.concatenate(scores)
    grid = 1 / (1 + np.exp(-np.linspace(np.log(ALARM_FLOOR / (1 - ALARM_FLOOR)), 14, 600)))
    candidates = np.unique(np.concatenate([grid[grid <= scores.max()], [1.0]]))

    def total(sweeps, thr):
        return np.sum([s(thr) for s in sweeps], axis=0)

    def at(thr: float) -> tuple[float, int, int, int]:
        caught, predictable, false = total(node_sweeps, thr)
        return caught / max(predictable, 1), int(caught), int(predictable), int(false)

    allowed = max(1, int(FALSE_ALARM_BUDGET * days / 1000))
    sensitive, best = 1.0, None
    for thr in candidates:
        here = at(thr)
        if here[3] <= allowed and (best is None or here[0] > best[0]):
            sensitive, best = float(thr), here
    best = best or at(1.0)          # even the rules alone exceed the budget: report them at 1.0
    strict = next((float(thr) for thr in candidates[candidates >= sensitive] if total(gpu_sweeps, thr)[2] == 0),
                  1.0)
    rec, caught, predictable, false = best
    info = {"validation_recall_of_predictable": round(float(rec), 4),
            "validation_false_alarms_per_1000_node_days": round(false / max(days, 1e-9) * 1000, 3),
            "validation_node_days": round(float(days), 2),
            # how little a few hundred node-days pin down: the figures above with their 95 % intervals
            "validation_ci95": {"recall_of_predictable": evaluation.recall_interval(caught, predictable),
                                "false_alarms_per_1000_node_days": evaluation.rate_interval(false, max(days, 1e-9))}}
    return sensitive, strict, info


def train(traces: list[str | Path], seed: int = 0, progress: bool | None = None) -> Model:
    """Fit, calibrate and threshold a model on labelled traces."""
    traces = [Path(t) for t in traces]
    sets = [collect(t, seed=seed, progress=progress) for t in traces]
    train_sets, val_sets = [s[0] for s in sets], [s[1] for s in sets]
    x = np.concatenate([d.x for d in train_sets])
    y = np.concatenate([d.y for d in train_sets])
    xv = np.concatenate([d.x for d in val_sets])
    yv = np.concatenate([d.y for d in val_sets])
    if y.sum() == 0 or yv.sum() == 0:
        raise ValueError("no failure with a visible precursor in the training or validation nodes")
    healthy = x[y == 0]
    center = np.median(healthy, axis=0)
    scale = np.maximum(np.percentile(healthy, 99, axis=0) - np.percentile(healthy, 1, axis=0), 1e-3)
    model = Model(fit_estimator(x, y, xv, yv, seed), sensitive=1.0, strict=1.0,
                  feature_center=center, feature_scale=scale)
    # read once per trace; a small trace may have none of its nodes held out
    held_out = {t: nodes for t in traces if (nodes := validation_nodes(t))}
    model.sensitive, model.strict, val_info = choose_thresholds(held_out, model, progress)
    calibration = job_risk.fit([job_risk.node_instants(t, model, nodes, progress) for t, nodes in held_out.items()])
    model.info = {"traces": [str(t) for t in traces], "horizon_s": HORIZON_S, "min_lead_s": MIN_LEAD_S,
                  "train_rows": int(len(y)), "train_positives": int(y.sum()),
                  "validation_rows": int(len(yv)), "validation_positives": int(yv.sum()), **val_info,
                  job_risk.INFO_KEY: calibration.to_info()}
    return model

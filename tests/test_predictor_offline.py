"""Offline path: train / score / eval on a small simulated trace, causality, the model format."""
import json
import math
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from predictor.ingest.wire import timestamps_ms
from predictor.model import evaluation, model_io, training
from predictor.model.features import COUNTERS, FEATURE_NAMES, METRICS, Chunk, FleetState, _nanmedian_of_peers
from predictor.model.replay import score_trace
from predictor.model.scoring import Scorer, Xids
from tests.predictor_fixtures import run_cli

#: The shared telemetry contract sits beside the repository (REPO/../shared), wherever it is cloned.
SHARED_SCORER = Path(__file__).resolve().parents[2] / "shared" / "telemetry" / "score_alarms.py"


def _cut(trace: Path, out: Path, until_ms: int) -> Path:
    out.mkdir()
    for name in ("telemetry.parquet", "xid.parquet"):
        t = pq.read_table(trace / name)
        pq.write_table(t.filter(pa.array(timestamps_ms(t.column("timestamp")) < until_ms)), out / name,
                       row_group_size=7777)                 # other batch boundaries than the original
    return out


def test_scoring_is_causal(small_trace, trained_model, tmp_path):
    """Alarms before T are the same whether the trace ends at T or goes on."""
    m = model_io.load(trained_model)
    ts = timestamps_ms(pq.read_table(small_trace / "telemetry.parquet", columns=["timestamp"]).column("timestamp"))
    cut_ms = int(ts.min() + (ts.max() - ts.min()) * 0.6) + 12_345
    low = min(m.sensitive, 0.05)                     # a low threshold, so there are many alarms to compare
    full = score_trace(small_trace, Scorer(m), threshold=low, progress=False)
    cut = score_trace(_cut(small_trace, tmp_path / "cut", cut_ms), Scorer(m), threshold=low, progress=False)
    before = full.filter(pc.less(pc.cast(full.column("timestamp"), pa.int64()), cut_ms))
    assert before.num_rows > 10
    assert cut.to_pylist() == before.to_pylist()


def _reference_scorer():
    """The shared reference scorer when this machine has it, else the vendored copy."""
    import importlib.util
    path = SHARED_SCORER if SHARED_SCORER.exists() else Path(model_io.__file__).with_name("score_alarms.py")
    spec = importlib.util.spec_from_file_location("reference_score_alarms", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_eval_matches_reference_scorer_and_writes_alarms(small_trace, trained_model, tmp_path):
    alarms = tmp_path / "alarms.parquet"
    res = json.loads(run_cli("predictor.cli", "eval", "--model", str(trained_model), "--trace", str(small_trace),
                             "--threshold", "0.05", "--alarms-out", str(alarms), "--json").stdout)
    ref = _reference_scorer()
    a = ref.load(str(alarms), ["timestamp", "node", "gpu"])
    f = ref.load(str(small_trace / "failures.parquet"), ["timestamp", "node", "gpu", "mode", "precursor_s"])
    expected = {lvl: ref.score(a, f, ref.node_days(str(small_trace)), level=lvl) for lvl in ("node", "gpu")}
    intervals = {lvl: res[lvl].pop("ci95") for lvl in res}       # ours, beside the reference metrics
    assert res == json.loads(json.dumps(expected, default=lambda v: v.item()))
    assert set(intervals["node"]) == {"recall_of_predictable", "false_alarms_per_1000_node_days"}
    assert res["node"]["failures"] > 0 and res["node"]["caught"] > 0
    # the alarm file: the documented columns, in time order, each with a reason
    t = pq.read_table(alarms)
    assert t.column_names == ["timestamp", "node", "gpu", "score", "reason"]
    assert str(t.schema.field("timestamp").type) == "timestamp[ms, tz=UTC]"
    assert t.num_rows > 0 and all(t.column("reason").to_pylist())
    ts = timestamps_ms(t.column("timestamp"))
    assert np.all(ts[1:] >= ts[:-1])
    # the fast threshold sweep used in training counts exactly what the reference counts
    truth = evaluation.load_truth(small_trace)
    for level in ("node", "gpu"):
        sweep = training._Sweep(t, truth, level)
        for thr in (0.0, 0.05, 0.3, 0.7, 0.99):
            a = ref.load(str(alarms), ["timestamp", "node", "gpu"])
            keep = pc.greater_equal(t.column("score"), thr).to_numpy(zero_copy_only=False)
            r = ref.score({k: v[keep] for k, v in a.items()}, f, ref.node_days(str(small_trace)), level=level)
            caught, predictable, false = sweep(thr)
            assert (predictable, false) == (r["predictable_failures"], r["false_alarms"]), (level, thr)
            assert caught == round((r["recall_of_predictable"] or 0) * predictable), (level, thr)


def test_vendored_reference_scorer_is_verbatim():
    if not SHARED_SCORER.exists():
        pytest.skip("the shared telemetry contract is not on this machine")
    vendored = Path(model_io.__file__).with_name("score_alarms.py").read_text().splitlines()
    assert vendored[3:] == SHARED_SCORER.read_text().splitlines()


def test_score_cli_writes_parquet(small_trace, trained_model, tmp_path):
    out = tmp_path / "alarms.parquet"
    ts = timestamps_ms(pq.read_table(small_trace / "telemetry.parquet", columns=["timestamp"]).column("timestamp"))
    part = _cut(small_trace, tmp_path / "part", int(ts.min() + (ts.max() - ts.min()) * 0.3))
    summary = json.loads(run_cli("predictor.cli", "score", "--model", str(trained_model), "--trace",
                                 str(part), "--threshold", "0.01", "--out", str(out), "--json").stdout)
    assert pq.read_table(out).num_rows == summary["alarms"]


def test_model_file_is_checked_before_loading(trained_model, tmp_path):
    m = model_io.load(trained_model)
    assert 0 < m.sensitive <= m.strict <= 1
    x = np.zeros((3, len(FEATURE_NAMES)))
    p = m.predict(x)
    assert p.shape == (3,) and np.all((0 <= p) & (p <= 1))
    # a file with an unexpected type is refused, not constructed
    import fractions

    import skops.io as sio
    bad = tmp_path / "bad.skops"
    sio.dump({"format_version": 1, "estimator": fractions.Fraction(1, 3)}, str(bad))
    with pytest.raises(ValueError, match="refusing"):
        model_io.load(bad)


def test_packaged_default_model_loads():
    m = model_io.load(None)
    assert m.info.get("traces"), "the default model records what it was trained on"


def test_train_records_how_sure_its_validation_figures_are(trained_model):
    """A few validation node-days pin a threshold's rates down loosely: the model says how loosely."""
    info = model_io.load(trained_model).info
    ci = info["validation_ci95"]
    lo, hi = ci["false_alarms_per_1000_node_days"]
    assert lo <= info["validation_false_alarms_per_1000_node_days"] <= hi
    assert hi >= -math.log(0.025) / info["validation_node_days"] * 1000      # no rate below one in its size
    lo, hi = ci["recall_of_predictable"]
    assert lo <= info["validation_recall_of_predictable"] <= hi


def test_replaced_gpu_starts_a_fresh_history(trained_model):
    """A new UUID (or counters that went back) resets the GPU's state; old errors do not linger."""
    s = Scorer(model_io.load(trained_model))
    vals = np.zeros((1, len(METRICS)))
    vals[0, :4] = [70, 75, 500, 1900]
    sbe = METRICS.index("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL")
    for i in range(30):
        vals[0, sbe] = 50 * i                                  # a fast-rising ECC counter
        s.score_rows(np.array([i * 60_000]), ["n0"], np.array([0]), vals.copy(), ["GPU-old"])
    slot = s.state.slot_of[("n0", 0)]
    assert s.state.counted[slot].sum() > 0
    vals[0, sbe] = 0
    s.score_rows(np.array([31 * 60_000]), ["n0"], np.array([0]), vals.copy(), ["GPU-new"])
    assert s.state.counted[slot].sum() == 0 and s.state.uuid[slot] == "GPU-new"
    s.score_rows(np.array([32 * 60_000]), ["n0"], np.array([0]), vals.copy(), [None])   # UUID not reported
    assert s.state.uuid[slot] == "GPU-new" and s.state.start_t[slot] == 31 * 60_000   # no reset


def test_node_median_is_numpys_bit_for_bit():
    rng = np.random.default_rng(0)
    peers = rng.choice([np.nan, -0.0, 0.0, 1.0, -1.5, 2.5, 7.0, np.inf, -np.inf], size=(2000, 8, 9))
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)          # all-NaN columns
        expected = np.nanmedian(peers, axis=1)
    got = _nanmedian_of_peers(peers)
    assert np.array_equal(got, expected, equal_nan=True)
    assert np.array_equal(np.signbit(got[~np.isnan(got)]), np.signbit(expected[~np.isnan(expected)]))


def _ramp_left_over_time(rate_per_min, minutes: int, interval_s: int, seed: int) -> np.ndarray:
    """Minutes left read off the SBE ramp feature of one GPU fed Poisson SBE counts."""
    rng = np.random.default_rng(seed)
    state = FleetState()
    slot = state.slots_for(["n0"], np.array([0]))
    sbe = METRICS.index(COUNTERS[0])
    col = FEATURE_NAMES.index("ecc_sbe_vol_total_ramp_left")
    t_min = np.arange(0, minutes, interval_s / 60)
    counts = np.cumsum(rng.poisson(rate_per_min(t_min) * interval_s / 60))
    out = []
    for tm, c in zip(t_min, counts):
        values = np.full((1, len(METRICS)), np.nan)
        values[0, sbe] = c
        out.append(state.apply(Chunk(slot, np.array([int(tm * 60_000)]), values))[0, col])
    return np.expm1(np.asarray(out))


@pytest.mark.parametrize("interval_s", [30, 60])
def test_ramp_features_date_an_exponential_precursor(interval_s):
    """A rate rising like exp(4 x progress) to 3 SBE/min over 3 h: the events so far tell how
    much is left, whatever the peak (loosely: there are few of them); a steady rate of errors
    has no end in sight."""
    duration = 180
    runs = [_ramp_left_over_time(lambda m: 3.0 * np.exp(4.0 * (m / duration - 1.0)), duration, interval_s, seed)
            for seed in range(6)]

    def at(m: float) -> float:
        return np.median([r[int(m * 60 / interval_s)] for r in runs])

    assert at(90) > 90 and 15 <= at(150) <= 90 and at(170) < 50     # 90, 30 and 10 min left
    steady = _ramp_left_over_time(lambda m: np.full_like(m, 0.5), 600, interval_s, 0)
    assert np.median(steady[len(steady) // 2:]) > 600


def test_a_due_ramp_sets_risk_to_one_with_its_reason():
    """The ramp rule: a steep SBE ramp is due near its end and not 40 min before; a steady
    rate never is. Counts are the expected ones (no noise), one sample a minute."""
    scorer = Scorer(None, reasons_from=0.5)
    sbe = METRICS.index(COUNTERS[0])
    minutes = np.arange(60)
    ramp = np.floor(np.cumsum(20.0 * np.exp(4.0 * (minutes / 60 - 1.0))))
    steady = 5.0 * minutes
    risk, reasons = {0: [], 1: []}, {0: [], 1: []}
    for m in minutes.tolist():
        values = np.full((2, len(METRICS)), np.nan)
        values[:, sbe] = ramp[m], steady[m]
        r = scorer.score_rows(np.array([m * 60_000] * 2), ["n0", "n0"], np.array([0, 1]), values)
        for i, gpu in enumerate(r.slots.tolist()):
            risk[gpu].append(r.risk[i])
            reasons[gpu].append(r.reasons[i])
    assert risk[0][20] == 0.0 and risk[0][55] == 1.0
    assert reasons[0][55].startswith("ecc_sbe_vol_total ramp of ")
    assert max(risk[1]) == 0.0


def test_slots_by_distinct_node_match_slots_by_row():
    """Looking nodes up once each (dictionary codes) registers GPUs in the same order as row by row."""
    by_row, by_code = FleetState(), FleetState()
    gpus = np.array([3, 0, 3, 9, 1])                          # a repeat; a GPU index beyond the first 8
    rows = by_row.slots_for(["n1", "n0", "n1", "n2", "n0"], gpus)
    coded = by_code.slots_for(["n0", "n1", "n2"], gpus, np.array([1, 0, 1, 2, 0]))
    assert rows.tolist() == coded.tolist() == [0, 1, 0, 2, 3]
    assert by_row.slot_key == by_code.slot_key and by_row.node_names == by_code.node_names
    assert by_code.slots_for(["n2", "n0"], np.array([9, 1, 0]), np.array([0, 1, 1])).tolist() == [2, 3, 1]


def test_late_and_duplicate_samples_are_dropped(trained_model):
    s = Scorer(model_io.load(trained_model))
    vals = np.full((3, len(METRICS)), 1.0)
    r = s.score_rows(np.array([120_000, 120_000, 60_000]), ["n0", "n0", "n0"], np.array([0, 0, 0]), vals)
    assert len(r.slots) == 2 and r.dropped == 1             # exact duplicate dropped, older one ordered first
    r = s.score_rows(np.array([90_000]), ["n0"], np.array([0]), vals[:1])
    assert len(r.slots) == 0 and r.dropped == 1             # older than what the GPU already reported


def test_critical_xid_sets_risk_to_one(trained_model):
    s = Scorer(model_io.load(trained_model))
    s.score_rows(np.array([60_000]), ["n0"], np.array([2]), np.full((1, len(METRICS)), 1.0))
    r = s.add_xids(Xids(np.array([61_000, 62_000]), ["n0", "n0"], np.array([2, 2]), np.array([13, 79])))
    assert r.risk.tolist() == [1.0] and r.reasons == ["critical XID 79"]
    assert s.node_risk("n0")["risk"] == 1.0


def test_critical_reason_is_read_before_a_later_reset(trained_model):
    """A GPU held by XID 79, then replaced later in the same batch: the held row's reason
    names the XID it was held by (it read 'critical XID 0' once the reset had run)."""
    s = Scorer(model_io.load(trained_model))
    vals = np.full((2, len(METRICS)), 1.0)
    s.score_rows(np.array([60_000]), ["n0"], np.array([0]), vals[:1], ["GPU-old"])
    s.add_xids(Xids(np.array([61_000]), ["n0"], np.array([0]), np.array([79])))
    r = s.score_rows(np.array([120_000, 180_000]), ["n0", "n0"], np.array([0, 0]), vals, ["GPU-old", "GPU-new"])
    assert r.risk.tolist()[0] == 1.0 and r.reasons[0] == "critical XID 79"
    assert r.reasons[1] != "critical XID 0"


def test_usage_errors_exit_2_and_failures_exit_1(tmp_path):
    assert run_cli("predictor.cli", "eval", "--threshold", check=False).returncode == 2
    res = run_cli("predictor.cli", "train", "--trace", str(tmp_path), "--out", str(tmp_path / "m"), check=False)
    assert res.returncode == 1 and "failures.parquet" in res.stderr


def test_eval_json_says_in_words_why_a_metric_is_missing():
    """No NaN (not JSON) in `predictor eval --json`: null, and a reason per missing metric."""
    alarms = pa.table({"timestamp": pa.array([], pa.timestamp("ms", tz="UTC")), "node": pa.array([], pa.string()),
                       "gpu": pa.array([], pa.int16())})

    def failures(precursor_s: list[float]) -> dict:
        n = len(precursor_s)
        return {"timestamp": np.full(n, 1_780_000_000_000, np.int64), "node": np.array(["n0"] * n, object),
                "gpu": np.zeros(n, np.int64), "mode": np.array(["sudden"] * n, object),
                "precursor_s": np.asarray(precursor_s, float)}

    none = evaluation.report(alarms, evaluation.Truth(failures([]), 10.0))
    json.dumps(none, allow_nan=False)
    assert none["node"]["recall"] is None and none["node"]["why_missing"]["recall"] == "no failures in this trace"
    sudden = evaluation.report(alarms, evaluation.Truth(failures([0.0]), 10.0))["gpu"]
    json.dumps(sudden, allow_nan=False)
    assert sudden["recall"] == 0.0 and sudden["recall_of_predictable"] is None
    assert sudden["why_missing"] == {"recall_of_predictable": "no predictable failures in this trace",
                                     "lead_s_median": "no failure was caught", "lead_s_p10": "no failure was caught",
                                     "precision_at_real_failure_rate": "no failure was caught and no alarm was false"}


def test_truth_of_no_nodes_is_empty(small_trace):
    """A trace with none of its nodes held out for validation (a small fold) has no truth there,
    not a type error from an untyped empty node list."""
    truth = evaluation.load_truth(small_trace, set())
    assert truth.node_days == 0 and len(truth.failures["timestamp"]) == 0


def test_eval_gives_exact_intervals_for_its_rates():
    """No false episode in N node-days bounds the rate at -ln(0.025) / N (the exact Poisson upper
    limit); every failure caught out of n bounds recall below at 0.025 ** (1 / n)."""
    assert evaluation.rate_interval(0, 1000.0) == [0.0, round(-math.log(0.025), 3)]
    lo, hi = evaluation.rate_interval(1, 256.0)        # the shared sample's one rule false episode
    assert lo < 2 < 3.9 < hi and round(hi, 1) == 21.8
    assert evaluation.recall_interval(10, 10) == [round(0.025 ** 0.1, 4), 1.0]
    lo, hi = evaluation.recall_interval(41, 69)
    assert lo < 41 / 69 < hi and hi - lo < 0.25

    t = [1_780_000_000_000 - 600_000, 1_790_000_000_000]       # a catch on n0, a false episode on n1
    alarms = pa.table({"timestamp": pa.array(t, pa.timestamp("ms", tz="UTC")),
                       "node": pa.array(["n0", "n1"], pa.string()), "gpu": pa.array([0, 0], pa.int16())})
    fails = {"timestamp": np.array([1_780_000_000_000], np.int64), "node": np.array(["n0"], object),
             "gpu": np.zeros(1, np.int64), "mode": np.array(["pcie"], object), "precursor_s": np.array([3600.0])}
    node = evaluation.report(alarms, evaluation.Truth(fails, 256.0))["node"]
    assert node["ci95"] == {"recall_of_predictable": [0.025, 1.0],
                            "false_alarms_per_1000_node_days": list(evaluation.rate_interval(1, 256.0))}
    json.dumps(node, allow_nan=False)

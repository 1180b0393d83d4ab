"""predictor hazard: reading a service history, features as of a time, the models, the CLI.

On a small synthetic history made here (the full Titan fit is a documented command:
docs/hazard.md): an old lot in cage 2 fails far more often than a new lot in cage 0.
"""
from __future__ import annotations

import csv
import logging
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest
import skops.io as sio
from click.testing import CliRunner

from predictor.cli import main
from predictor.hazard import evaluation, store, training
from predictor.hazard.features import FEATURE_NAMES, outcome, snapshot
from predictor.hazard.history import HistoryError, parse_time, read_history

T0 = datetime(2013, 6, 1)
CUT = datetime(2018, 1, 1)
FMT = "%Y-%m-%d %H:%M:%S"


def _row(sn, loc, t_in, t_out, out, event=""):
    if t_in is None:
        return [sn, loc, "", t_out.strftime(FMT), "", "", event]
    return [sn, loc, t_in.strftime(FMT), t_out.strftime(FMT), int((t_out - t_in).total_seconds()), out, event]


def make_history(path: Path, gpus: int = 400, seed: int = 0) -> Path:
    """Old lot 03237 from 2013 (cage 2 fails ~5x as often), new lot 03250 from 2016; healthy swaps in 2017."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(gpus):
        old = i < gpus * 0.6
        sn = f"{'03237' if old else '03250'}{i:08d}"
        cage, node = int(rng.integers(0, 3)), int(rng.integers(0, 4))
        loc = f"c{i % 25}-{i % 8}c{cage}s{i % 8}n{node}"
        start = T0 + timedelta(days=float(rng.uniform(0, 30))) if old else datetime(2016, 3, 1)
        rate = (1 / 900 if cage == 2 else 1 / 4500) if old else 1 / 20000   # per day
        fail = start + timedelta(days=float(rng.exponential(1 / rate)))
        swap = datetime(2017, 3, 1) + timedelta(days=float(rng.uniform(0, 200))) if rng.random() < 0.1 else None
        if fail < CUT and (swap is None or fail < swap):
            if rng.random() < 0.3:   # an earlier DBE recorded without a removal
                rows.append(_row(sn, loc, None, fail - timedelta(days=20), "", "DBE"))
            rows.append(_row(sn, loc, start, fail, "True", "DBE" if rng.random() < 0.7 else "OTB"))
        elif swap is not None and swap < CUT:
            rows.append(_row(sn, loc, start, swap, "True"))
        else:
            rows.append(_row(sn, loc, start, CUT, "False"))
    # one GPU's two stays overlap: moved to another slot before the first stay was closed
    rows.append(_row("0323899999999", "c1-1c0s0n0", datetime(2014, 1, 1), datetime(2015, 6, 1), "False"))
    rows.append(_row("0323899999999", "c1-1c0s1n0", datetime(2015, 5, 1), CUT, "False"))
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["SN", "location", "insert", "remove", "duration", "out", "event"])
        w.writerows(rows)
    return path


@pytest.fixture(scope="module")
def history_csv(tmp_path_factory) -> Path:
    return make_history(tmp_path_factory.mktemp("hazard") / "history.csv")


def _cli(*args: str):
    """The click command in this process (an interpreter per call costs seconds on a busy machine)."""
    return CliRunner().invoke(main, ["hazard", *args])


def test_reads_event_records_and_resolves_an_overlap(history_csv, caplog):
    with caplog.at_level(logging.WARNING):
        h = read_history(history_csv)
    assert "overlap" in caplog.text
    g = list(h.serials).index("0323899999999")
    stays = np.flatnonzero(h.stay_gpu == g)
    assert h.stay_out_t[stays].min() == parse_time("2015-05-01")   # cut where the later stay begins
    # event records (no insert) count as events but not as stays
    assert len(h.event_t) > h.stay_event.sum()
    assert len(h.stay_gpu) == sum(1 for _ in open(history_csv)) - 1 - (len(h.event_t) - h.stay_event.sum())


def test_in_service_at_the_cut_and_features_only_from_before(history_csv):
    h = read_history(history_csv)
    at_cut = snapshot(h, parse_time("2018-01-01"))
    assert at_cut.n == int((~h.stay_out & (h.stay_out_t == h.end_t)).sum())   # ends at t, not out: in service
    t = parse_time("2016-06-01")
    snap = snapshot(h, t)
    later = h.event_t > t
    h.event_t[later] += 1e6   # moving later events cannot change what is known at t
    assert np.array_equal(snapshot(h, t).x, snap.x)
    days, ev = outcome(h, snap, until=parse_time("2017-01-01"))
    assert (days[ev] <= (parse_time("2017-01-01") - t) / 86400 + 1e-9).all()


def test_malformed_value_names_the_row(tmp_path, history_csv):
    bad = tmp_path / "bad.csv"
    lines = history_csv.read_text().splitlines()
    lines[5] = lines[5].replace(":", "x", 1)
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(HistoryError, match="row 6"):
        read_history(bad)
    model = tmp_path / "m.skops"
    store.save(store.HazardModel(training.fit("cox", training.landmark_set(read_history(history_csv),
                                                                           parse_time("2018-01-01"), 180), 180),
                                 180.0), model)
    res = _cli("score", "--model", str(model), "--history", str(bad), "--out", str(tmp_path / "s.csv"))
    assert res.exit_code == 2 and "row 6" in res.output, res.output


def test_linear_models_find_the_old_lot_and_the_hot_cage(history_csv):
    h = read_history(history_csv)
    t = parse_time("2015-01-01")
    data = training.landmark_set(h, t, 180)
    cox = training.fit("cox", data, 180)
    hr = cox.hazard_ratios()
    assert hr["cage2"] > 1.5   # the planted 5x
    snap = snapshot(h, t)
    days, ev = outcome(h, snap)
    for kind in ("cox", "weibull"):
        p = training.fit(kind, data, 180).probability(snap.x, 180)
        assert ((p >= 0) & (p <= 1)).all()
        assert evaluation.concordance(days, ev, p) > 0.6


def test_train_score_drain_cli(tmp_path, history_csv):
    model, scores, prom = tmp_path / "m.skops", tmp_path / "scores.csv", tmp_path / "hazard.prom"
    res = _cli("train", "--history", str(history_csv), "--out", str(model), "--step-days", "60", "--json")
    assert res.exit_code == 0, res.output
    res = _cli("score", "--model", str(model), "--history", str(history_csv), "--at", "2018-01-01",
               "--horizon-days", "180", "--out", str(scores), "--prom", str(prom))
    assert res.exit_code == 0, res.output
    rows = list(csv.DictReader(open(scores)))
    h = read_history(history_csv)
    assert len(rows) == snapshot(h, parse_time("2018-01-01")).n == len({r["SN"] for r in rows})
    assert {"SN", "probability", "location", "cage", "reasons"} <= set(rows[0])
    p = [float(r["probability"]) for r in rows]
    assert p == sorted(p, reverse=True) and 0 < p[0] < 1
    assert rows[0]["reasons"]   # the riskiest GPU says why
    assert prom.read_text().count("ckpt_guard_gpu_hazard{") == len(rows)
    res = _cli("drain", "--model", str(model), "--history", str(history_csv), "--top", "5", "--json")
    assert res.exit_code == 0, res.output
    assert '"blades"' in res.output and rows[0]["SN"] in res.output


class Planted:
    """A type no model file has: loading one could run its code."""


def test_model_file_with_foreign_types_is_refused(tmp_path):
    path = tmp_path / "evil.skops"
    sio.dump({"format_version": store.FORMAT_VERSION, "feature_names": list(FEATURE_NAMES), "kind": "boosted",
              "horizon_days": 180.0, "info_json": "{}", "estimator": Planted()}, str(path))
    with pytest.raises(ValueError, match="unexpected types"):
        store.load(path)


def test_precision_at_top_and_auc():
    y = np.array([1, 0, 0, 0, 0, 0, 0, 0, 0, 0] * 4)
    score = y + np.linspace(0, 0.5, len(y))
    assert evaluation.precision_at_top(y, score, share=0.1) == 1.0
    assert evaluation.auc(y, score) == 1.0


def test_paper_findings_on_the_planted_history(history_csv):
    from predictor.hazard import paper
    life = paper.lifetimes(read_history(history_csv))
    hr = paper.hazard_ratios(life)
    assert hr["cage2"] > 2 * hr["cage1"]   # the planted hot cage
    rates = paper.batch_rates(life)        # the planted old lot fails ~10x as often, at any age and date
    assert rates["same_quarters_by_cage"]["ratio"] > 3 and rates["age_year_0"]["ratio"] > 3
    t, s = paper.kaplan_meier(np.array([1.0, 2.0, 2.0, 3.0]), np.array([True, True, False, False]))
    assert t.tolist() == [1.0, 2.0] and s == pytest.approx([0.75, 0.5])


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory) -> Path:
    """A small `agents simulate` trace (64 GPUs, 4 days, failures enriched), plus two XID 48s a minute apart."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.predictor_fixtures import simulate
    out = simulate(tmp_path_factory.mktemp("trace"), 8, 4, 300, 5, "--failure-rate", "0.3")
    xid = pq.read_table(out / "xid.parquet")
    t0 = xid.column("timestamp")[0].value
    extra = pa.table({"timestamp": pa.array([t0 + 3_600_000, t0 + 3_660_000], xid.schema.field("timestamp").type),
                      "node": ["node0003", "node0003"], "gpu": pa.array([2, 2], pa.int16()),
                      "xid": pa.array([48, 48], pa.int32())})
    pq.write_table(pa.concat_tables([xid, extra.cast(xid.schema)]), out / "xid.parquet")
    return out


def test_trace_reads_as_a_history(trace_dir):
    import pandas as pd

    from predictor.hazard.trace_history import MERGE_S, read_trace_history
    from telemetry.schema import DBE
    h = read_trace_history(trace_dir)
    tel = pd.read_parquet(trace_dir / "telemetry.parquet", columns=["timestamp", "node", "gpu", "uuid", DBE])
    xid = pd.read_parquet(trace_dir / "xid.parquet")
    assert sorted(h.serials) == sorted(tel["uuid"].unique())       # one GPU per UUID
    replaced = tel.groupby(["node", "gpu"])["uuid"].nunique() - 1
    assert h.stay_out.sum() == replaced.sum() > 0                 # a new UUID in a slot: the old one went out

    def found(kind):
        m = h.event_kind == kind
        return sorted(zip(h.event_location[m], np.round(h.event_t[m], 3)))

    def slot(r):
        return f"{r.node}/gpu{r.gpu}"
    otb = xid[xid.xid == 79]
    assert len(otb) > 3
    assert found("OTB") == sorted((slot(r), round(r.timestamp.timestamp(), 3)) for r in otb.itertuples())
    # a DBE: a rise of the double-bit counter or an XID 48; one incident within MERGE_S is one event
    tel = tel.dropna(subset=[DBE]).sort_values("timestamp")    # a blank reading is skipped, not a reset
    rises = [(slot(r), round(r.timestamp.timestamp(), 3)) for _, g in tel.groupby(["node", "gpu", "uuid"])
             for r, d in zip(g.itertuples(), g[DBE].diff().to_numpy()) if d > 0]
    signs = rises + [(slot(r), round(r.timestamp.timestamp(), 3)) for r in xid[xid.xid == 48].itertuples()]
    dbe = found("DBE")
    assert rises and set(dbe) <= set(signs)
    assert all(any(s == loc and 0 <= t - e <= MERGE_S for loc, e in dbe) for s, t in signs)
    assert sum(loc == "node0003/gpu2" for loc, _ in dbe) == 1   # the planted pair a minute apart
    # the ground truth's DBE and OTB failures are all there (or the same incident's first sign)
    fails = pd.read_parquet(trace_dir / "failures.parquet")
    for r in fails[fails.xid.isin([48, 79])].itertuples():
        kind, t = ("DBE" if r.xid == 48 else "OTB"), r.timestamp.timestamp()
        assert any(loc == slot(r) and 0 <= t - e <= MERGE_S for loc, e in found(kind)), r
    # every event's GPU is the one in that slot at the time
    for g, t, loc in zip(h.event_gpu, h.event_t, h.event_location):
        on = tel[(tel.uuid == h.serials[g])]
        assert f"{on.node.iloc[0]}/gpu{on.gpu.iloc[0]}" == loc and on.timestamp.min().timestamp() <= t + 1


def test_trace_without_uuids_has_one_gpu_per_slot(tmp_path, trace_dir):
    import pyarrow.parquet as pq

    from predictor.hazard.trace_history import read_trace_history
    tel = pq.read_table(trace_dir / "telemetry.parquet")
    pq.write_table(tel.drop_columns(["uuid"]), tmp_path / "telemetry.parquet")
    h = read_trace_history(tmp_path)      # no xid.parquet either: counter rises only
    assert len(h.serials) == len(h.stay_in) == 64 and not h.stay_out.any()
    assert set(h.serials) == set(h.stay_location) and set(h.event_kind) == {"DBE"}


def test_train_and_score_on_a_trace(tmp_path, trace_dir):
    model, scores = tmp_path / "m.skops", tmp_path / "scores.csv"
    res = _cli("train", "--history", str(trace_dir), "--out", str(model), "--kind", "cox", "--horizon-days", "1",
               "--step-days", "1", "--json")
    assert res.exit_code == 0, res.output
    res = _cli("drain", "--model", str(model), "--history", str(trace_dir), "--horizon-days", "1", "--json")
    assert res.exit_code == 0, res.output
    assert '"node0' in res.output and "/gpu" not in res.output.split('"blades"')[1]   # a host is drained whole
    import json

    from predictor.hazard.trace_history import read_trace_history
    at = datetime.fromtimestamp(read_trace_history(trace_dir).end_t // 3600 * 3600 - 3600, timezone.utc)
    at = at.replace(tzinfo=None)
    res = _cli("score", "--model", str(model), "--history", str(trace_dir), "--at", at.isoformat(),
               "--horizon-days", "1", "--out", str(scores), "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["at"] == at.replace(tzinfo=timezone.utc).timestamp()   # a trace's times are UTC
    res = _cli("score", "--model", str(model), "--history", str(tmp_path), "--out", str(scores))
    assert res.exit_code == 2 and "no telemetry.parquet" in res.output, res.output

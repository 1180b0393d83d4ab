"""`agents simulate`: a labelled trace that keeps to SCHEMA.md and to its own labels."""
import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from agents.cli import main
from agents.fleetsim import FleetConfig
from telemetry import schema as S

SHARED_SAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "fleet-sample")


def simulate(out, *args):
    res = CliRunner().invoke(main, ["simulate", "--out", str(out), "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("trace")
    summary = simulate(out, "--nodes", "6", "--days", "2", "--interval", "30", "--seed", "7",
                       "--failure-rate", "0.15", "--fail", "node0002/gpu5/thermal@+3h")
    tables = {name: pq.read_table(out / f"{name}.parquet").to_pandas() for name in ("telemetry", "xid", "failures")}
    return out, summary, tables


def test_files_follow_the_schema(trace):
    out, summary, _ = trace
    for name, schema in (("telemetry", S.TELEMETRY_SCHEMA), ("xid", S.XID_SCHEMA), ("failures", S.FAILURE_SCHEMA)):
        got = pq.read_schema(out / f"{name}.parquet")
        assert got.names == schema.names
        for field in schema:
            t = got.field(field.name).type
            t = t.value_type if hasattr(t, "value_type") else t  # node/uuid are dictionary-encoded
            assert t == field.type, (name, field.name, t)
    meta = json.loads((out / "trace.json").read_text())
    assert meta == summary
    assert {"nodes", "gpus_per_node", "days", "interval_s", "failures"} <= meta.keys()


@pytest.mark.skipif(not os.path.isdir(SHARED_SAMPLE), reason="shared fleet sample not present")
def test_same_column_types_as_the_shared_sample(trace):
    out, _, _ = trace
    ours = pq.read_schema(out / "telemetry.parquet")
    theirs = pq.read_schema(os.path.join(SHARED_SAMPLE, "telemetry.parquet"))
    for field in theirs:
        assert ours.field(field.name).type == field.type, field.name


def test_labels_agree_with_the_telemetry(trace):
    _, summary, t = trace
    tel, xid, fails = t["telemetry"], t["xid"], t["failures"]
    assert summary["failures"] == len(fails) > 5
    assert set(fails["mode"]) <= set(S.FAILURE_MODES)
    assert (fails.loc[fails["mode"] == "sudden", "precursor_s"] == 0).all()
    for f in fails.itertuples():
        # the terminal XID is logged at the failure, and the GPU then goes silent for a while
        hit = xid[(xid.node == f.node) & (xid.gpu == f.gpu) & (xid.timestamp == f.timestamp)]
        assert list(hit.xid) == [f.xid]
        assert f.xid in S.CRITICAL_XIDS
        after = tel[(tel.node == f.node) & (tel.gpu == f.gpu) & (tel.timestamp > f.timestamp)]
        assert after.empty or (after.timestamp.min() - f.timestamp).total_seconds() >= 1800
        before = tel[(tel.node == f.node) & (tel.gpu == f.gpu) & (tel.timestamp <= f.timestamp)]
        if not after.empty and not before.empty:
            # back reset or replaced: volatile counters restart from zero
            assert (after[S.SBE].dropna().iloc[0] <= before[S.SBE].dropna().iloc[-1]
                    or before[S.SBE].dropna().iloc[-1] == 0)


def test_scheduled_failure_has_a_visible_precursor(trace):
    _, _, t = trace
    fails, tel = t["failures"], t["telemetry"]
    f = fails[(fails.node == "node0002") & (fails.gpu == 5)].iloc[0]
    assert f["mode"] == "thermal" and f["xid"] == 79
    assert abs((f.timestamp - tel.timestamp.min()).total_seconds() - 3 * 3600) < 60
    assert 120 < f.precursor_s < 3 * 3600
    gpu = tel[(tel.node == "node0002") & (tel.gpu == 5) & (tel.timestamp < f.timestamp)]
    late = gpu[gpu.timestamp > f.timestamp - np.timedelta64(5, "m")][S.GPU_TEMP].median()
    assert late > gpu[S.GPU_TEMP].median() + 10


def test_healthy_variation_is_present(trace):
    _, _, t = trace
    tel, xid = t["telemetry"], t["xid"]
    assert xid.xid.isin(list(S.APPLICATION_XIDS)).sum() > 0
    assert (tel[S.THROTTLE] == S.THROTTLE_IDLE).any()  # idle phases
    assert tel[S.GPU_TEMP].isna().any()  # blank fields
    assert tel.uuid.notna().all()
    steps = tel[(tel.node == "node0000") & (tel.gpu == 0)].timestamp.diff().dt.total_seconds().dropna()
    assert 29 < steps.median() < 31 and steps.max() > 60  # jittered 30 s, with gaps


def test_same_seed_same_trace_and_warmer_fleet(tmp_path):
    a = simulate(tmp_path / "a", "--nodes", "2", "--days", "0.5", "--seed", "3")
    b = simulate(tmp_path / "b", "--nodes", "2", "--days", "0.5", "--seed", "3")
    simulate(tmp_path / "c", "--nodes", "2", "--days", "0.5", "--seed", "3", "--temp-offset", "4")
    assert a == {**b}
    ta, tb = (pq.read_table(tmp_path / d / "telemetry.parquet") for d in "ab")
    assert ta.equals(tb)
    tc = pq.read_table(tmp_path / "c" / "telemetry.parquet")
    diff = (np.nanmean(tc[S.GPU_TEMP].to_numpy(zero_copy_only=False))
            - np.nanmean(ta[S.GPU_TEMP].to_numpy(zero_copy_only=False)))
    assert 3.5 < diff < 4.5


@pytest.mark.parametrize("args, message", [
    (["--fail", "node9999/gpu0/hbm@+1m"], "not in this fleet"),
    (["--fail", "node0000/gpu0/gremlin@+1m"], "bad failure mode"),
    (["--fail", "node0000/gpu9/hbm@+1m"], "GPUs 0-7"),
    (["--mode-weights", "hbm=x"], "expected e.g."),
])
def test_bad_options_are_usage_errors(tmp_path, args, message):
    res = CliRunner().invoke(main, ["simulate", "--out", str(tmp_path), "--nodes", "2", *args])
    assert res.exit_code == 2 and message in res.output


def test_live_sim_stamps_samples_on_the_wall_or_the_simulated_clock():
    from agents.sources.sim import SimSource

    cfg = FleetConfig(nodes=1, node_names=("n0",), interval_s=2, seed=1, days=None, time_scale=30)
    now = [1_780_000_000.0]
    wall, model = SimSource(cfg, clock=lambda: now[0]), SimSource(cfg, clock=lambda: now[0], model_clock=True)
    stamps: dict[str, list[int]] = {"wall": [], "model": []}
    for _ in range(4):
        stamps["wall"].append(wall.read()[0]["timestamp"])
        stamps["model"].append(model.read()[0]["timestamp"])
        now[0] += 2  # reads on schedule, every 2 s of wall time
    assert [b - a for a, b in zip(stamps["wall"], stamps["wall"][1:])] == [2000] * 3
    assert [b - a for a, b in zip(stamps["model"], stamps["model"][1:])] == [60_000] * 3  # 2 s x 30
    assert stamps["model"][0] == stamps["wall"][0]  # both clocks start at the wall clock

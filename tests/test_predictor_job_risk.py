"""Job-level risk: calibrated node probabilities, `1 - prod(1 - p)` per job, on `/v1/risk?job=`
and the job's stream, and the checkpoint interval that follows it."""
from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from ckpt.integrations.risk import RiskListener
from ckpt.integrations.urgency import SaveRequests
from ckpt.policy import IntervalPolicy, Predictor, daly_interval
from predictor.model import job_risk
from predictor.model.model_io import load
from tests.predictor_fixtures import TOKENS, arrow_body, node_rows, post, run_cli
from tests.procs import HTTP_S, wait_for
from tests.test_predictor_server import read_events

CAL = job_risk.NodeCalibration(np.array([0.0, 0.5, 1.0]), np.array([0.001, 0.05, 0.6]), base_rate_per_s=1 / 86400)


def test_job_probability_is_any_node_failing_and_states_the_base_rate():
    r = job_risk.job_risk(np.array([0.1, 0.2]), CAL)
    assert r["probability"] == pytest.approx(1 - 0.9 * 0.8, abs=1e-6)
    assert r["base_probability"] == pytest.approx(1 - math.exp(-2 * 3600 / 86400), abs=1e-6)
    hazard = -(math.log(0.9) + math.log(0.8)) / 3600
    assert r["excess_hazard_per_s"] == pytest.approx(hazard - 2 / 86400)
    assert r["hazard_ratio"] == pytest.approx(hazard / (2 / 86400), rel=1e-3)
    calm = job_risk.job_risk(np.full(4, 1e-5), CAL)
    assert calm["excess_hazard_per_s"] == 0.0 and calm["hazard_ratio"] < 1
    assert job_risk.job_risk(np.array([1.0]), CAL)["probability"] < 1.0     # never certain: finite hazard
    assert CAL.probability(np.array([0.0, 0.25, 2.0])).tolist() == pytest.approx([0.001, 0.0255, 0.6])


def test_fit_is_monotone_and_reliability_is_measured():
    rng = np.random.default_rng(0)
    score = rng.random(20_000)
    failed = rng.random(20_000) < score ** 3 * 0.5           # a score that means more risk, not a probability
    inst = job_risk.NodeInstants(score, np.zeros(len(score), np.int64), np.arange(len(score)), failed, ["n"],
                                 node_seconds=86400.0 * 10, failures=5)
    cal = job_risk.fit([inst])
    assert np.all(np.diff(cal.p) >= 0) and cal.base_rate_per_s == pytest.approx(5 / 864000)
    rel = job_risk.reliability(cal.probability(score), failed)
    assert rel["brier"] < rel["brier_of_base_rate"]
    for row in rel["table"]:
        if row["n"] > 500:
            assert abs(row["predicted"] - row["observed"]) < 0.05, row
    with pytest.raises(ValueError, match="no node failure"):
        job_risk.fit([job_risk.NodeInstants(score, inst.node, inst.t_ms, np.zeros(len(score), bool), ["n"], 1.0, 0)])


def test_interval_follows_the_jobs_hazard_ratio():
    p = IntervalPolicy(blocking_s=10, mtbf_s=86400, predictor=Predictor(recall=0.5, false_alarms_per_day=0.1,
                                                                          lead_s=900))
    assert p.interval_at(None) == p.interval_s and p.interval_at(None, elevated=True) == p.risk_interval_s
    assert p.interval_at(0.2) == p.interval_at(1.0) == p.interval_s          # no threshold, no shorter at base
    steps = [p.interval_at(r) for r in (1.5, 3, 10, 100, 1000)]
    assert all(a > b for a, b in zip(steps, steps[1:]))
    assert p.interval_at(1000) == pytest.approx(daly_interval(10, 86400 / (0.5 + 999)))   # (1 - recall) + excess
    p.should_save(now=0.0)
    assert not p.should_save(now=p.interval_at(100) - 1, hazard_ratio=100)
    assert p.should_save(now=p.interval_at(100) + 1, hazard_ratio=100)
    assert not p.should_save(now=p.interval_at(100) + 1, hazard_ratio=1.0)
    assert p.interval_steps(1.0, hazard_ratio=100) == round(p.interval_at(100))


class _Heard:
    """What the loop reads from a RiskListener (whose ratio comes from the live stream below)."""

    elevated = False
    at_risk_nodes: set[str] = set()

    def __init__(self, ratio: float) -> None:
        self.hazard_ratio = ratio


def test_loop_saves_sooner_as_the_jobs_hazard_ratio_rises(root, shm_dir):
    import torch

    from ckpt import CheckpointManager
    from ckpt.integrations.loop import save_at_boundary
    now = [0.0]
    policy = IntervalPolicy(blocking_s=1.0, mtbf_s=3600.0, formula="young", clock=lambda: now[0])  # 85 s at the base
    state = {"w": torch.zeros(4)}
    saved = []
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        policy.should_save()                      # the clock starts with training
        for step in range(1, 31):
            now[0] += 3.0                         # a step takes 3 s of the policy's clock
            ratio = 1.0 if step <= 10 else 100.0  # the job's nodes heat up after step 10
            if save_at_boundary(mgr, SaveRequests(), step, lambda: state, policy, listener=_Heard(ratio)):
                saved.append(step)
    assert saved[0] == 11 and len(saved) >= 5, saved    # 8.5 s between saves at 100x the base hazard


def test_train_calibrates_node_probabilities_on_its_validation_nodes(trained_model):
    cal = job_risk.NodeCalibration.of(load(trained_model))
    assert cal is not None and np.all(np.diff(cal.p) >= 0) and np.all(np.diff(cal.score) > 0)
    assert 0 < cal.base_probability < 0.5


@pytest.fixture(scope="module")
def calibrated_model(small_trace, tmp_path_factory):
    """The packaged model with its node calibration refitted on the small trace."""
    out = tmp_path_factory.mktemp("cal") / "cal.skops"
    res = json.loads(run_cli("predictor.cli", "calibrate", "--trace", str(small_trace), "--out", str(out),
                             "--json").stdout)
    assert res["in_sample"]["brier"] <= res["in_sample"]["brier_of_base_rate"]
    return out


def test_job_risk_on_the_endpoint_and_the_stream(live_server, calibrated_model):
    srv = live_server("--model", str(calibrated_model))
    cal = job_risk.NodeCalibration.of(load(calibrated_model))
    job = requests.post(f"{srv.url}/v1/jobs", json={"nodes": ["ja", "jb"]}, headers=srv.headers("job"),
                        timeout=HTTP_S).json()
    url = f"{srv.url}/v1/risk?job={job['id']}"
    assert requests.get(url, timeout=HTTP_S).status_code == 401
    assert requests.get(url, headers=srv.headers("agent"), timeout=HTTP_S).status_code == 403
    assert requests.get(f"{srv.url}/v1/risk?job=nope", headers=srv.headers("job"), timeout=HTTP_S).status_code == 404
    unseen = requests.get(url, headers=srv.headers("job"), timeout=HTTP_S).json()
    assert unseen["calibrated"] and unseen["unseen_nodes"] == 2
    assert unseen["probability"] == pytest.approx(1 - (1 - cal.base_probability) ** 2, abs=1e-6)
    assert unseen["hazard_ratio"] == pytest.approx(1.0, rel=1e-3)

    stream = requests.get(srv.url + job["stream"], headers=srv.headers("job"), stream=True, timeout=15)
    assert read_events(stream, 0)[0][1]["risk"]["probability"] == unseen["probability"]
    listener = RiskListener(srv.url, ["ja", "jb"], SaveRequests(), token=TOKENS["job"]).start()
    try:
        assert wait_for(lambda: listener.hazard_ratio is not None), "the listener never heard the job's risk"
        t0 = int(time.time() * 1000) - 60_000
        assert post(srv, "telemetry", arrow_body(node_rows("ja", t0) + node_rows("jb", t0))).status_code == 202
        calm = [e for n, e in read_events(stream, 1) if n == "risk"][0]
        assert calm["unseen_nodes"] == 0 and calm["probability"] < 0.5
        xid = json.dumps({"timestamp": t0 + 2000, "node": "ja", "gpu": 3, "xid": 79}).encode()
        assert post(srv, "xid", xid, ctype="application/x-ndjson").status_code == 202
        hot = [e for n, e in read_events(stream, 3) if n == "risk"][0]
        assert hot["probability"] > calm["probability"] and hot["hazard_ratio"] > 1
        assert hot["top_nodes"][0]["node"] == "ja"
        assert hot["top_nodes"][0]["probability"] == pytest.approx(cal.probability(np.array([1.0]))[0], abs=1e-6)
        now = requests.get(url, headers=srv.headers("operator"), timeout=HTTP_S).json()
        assert now["probability"] == hot["probability"]
        # the same on /metrics, for dashboards and alert rules
        metrics = {(f.name, s.labels.get("job_id")): s.value for f in text_string_to_metric_families(
            requests.get(f"{srv.url}/metrics", timeout=HTTP_S).text) for s in f.samples}
        assert metrics[("predictor_job_failure_probability", job["id"])] == now["probability"]
        assert metrics[("predictor_job_hazard_ratio", job["id"])] == now["hazard_ratio"]
        assert metrics[("predictor_job_base_probability", job["id"])] == now["base_probability"]
        assert metrics[("predictor_job_risk_calibrated", None)] == 1.0
        # the training side: the listener's ratio shortens the policy's interval, with no "at risk" flag
        assert wait_for(lambda: (listener.hazard_ratio or 0) > 1), listener.risk
        policy = IntervalPolicy(blocking_s=5, mtbf_s=7 * 86400)
        assert policy.interval_at(listener.hazard_ratio) < policy.interval_s
    finally:
        listener.close()
        stream.close()

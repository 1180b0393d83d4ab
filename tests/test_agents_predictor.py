"""`agents run` against the real `predictor serve`, once both are in the tree.

Skipped where the predictor service or its packaged model is missing (the
agents branch alone); the fixture receiver in agents_fixtures.py covers the
wire contract there.
"""
import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.agents_fixtures import TOKEN
from tests.procs import HTTP_S, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _packaged_model() -> bool:
    spec = importlib.util.find_spec("predictor")
    if spec is None or importlib.util.find_spec("predictor.serve.server") is None:
        return False
    return os.path.isfile(os.path.join(os.path.dirname(spec.origin), "model", "default.skops"))


pytestmark = pytest.mark.skipif(not _packaged_model(),
                                reason="predictor service with a packaged model not in this tree")


def _env():
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), ROOT) if p)
    return {**os.environ, "PYTHONPATH": path}


@pytest.fixture(scope="module")
def predictor(tmp_path_factory):
    d = tmp_path_factory.mktemp("predictor")
    (d / "tokens").write_text(f"agent {TOKEN}\n")
    (d / "agent.token").write_text(TOKEN)
    port = free_port()
    # --max-ahead as the demo sets it: a --model-clock agent stamps samples ahead of the wall clock
    proc = subprocess.Popen([sys.executable, "-m", "predictor.cli", "serve", "--port", str(port),
                             "--tokens", str(d / "tokens"), "--max-ahead", "86400"],
                            cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"predictor serve exited: {proc.stderr.read()}"
            assert time.monotonic() < deadline, "predictor serve did not come up"
            try:
                with urllib.request.urlopen(url + "/healthz", timeout=2):
                    break
            except OSError:
                time.sleep(0.3)
        yield url, str(d / "agent.token")
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def ingested(url: str) -> dict[str, float]:
    """Rows the predictor accepted, by endpoint (nothing until its first batch)."""
    with urllib.request.urlopen(url + "/metrics", timeout=HTTP_S) as r:
        text = r.read().decode()
    for fam in text_string_to_metric_families(text):
        if fam.name == "predictor_ingested_rows":
            return {s.labels["endpoint"]: s.value for s in fam.samples if s.name.endswith("_total")}
    return {}


def agents_run(url, token_file, tmp_path, *args):
    res = subprocess.run([sys.executable, "-m", "agents.cli", "run", "--source", "sim", "--predictor", url,
                          "--token-file", token_file, "--interval", "0.2", "--batch-seconds", "0.5",
                          "--metrics-port", "0", "--spool-dir", str(tmp_path / "spool"), "--json", *args],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_predictor_counts_every_sample_and_xid(predictor, tmp_path):
    url, token_file = predictor
    before = ingested(url)
    # the failure at +0.1 s (6 s of model time) falls in the second read, the one that makes 16
    # samples: a busy machine that drops ticks still gets there (+1 s needed the sixth read)
    counters = agents_run(url, token_file, tmp_path, "--node-name", "it01", "--duration", "3", "--time-scale", "60",
                          "--fail", "it01/gpu3/sudden@+0.1s")
    after = ingested(url)
    assert "telemetry" in after, "predictor_ingested_rows_total not on the predictor's /metrics"
    assert counters["samples_sent"] == counters["samples_collected"] >= 16  # the count, not the rate
    assert after["telemetry"] - before.get("telemetry", 0) == counters["samples_sent"]
    assert after.get("xid", 0) - before.get("xid", 0) == counters["xid_events_sent"] >= 1, (counters, before, after)
    assert counters["samples_rejected"] == counters["send_errors"] == 0


def test_a_model_clock_agent_is_accepted_with_the_demos_max_ahead(predictor, tmp_path):
    """The demo's agent runs its clock --time-scale times faster (here 30 min ahead by the end):
    a server started as the demo starts it takes every sample."""
    url, token_file = predictor
    counters = agents_run(url, token_file, tmp_path, "--node-name", "mc01", "--duration", "3", "--time-scale", "600",
                          "--model-clock")
    assert counters["samples_sent"] == counters["samples_collected"] >= 16  # the count, not the rate
    assert counters["samples_rejected"] == counters["send_errors"] == 0


def test_refused_token_keeps_the_samples(predictor, tmp_path):
    url, _ = predictor
    wrong = tmp_path / "wrong.token"
    wrong.write_text("not-the-agent-token-at-all")
    counters = agents_run(url, str(wrong), tmp_path, "--duration", "1.5", "--drain-seconds", "0")
    assert counters["samples_sent"] == 0 and counters["send_errors"] >= 1 and counters["spool_batches"] >= 1

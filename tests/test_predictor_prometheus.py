"""`predictor score|eval|label|calibrate --prometheus`: a simulated trace backfilled into a real
Prometheus scores to the same risk, sample for sample, labels to the same failures and calibrates
to the same node-probability map as the trace itself."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import numpy as np
import pyarrow.parquet as pq
import pytest

from predictor.ingest.prometheus_source import HistoryQuery, PrometheusError, PrometheusHistory
from predictor.model import job_risk
from predictor.model.model_io import load
from tests.predictor_fixtures import ROOT, run_cli, simulate
from tests.prometheus_fixtures import FakePrometheus, Prometheus, backfill, basic_auth_config, xids_as_gauge_shows

HOURS = 2


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    """(trace, the trace with XIDs as the gauge shows them, Prometheus holding it, window args)."""
    tmp = tmp_path_factory.mktemp("prom")
    start = (datetime.now(timezone.utc) - timedelta(days=3)).replace(minute=0, second=0, microsecond=0)
    trace = simulate(tmp / "trace", 3, HOURS / 24, 60, 3, "--start", start.isoformat(),
                     "--fail", "node0001/gpu2/hbm@+90m", "--fail", "node0002/gpu5/pcie@+100m")
    expected = tmp / "expected"
    xids_as_gauge_shows(trace, expected)
    storage = tmp / "tsdb"
    backfill(trace, storage)
    prom = Prometheus(tmp, storage)
    window = ["--start", (start - timedelta(minutes=1)).isoformat(),
              "--end", (start + timedelta(hours=HOURS, minutes=1)).isoformat()]
    try:
        yield trace, expected, prom, window, storage
    finally:
        prom.stop()


def _score(tmp_path, name: str, *source: str) -> dict:
    out = tmp_path / f"{name}.parquet"
    run_cli("predictor.cli", "score", *source, "--threshold", "0", "--out", str(out))
    return pq.read_table(out).to_pydict()


def test_scoring_through_prometheus_gives_the_traces_risk(history, tmp_path):
    trace, expected, prom, window, _ = history
    direct = _score(tmp_path, "direct", "--trace", str(expected))
    saved = tmp_path / "saved"
    # 25 min chunks: boundaries fall between and on samples; every sample must come once
    through = _score(tmp_path, "prom", "--prometheus", prom.url, *window, "--chunk", "25m", "--match", 'job="dcgm"',
                     "--save-trace", str(saved))
    assert len(direct["timestamp"]) >= pq.ParquetFile(trace / "telemetry.parquet").metadata.num_rows
    for col in ("timestamp", "node", "gpu", "reason"):
        assert through[col] == direct[col], col
    np.testing.assert_array_equal(through["score"], direct["score"])
    assert max(direct["score"]) == 1.0                  # the critical XIDs came through
    got = pq.read_table(saved / "xid.parquet").to_pydict()
    want = pq.read_table(expected / "xid.parquet").to_pydict()
    assert (got["node"], got["gpu"], got["xid"]) == (want["node"], want["gpu"], want["xid"])
    assert [t.timestamp() for t in got["timestamp"]] == [t.timestamp() for t in want["timestamp"]]
    meta = json.loads((saved / "trace.json").read_text())
    assert meta["nodes"] == 3 and meta["gpus_per_node"] == 8 and meta["missing_metrics"] == []


def test_eval_through_prometheus_with_failures(history, tmp_path):
    trace, expected, prom, window, _ = history
    res = run_cli("predictor.cli", "eval", "--prometheus", prom.url, *window, "--failures",
                  str(trace / "failures.parquet"), "--json")
    direct = json.loads(run_cli("predictor.cli", "eval", "--trace", str(expected), "--json").stdout)
    node = json.loads(res.stdout)["node"]
    assert node["failures"] == 2
    for k in ("caught", "recall", "recall_of_predictable", "lead_s_median"):
        assert node[k] == direct["node"][k], k
    assert "read " in res.stderr and "from http://127.0.0.1" in res.stderr


def _query(prom, window_args: list[str], **kw) -> HistoryQuery:
    start, end = (datetime.fromisoformat(window_args[i]) for i in (1, 3))
    return HistoryQuery(prom.url, int(start.timestamp() * 1000), int(end.timestamp() * 1000), **kw)


@pytest.mark.parametrize("kw, message", [
    ({"match": 'job="elsewhere"'}, "no DCGM series match"),
    ({"match": 'job=~"("'}, "check --match"),
    ({"max_samples": 100}, "over --max-samples 100: shorten --chunk"),
    ({"max_series": 10}, "over --max-series 10: narrow --match"),
    ({"node_label": "kubernetes_node"}, "has no 'kubernetes_node' or 'gpu' label"),
])
def test_clear_errors(history, tmp_path, kw, message):
    _, _, prom, window, _ = history
    with pytest.raises(PrometheusError, match=re.escape(message)):
        PrometheusHistory(_query(prom, window, **kw)).write_trace(tmp_path / "t")
    with pytest.raises(PrometheusError, match="unreachable"):
        PrometheusHistory(HistoryQuery("http://127.0.0.1:9", 0, 1000)).write_trace(tmp_path / "t")


def test_missing_series_are_named_and_read_as_missing(history, tmp_path):
    _, _, prom, window, _ = history
    out = str(tmp_path / "a.parquet")
    partial = run_cli("predictor.cli", "score", "--out", out, "--prometheus", prom.url, *window,
                      "--match", '__name__!~"DCGM_FI_DEV_PCIE_REPLAY_COUNTER|DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"')
    assert "no series for DCGM_FI_DEV_ECC_SBE_VOL_TOTAL, DCGM_FI_DEV_PCIE_REPLAY_COUNTER" in partial.stderr
    assert "the model misses most HBM and NVLink failures" in partial.stderr
    usage = run_cli("predictor.cli", "score", "--out", out, "--prometheus", prom.url, check=False)
    assert usage.returncode == 2 and "--start" in usage.stderr


def test_basic_auth(history, tmp_path):
    _, expected, _, window, storage = history
    copy = tmp_path / "tsdb"
    shutil.copytree(storage, copy, ignore=shutil.ignore_patterns("lock", "queries.active", "wal", "chunks_head"))
    prom = Prometheus(tmp_path, copy, basic_auth_config(tmp_path / "web.yml"))
    try:
        out = str(tmp_path / "a.parquet")
        refused = run_cli("predictor.cli", "score", "--out", out, "--prometheus", prom.url, *window, check=False)
        assert refused.returncode == 1 and "refused the credentials (401)" in refused.stderr
        ok = run_cli("predictor.cli", "score", "--out", out, "--prometheus", prom.url, *window, "--prometheus-user",
                     "reader", "--json", env={"CKPT_GUARD_PROMETHEUS_PASSWORD": "s3cret-pass"})
        assert json.loads(ok.stdout)["alarms"] == json.loads(run_cli(
            "predictor.cli", "score", "--out", out, "--trace", str(expected), "--json").stdout)["alarms"]
    finally:
        prom.stop()


def _labels(path) -> dict:
    """The labels, their unknown precursors (NaN, which equals nothing) checked and left out."""
    labels = pq.read_table(path / "failures.parquet").to_pydict()
    assert np.isnan(labels.pop("precursor_s")).all()
    return labels


def test_label_through_prometheus_gives_the_traces_labels(history, tmp_path):
    _, expected, prom, window, _ = history
    res = run_cli("predictor.cli", "label", "--prometheus", prom.url, *window, "--chunk", "25m",
                  "--out", str(tmp_path / "prom"), "--json")
    direct = run_cli("predictor.cli", "label", "--trace", str(expected), "--out", str(tmp_path / "direct"), "--json")
    assert json.loads(res.stdout)["failures"] == json.loads(direct.stdout)["failures"] == 2
    assert _labels(tmp_path / "prom") == _labels(tmp_path / "direct")
    assert (tmp_path / "prom" / "telemetry.parquet").is_file()    # the window itself: train/eval read the dir
    again = run_cli("predictor.cli", "label", "--prometheus", prom.url, *window, "--out", str(tmp_path / "prom"),
                    check=False)
    assert again.returncode == 1 and "exists" in again.stderr
    missing = run_cli("predictor.cli", "label", "--prometheus", prom.url, *window, "--out", str(tmp_path / "m"),
                      "--match", 'job="elsewhere"', check=False)
    assert missing.returncode == 1 and "no DCGM series match" in missing.stderr


def _calibration(tmp_path, name: str, *source: str) -> dict:
    out = tmp_path / f"{name}.skops"
    run_cli("predictor.cli", "calibrate", *source, "--out", str(out), "--json")
    info = dict(load(out).info[job_risk.INFO_KEY])
    info.pop("traces")
    return info


def test_calibrate_through_prometheus(history, tmp_path):
    trace, expected, prom, window, _ = history
    direct = _calibration(tmp_path, "direct", "--trace", str(expected))
    through = _calibration(tmp_path, "prom", "--prometheus", prom.url, *window, "--failures",
                           str(trace / "failures.parquet"))
    assert through == direct and through["base_rate_per_s"] > 0
    # labels derived from the window, as from the trace's own telemetry
    unlabelled = tmp_path / "unlabelled"
    shutil.copytree(expected, unlabelled, ignore=shutil.ignore_patterns("failures.parquet"))
    derived = _calibration(tmp_path, "derived", "--prometheus", prom.url, *window, "--derive-labels")
    assert derived == _calibration(tmp_path, "derived_trace", "--trace", str(unlabelled), "--derive-labels")
    usage = run_cli("predictor.cli", "calibrate", "--prometheus", prom.url, *window, "--out",
                    str(tmp_path / "x.skops"), check=False)
    assert usage.returncode == 2 and "--derive-labels" in usage.stderr
    refused = run_cli("predictor.cli", "calibrate", "--trace", str(unlabelled), "--out", str(tmp_path / "x.skops"),
                      check=False)
    assert refused.returncode == 1 and "no failures.parquet" in refused.stderr


# ------------------------------------------------------------ hostile answers (issue 32.5)
LABELS = '{"status":"success","data":["DCGM_FI_DEV_GPU_TEMP","DCGM_FI_DEV_XID_ERRORS"]}'
GPU = '"Hostname":"n0","gpu":"0"'


def _matrix(result: str) -> bytes:
    return ('{"status":"success","data":{"resultType":"matrix","result":[' + result + "]}}").encode()


@pytest.fixture
def fake_prometheus():
    fakes = []

    def start(query: bytes | object, labels: bytes = LABELS.encode()) -> FakePrometheus:
        fakes.append(FakePrometheus({"/api/v1/label/__name__/values": labels, "/api/v1/query": query}))
        return fakes[-1]
    yield start
    for f in fakes:
        f.stop()


@pytest.mark.parametrize("query, labels, message", [
    (b"[]", LABELS, "the answer is a list, not a JSON object"),
    (b"[1, 2]", LABELS, "the answer is a list, not a JSON object"),
    (_matrix(""), '["DCGM_FI_DEV_GPU_TEMP"]', "the answer is a list, not a JSON object"),
    (_matrix(""), '{"status":"success","data":{"x":1}}', "label values: expected a list of names"),
    (_matrix('{"metric":{"__name__":"up",' + GPU + '},"values":[[1700000000,"1"]]}'), LABELS,
     "series 'up' is not one of the DCGM fields asked for"),
    (_matrix('{"metric":{"__name__":"DCGM_FI_DEV_GPU_TEMP",' + GPU + '},"values":[[1e400,"1"]]}'), LABELS,
     "timestamp 1E+400 is not a finite number"),
    (_matrix('{"metric":{"__name__":"DCGM_FI_DEV_GPU_TEMP",' + GPU + '},"values":[["x","1"]]}'), LABELS,
     "timestamp 'x' is not a finite number"),
    (_matrix('{"metric":{"__name__":"DCGM_FI_DEV_GPU_TEMP",' + GPU + '},"values":[[1700000000,"warm"]]}'), LABELS,
     "value 'warm' is not a number"),
    (_matrix('{"metric":{"__name__":"DCGM_FI_DEV_GPU_TEMP",' + GPU + '},"values":[[1700000000]]}'), LABELS,
     "a sample is not a [time, value] pair"),
    (_matrix('{"metric":{"__name__":"DCGM_FI_DEV_GPU_TEMP",' + GPU + '},"values":{}}'), LABELS,
     "'values' is not a list"),
    (_matrix('{"values":[[1700000000,"1"]]}'), LABELS, "a series without a 'metric' object"),
    (_matrix('{"metric":"DCGM_FI_DEV_GPU_TEMP","values":[]}'), LABELS, "a series without a 'metric' object"),
    (_matrix('[1700000000,"1"]'), LABELS, "a series is not a JSON object"),
    (_matrix('{"metric":{"__name__":"DCGM_FI_DEV_GPU_TEMP","Hostname":"n0","gpu":"40000"},'
             '"values":[[1700000000,"1"]]}'),
     LABELS, "gpu label '40000' is not an index in 0..63"),
    (b'{"status":"success","data":{"resultType":"vector","result":[]}}', LABELS, "expected a matrix answer"),
    (b'{"status":"success","data":[]}', LABELS, "expected a matrix answer"),
    (b'{"status":"success","data":{"resultType":"matrix","result":[', LABELS, "not JSON"),
    (b'{"status":"success","data":{"resultType":"matrix","result":[}', LABELS, "not JSON"),
])
def test_malformed_answers_are_one_clear_error(fake_prometheus, tmp_path, query, labels, message):
    prom = fake_prometheus(query, labels.encode())
    with pytest.raises(PrometheusError, match=re.escape(message)):
        PrometheusHistory(HistoryQuery(prom.url, 1_699_999_000_000, 1_700_000_500_000)).write_trace(tmp_path / "t")


def test_a_malformed_answer_is_one_line_from_the_cli(fake_prometheus, tmp_path):
    prom = fake_prometheus(_matrix('{"metric":{"__name__":"DCGM_FI_DEV_GPU_TEMP",' + GPU +
                                   '},"values":[[1700000000,"warm"]]}'))
    res = run_cli("predictor.cli", "score", "--prometheus", prom.url, "--start", "2023-11-14T22:00:00Z",
                  "--end", "2023-11-14T22:20:00Z", "--out", str(tmp_path / "s.parquet"), check=False)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines()[-1] == ("error: the chunk ending 2023-11-14T22:20:00Z: series "
                                                   "DCGM_FI_DEV_GPU_TEMP: value 'warm' is not a number")


def test_a_dripping_server_is_cut_at_the_timeout(fake_prometheus, tmp_path):
    prom = fake_prometheus(_matrix(",".join(['{"metric":{"__name__":"DCGM_FI_DEV_GPU_TEMP",' + GPU +
                                             '},"values":[[1700000000,"1"]]}'] * 200)))
    prom.drip_s = 0.05                              # 256 bytes every 50 ms: ~8 s for the chunk
    started = time.monotonic()
    with pytest.raises(PrometheusError, match=re.escape("no complete answer within 1 s (--prometheus-timeout)")):
        PrometheusHistory(HistoryQuery(prom.url, 1_699_999_000_000, 1_700_000_500_000, timeout_s=1.0)) \
            .write_trace(tmp_path / "t")
    assert time.monotonic() - started < 6           # generous: it must not wait for the whole drip


# the peak of this process alone: VmHWM (ru_maxrss after a fork carries the parent's peak)
_EMPTY_SERIES_READER = """
import re, sys
from predictor.ingest.prometheus_source import HistoryQuery, PrometheusError, PrometheusHistory
try:
    PrometheusHistory(HistoryQuery(sys.argv[1], 1_699_999_000_000, 1_700_000_500_000)).write_trace(sys.argv[2])
except PrometheusError as e:
    print(e)
print(int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) // 1024)
"""


def test_twelve_million_empty_series_are_refused_before_they_are_held(fake_prometheus, tmp_path):
    def answer():
        yield b'{"status":"success","data":{"resultType":"matrix","result":['
        piece = b",".join([b'{"metric":{},"values":[]}'] * 100_000)
        for i in range(120):
            yield piece if i == 0 else b"," + piece
        yield b"]}}"
    prom = fake_prometheus(answer)
    res = subprocess.run([sys.executable, "-c", _EMPTY_SERIES_READER, prom.url, str(tmp_path / "t")],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    error, peak_mib = res.stdout.splitlines()
    assert "over --max-series 50000: narrow --match" in error, res.stdout + res.stderr
    assert int(peak_mib) < 1024, peak_mib           # generous: ~120 MiB, the import ~100; parsed whole, 4.8 GiB

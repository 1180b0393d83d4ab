"""`agents run` end to end, as a real process, against a real receiver on 127.0.0.1."""
import json
import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from agents.cli import main
from agents.sources.nvml import NvmlSource, NvmlUnavailable
from agents.sources.replay import ReplaySource
from tests.agents_fixtures import TOKEN

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def agents(*args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "agents.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT, **(env or {})}, timeout=120, **kw)


@pytest.fixture
def token_file(tmp_path):
    p = tmp_path / "token"
    p.write_text(TOKEN + "\n")
    return str(p)


def test_sim_agent_streams_every_sample_and_the_scheduled_failure(receiver, token_file, tmp_path):
    res = agents("run", "--source", "sim", "--node-name", "demo01", "--predictor", receiver.url,
                 "--token-file", token_file, "--interval", "0.2", "--duration", "8", "--batch-seconds", "0.5",
                 "--metrics-port", "0", "--spool-dir", str(tmp_path / "spool"), "--time-scale", "60",
                 "--fail", "demo01/gpu4/sudden@+1s", "--json")
    assert res.returncode == 0, res.stderr
    counters = json.loads(res.stdout)
    # every sample collected arrives; how many ticks the run holds depends on the machine's load (3 s
    # held 4 ticks at load 150, none after the failure at +1 s: the run is 8 s): at least two ticks of 8 GPUs
    assert counters["samples_collected"] == counters["samples_sent"] == receiver.count() >= 16
    assert counters["spool_batches"] == 0
    xids = receiver.rows("/v1/xid").to_pylist()
    assert any(x["gpu"] == 4 and x["xid"] in (79, 48, 119, 120, 62) and x["node"] == "demo01" for x in xids)
    assert set(receiver.rows().column("node").to_pylist()) == {"demo01"}


def test_replay_streams_a_recorded_trace_and_stops_at_its_end(receiver, token_file, tmp_path):
    trace = tmp_path / "trace"
    res = CliRunner().invoke(main, ["simulate", "--nodes", "2", "--days", "0.25", "--interval", "60",
                                    "--out", str(trace), "--failure-rate", "1"])
    assert res.exit_code == 0, res.output
    rows = pq.read_metadata(trace / "telemetry.parquet").num_rows
    xids = pq.read_metadata(trace / "xid.parquet").num_rows
    res = agents("run", "--source", "replay", "--trace", str(trace), "--speed", "20000", "--predictor", receiver.url,
                 "--interval", "0.1", "--metrics-port", "0", "--spool-dir", str(tmp_path / "spool"), "--json",
                 env={"CKPT_GUARD_AGENT_TOKEN": TOKEN})
    assert res.returncode == 0, res.stderr
    assert receiver.count() == rows and receiver.count("/v1/xid") == xids > 0
    sent = receiver.rows().to_pandas()
    recorded = pq.read_table(trace / "telemetry.parquet").to_pandas()
    assert sorted(sent.timestamp) == sorted(recorded.timestamp)  # recorded times kept


def test_replay_retime_maps_onto_the_wall_clock(tmp_path):
    CliRunner().invoke(main, ["simulate", "--nodes", "1", "--days", "0.02", "--out", str(tmp_path)])
    clock = iter([1000.0, 1000.5]).__next__
    src = ReplaySource(str(tmp_path), speed=600, retime=True, clock=clock)
    rows = src.read()  # 0.5 s at 600x: the first 300 s of the trace
    assert rows and {r["timestamp"] for r in rows} <= set(range(1_000_000, 1_000_501))
    assert not src.finished


def test_sigterm_stops_the_agent_cleanly(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "agents.cli", "run", "--source", "sim", "--interval", "0.2",
                             "--metrics-port", "0", "--json"], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while "agent for node" not in proc.stderr.readline():  # signal handlers are in place
            assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert json.loads(out)["samples_collected"] > 0


def test_no_driver_names_the_sim_source():
    """No GPU here: the NVML path can only be checked for its no-driver message."""
    try:
        NvmlSource().close()
    except NvmlUnavailable:
        pass
    else:
        pytest.skip("NVML works here: see tests marked gpu")
    res = agents("run", "--source", "nvml", "--metrics-port", "0")
    assert res.returncode == 1 and "--source sim" in res.stderr


@pytest.mark.gpu
def test_nvml_reads_every_field_on_a_real_gpu():
    try:
        src = NvmlSource()
    except NvmlUnavailable:
        pytest.skip("no NVIDIA driver")
    try:
        rows = src.read()
        assert rows and all(r["uuid"].startswith("GPU-") for r in rows)
        assert all(r["DCGM_FI_DEV_GPU_TEMP"] is not None and r["DCGM_FI_DEV_POWER_USAGE"] is not None for r in rows)
        print(json.dumps(rows, indent=1))  # what the GPU showed, for the report
    finally:
        src.close()


@pytest.mark.parametrize("args, env, message", [
    (["--predictor", "http://127.0.0.1:9"], {"CKPT_GUARD_AGENT_TOKEN": ""}, "needs a token"),
    (["--source", "replay"], {}, "needs --trace"),
    (["--source", "sim", "--node-name", "a", "--fail", "b/gpu0/hbm@+1m"], {}, "set --node-name"),
    (["--token", "s3cret"], {}, "--token-file"),
])
def test_usage_errors_exit_2(args, env, message):
    res = agents("run", "--metrics-port", "0", "--duration", "1", *args, env=env)
    assert res.returncode == 2 and message in res.stderr


def test_replay_reads_traces_without_uuid_and_with_extra_columns(tmp_path):
    """Recorded traces vary: microsecond times, dictionary-encoded nodes, no uuid, columns we do not know."""
    import pyarrow as pa

    n = 6
    table = pa.table({
        "timestamp": pa.array([1_700_000_000_000_123 + 60_000_000 * (i // 2) for i in range(n)],
                              pa.int64()).cast(pa.timestamp("us")),
        "node": pa.array(["a", "b"] * 3).dictionary_encode(),
        "gpu": pa.array([0] * n, pa.int16()),
        "DCGM_FI_DEV_GPU_TEMP": pa.array([50.0] * n, pa.float32()),
        "SOMETHING_ELSE": pa.array(range(n)),
    })
    pq.write_table(table, tmp_path / "telemetry.parquet")
    src = ReplaySource(str(tmp_path), speed=1e9, nodes=["b"])
    rows = src.read()
    assert [r["node"] for r in rows] == ["b"] * 3 and all(r["uuid"] is None for r in rows)
    assert rows[0]["timestamp"] == 1_700_000_000_000  # microseconds, no zone: read as UTC, truncated to ms
    assert "SOMETHING_ELSE" not in rows[0] and rows[0]["DCGM_FI_DEV_SM_CLOCK"] is None
    assert src.finished and src.xids() == []

"""/metrics: dcgm-exporter names and labels, checked by prometheus_client's parser and a real Prometheus."""
import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agents.exporter import DCGM_METRICS, Exporter
from agents.fleetsim import FleetConfig
from agents.sources.sim import SimSource
from agents.stats import AgentStats
from telemetry import schema as S
from tests.procs import free_port

DCGM_LABELS = {"gpu", "UUID", "device", "modelName", "Hostname"}


def sim_exporter(stale_s=60.0):
    src = SimSource(FleetConfig(nodes=1, node_names=("node0042",), interval_s=10, seed=2, days=None))
    stats = AgentStats()
    exp = Exporter(stats, None, src.model_name, stale_s=stale_s)
    rows = src.read()
    stats.add(samples_collected=len(rows), samples_sent=len(rows))
    exp.observe(rows, [{"timestamp": 0, "node": "node0042", "gpu": 3, "xid": 79}])
    return exp, rows


def families(text):
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_text_format_has_dcgm_names_labels_and_agent_counters():
    exp, rows = sim_exporter()
    text = exp.render().decode()
    fams = families(text)
    for name, (kind, _) in DCGM_METRICS.items():
        fam = fams[name]
        assert fam.type == kind
        assert {s.labels["gpu"] for s in fam.samples} <= {str(g) for g in range(8)}
        for s in fam.samples:
            assert set(s.labels) == DCGM_LABELS
            assert s.labels["Hostname"] == "node0042" and s.labels["modelName"] == "NVIDIA H100 80GB HBM3"
            assert s.labels["UUID"].startswith("GPU-") and s.labels["device"] == f"nvidia{s.labels['gpu']}"
    temps = {s.labels["gpu"]: s.value for s in fams[S.GPU_TEMP].samples}
    assert temps == {str(r["gpu"]): r[S.GPU_TEMP] for r in rows if r[S.GPU_TEMP] is not None}
    assert {s.labels["gpu"]: s.value for s in fams["DCGM_FI_DEV_XID_ERRORS"].samples}["3"] == 79
    # counters keep their DCGM names on the page (the parser itself appends "_total" when reading)
    assert f"\n{S.SBE}{{gpu=" in text and f"{S.SBE}_total" not in text
    assert fams["ckpt_guard_agent_samples_sent"].samples[0].value == len(rows)
    for name in ("samples_dropped", "send_errors", "samples_rejected"):
        assert f"ckpt_guard_agent_{name}" in fams
    assert "process_resident_memory_bytes" in fams


def test_blank_fields_are_left_out_and_silent_gpus_expire():
    exp, rows = sim_exporter(stale_s=0.2)
    row = dict(rows[0], **{S.POWER: None})
    exp.observe([row], [])
    power = families(exp.render().decode())[S.POWER]
    assert str(row["gpu"]) not in {s.labels["gpu"] for s in power.samples}
    time.sleep(0.3)
    exp.observe([rows[1]], [])
    fam = families(exp.render().decode())[S.GPU_TEMP]
    assert [s.labels["gpu"] for s in fam.samples] == [str(rows[1]["gpu"])]


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian package prometheus not installed")
def test_a_real_prometheus_scrapes_it(tmp_path):
    exp, rows = sim_exporter()
    port = exp.serve(0)
    prom_port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs:\n- job_name: dcgm\n  static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n")
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        query = urllib.parse.urlencode({"query": f'{S.GPU_TEMP}{{Hostname="node0042"}}'})
        deadline, result = time.monotonic() + 30, []
        while time.monotonic() < deadline and len(result) < len(rows):
            time.sleep(0.5)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/api/v1/query?{query}", timeout=2) as r:
                    result = json.load(r)["data"]["result"]
            except OSError:
                continue
        assert len(result) == len(rows), proc.stderr.read1().decode() if proc.poll() is not None else result
        assert DCGM_LABELS <= set(result[0]["metric"])
        with urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/api/v1/targets", timeout=2) as r:
            target = json.load(r)["data"]["activeTargets"][0]
        assert target["health"] == "up", target["lastError"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        exp.close()


def test_default_metrics_port_is_not_dcgm_exporters():
    """dcgm-exporter serves 9400 on the same GPU nodes (GPU Operator): the agent's default and
    the deploy files must use another port, the same one. (The exporter's own page, which the
    agent reads with --source dcgm-exporter, is at 9400: that address may appear.)"""
    import re
    from pathlib import Path

    from agents.cli import DEFAULT_METRICS_PORT, run
    assert next(p for p in run.params if p.name == "metrics_port").default == DEFAULT_METRICS_PORT
    assert DEFAULT_METRICS_PORT not in (9100, 9400, 9410)
    deploy = Path(__file__).resolve().parents[1] / "deploy" / "agents"
    for name in ("ckpt-guard-agent.service", "prometheus-scrape.yml", "alerts_test.yml"):
        text = re.sub(r"https?://[\w.-]+:9400/metrics", "", (deploy / name).read_text())
        assert str(DEFAULT_METRICS_PORT) in text and "9400" not in text, name


def test_checkpoint_shared_memory_is_reported_and_reclaimed(tmp_path, shm_dir, monkeypatch):
    """Each namespace on the node with its owner, whether it lives and whether its newest step
    is durable; a job that is gone is an orphan, reclaimed on the second tick that finds it
    durable; one holding the only copy of a step is kept, stale past the grace time. The agent
    reads the locks from /proc/locks, never takes them to look."""
    import torch

    from agents.shm import ShmWatch
    from ckpt import CheckpointManager
    from ckpt.tiers.memory import memory_namespace

    def gone(name):
        with CheckpointManager(tmp_path / name, memory_dir=shm_dir, keep_memory=True, sweep=False) as mgr:
            mgr.save(1, {"w": torch.ones(1 << 16)}).wait()
        return memory_namespace(tmp_path / name, None, shm_dir)

    live = CheckpointManager(tmp_path / "live", memory_dir=shm_dir, keep_memory=True)
    durable, only_copy = gone("gone"), gone("only-copy")
    shutil.rmtree(tmp_path / "only-copy" / "step-000000000001.g0")
    watch = ShmWatch(shm_dir, every_s=0)
    try:
        live.save(1, {"w": torch.ones(1 << 16)}).wait()
        fams = families(Exporter(AgentStats(), shm=watch).render().decode())
        rows = {s.labels["root"].rsplit("/", 1)[-1]: s for s in fams["ckpt_guard_node_shm_bytes"].samples}
        assert {k: (s.labels["owner_alive"], s.labels["durable"], s.labels["state"]) for k, s in rows.items()} == {
            "gone": ("0", "1", "reclaimable"), "only-copy": ("0", "0", "grace"), "live": ("1", "1", "live")}
        assert rows["live"].labels["pid"] == str(os.getpid()) and rows["live"].labels["user"]
        assert 4 * (1 << 16) <= rows["gone"].value < 1 << 22  # one slot
        assert fams["ckpt_guard_node_orphaned_shm_namespaces"].samples[0].value == 2
        assert fams["ckpt_guard_node_stale_shm_bytes"].samples[0].value == 0
        assert watch.tick() == [] and durable.is_dir()  # first sighting: a relaunch may be taking it back
        assert [h.path for h in watch.tick()] == [durable] and not durable.exists()
        monkeypatch.setenv("CKPT_GUARD_SHM_GRACE_S", "0")
        watch.tick()
        fams = families(Exporter(AgentStats(), shm=watch).render().decode())
        assert fams["ckpt_guard_node_stale_shm_bytes"].samples[0].value > 0 and only_copy.is_dir()
        assert fams["ckpt_guard_node_shm_reclaimed_bytes"].samples[0].value > 0
    finally:
        live.close()
        shutil.rmtree(only_copy)
        shutil.rmtree(memory_namespace(tmp_path / "live", None, shm_dir))

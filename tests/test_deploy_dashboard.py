"""The Grafana dashboard queries only metrics that our running services really export:
a CheckpointManager with metrics on, `predictor serve` (with a registered job, for its
job-risk series), and node agents' exporters (one on the simulator, one reading a
dcgm-exporter page that lacks fields, and one whose exporter does not answer) are started
and their /metrics scraped (names and labels from the exposition, not from the source)."""
from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import requests
import torch
from prometheus_client.parser import text_string_to_metric_families

from agents.exporter import Exporter
from agents.fleetsim import FleetConfig
from agents.sources.dcgm_exporter import DcgmExporterSource
from agents.sources.sim import SimSource
from agents.spool import Spool
from agents.stats import AgentStats
from ckpt import CheckpointManager
from tests.dcgm_fixtures import FakeExporter, gpu, render
from tests.procs import HTTP_S, free_port

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "ckpt-guard.json"
# PromQL words, and label names of series that carry no sample in this test (nothing ingested)
_FUNCS = {"histogram_quantile", "sum", "rate", "increase", "max", "min", "topk", "by", "le", "tier", "kind",
          "endpoint", "target", "outcome", "Hostname", "gpu"}
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
             "summary": ("_count", "_sum", "_created"), "gauge": (), "unknown": (), "info": ("_info",)}


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=HTTP_S) as r:
        return r.read().decode()


def names(text: str) -> set[str]:
    """Every series name an exposition offers (each family's name and its sample suffixes) and
    every label name its samples carry, plus `instance`, which Prometheus adds."""
    out = {"instance"}
    for family in text_string_to_metric_families(text):
        out.add(family.name)
        out.update(family.name + s for s in _SUFFIXES.get(family.type, ()))
        out.update(s.name for s in family.samples)
        out.update(label for s in family.samples for label in s.labels)
    return out


def exported(tmp_path: Path, shm_dir: str, live_server) -> set[str]:
    port = free_port()
    with CheckpointManager(tmp_path / "ckpt", memory_dir=shm_dir, metrics_port=port) as mgr:
        mgr.save(1, {"w": torch.ones(4)}).wait()
        mgr.restore({"w": torch.zeros(4)})
        found = names(scrape(f"http://127.0.0.1:{port}/metrics"))
    srv = live_server()
    job = requests.post(f"{srv.url}/v1/jobs", json={"nodes": ["node0042"], "name": "llama"},
                        headers=srv.headers("job"), timeout=HTTP_S)
    assert job.status_code == 201, job.text
    found |= names(scrape(f"{srv.url}/metrics"))
    src = SimSource(FleetConfig(nodes=1, node_names=("node0042",), interval_s=10, seed=2, days=None))
    exporter = Exporter(AgentStats(), Spool(str(tmp_path / "spool")), src.model_name)
    exporter.observe(src.read(), [{"timestamp": 0, "node": "node0042", "gpu": 3, "xid": 79}])
    try:
        found |= names(scrape(f"http://127.0.0.1:{exporter.serve(0)}/metrics"))
    finally:
        exporter.close()
    return found | dcgm_source_names(tmp_path)


def dcgm_source_names(tmp_path: Path) -> set[str]:
    """An agent's exporter over a dcgm-exporter source: one page with the default fields that
    loses a GPU, one URL that answers nothing (so every dcgm series has samples)."""
    page = FakeExporter(render("dgx-a", [gpu(0), gpu(1)]))
    src = DcgmExporterSource([page.url, f"http://127.0.0.1:{free_port()}/metrics"], timeout_s=2.0)
    exporter = Exporter(AgentStats(), None, src.model_name, shm=None, source_metrics=src.metrics)
    try:
        exporter.observe(src.read(), [])
        page.page = render("dgx-a", [gpu(0)])
        exporter.observe(src.read(), [])
        return names(scrape(f"http://127.0.0.1:{exporter.serve(0)}/metrics"))
    finally:
        exporter.close()
        src.close()
        page.stop()


def test_dashboard_is_valid_and_queries_metrics_the_services_export(tmp_path: Path, shm_dir: str,
                                                                     live_server) -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 25 and len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    known = exported(tmp_path, shm_dir, live_server)
    missing = {word: expr for expr in exprs
               for word in set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", re.sub(r"\[[^\]]*\]", "", expr))) - _FUNCS
               if word not in known}
    assert not missing, f"queried but exported by no running service: {missing}"


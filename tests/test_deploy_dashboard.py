"""The Grafana dashboard queries only metrics that our exporters really expose."""
from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "ckpt-guard.json"
_FUNCS = {"histogram_quantile", "sum", "rate", "increase", "max", "topk", "by", "le", "tier", "kind", "endpoint",
          "target", "outcome", "Hostname", "gpu"}


def exported_names() -> set[str]:
    """Metric names as the code declares them (counters gain _total, histograms _bucket)."""
    names = set()
    for py in [*(REPO / "ckpt").rglob("*.py"), *(REPO / "agents").rglob("*.py"), *(REPO / "predictor").rglob("*.py"),
               *(REPO / "telemetry").rglob("*.py")]:
        for name in re.findall(r'"((?:ckpt|predictor|DCGM_FI|ckpt_guard_agent)_[A-Za-z_]+)"', py.read_text()):
            names |= {name, f"{name}_total", f"{name}_bucket"}
    names |= {f"ckpt_guard_agent_{k}_total" for k in ("samples_sent", "samples_dropped")}
    return names


def test_dashboard_is_valid_and_queries_known_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15 and len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    known = exported_names()
    for expr in exprs:
        for word in set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", re.sub(r"\[[^\]]*\]", "", expr))) - _FUNCS:
            assert word in known, f"{word} in {expr!r} is exported by nothing"

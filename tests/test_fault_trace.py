"""A real fault history in the goodput simulator and the node ranking (issue 51): reading the
InfiniteHBD JSON and the CSV form, the replay of a job with spares worked by hand, the
Poisson fit beside it, spare sizing, drain evaluation, the quarantine's ranking hook, and
the node ranking that reads nothing at or after its day."""
from __future__ import annotations

import csv
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckpt.goodput.command import simulate_cmd
from ckpt.goodput.replay import PoissonFit, replay
from telemetry.faults import TraceError, classify, read_trace

HERE = Path(__file__).parent
SMALL = HERE / "data" / "faults_small.csv"
IHBD = HERE.parent.parent / "shared" / "data" / "ihbd-faults" / "fault_trace_to_day240.json"
needs_ihbd = pytest.mark.skipif(not IHBD.exists(), reason="shared InfiniteHBD trace not present (../shared/data)")


def test_the_csv_form_is_read_with_burn_in_folded_and_fault_free_nodes_kept() -> None:
    t = read_trace(SMALL)
    assert t.nodes == ["a", "b", "c", "d", "e", "f"] and t.days == 21.0 and t.raw_faults == 8
    assert [(o.start, o.end, o.cls) for o in t.outages["a"]] == [(1.0, 4.5, "gpu"), (20.0, 21.0, "host")]
    assert t.burn_in_merged == 1 and t.kinds == {"gpu": 4, "host": 1, "planned": 1, "test": 1}
    assert math.isinf(t.outages["b"][-1].end)  # still open
    assert [classify(k) for k in ("Stress Test Failure", "Change: Y-cables", "GPU: GPU SBE(Single Bit ECC) > X",
                                  "Power Supply: failed", "Unknown Error")] == ["test", "planned", "planned",
                                                                                "host", "gpu"]


def test_timestamps_and_bad_rows(tmp_path: Path) -> None:
    p = tmp_path / "ts.csv"
    p.write_text("node,start,end,kind\nx,2024-03-01T00:00:00,2024-03-02T12:00:00,GPU\nx,2024-03-11,,NIC\n")
    t = read_trace(p, fleet=4)
    assert [(o.start, o.end) for o in t.outages["x"]] == [(0.0, 1.5), (10.0, math.inf)] and len(t.nodes) == 4
    for body, words in (("node,start,end,kind\nx,5,4,GPU\n", ":2: the fault ends"),
                        ("node,begin\nx,1\n", "header must name"),
                        ("node,start,end,kind\nx,1,2024-01-01,GPU\n", "all days or all timestamps")):
        p.write_text(body)
        with pytest.raises(TraceError, match=words):
            read_trace(p)
    with pytest.raises(TraceError, match="smaller than"):
        read_trace(SMALL, fleet=3)


def test_a_job_with_one_spare_replayed_by_hand() -> None:
    """Job a,b with spare c: a fails (c joins), b fails (none left: short 2-4.5), c leaves for a
    planned change (short 5-6), c's stress test swaps in b, b fails (c joins), a's host goes
    down at 20 (short to 21)."""
    t = read_trace(SMALL)
    for mode, stopped in (("wait", 4.5), ("shrink", 0.0)):
        p = replay(t, ["a", "b"], ["c"], mode)
        assert p.interruptions == {"gpu": 3, "host": 1} and p.planned == 2
        assert (p.short_days, p.missing_node_days, p.stopped_days) == (4.5, 4.5, stopped)


def _simulate(*args: str) -> dict:
    out = CliRunner().invoke(simulate_cmd, ["--fault-trace", str(SMALL), "--json", *args])
    assert out.exit_code == 0, out.output
    return _strict(out.output)


def _strict(text: str) -> dict:
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))


def test_simulate_replays_beside_poisson_and_says_not_achievable(tmp_path: Path) -> None:
    place = tmp_path / "place.txt"
    place.write_text("a\nb\nc\n")
    res = _simulate("--placement", "fixed", "--place", str(place), "--job-nodes", "2", "--spares", "1",
                    "--placements", "20")
    real, fit = res["replay"]["trace"], res["replay"]["poisson"]
    assert real["interruptions"]["mean"] == 4 and real["short_days"]["mean"] == 4.5 and fit["replays"] == 20
    assert set(real["ettr"]) == set("abcdef") and all(0 < v["mean"] < 1 for v in real["ettr"].values())
    assert real["ettr"]["a"]["mean"] < real["ettr"]["f"]["mean"]
    assert res["trace"]["poisson"]["closed_repairs"] == 6
    res = _simulate("--job-nodes", "5", "--spares", "2")
    assert res["replay"] == {"achievable": False, "why": res["replay"]["why"]} and "not achievable" in \
        res["replay"]["why"]


def test_spare_sizing_plot_and_drains(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "s.png"
    res = _simulate("--job-nodes", "2", "--spares", "1", "--placements", "20", "--spare-sizing", "--sizes", "2,5",
                    "--resamples", "5", "--plot", str(png), "--quarantine-top", "1,2", "--quarantine-days", "7")
    two, five = res["spare_sizing"]["sizes"]
    assert two["achievable"] and 0 <= two["spares"] <= 4 and two["full_size_share"] >= 0.99
    assert not five["achievable"]  # 5 nodes, and some always down: no pool on 6 nodes keeps it whole
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert res["quarantine"]["settings"] == [] and res["quarantine"]["supported"] is None  # 21 days: no window


def _synthetic(path: Path, seed: int = 1, nodes: int = 40, days: float = 150.0, declare: bool = True) -> None:
    """A history with a few lemons: nodes fault at different rates, repairs of 0.5-6 days."""
    rng = random.Random(seed)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["node", "start", "end", "kind"])
        for n in range(nodes):
            rate, t = (1 / 10 if n < 5 else 1 / 60), 0.0
            if declare:
                w.writerow([f"n{n}", "", "", ""])
            while (t := t + rng.expovariate(rate)) < days:
                end = t + rng.uniform(0.5, 6)
                w.writerow([f"n{n}", f"{t:.3f}", f"{end:.3f}" if end < days else "", rng.choice(["GPU", "NIC"])])
                t = end


def test_quarantine_sweep_on_a_history_with_lemons(tmp_path: Path) -> None:
    p = tmp_path / "h.csv"
    _synthetic(p)
    out = CliRunner().invoke(simulate_cmd, ["--fault-trace", str(p), "--json", "--job-nodes", "10", "--spares", "2",
                                            "--placements", "10", "--quarantine-top", "5", "--quarantine-days", "14"])
    assert out.exit_code == 0, out.output
    row = _strict(out.output)["quarantine"]["settings"][0]
    assert row["windows"] == 6 and row["avoided"] > row["random"]  # the lemons are found from their past


def test_poisson_fit_matches_the_trace_rate() -> None:
    t = read_trace(SMALL)
    fit = PoissonFit.of(t)
    assert fit.class_share == {"gpu": 4 / 7, "host": 1 / 7, "planned": 1 / 7, "test": 1 / 7}
    s = fit.sample([f"x{i}" for i in range(300)], 100.0, random.Random(0))
    starts = sum(len(v) for v in s.outages.values())
    assert 0.7 < starts / (300 * 100 * fit.rate_per_node_day) < 1.1  # fewer: nodes are down part of the time


def test_node_ranking_reads_nothing_at_or_after_its_day(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    from predictor.hazard.node_risk import rank
    p, q = tmp_path / "h.csv", tmp_path / "poisoned.csv"
    _synthetic(p)
    rows = list(csv.reader(p.open()))
    poisoned = [rows[0]]
    for r in rows[1:]:
        if r[1] and float(r[1]) >= 60:
            r = [r[0], str(float(r[1]) + 0.5), "", "Power Supply"]  # moved, left open, another kind
        elif r[2] and float(r[2]) >= 60:
            r = [*r[:2], "149", r[3]]  # its repair, after the day, changed
        poisoned.append(r)
    poisoned += [["n7", str(60 + i), str(61 + i), "GPU"] for i in range(0, 80, 2)] + [["new", "70", "", "GPU"]]
    csv.writer(q.open("w", newline="")).writerows(poisoned)
    a, b = rank(read_trace(p), 60.0, 14.0), rank(read_trace(q, days=150.0), 60.0, 14.0)
    named = {n: x for n, x in zip(a.nodes, a.probability)}
    assert named == {n: x for n, x in zip(b.nodes, b.probability) if n != "new"}
    assert a.absent_probability == b.absent_probability < max(a.probability)
    lemons = [named[f"n{i}"] for i in range(5)]
    assert sum(lemons) / 5 > sum(named.values()) / len(named)  # the lemons rank above the fleet on average


def test_evaluation_judges_the_whole_fleet_nodes_first_named_later_included(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    from predictor.hazard.node_eval import evaluate
    p = tmp_path / "h.csv"
    _synthetic(p, declare=False)
    t = read_trace(p)
    split = evaluate(t, [60.0], 14.0, resamples=10)["splits"][0]
    later = [n for n in t.nodes if min(f.start for f in t.faults[n]) >= 60]
    assert later and split["nodes"] == len(t.nodes)
    assert split["faulted"] == sum(any(60 <= f.start < 74 for f in t.faults[n]) for n in t.nodes)


def test_nodes_rank_cli_and_the_quarantine_hook(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    from predictor.cli import main as predictor
    p, scores, fleet = tmp_path / "h.csv", tmp_path / "s.csv", tmp_path / "fleet.txt"
    _synthetic(p)
    fleet.write_text("n0\nnever-seen\n")
    out = CliRunner().invoke(predictor, ["nodes", "rank", "--faults", str(p), "--at", "100", "--horizon-days", "14",
                                         "--out", str(scores), "--nodes", str(fleet), "--json"])
    assert out.exit_code == 0, out.output
    summary = json.loads(out.output)
    rows = list(csv.DictReader(scores.open()))
    assert list(rows[0]) == ["node_id", "probability"] and len(rows) == 41
    assert rows[-1] == {"node_id": "never-seen", "probability": f"{summary['absent_node_probability']:.6f}"}
    out = CliRunner().invoke(predictor, ["nodes", "drain", "--scores", str(scores), "--top", "3", "--json"])
    assert [d["node"] for d in json.loads(out.output)["nodes"]] == [r["node_id"] for r in rows[:3]]
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    check = [sys.executable, "-m", "ckpt.quarantine", "check", "--record", str(tmp_path / "q.json"), "--ranking",
             str(scores), "--top", "3", "--node"]
    assert subprocess.run([*check, rows[0]["node_id"]], env=env, capture_output=True).returncode == 88
    assert subprocess.run([*check, rows[-1]["node_id"]], env=env, capture_output=True).returncode == 0
    bad = CliRunner().invoke(predictor, ["nodes", "rank", "--faults", str(p), "--at", "10", "--out", str(scores)])
    assert bad.exit_code == 2 and "too short" in bad.output


@needs_ihbd
def test_the_infinitehbd_trace() -> None:
    t = read_trace(IHBD)
    assert t.raw_faults == 381 and len(t.nodes) == 400 and len(t.named_nodes) == 184
    assert sum(math.isinf(o.end) for os_ in t.faults.values() for o in os_) == 10
    assert t.kinds["test"] + t.burn_in_merged == 64  # every stress test: on its own, or a repair's burn-in
    p = replay(t, t.nodes[:128], t.nodes[128:136])
    assert p.interrupted > 0 and 0 < p.full_share <= 1

"""Restart timing (ckpt/recovery/restarts.py): records of the failing generation in a node's file,
marks of the new one, phases that add up; a lost node's missing records merge phases."""
from __future__ import annotations

import json
from pathlib import Path

from ckpt.recovery.restarts import PHASES, RestartRecorder, previous_records, summarize


def test_phases_add_up_from_the_records_of_every_node(tmp_path: Path) -> None:
    files = [tmp_path / "node0.jsonl", tmp_path / "node1.jsonl"]
    old = [RestartRecorder(f, "inc-old", r, f"node{r}") for r, f in enumerate(files)]
    RestartRecorder(files[0], "inc-older", 0, "node0").fault("an earlier restart", 1.0)
    old[0].fault("hang: frozen: rank 1 on node node1", 90.0, ["node1"])
    old[0].left()
    old[0].left(rank=1)  # SIGKILLed by rank 0
    records = [r for f in files for r in previous_records(f)]
    assert {r["inc"] for r in records} == {"inc-old"}, "only the newest generation's records count"
    t = {r["ev"]: r for r in records}
    detected, exited = t["fault"]["detected"], max(r["t"] for r in records if r["ev"] == "exit")
    marks = [{"started": exited + 1, "pg_init_start": exited + 3, "pg_init_done": exited + 3.5,
              "restore_start": exited + 5, "restore_done": exited + 5.25},
             {"started": exited + 2, "pg_init_start": exited + 3, "pg_init_done": exited + 3.5}]
    out = summarize(records, marks, first_step_t=exited + 6)
    assert out["cause"].startswith("hang: frozen") and out["culprit_nodes"] == ["node1"]
    assert out["detect_s"] == round(detected - 90.0, 3)
    assert (out["agent_s"], out["relaunch_s"], out["startup_s"], out["pg_init_s"], out["setup_s"], out["restore_s"],
            out["first_step_s"]) == (None, 2.0, 1.0, 0.5, 1.5, 0.25, 0.75)  # the slowest rank's marks
    phases = sum(out[f"{p}_s"] for p in PHASES if out[f"{p}_s"] is not None)
    assert abs(phases - out["total_s"]) < 0.01
    marks[1]["agent_started"] = exited + 1.5  # node 1's agent is a replacement, started after the fault
    marks[0]["agent_started"] = 5.0  # node 0's survived it
    out = summarize(records, marks, first_step_t=exited + 6)
    assert (out["agent_s"], out["relaunch_s"]) == (1.5, 0.5), "the replacement agent's start is its own phase"
    json.dumps(out)  # one log line


def test_without_records_the_known_phases_remain(tmp_path: Path) -> None:
    out = summarize([], [{"started": 10.0, "pg_init_start": 12.0, "pg_init_done": 12.5}], first_step_t=14.0)
    assert out["cause"].startswith("unknown") and out["total_s"] is None
    assert (out["detect_s"], out["relaunch_s"], out["startup_s"], out["pg_init_s"]) == (None, None, 2.0, 0.5)
    assert out["first_step_s"] == 1.5  # setup and restore unknown: merged into the first step

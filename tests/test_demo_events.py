"""The demo prints its story's events live, each once, as the job logs them, and explains
every figure of its summary."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from examples.demo import EXPLAINED, report
from examples.demo_events import collect_alarm, collect_restore, failure_gate, object_store_steps
from examples.demo_procs import Run, leaves_no_shm, log_time


def test_alarm_and_urgent_save_are_reported_once_as_they_appear(tmp_path: Path) -> None:
    run = Run("in-process", tmp_path)
    log = tmp_path / "node1.log"
    log.write_text("2026-11-23 10:00:01,250 node1 w1 training from step 0\n")
    assert collect_alarm(run) == []
    with log.open("a") as f:
        f.write("2026-11-23 10:01:10,700 node1 w1 predictor: node node1 at risk (PCIe replay ramp); requested an "
                "urgent checkpoint\n")
    assert [e for e, _ in collect_alarm(run)] == ["alarm"]
    (tmp_path / "node0.log").write_text(  # every rank logs its urgent save: the first one counts
        "2026-11-23 10:01:11,300 node0 w0 urgent checkpoint of step 123 durable in every tier 0.50 s after save() "
        "(object 0.30 s, disk 0.38 s, peer 0.50 s)\n")
    with log.open("a") as f:
        f.write("2026-11-23 10:01:10,900 node1 w1 urgent checkpoint of step 123 durable in every tier 0.18 s after "
                "save() (peer 0.04 s, disk 0.05 s, object 0.18 s)\n")
    (event, text), = collect_alarm(run)
    assert event == "urgent_durable" and "step 123" in text and run.events["urgent_step"] == 123
    assert "peer 0.04 s, object 0.18 s" in text  # off-node: the evacuated replica and the object store
    assert collect_alarm(run) == []
    assert abs(run.events["urgent_durable"] - run.events["alarm"] - 0.2) < 1e-6


def test_the_spares_restore_from_a_peer_is_read_from_its_log(tmp_path: Path) -> None:
    run = Run("in-process", tmp_path)
    failure = log_time("2026-11-23 10:03:00,000")
    log = ("2026-11-23 10:01:00,100 node2 w2 rank 1 restored step 10 (shard 1 from memory) in 0.10 s\n"  # before
           "2026-11-23 10:03:00,100 node2 w2 rank 1 (node node2) replicates to rank 0 (node node0)\n")
    assert not collect_restore(run, log, 1, failure)
    log += ("2026-11-23 10:03:00,400 node2 w2 rank 1 restored step 270 (shard 1 from remote-peer) in 0.31 s\n"
            "2026-11-23 10:03:00,400 node2 w2 rank 1 restored its shard of step 270 from rank 0's replica (node "
            "node0) in 0.03 s; unprotected (one copy, on node node0) until re-replicated\n")
    assert collect_restore(run, log, 1, failure)
    e = run.events
    assert (e["restored_step"], e["restore_s"], e["restore_from"]) == (270, 0.31, "a peer replica in node0's memory")


def test_a_relaunchs_restore_from_the_object_store_is_named_so(tmp_path: Path) -> None:
    run = Run("relaunch", tmp_path)
    log = ("2026-11-23 10:03:05,000 node-b w0 rank 0 restored step 240 (shard 0 from object, shard 1 from object) "
           "in 0.41 s\n")
    assert collect_restore(run, log, 0, log_time("2026-11-23 10:03:00,000"))
    assert (run.events["restored_step"], run.events["restore_from"]) == (240, "the object store")


def test_every_figure_of_the_summary_is_explained(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = Run("in-process", tmp_path)
    run.events.update(start=0.0, alarm=80.0, urgent_durable=81.0, urgent_step=150, failure=190.0, last_step=355,
                      restore_done=190.6, restored_step=354, restore_from="a peer replica in node0's memory",
                      restore_sources="shard 1 from remote-peer", restore_s=0.3, first_resumed_step=191.0,
                      recovery_total_s=0.9, world_size=2)
    out = report([run], argparse.Namespace(step_time=0.5))
    printed = capsys.readouterr().out
    assert out["in-process"]["lost_steps"] == 1 and out["in-process"]["failure_to_first_resumed_step_s"] == 1.0
    assert "failure to first resumed step: 1.00 s   (from the SIGKILL" in printed and "steps lost: 1   (" in printed
    assert all(f"  {k}: " in printed for k in EXPLAINED) and set(EXPLAINED) <= set(run.events)


def test_the_node_fails_only_once_the_job_has_what_the_story_needs(tmp_path: Path) -> None:
    """A slow start puts the scheduled failure before the first checkpoint: the demo waits
    for it rather than failing a node that has nothing to restore."""
    periodic = Run("relaunch", tmp_path)
    for with_predictor in (True, False):  # both fail at one step, past the first periodic checkpoint
        assert failure_gate(periodic, with_predictor, [], False, 120, 120).startswith("a periodic checkpoint behind")
    assert failure_gate(periodic, False, [], False, 500, 120) == "a checkpoint in the object store"
    assert failure_gate(periodic, False, [120], False, 500, 120) is None
    predicted = Run("in-process", tmp_path)
    assert failure_gate(predicted, True, [120], False, 500, 120) == "the urgent checkpoint to be durable off-node"
    predicted.events["urgent_durable"] = 1.0
    assert failure_gate(predicted, True, [], False, 500, 120) is None  # durable off-node means in the object store too
    no_alarm = Run("in-process", tmp_path)  # the alarm never came: fail once a periodic checkpoint is there
    assert failure_gate(no_alarm, True, [], True, 500, 120) == "a checkpoint in the object store"
    assert failure_gate(no_alarm, True, [120], True, 500, 120) is None


def test_an_object_store_not_written_yet_holds_no_steps(tmp_path: Path) -> None:
    args = argparse.Namespace(object_store_for=lambda run: f"file://{tmp_path}/{run.name}/objstore")
    assert object_store_steps(Run("relaunch", tmp_path), args) == []


def test_the_demo_ends_failing_loudly_on_shared_memory_it_left(tmp_path: Path) -> None:
    node = tmp_path / "ckpt-demo-in-process-node0-x"
    node.mkdir()
    args = argparse.Namespace(workdir=str(tmp_path / "work"), memory_dirs=[node])
    with pytest.raises(SystemExit, match="left 1 shared-memory dir.*node0"):
        leaves_no_shm(args)
    node.rmdir()
    leaves_no_shm(args)  # nothing left: it says so and returns

"""The demo prints its story's events live, each once, as the job logs them."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from examples.demo import Run, collect_alarm, collect_peer_restore, failure_gate, leaves_no_shm, object_store_steps


def test_alarm_and_urgent_save_are_reported_once_as_they_appear(tmp_path: Path) -> None:
    run = Run("with-predictor", tmp_path)
    log = tmp_path / "train.log"
    log.write_text("2026-11-23 10:00:01,250 rank0 training from step 0\n")
    assert collect_alarm(run) == []
    with log.open("a") as f:
        f.write("2026-11-23 10:01:10,700 rank0 predictor: node n1 at risk (PCIe replay ramp); requested an urgent "
                "checkpoint\n")
    assert [e for e, _ in collect_alarm(run)] == ["alarm"]
    with log.open("a") as f:
        f.write("2026-11-23 10:01:10,900 rank0 urgent checkpoint of step 123 durable in every tier 0.18 s after "
                "save() (peer 0.04 s, disk 0.05 s, object 0.18 s)\n")
    (event, text), = collect_alarm(run)
    assert event == "urgent_durable" and "step 123" in text and run.events["urgent_step"] == 123
    assert "peer 0.04 s, object 0.18 s" in text  # off-node: the evacuated replica and the object store
    assert collect_alarm(run) == []
    assert abs(run.events["urgent_durable"] - run.events["alarm"] - 0.2) < 1e-6


def test_the_replacement_nodes_restore_from_a_peer_is_read_from_its_log(tmp_path: Path) -> None:
    run = Run("with-predictor", tmp_path)
    log = tmp_path / "replacement.log"
    log.write_text("2026-11-23 10:03:00,100 rank1 rank 1 (node node2) replicates to rank 0 (node node0)\n")
    assert not collect_peer_restore(run)
    with log.open("a") as f:
        f.write("2026-11-23 10:03:00,400 rank1 rank 1 restored step 270 (shard 1 from remote-peer) in 0.31 s\n"
                "2026-11-23 10:03:00,400 rank1 rank 1 restored its shard of step 270 from rank 0's replica (node "
                "node0) in 0.03 s; unprotected (one copy, on node node0) until re-replicated\n")
    assert collect_peer_restore(run)
    e = run.events
    assert (e["restored_step"], e["restore_s"], e["restore_from"]) == (270, 0.31, "a peer replica in node0's memory")


def test_the_node_fails_only_once_the_job_has_what_the_story_needs(tmp_path: Path) -> None:
    """A slow start puts the scheduled failure before the first checkpoint: the demo waits
    for it rather than failing a node that has nothing to restore."""
    periodic = Run("periodic-only", tmp_path)
    assert failure_gate(periodic, False, [], late=False) == "a checkpoint in the object store"
    assert failure_gate(periodic, False, [120], late=False) is None
    predicted = Run("with-predictor", tmp_path)
    assert failure_gate(predicted, True, [120], late=False) == "the urgent checkpoint to be durable off-node"
    predicted.events["urgent_durable"] = 1.0
    assert failure_gate(predicted, True, [], late=False) is None  # durable off-node means in the object store too
    no_alarm = Run("with-predictor", tmp_path)  # the alarm never came: fail once a periodic checkpoint is there
    assert failure_gate(no_alarm, True, [], late=True) == "a checkpoint in the object store"
    assert failure_gate(no_alarm, True, [120], late=True) is None


def test_an_object_store_not_written_yet_holds_no_steps(tmp_path: Path) -> None:
    args = argparse.Namespace(object_store_for=lambda run: f"file://{tmp_path}/{run.name}/objstore")
    assert object_store_steps(Run("periodic-only", tmp_path), args) == []


def test_the_demo_ends_failing_loudly_on_shared_memory_it_left(tmp_path: Path) -> None:
    node = tmp_path / "ckpt-demo-with-predictor-node0-x"
    node.mkdir()
    args = argparse.Namespace(workdir=str(tmp_path / "work"), memory_dirs=[node])
    with pytest.raises(SystemExit, match="left 1 shared-memory dir.*node0"):
        leaves_no_shm(args)
    node.rmdir()
    leaves_no_shm(args)  # nothing left: it says so and returns

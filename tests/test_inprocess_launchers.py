"""One script, either launcher: tests/inprocess_child.py (written for ``ckpt.inprocess.run``)
runs unchanged under plain torchrun, where a killed rank costs a relaunch that restores from
memory, and ``python -m ckpt.inprocess.launch`` takes torchrun's flags for what they share."""
from __future__ import annotations

import pytest

from ckpt.inprocess.launch import parse
from tests.integration_helpers import torchrun
from tests.test_inprocess import CHILD, KILL_AT, STEPS, events, finals, launch

TORCHRUN_STYLE = ("--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                  "127.0.0.1:0", "--max-restarts", "1")


@pytest.mark.timeout(600)
def test_the_same_script_under_torchrun_and_under_the_launcher_with_torchruns_flags(tmp_path):
    """Under torchrun (2 ranks, --max-restarts 1) rank 1 is SIGKILLed at step 4: torchrun
    restarts both, each restores the newest step from node memory, and the run ends bitwise
    equal to a clean run of the same script under our launcher started with torchrun's flags
    (one word changed), which itself replaces a killed rank in process."""
    log = torchrun(CHILD, "--root", str(tmp_path / "t"), "--events", str(tmp_path / "t.jsonl"), "--steps", str(STEPS),
                   "--kill-worker", "1", "--kill-at", str(KILL_AT), restarts=1)
    assert log.count("in-process recovery needs that launcher") == 1, log[-3000:]
    assert "KeyError" not in log, log[-3000:]
    evs = events(tmp_path / "t.jsonl")
    recs = [e for e in evs if e["event"] == "recovery"]
    assert {r["worker"] for r in recs} == {0, 1} and all(r["reason"].startswith("relaunched by torchrun") for r in recs)
    assert {r["restored_step"] for r in recs} == {KILL_AT}, recs
    assert f"restored step {KILL_AT} (shard 0 from memory" in log, log[-3000:]
    assert {w: e["steps"] for w, e in finals(evs).items()} == {0: STEPS, 1: STEPS}

    inproc = launch(tmp_path / "i", tmp_path / "i.jsonl", *TORCHRUN_STYLE, "--spares", "1",
                    child=("--steps", str(STEPS), "--kill-worker", "1", "--kill-at", str(KILL_AT)))
    assert "spare 2 takes rank 1" in inproc and "attempt 1" not in inproc, inproc[-3000:]
    launch(tmp_path / "clean", tmp_path / "clean.jsonl", *TORCHRUN_STYLE, child=("--steps", str(STEPS)))
    clean = {e["digest"] for e in finals(events(tmp_path / "clean.jsonl")).values()}
    assert len(clean) == 1
    assert {e["digest"] for e in finals(evs).values()} == clean
    assert {e["digest"] for e in finals(events(tmp_path / "i.jsonl")).values()} == clean


def test_torchrun_flags_are_taken_and_what_is_not_shared_is_refused_by_name(capsys):
    args = parse(["--nnodes", "2", "--nproc_per_node", "4", "--rdzv-endpoint", "h1:29500", "--node-rank", "1",
                  "--max-restarts", "3", "train.py", "--lr", "1"])
    assert (args.nodes, args.nproc, args.master_addr, args.master_port, args.node_rank, args.relaunches) == \
        (2, 4, "h1", 29500, 1, 3)
    assert args.command == ["train.py", "--lr", "1"]
    args = parse(["--nnodes=2", "--nproc-per-node=2", "--master_addr", "h2", "--master_port", "7", "train.py"])
    assert (args.master_addr, args.master_port) == ("h2", 7)
    for argv, said in [(["--nnodes", "1:4"], "elastic --nnodes 1:4 is not supported"),
                       (["--nproc-per-node", "gpu"], "--nproc-per-node gpu is not supported"),
                       (["--rdzv-backend", "etcd"], "invalid choice: 'etcd'"),
                       (["--max-nodes", "4"], "torchrun's --max-nodes is not supported"),
                       (["--no-python"], "torchrun's --no-python is not supported")]:
        with pytest.raises(SystemExit):
            parse([*argv, *(["--nproc", "2"] if "gpu" not in argv else []), "train.py"])
        err = capsys.readouterr().err.strip().splitlines()
        assert said in err[-1], err

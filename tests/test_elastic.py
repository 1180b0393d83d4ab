"""Elastic torchrun (issue 18): a job on two simulated nodes (``--nnodes=1:2``) loses one and
continues on the other from the newest checkpoint, resharded from 2 ranks to 1; and the
data sampler's position re-split over a new world size."""
from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

from ckpt.integrations.data import ResumableSampler
from ckpt.tiers.local import LocalDiskTier
from tests.integration_helpers import REPO, finish_nodes, kill_node, start_node
from tests.procs import free_port, wait_for

SCRIPT = REPO / "examples" / "train_elastic.py"


def test_a_lost_node_and_the_job_goes_on_with_the_other(tmp_path: Path) -> None:
    root, out, port = tmp_path / "shared", tmp_path / "steps.jsonl", free_port()
    shms = [tempfile.mkdtemp(prefix=f"ckpt-elastic-{i}-", dir="/dev/shm") for i in range(2)]
    try:
        nodes = [start_node(SCRIPT, i, "1:2", port, ["--root", str(root), "--memory-dir", shms[i], "--steps", "24",
                                                    "--every", "4", "--step-time", "0.3", "--out", str(out)],
                            restarts=2, rdzv_conf="last_call_timeout=2") for i in range(2)]
        tier = LocalDiskTier(root)
        assert wait_for(lambda: root.exists() and any(i.id.step >= 8 for i in tier.list()), timeout=240), \
            "no checkpoint of step 8"
        kill_node(nodes[1])
        log = finish_nodes(nodes[:1], timeout=300)[0]
    finally:
        for d in shms:
            shutil.rmtree(d, ignore_errors=True)
    found = re.search(r"rank 0 resharded step (\d+) from 2 ranks", log)
    assert found, log[-4000:]
    resumed = int(found.group(1))
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    after = [x for x in lines if x["world"] == 1]
    assert [x["step"] for x in after] == list(range(resumed + 1, 25)), lines
    assert {x["world"] for x in lines if x["step"] <= resumed} == {2}


def test_the_sampler_position_is_split_over_a_new_world_size() -> None:
    data = list(range(40))
    old = [ResumableSampler(data, seed=1, rank=r, world_size=4) for r in range(4)]
    seen = [i for s in old for _, i in zip(range(3), s)]  # each rank took 3 samples
    saved = old[0].state_dict()
    assert saved == {"epoch": 0, "consumed": 3, "start": 0, "world_size": 4}
    new = [ResumableSampler(data, seed=1, rank=r, world_size=3) for r in range(3)]
    for s in new:
        s.load_state_dict(saved)
    rest = [i for s in new for i in s]
    assert sorted(seen + rest) == sorted(set(seen + rest)) and len(rest) == 27  # 28 left: 9 per rank, 1 dropped
    assert [s.state_dict()["start"] for s in new] == [12] * 3
    assert [len(list(s)) for s in new] == [13] * 3  # the next epoch is whole again

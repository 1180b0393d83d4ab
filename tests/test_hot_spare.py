"""A hot spare under torchrun: the job runs on two simulated nodes (``--nnodes=2``) and a
third agent, started while it trains, stands by. torch's dynamic rendezvous keeps an
agent that arrives when the round is full in its redundancy list (alive, heartbeating,
not counted as a node waiting, so the job does not restart for it) and lets it join the
next round once a participant is gone. Node 1 is lost (agent and worker SIGKILLed by
pid, its memory and disk deleted): the job goes on on node 0 and the spare, no new
agent started, the spare's rank restores node 1's shard from node 0's replica, and the
run ends bitwise equal to an uninterrupted one. This is what ``ckpt simulate
--replace-s 0`` stands for (docs/research/goodput-model.md, the wait for a spare).

torch numbers the nodes of a round in the order of their addresses (then agent pids), so
the spare's address decides its rank: placed after node 0, it takes the lost node's
rank; placed before, it takes rank 0 and node 0 becomes rank 1 (on a cluster, a spare
whose host name sorts first). Then node 0 restores rank 1's shard from the replica it
holds, and the spare fetches rank 0's from node 0's own memory slot, left there under
its old number (``NodeMemoryTier``; before it, the restore refused)."""
from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from ckpt.tiers.peer import PeerTier, replica_namespace
from tests.integration_helpers import REPLACEABLE, finish_nodes, kill_node, rendezvous_state, start_node
from tests.procs import free_port, wait_for
from tests.session_cache import CleanRuns
from tests.test_peer_multinode import SCRIPT, clean_digests, digests, node_args

# a lost agent leaves the rendezvous after 3 missed heartbeats: 1 s apart here, not torch's 5 s
RDZV_CONF = "keep_alive_interval=1,keep_alive_max_attempt=3"


@pytest.fixture
def shm():
    """Each simulated node's shared-memory directory (removed at the end, whatever is left)."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(tempfile.TemporaryDirectory(prefix=f"ckpt-spare-node{i}-", dir="/dev/shm",
                                                               ignore_cleanup_errors=True)) for i in range(3)]


def standing_by(port: int) -> bool:
    """The round is full, and one more agent is registered, waiting outside it."""
    state = rendezvous_state(port)
    return bool(state and state.complete and len(state.participants) == 2 and len(state.redundancy_list) == 1)


@pytest.mark.parametrize("addrs", [pytest.param(("127.0.0.1", "127.0.0.2", "127.0.0.3"), id="spare-sorts-last"),
                                   pytest.param(("127.0.0.2", "127.0.0.3", "127.0.0.1"), id="spare-sorts-first",
                                                marks=pytest.mark.extended)])
def test_a_hot_spare_takes_a_lost_nodes_place_and_the_job_ends_bitwise_equal(tmp_path: Path, shm: list[str],
                                                                              addrs: tuple[str, ...],
                                                                              clean_runs: CleanRuns) -> None:
    port = free_port()
    args = [node_args(tmp_path, "lost", shm, i, 0.3) for i in range(3)]
    spare_rank = 1 if addrs[2] > addrs[0] else 0

    def node(i: int) -> subprocess.Popen:
        return start_node(SCRIPT, i, 2, port, args[i], restarts=2, env=REPLACEABLE, rdzv_conf=RDZV_CONF,
                          local_addr=addrs[i])

    started = [node(0), node(1)]
    node0, node1 = started
    try:
        assert wait_for(lambda: (s := rendezvous_state(port)) is not None and s.complete, timeout=120), \
            "the first round never completed"
        spare = node(2)
        started.append(spare)
        assert wait_for(lambda: standing_by(port), timeout=120), "the third agent is not standing by"
        held = PeerTier(replica_namespace(str(Path(args[0][0]).resolve()), "default", shm[0]))
        assert wait_for(lambda: any(1 in i.ranks and i.id.step >= 15 for i in held.list()), timeout=120), \
            "node 0 never held a replica of rank 1"
        assert standing_by(port), "the job restarted for the spare before any fault"
        kill_node(node1)
        shutil.rmtree(shm[1])
        shutil.rmtree(args[1][0])
    except BaseException:
        for proc in started:
            kill_node(proc)
        raise
    log0, log2 = finish_nodes([node0, spare], timeout=300)

    if spare_rank == 1:  # the lost node's rank: its shard from node 0's replica of it
        found = re.search(r"rank 1 restored its shard of step (\d+) from rank 0's replica \(node node0\)", log2)
        assert found and int(found.group(1)) >= 15, log2[-4000:]
        assert re.search(rf"rank 0 restored step {found.group(1)} .*shard 0 from memory", log0), log0[-4000:]
    else:  # node 0 is rank 1 now: rank 1's shard from the replica it holds, rank 0's old slot fetched by the spare
        found = re.search(r"rank 0 restored its shard of step (\d+) from rank 1's replica \(node node0\)", log2)
        assert found and int(found.group(1)) >= 15, log2[-4000:]
        assert re.search(rf"rank 1 restored step {found.group(1)} .*shard 1 from peer", log0), log0[-4000:]
    assert digests(tmp_path, "lost", 2) == clean_digests(clean_runs, 1), "the job diverged after losing node 1"

"""Every torchrun round gets a store of its own (ckpt.recovery.process_group): ranks find this
round's, past an address an earlier round left in the job's store, whatever their
restart counts (which torchrun does not agree across nodes)."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from ckpt.recovery.process_group import round_store
from tests.procs import free_port


def test_ranks_meet_on_this_rounds_store_past_a_stale_address(monkeypatch) -> None:
    port = free_port()
    job = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=20))
    job.set("ckpt-guard/round-store", f"127.0.0.1 {free_port()} token-of-a-dead-round")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    stores: dict[int, dist.Store] = {}

    def rank(r: int) -> None:
        store = round_store(r, 3, timedelta(seconds=20))
        store.set(f"hello/{r}", str(r))
        stores[r] = store

    late_rank0 = [threading.Thread(target=rank, args=(r,)) for r in (1, 2)]
    for t in late_rank0:
        t.start()
    time.sleep(1.0)  # the others read the stale address first, as after a restart
    rank(0)
    for t in late_rank0:
        t.join(30)
    assert sorted(stores) == [0, 1, 2]
    for r, store in stores.items():
        store.wait([f"hello/{o}" for o in range(3)], timedelta(seconds=10))
        assert [store.get(f"hello/{o}").decode() for o in range(3)] == ["0", "1", "2"], r
    del job


def test_a_finished_rank_exits_with_its_output_flushed() -> None:
    """exit_rank skips the interpreter's teardown (where gloo can abort), not what was printed."""
    script = ("import logging, torch.distributed as dist\n"
              "from ckpt.distributed import exit_rank\n"
              "logging.basicConfig(level=logging.INFO)\n"
              "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
              "print('trained', end='')\n"
              "logging.info('closing')\n"
              "exit_rank(3)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "trained" and "closing" in done.stderr

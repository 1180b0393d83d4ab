"""Workers of one torchrun round agree on its namespace through a real TCPStore, whatever
their restart counts, past stale join entries of a round whose rank 0 is gone."""
from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from ckpt.worker_round import agree_round
from tests.procs import free_port


@pytest.fixture
def server():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    yield lambda timeout=10: dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout))
    del master


def one_round(connect, world: int) -> list[str]:
    tokens: list[str] = [""] * world
    group_up = threading.Barrier(world)  # what init_process_group is: every rank has joined

    def worker(rank: int) -> None:
        token, done = agree_round(connect, connect(), rank)
        tokens[rank] = token
        group_up.wait()
        done()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return tokens


def test_every_worker_of_a_round_gets_its_rank0s_token_past_stale_joins(server) -> None:
    stale = threading.Thread(target=lambda: pytest.raises(Exception, agree_round, server, server(timeout=1), 1))
    stale.start()  # a worker of a round whose rank 0 died: its join entry stays unanswered
    stale.join()
    first = one_round(server, 3)
    second = one_round(server, 3)
    assert len(set(first)) == 1 and len(set(second)) == 1 and first[0] != second[0] and first[0]

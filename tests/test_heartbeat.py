"""Beats aggregated per node (ckpt/recovery/heartbeat.py): the job's store sees one write per
node per interval and one "failed" check per node per poll, however many ranks a node
runs, counted on a real TCPStore (no timing); a hung rank is still named by rank, and a
stopped aggregator is replaced by the next rank of its node."""
from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from ckpt.recovery.heartbeat import STALE_BEATS, NodeBeats
from ckpt.recovery.watchdog import EXIT_NODE_FAILED, HangDetection, Watchdog

NODES, PER_NODE = 2, 4
OPTS = HangDetection(interval_s=0.5, poll_s=0.05, warmup_steps=0, deadline_s=60.0)  # beats stay fresh under load


class CountingStore:
    """A real store client that counts the operations made through it."""

    def __init__(self, inner: dist.Store, ops: Counter) -> None:
        self._inner, self._ops = inner, ops

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)

        def counted(*args, **kwargs):
            self._ops[name] += 1
            return attr(*args, **kwargs)
        return counted


@pytest.fixture
def job(tmp_path: Path) -> Iterator[tuple[list[Watchdog], Counter, list[int]]]:
    """Eight ranks on two simulated nodes, each a watchdog whose thread is driven by hand."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    ops: Counter = Counter()
    local, port = threading.local(), server.port

    def client() -> CountingStore:
        if not hasattr(local, "store"):
            local.store = CountingStore(dist.PrefixStore("t", dist.TCPStore(
                "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))), ops)
        return local.store

    exits: list[int] = []
    world = NODES * PER_NODE
    nodes = [f"node{r // PER_NODE}" for r in range(world)]
    dogs = [Watchdog(client, NodeBeats(client, tmp_path, r, nodes[r], nodes, OPTS.interval_s), r, world, OPTS,
                     exit=exits.append) for r in range(world)]
    yield dogs, ops, exits
    assert server.num_keys() >= 0  # the server lived until here


def turn(dogs: list[Watchdog], now: float, frozen: tuple[int, ...] = ()) -> None:
    """Every rank but the ``frozen`` ones reaches a boundary, then its watchdog takes a turn."""
    for dog in dogs:
        if dog.rank not in frozen:
            dog.boundary()
            dog.tick(now)


def test_one_store_write_per_node_per_interval(job) -> None:
    dogs, ops, _ = job
    now = time.monotonic()
    for _ in range(10):  # each turn exactly one interval on: t0 + i * interval can round below the next beat
        turn(dogs, now)
        now += OPTS.interval_s
    assert ops["set"] == NODES * 10, ops  # not 8 ranks x 10
    assert ops["check"] <= NODES * 10, ops  # the "failed" key: polled by each node's aggregator only
    assert [d.rank for d in dogs if d.beats.aggregating] == [0, PER_NODE]


def test_a_frozen_rank_is_named_by_rank_and_its_node_gets_a_new_aggregator(job, tmp_path: Path) -> None:
    dogs, ops, _ = job
    beats = dogs[0].beats  # an observer that reads the nodes' keys, as a stalled rank does
    observer = Watchdog(beats._store, NodeBeats(beats._store, tmp_path / "observer", 0, "elsewhere", beats.nodes,
                                                OPTS.interval_s), 0, len(dogs), OPTS, exit=lambda code: None)
    now = time.monotonic()
    turn(dogs, now)
    frozen = (PER_NODE,)  # node1's aggregator stops
    time.sleep(STALE_BEATS * OPTS.interval_s + 0.05)  # its file goes stale (the freshness is wall-clock)
    for _ in range(4):
        now += OPTS.interval_s
        turn(dogs, now, frozen)
        observer._observe()
    assert dogs[PER_NODE + 1].beats.aggregating, "node1 has no aggregator"
    assert observer._culprits() == ("frozen (its process has not run for the last polls)", [PER_NODE])


def test_a_failed_job_reaches_every_rank_through_the_aggregators(job) -> None:
    dogs, ops, exits = job
    t0 = time.monotonic()
    turn(dogs, t0)
    checks = ops["check"]
    dogs[5].fail("node1 failed", node="node1")
    turn(dogs, t0 + OPTS.poll_s)
    assert exits == [EXIT_NODE_FAILED] * NODES * PER_NODE
    assert ops["check"] - checks <= NODES

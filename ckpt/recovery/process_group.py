"""A process group that survives torchrun restarts, on one node or many.

torchrun (c10d rendezvous) gives workers one TCPStore for the whole job, shared by
every restart. Left as it is, a restarted gloo or NCCL group finds the previous
round's (dead) peer addresses in it and hangs. Keying keys by
TORCHELASTIC_RESTART_COUNT is not enough across nodes: an agent whose own workers
did not fail restarts them for the membership change without counting a restart
(pytorch/pytorch#108158, #135712), so two nodes disagree on the count and wait for
each other forever.

So every round gets a store of its own: rank 0 starts a fresh TCPStore server and
publishes its address, with a random token, in the job's store; the other ranks
read the address, connect, and check the token. An address left by an earlier
round points to a dead server (refused) or to some other server (wrong token): they
read again until this round's rank 0 has published. The group runs on that store.
"""
from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .restarts import mark

log = logging.getLogger(__name__)

_ADDRESS_KEY = "ckpt-guard/round-store"
_TOKEN_KEY = "ckpt-guard/round-token"
_CONNECT_S = 2.0  # one connection attempt to a published address


def init_process_group(backend: str | None = None, timeout: timedelta = timedelta(minutes=10)) -> None:
    """``dist.init_process_group`` for torchrun workers (any number of nodes) that survives
    restarts; outside torchrun's agent store it is the plain call."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    mark("pg_init_start")  # restart timing (ckpt.restarts)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = round_store(rank, world, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    mark("pg_init_done")


def round_store(rank: int, world: int, timeout: timedelta) -> "dist.Store":
    """This round's own store (see the module docstring)."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    job = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    if rank == 0:  # rank 0 runs on the node that hosts the job's store: others reach it at MASTER_ADDR
        token = secrets.token_hex(16)
        server = dist.TCPStore(host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        server.set(_TOKEN_KEY, token)
        job.set(_ADDRESS_KEY, f"{host} {server.port} {token}")
        return server
    deadline = time.monotonic() + timeout.total_seconds()
    job.wait([_ADDRESS_KEY], timeout)
    while time.monotonic() < deadline:
        addr, port_text, token = job.get(_ADDRESS_KEY).decode().split()
        store = _connect(addr, int(port_text), token, timeout)
        if store is not None:
            return store
        time.sleep(0.1)  # an earlier round's address: wait for this round's rank 0
    raise TimeoutError(f"rank 0 did not publish this round's store within {timeout}")


def _connect(host: str, port: int, token: str, timeout: timedelta) -> "dist.Store | None":
    try:  # a dead server refuses at once; TCPStore itself would retry for its whole timeout
        socket.create_connection((host, port), timeout=_CONNECT_S).close()
    except OSError:
        return None
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=_CONNECT_S))
        if store.check([_TOKEN_KEY]) and store.get(_TOKEN_KEY).decode() == token:
            store.set_timeout(timeout)
            return store
    except (RuntimeError, ValueError, TimeoutError) as e:  # refused, reset, timed out: not this round's server
        log.debug("store at %s:%d is not this round's: %s", host, port, e)
    return None

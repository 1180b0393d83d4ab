"""The stand-ins of scale_bench's store components: store clients that count, worker processes
that never exit, the job's store on 127.0.0.1, the job and node launchers (our real code) of a
job of N ranks, and the launchers' clock. Shared by ``scale_bench.py`` and ``scale_clients.py``."""
from __future__ import annotations

import argparse
import os
import socket
import threading
import time
from datetime import timedelta

PER_NODE = 8
TIMEOUT = timedelta(seconds=300)


def listening_store(timeout: timedelta = TIMEOUT):
    """The job's store server, listening on 127.0.0.1 only: on a socket bound here, as the launcher
    binds its own (``master_listen_fd``); ``TCPStore(is_master=True)`` alone listens on every address."""
    import torch.distributed as dist
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4096)
    port = listener.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timeout,
                         master_listen_fd=listener.detach())


class Counting:
    """A store client that counts what passes through it (operations and the keys they name)."""

    ops = 0
    keys = 0
    _lock = threading.Lock()

    def __init__(self, store) -> None:
        self._s, self.port = store, store.port

    def _n(self, keys: int) -> None:
        with Counting._lock:
            Counting.ops += 1
            Counting.keys += keys

    def set(self, k, v):
        self._n(1)
        return self._s.set(k, v)

    def get(self, k):
        self._n(1)
        return self._s.get(k)

    def add(self, k, v):
        self._n(1)
        return self._s.add(k, v)

    def check(self, keys):
        self._n(len(keys))
        return self._s.check(keys)

    def wait(self, keys, timeout=None):
        self._n(len(keys))  # one operation, blocking in the server however long it takes
        return self._s.wait(keys) if timeout is None else self._s.wait(keys, timeout)

    def delete_key(self, k):
        self._n(1)
        return self._s.delete_key(k)

    def multi_get(self, keys):
        self._n(len(keys))
        return self._s.multi_get(keys)

    def multi_set(self, keys, values):
        self._n(len(keys))
        return self._s.multi_set(keys, values)


class StandIn:
    """A worker process that never exits unless told to (``code``)."""

    def __init__(self, *_a, **_k) -> None:
        self.pid, self.code = os.getpid(), None

    def poll(self):
        return self.code

    def kill(self) -> None:
        self.code = -9

    def wait(self):
        return self.code


def pool(n: int, clients: int):
    """The job's store and ``min(n, clients)`` counting clients of it."""
    import torch.distributed as dist
    server = listening_store()
    return server, [Counting(dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT))
                    for _ in range(min(n, clients))]


SECRET = b"scale-bench job secret, not a real job's: 32+ bytes"


def ctl(store, attempt: int = 0):
    """One process's signed view of the job's store (``ckpt.control``), as every launcher and worker has."""
    from ckpt.control import Control, control_key
    return Control(store, control_key(SECRET), attempt)


def job_of(n: int, pool, others: bool = True):
    """Round 0 of a job of ``n`` ranks on n/8 nodes: the job launcher and (``others``) every other
    node launcher."""
    from ckpt import secret
    from ckpt.inprocess import launch, node
    os.environ[secret.SECRET_ENV] = SECRET.decode()  # the job launcher reads the job's secret from here
    node.subprocess.Popen = StandIn  # the workers are stand-ins: nothing is started
    args = argparse.Namespace(nproc=PER_NODE, spares=0, spare_nodes=0, nodes=max(1, n // PER_NODE), min_world=1,
                              hang_s=60.0, progress_s=None, master_addr="127.0.0.1", command=["stand-in"])
    job = launch.Job(args, 0, pool[0], set())
    nodes = [job.local] + [node_launcher(ctl(pool[k % len(pool)]), k, pool[0].port)
                           for k in range(1, args.nodes if others else 1)]
    return job, nodes


def node_launcher(ctl, k: int, port: int):
    """Node ``k``'s launcher on the job's store (port ``port``), its workers stand-ins."""
    from ckpt.inprocess import node
    node.subprocess.Popen = StandIn
    return node.NodeLauncher(ctl, k, master=("127.0.0.1", port), command=["stand-in"], attempt=0, hang_s=60.0,
                             progress_s=None)


def worker_step(ctl, w: int, step: int) -> None:
    """Worker ``w``'s store traffic in one ``BEAT_S``: its beat, two looks for a newer round, its step."""
    from ckpt.inprocess import membership
    ctl.put(membership.beat_key(w), b"", round=0)
    membership.changed(ctl, 0)
    membership.changed(ctl, 0)
    ctl.put(membership.step_key(w), str(step))


class Clock:
    """The launchers' clock in `steady_step`: one tick a ``POLL_S``, however long a tick takes here,
    so that the step measured is one ``BEAT_S`` of the launchers' work whatever the machine's speed."""

    now = 0.0

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str):
        return getattr(time, name)


CLOCK = Clock()

"""Each node launcher's lifeline to the job launcher: one TCP connection, held for the job.

A node launcher that dies (SIGKILL, the OOM killer, a crash), or whose host's kernel closes
its sockets on the way down, ends its connection at once: the job launcher declares the node
lost at its next tick instead of after ``--hang-s`` without a beat. A host that vanishes
without a word (power, a cut network) closes nothing; silence still decides then. Like the
job's store, the listener trusts its network: a connection names its node and counts only
for a node rank of this job, once.
"""
from __future__ import annotations

import selectors
import socket
from typing import TYPE_CHECKING

from . import membership

if TYPE_CHECKING:
    import torch.distributed as dist

KEY = f"{membership.PREFIX}/lifeline"  # the listener's port, in the job's store


class Lifelines:
    """The job launcher's side: ``cut()`` once per tick says which nodes' lifelines ended."""

    def __init__(self, host: str, store: "dist.Store", nodes: set[int]) -> None:
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._nodes, self._held = nodes, set()
        store.set(KEY, str(self._listener.getsockname()[1]))

    def cut(self) -> list[int]:
        """Nodes whose lifeline ended since the last call (a connection not yet named is ignored)."""
        ended = []
        for key, _ in self._sel.select(timeout=0):
            if key.fileobj is self._listener:
                try:
                    conn, _addr = self._listener.accept()
                except BlockingIOError:
                    continue
                conn.setblocking(False)
                self._sel.register(conn, selectors.EVENT_READ, bytearray())
                continue
            conn, state = key.fileobj, key.data  # bytes of its name so far, its node, or None: ignored
            try:
                data = conn.recv(64)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if not data:
                self._sel.unregister(conn)
                conn.close()
                if isinstance(state, int):
                    ended.append(state)
            elif isinstance(state, bytearray):
                state += data
                if b"\n" in state:  # named: from now on only its end matters
                    node = _node_of(bytes(state))
                    keep = node is not None and node in self._nodes and node not in self._held
                    self._sel.modify(conn, selectors.EVENT_READ, node if keep else None)
                    if keep:
                        self._held.add(node)
        return ended

    def close(self) -> None:
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()
        self._sel.close()


def hold(store: "dist.Store", host: str, node: int) -> socket.socket:
    """The node launcher's side: connect and name this node; keep the socket open (and
    referenced) until the job is over."""
    sock = socket.create_connection((host, int(store.get(KEY))))
    sock.sendall(f"{node}\n".encode())
    return sock


def _node_of(line: bytes) -> int | None:
    try:
        return int(line.split(b"\n", 1)[0])
    except ValueError:
        return None

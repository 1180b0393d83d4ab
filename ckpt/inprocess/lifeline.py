"""Each node launcher's lifeline to the job launcher: one TCP connection, held for the job.

A node launcher that dies (SIGKILL, the OOM killer, a crash), or whose host's kernel closes
its sockets on the way down, ends its connection at once: the job launcher declares the node
lost at its next tick instead of after ``--hang-s`` without a beat. A host that vanishes
without a word (power, a cut network) closes nothing; silence still decides then.

Only the job's own node launchers can hold one: the listener sends each connection a fresh
challenge, and a connection counts for node K only once it answers with K and an HMAC of the
challenge under the job's control key (``control.Control.mac``, bound to the attempt): an
outsider cannot claim a node and then "lose" it by closing. The listener cannot be exhausted:
accept() failing for want of file descriptors or memory pauses accepting (logged once), a
connection that has not proven itself within ``HELLO_S`` is closed, unproven connections are
capped per address and in total (the oldest goes first), and no read buffer grows past a line.
"""
from __future__ import annotations

import hmac
import logging
import os
import selectors
import socket
import time
from dataclasses import dataclass, field

from ..control import Control
from ..listening import TRANSIENT_ACCEPT_ERRORS
from . import membership

log = logging.getLogger(__name__)
KEY = f"{membership.PREFIX}/lifeline"  # the listener's port, in the job's store
HELLO_S = 5.0  # a connection that has not proven its node by then is closed
PENDING_PER_ADDRESS, PENDING_TOTAL = 16, 128  # unproven connections held at once
_CHALLENGE = 16
_LINE = 128  # "K MAC-hex\n" fits; a longer line is nobody's
_PAUSE_S = 0.5


@dataclass
class _Hello:
    """An accepted connection not proven yet: its address, when it came, its challenge, its line so far."""

    address: str
    since: float
    challenge: bytes
    line: bytearray = field(default_factory=bytearray)


class Lifelines:
    """The job launcher's side: ``cut()`` once per tick says which nodes' lifelines ended."""

    def __init__(self, host: str, ctl: Control, nodes: set[int]) -> None:
        self._listener = socket.create_server((host, 0), backlog=1024)
        self._listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._ctl, self._nodes, self._held = ctl, nodes, set()
        self._hellos: dict[socket.socket, _Hello] = {}
        self._paused_until = 0.0
        self.accept_errors = self.refused = 0
        ctl.put(KEY, str(self._listener.getsockname()[1]))

    def cut(self) -> list[int]:
        """Nodes whose lifeline ended since the last call (a connection not yet proven is ignored)."""
        ended, now = [], time.monotonic()
        for key, _ in self._sel.select(timeout=0):
            if key.fileobj is self._listener:
                self._accept(now)
                continue
            conn, state = key.fileobj, key.data  # a _Hello, or the node it holds
            if conn.fileno() < 0:  # pushed out by this tick's accept, after select() named it
                continue
            try:
                data = conn.recv(_LINE)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if not data:
                self._drop(conn)
                if isinstance(state, int):
                    ended.append(state)
            elif isinstance(state, _Hello):
                state.line += data
                if b"\n" in state.line or len(state.line) > _LINE:
                    self._prove(conn, state)
        for conn in [c for c, h in self._hellos.items() if now - h.since > HELLO_S]:
            self._refuse(conn, "no proof in time")
        return ended

    def _accept(self, now: float) -> None:
        if now < self._paused_until:
            return
        for _ in range(64):  # a burst, then the tick goes on
            try:
                conn, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno not in TRANSIENT_ACCEPT_ERRORS:
                    raise
                if not self.accept_errors:
                    log.warning("lifeline listener cannot accept a connection now (%s); pausing %.1f s each time "
                                "(logged once)", e, _PAUSE_S)
                self.accept_errors += 1
                self._paused_until = now + _PAUSE_S
                return
            address = addr[0]
            mine = [c for c, h in self._hellos.items() if h.address == address]
            if len(mine) >= PENDING_PER_ADDRESS or len(self._hellos) >= PENDING_TOTAL:
                self._refuse((mine or list(self._hellos))[0], "too many unproven connections")
            hello = _Hello(address, now, os.urandom(_CHALLENGE))
            try:
                conn.setblocking(False)
                conn.send(hello.challenge)  # a fresh socket's buffer takes 16 bytes at once
            except OSError:
                conn.close()
                continue
            self._hellos[conn] = hello
            self._sel.register(conn, selectors.EVENT_READ, hello)

    def _prove(self, conn: socket.socket, hello: _Hello) -> None:
        """A node, if the line names one of this job's and proves it; else the connection goes."""
        try:
            name, proof = bytes(hello.line).split(b"\n", 1)[0].split(b" ", 1)
            node, mac = int(name), bytes.fromhex(proof.decode("ascii"))
        except (ValueError, UnicodeError):
            node, mac = None, b""
        if node is None or node not in self._nodes or node in self._held or \
                not hmac.compare_digest(mac, self._ctl.mac("lifeline", node, hello.challenge)):
            self._refuse(conn, f"a claim of node {node} that fails its check, or a node held already")
            return
        del self._hellos[conn]
        self._held.add(node)
        self._sel.modify(conn, selectors.EVENT_READ, node)

    def _refuse(self, conn: socket.socket, why: str) -> None:
        if not self.refused:
            log.warning("lifeline: closed a connection from %s: %s (logged once; counted)",
                        self._hellos[conn].address, why)
        self.refused += 1
        self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        self._hellos.pop(conn, None)
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):  # already gone
            pass
        conn.close()

    def close(self) -> None:
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()
        self._sel.close()


def hold(ctl: Control, host: str, node: int) -> socket.socket:
    """The node launcher's side: connect, answer the challenge for this node; keep the socket
    open (and referenced) until the job is over."""
    deadline = time.monotonic() + 60.0
    while (port := ctl.get(KEY)) is None:  # the job launcher publishes it with the attempt's first keys
        if time.monotonic() > deadline:
            raise RuntimeError("the job launcher published no lifeline port within 60 s")
        time.sleep(0.01)
    try:
        sock = socket.create_connection((host, int(port)), timeout=60.0)  # the launcher answers at its next tick
        challenge = b""
        while len(challenge) < _CHALLENGE:
            chunk = sock.recv(_CHALLENGE - len(challenge))
            if not chunk:
                raise OSError("the job launcher's lifeline listener closed the connection")
            challenge += chunk
        sock.sendall(f"{node} {ctl.mac('lifeline', node, challenge).hex()}\n".encode())
    except OSError as e:
        raise RuntimeError(f"no lifeline to the job launcher: {e}") from e
    sock.settimeout(None)
    return sock

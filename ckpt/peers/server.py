"""Each rank's peer server: a small thread on an address published at start-up that
takes replicas from the ranks it holds for (``put``) and hands out, at restore
(``get``), the replicas it holds and this node's own snapshots of any rank (a rank
numbered differently after a restart fetches its old shard from here). One
short-lived thread per connection, at most ``max_connections`` at once, each done by
its deadline (``timeout_s`` from its handshake to its reply); every connection first
proves it knows the job's secret and then speaks encrypted (``wire``). Running out of
file descriptors pauses the accept loop, never ends it. A ``put`` is received at nice ``nice`` (``priority``:
training on this node runs first), a ``get`` (a restore waiting for it) at normal
priority."""
from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from typing import Sequence

from ..errors import CheckpointError
from ..format.manifest import ShardManifest
from ..restore.execute import DAMAGE, open_shard
from ..tiers.base import CheckpointId, ShardReader, TierReader
from . import wire
from .priority import lower_this_thread
from .replicas import ReplicaSlots

log = logging.getLogger(__name__)

# accept() failing with one of these is the machine short of something for a while (file
# descriptors, memory) or one connection gone before it was taken: wait, then go on.
_TRANSIENT = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EPROTO}


class PeerServer:
    """Bound at construction (so the address can be gathered), serving after ``start``."""

    def __init__(self, replicas: ReplicaSlots, sources: Sequence[TierReader], *, host: str, timeout_s: float,
                 nice: int = 0, max_connections: int = 64) -> None:
        self.replicas, self.sources, self.timeout_s, self.nice = replicas, list(sources), timeout_s, nice
        self._slots = threading.BoundedSemaphore(max_connections)
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(0.5)  # the accept loop looks at the stop flag this often
        self.addr = f"{host}:{self._sock.getsockname()[1]}"
        self._secret = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="ckpt-peer-server", daemon=True)
        self._serving: dict[threading.Thread, socket.socket] = {}  # connections being served
        self._serving_guard = threading.Lock()
        self.received = 0  # replicas sealed here
        self.accept_errors = 0  # accept() failures waited out (file descriptors exhausted, ...)

    def start(self, secret: bytes) -> None:
        self._secret = secret
        self._thread.start()

    def _accept(self) -> None:
        streak = 0  # accept() failures in a row
        while not self._stop.is_set():
            if not self._slots.acquire(timeout=0.5):  # every slot taken: the oldest end by their deadline
                continue
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                self._slots.release()
                continue
            except OSError as e:
                self._slots.release()
                if self._stop.is_set() or e.errno not in _TRANSIENT:
                    return
                self.accept_errors += 1
                if streak % 120 == 0:  # once a minute while it lasts
                    log.warning("peer server cannot accept a connection now (%s); retrying every 0.5 s", e)
                streak += 1
                self._stop.wait(0.5)
                continue
            streak = 0
            thread = threading.Thread(target=self._serve, args=(conn, f"{peer[0]}:{peer[1]}"), name="ckpt-peer-conn",
                                      daemon=True)
            with self._serving_guard:
                self._serving[thread] = conn
            try:
                thread.start()
            except RuntimeError as e:  # no thread to be had now: this connection is dropped, not the server
                with self._serving_guard:
                    del self._serving[thread]
                conn.close()
                self._slots.release()
                log.warning("peer server dropped a connection from %s:%s: %s", peer[0], peer[1], e)

    def _serve(self, conn: socket.socket, peer: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        try:
            with wire.handshake(conn, self._secret, server=True, deadline=deadline) as session:
                req = session.recv_frame(deadline=deadline)
                if req.get("op") == "put":
                    lower_this_thread(self.nice)  # this connection's thread only; its checkers inherit it
                    self._put(session, req, peer, deadline)
                elif req.get("op") == "get":
                    self._get(session, req, peer, deadline)
                else:
                    session.send_frame({"ok": False, "error": f"unknown request {str(req.get('op'))[:80]!r}"},
                                       deadline=deadline)
        except (CheckpointError, OSError) as e:
            log.warning("peer request from %s failed: %s", peer, e)
        finally:
            conn.close()
            self._slots.release()
            with self._serving_guard:
                self._serving.pop(threading.current_thread(), None)

    def _put(self, session: wire.Session, req: dict, peer: str, deadline: float) -> None:
        try:
            raw = req.get("manifest")
            if not isinstance(raw, str):
                raise CheckpointError(f"replica manifest from {peer} is not a string")
            manifest = ShardManifest.from_bytes(raw.encode(), f"replica manifest from {peer}")
        except (CheckpointError, UnicodeError) as e:
            log.warning("replica from %s refused: %s", peer, e)
            session.send_frame({"ok": False, "error": f"bad replica manifest: {e}"}, deadline=deadline)
            return
        try:
            node = req.get("node")
            self.replicas.receive(manifest, lambda view: session.recv_data(view, deadline=deadline),
                                  node=node if isinstance(node, str) else None)
        except (CheckpointError, OSError) as e:
            log.warning("replica of rank %d's step %d from %s rejected: %s", manifest.rank, manifest.step, peer, e)
            session.send_frame({"ok": False, "error": str(e)}, deadline=deadline)
            return
        self.received += 1
        session.send_frame({"ok": True}, deadline=deadline)

    def _get(self, session: wire.Session, req: dict, peer: str, deadline: float) -> None:
        try:
            ckpt_id = CheckpointId(int(req["generation"]), int(req["step"]))
            reader = self._open(ckpt_id, int(req["rank"]))
        except (KeyError, TypeError, ValueError, OverflowError, *DAMAGE) as e:
            session.send_frame({"ok": False, "error": str(e)}, deadline=deadline)
            return
        try:
            session.send_frame({"ok": True, "manifest": reader.manifest.to_bytes().decode()}, deadline=deadline)
            session.send_data(reader.view(0, reader.manifest.data_bytes), bytes_per_s=None, deadline=deadline)
        finally:
            reader.close()  # raises if the slot was overwritten meanwhile (the client's checksums fail too)
        log.info("sent the replica of rank %s's step %s to %s", req["rank"], ckpt_id.step, peer)

    def _open(self, ckpt_id: CheckpointId, rank: int) -> ShardReader:
        """The first of ``sources`` holding that shard (the sealed copy, checked at close)."""
        missing = []
        for tier in self.sources:
            try:
                return open_shard(tier, ckpt_id, rank)
            except FileNotFoundError as e:
                missing.append(str(e))
        raise FileNotFoundError("; ".join(missing) or f"step {ckpt_id}: nothing served here")

    def close(self) -> bool:
        """Stop accepting, then end the connections being served: their sockets are shut down
        and their threads joined, since they read and write memory (replica slots, this
        node's snapshots) that the caller unmaps next. Unmapping under a thread still
        checking a replica it received killed a rank with SIGSEGV. Shutting the listener
        down wakes the accept loop at once (closing it alone leaves accept() to its 0.5 s
        timeout, half a second of every in-process abort). Returns whether every connection
        ended within ``timeout_s``; if not, the caller must leave that memory mapped."""
        self._stop.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # never listened, or already shut
            pass
        self._sock.close()
        if self._thread.is_alive():
            self._thread.join()
        with self._serving_guard:
            serving = dict(self._serving)
        for conn in serving.values():
            try:
                conn.shutdown(socket.SHUT_RDWR)  # a recv or send in progress fails at once
            except OSError:
                pass
        deadline = time.monotonic() + self.timeout_s
        for thread in serving:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t for t in serving if t.is_alive()]
        if alive:
            log.warning("peer server: %d connection(s) still running %.0f s after close; their memory is left "
                        "mapped", len(alive), self.timeout_s)
        return not alive

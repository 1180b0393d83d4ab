"""Each rank's peer server: a small thread on an address published at start-up that
takes replicas from the ranks it holds for (``put``) and hands out, at restore
(``get``), the replicas it holds and this node's own snapshots of any rank (a rank
numbered differently after a restart fetches its old shard from here). One
short-lived thread per connection, each done by its deadline; every connection first
proves it knows the job's secret and then speaks encrypted (``wire``). A connection has
``HANDSHAKE_S`` to prove it, and unproven connections are capped per address and in total
(a new one pushes out the oldest), so idle or hostile connections never take the
``max_connections`` slots of proven peers (each done ``timeout_s`` after its handshake).
Running out of file descriptors pauses the accept loop, never ends it. A ``put`` is
received at nice ``nice`` (``priority``: training on this node runs first), a ``get`` (a
restore waiting for it) at normal priority."""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Sequence

from ..errors import CheckpointError
from ..format.manifest import ShardManifest
from ..listening import TRANSIENT_ACCEPT_ERRORS
from ..restore.execute import DAMAGE, open_shard
from ..tiers.base import CheckpointId, ShardReader, TierReader
from . import wire
from .priority import lower_this_thread
from .replicas import ReplicaSlots

log = logging.getLogger(__name__)

HANDSHAKE_S = 5.0  # a connection that has not proven the secret by then is closed (a proof takes ms)
PENDING_PER_ADDRESS, PENDING_TOTAL = 8, 32  # unproven connections held at once


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
        self._unproven: dict[socket.socket, str] = {}  # connections in their handshake -> address, oldest first
        self.received = 0  # replicas sealed here
        self.accept_errors = 0  # accept() failures waited out (file descriptors exhausted, ...)
        self.refused = 0  # connections closed unproven: no proof in time, a wrong one, or pushed out

    def start(self, secret: bytes) -> None:
        self._secret = secret
        self._thread.start()

    def _accept(self) -> None:
        streak = 0  # accept() failures in a row
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._stop.is_set() or e.errno not in TRANSIENT_ACCEPT_ERRORS:
                    return
                self.accept_errors += 1
                if streak % 120 == 0:  # once a minute while it lasts
                    log.warning("peer server cannot accept a connection now (%s); retrying every 0.5 s", e)
                streak += 1
                self._stop.wait(0.5)
                continue
            streak = 0
            self._make_room(peer[0])
            thread = threading.Thread(target=self._serve, args=(conn, f"{peer[0]}:{peer[1]}"), name="ckpt-peer-conn",
                                      daemon=True)
            with self._serving_guard:
                self._serving[thread] = conn
                self._unproven[conn] = peer[0]
            try:
                thread.start()
            except RuntimeError as e:  # no thread to be had now: this connection is dropped, not the server
                with self._serving_guard:
                    del self._serving[thread]
                    del self._unproven[conn]
                conn.close()
                log.warning("peer server dropped a connection from %s:%s: %s", peer[0], peer[1], e)

    def _make_room(self, address: str) -> None:
        """Before a new connection from ``address``: at the cap, the oldest unproven connection
        (of that address, else of all) is shut down; its thread's handshake then fails."""
        with self._serving_guard:
            mine = [c for c, a in self._unproven.items() if a == address]
            if len(mine) >= PENDING_PER_ADDRESS:
                victim = mine[0]
            elif len(self._unproven) >= PENDING_TOTAL:
                victim = next(iter(self._unproven))
            else:
                return
            del self._unproven[victim]
        try:
            victim.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            session = wire.handshake(conn, self._secret, server=True,
                                     deadline=time.monotonic() + min(HANDSHAKE_S, self.timeout_s))
        except OSError as e:
            with self._serving_guard:
                self.refused += 1
                first = self.refused == 1
            if first:
                log.warning("peer server closed a connection from %s that did not prove the job's secret within "
                            "%.0f s (%s); logged once, counted in refused", peer, HANDSHAKE_S, e)
            self._done(conn, slot=False)
            return
        with self._serving_guard:
            self._unproven.pop(conn, None)
        if not self._slots.acquire(blocking=False):
            log.warning("peer server: every one of its slots is taken by proven peers; a request from %s refused", peer)
            self._done(conn, slot=False)
            return
        deadline = time.monotonic() + self.timeout_s
        try:
            with session:
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
            self._done(conn, slot=True)

    def _done(self, conn: socket.socket, *, slot: bool) -> None:
        conn.close()
        if slot:
            self._slots.release()
        with self._serving_guard:
            self._unproven.pop(conn, None)
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

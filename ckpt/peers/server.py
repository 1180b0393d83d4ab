"""Each rank's peer server: a small thread on an address published at start-up that
takes replicas from the ranks it holds for (``put``) and hands out, at restore
(``get``), the replicas it holds and this node's own snapshots of any rank (a rank
numbered differently after a restart fetches its old shard from here). One
short-lived thread per connection; every connection first proves it knows the job's
secret (``wire.handshake``). A ``put`` is received at nice ``nice`` (``priority``:
training on this node runs first), a ``get`` (a restore waiting for it) at normal
priority."""
from __future__ import annotations

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


class PeerServer:
    """Bound at construction (so the address can be gathered), serving after ``start``."""

    def __init__(self, replicas: ReplicaSlots, sources: Sequence[TierReader], *, host: str, timeout_s: float,
                 nice: int = 0) -> None:
        self.replicas, self.sources, self.timeout_s, self.nice = replicas, list(sources), timeout_s, nice
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(0.5)  # the accept loop looks at the stop flag this often
        self.addr = f"{host}:{self._sock.getsockname()[1]}"
        self._secret = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="ckpt-peer-server", daemon=True)
        self.received = 0  # replicas sealed here

    def start(self, secret: bytes) -> None:
        self._secret = secret
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, f"{peer[0]}:{peer[1]}"), name="ckpt-peer-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        with conn:
            try:
                conn.settimeout(self.timeout_s)
                wire.handshake(conn, self._secret, server=True)
                req = wire.recv_frame(conn)
                if req.get("op") == "put":
                    lower_this_thread(self.nice)  # this connection's thread only; its checkers inherit it
                    self._put(conn, req, peer)
                elif req.get("op") == "get":
                    self._get(conn, req, peer)
                else:
                    wire.send_frame(conn, {"ok": False, "error": f"unknown request {req.get('op')!r}"})
            except (CheckpointError, OSError) as e:
                log.warning("peer request from %s failed: %s", peer, e)

    def _put(self, conn: socket.socket, req: dict, peer: str) -> None:
        manifest = ShardManifest.from_bytes(str(req.get("manifest", "")).encode(), f"replica manifest from {peer}")
        deadline = time.monotonic() + self.timeout_s
        try:
            self.replicas.receive(manifest, lambda view: wire.recv_into(conn, view, deadline=deadline))
        except (CheckpointError, OSError) as e:
            log.warning("replica of rank %d's step %d from %s rejected: %s", manifest.rank, manifest.step, peer, e)
            wire.send_frame(conn, {"ok": False, "error": str(e)})
            return
        self.received += 1
        wire.send_frame(conn, {"ok": True})

    def _get(self, conn: socket.socket, req: dict, peer: str) -> None:
        try:
            ckpt_id = CheckpointId(int(req["generation"]), int(req["step"]))
            reader = self._open(ckpt_id, int(req["rank"]))
        except (KeyError, TypeError, ValueError, *DAMAGE) as e:
            wire.send_frame(conn, {"ok": False, "error": str(e)})
            return
        try:
            wire.send_frame(conn, {"ok": True, "manifest": reader.manifest.to_bytes().decode()})
            wire.send_paced(conn, reader.view(0, reader.manifest.data_bytes), bytes_per_s=None,
                            deadline=time.monotonic() + self.timeout_s)
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

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        if self._thread.is_alive():
            self._thread.join()

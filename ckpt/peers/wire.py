"""The peer connection: mutual authentication with the job's secret, then every frame and
every piece of shard bytes encrypted and authenticated with a key of this connection
(paced by a bandwidth cap, bounded by a deadline).

Threat model: the ranks of a job sit on a network that others may read and write. The
secret (derived from the job's secret, ``ckpt.secret``, on every rank; without one, 32
random bytes chosen by rank 0 and handed to every rank through the job's control group at
start-up) is what a peer must know: a connection proves it by an
HMAC-SHA256 over both sides' fresh nonces, in both directions, and both sides derive
this connection's keys (one per direction) from the secret and both nonces. Every frame
and data piece after the handshake is AES-256-GCM under those keys, numbered by a
sequence number (the GCM nonce), so a transparent relay that passes the handshake
through (both ends see the same nonces) can neither read a replica nor change, drop,
reorder or replay a piece of it: the holder's decryption fails before it seals. What is
not protected: without a job secret, anyone who can read the job's rendezvous (the store
that hands out the secret) can be a peer; traffic volume and timing are visible. Shard bytes are still
checked against their CRC32C chunk sums on arrival (a torn transfer, a bad sender).

Every wait is bounded: the handshake and each request by a total deadline (not per
``recv``: a peer that drips one byte at a time gets no longer than one that is silent).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

_NONCE = 16
_TAG = 16  # AES-GCM's tag, after every frame and every data piece
_MAX_FRAME = 256 << 20  # a shard manifest's limit
# Shard bytes move in pieces this big, each one blocking call that sleeps in the kernel
# until the whole piece is through (MSG_WAITALL on receipt): the thread wakes, and takes
# the GIL from the trainer, once per piece instead of once per batch of TCP segments.
# Each piece is sealed on its own (its tag follows it), so a receiver decrypts into its
# destination piece by piece and never holds more than one piece that is not verified.
PIECE = 8 << 20


class PeerError(ConnectionError):
    """A peer transfer failed: refused, timed out, closed or unauthenticated. An OSError,
    so restore treats it like any unreadable copy and tries the next source."""


def new_secret() -> bytes:
    return os.urandom(32)


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


class Session:
    """One authenticated connection after its handshake: frames and data pieces are
    encrypted and authenticated in both directions, each numbered (a piece out of order,
    dropped, replayed or changed fails its tag). Not thread-safe; one request at a time."""

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes) -> None:
        self.sock = sock
        self._tx, self._rx = AESGCM(send_key), AESGCM(recv_key)
        self._tx_seq = self._rx_seq = 0
        self._scratch: bytearray | None = None  # one sealed piece, reused

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def _nonce(self, send: bool) -> bytes:
        if send:
            self._tx_seq += 1
            return struct.pack("!4xQ", self._tx_seq)
        self._rx_seq += 1
        return struct.pack("!4xQ", self._rx_seq)

    def send_frame(self, doc: dict[str, Any], *, deadline: float) -> None:
        raw = json.dumps(doc).encode()
        header = struct.pack("!I", len(raw) + _TAG)
        sealed = self._tx.encrypt(self._nonce(True), raw, header)
        send_paced(self.sock, memoryview(header + sealed), bytes_per_s=None, deadline=deadline)

    def recv_frame(self, *, deadline: float) -> dict[str, Any]:
        header = recv_exact(self.sock, 4, deadline=deadline)
        (n,) = struct.unpack("!I", header)
        if not _TAG <= n <= _MAX_FRAME:
            raise PeerError(f"peer sent a {n}-byte frame; expected {_TAG} to {_MAX_FRAME}")
        try:
            raw = self._rx.decrypt(self._nonce(False), recv_exact(self.sock, n, deadline=deadline), header)
        except InvalidTag:
            raise PeerError("peer frame failed authentication (changed on the way, or not this connection)") \
                from None
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise PeerError(f"peer sent a malformed frame: {e}") from None
        if not isinstance(doc, dict):
            raise PeerError("peer sent a frame that is not a JSON object")
        return doc

    def send_data(self, data: memoryview, *, bytes_per_s: float | None, deadline: float,
                  stop: threading.Event | None = None) -> None:
        """``data`` in sealed pieces, at most ``bytes_per_s`` on average (``send_paced``)."""
        t0 = time.monotonic()
        for lo in range(0, len(data), PIECE):
            piece = data[lo : lo + PIECE]
            out = self._piece_buffer(len(piece))
            self._tx.encrypt_into(self._nonce(True), piece, b"data", out)
            send_paced(self.sock, out, bytes_per_s=None, deadline=deadline, stop=stop)
            if bytes_per_s:
                _pace(lo + len(piece), bytes_per_s, t0, stop)

    def recv_data(self, out: memoryview, *, deadline: float) -> None:
        """Fill ``out`` with the next ``len(out)`` data bytes, every piece verified as it
        lands: PeerError on a piece that fails its tag. The sender's pieces are PIECE
        bytes from the start of its data, so ``out`` must start at a piece boundary."""
        for lo in range(0, len(out), PIECE):
            dst = out[lo : lo + PIECE]
            sealed = self._piece_buffer(len(dst))
            recv_into(self.sock, sealed, deadline=deadline)
            try:
                self._rx.decrypt_into(self._nonce(False), sealed, b"data", dst)
            except InvalidTag:
                raise PeerError("peer data failed authentication (changed on the way, or not this "
                                "connection)") from None

    def _piece_buffer(self, n: int) -> memoryview:
        if self._scratch is None or len(self._scratch) < n + _TAG:
            self._scratch = bytearray(min(PIECE, max(n, 1 << 16)) + _TAG)
        return memoryview(self._scratch)[: n + _TAG]


def handshake(sock: socket.socket, secret: bytes, *, server: bool, deadline: float) -> Session:
    """Both sides prove they hold ``secret`` and agree on this connection's keys, all by
    ``deadline``; PeerError otherwise."""
    mine = os.urandom(_NONCE)
    send_paced(sock, memoryview(mine), bytes_per_s=None, deadline=deadline)
    theirs = recv_exact(sock, _NONCE, deadline=deadline)
    client_nonce, server_nonce = (theirs, mine) if server else (mine, theirs)
    transcript = b"ckpt-guard peer v2" + client_nonce + server_nonce
    me, them = (b"server", b"client") if server else (b"client", b"server")
    send_paced(sock, memoryview(_mac(secret, b"proof ", me, transcript)), bytes_per_s=None, deadline=deadline)
    if not hmac.compare_digest(recv_exact(sock, 32, deadline=deadline), _mac(secret, b"proof ", them, transcript)):
        raise PeerError("peer failed authentication (not this job's secret)")
    session_key = _mac(secret, b"session ", transcript)  # HKDF-extract, then one expand per direction
    return Session(sock, _mac(session_key, b"key ", me), _mac(session_key, b"key ", them))


def recv_exact(sock: socket.socket, n: int, *, deadline: float) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf), deadline=deadline)
    return bytes(buf)


def recv_into(sock: socket.socket, out: memoryview, *, deadline: float | None) -> None:
    """Fill ``out`` from ``sock``; PeerError when the peer closes or ``deadline`` passes
    (None: each piece within the socket's own timeout)."""
    got = 0
    while got < len(out):
        with _kernel_timeout(sock, deadline):
            try:
                n = sock.recv_into(out[got : got + PIECE], 0, socket.MSG_WAITALL)
            except (BlockingIOError, TimeoutError):
                raise PeerError("peer transfer took longer than its timeout; abandoned") from None
        if n == 0:
            raise PeerError(f"peer closed the connection after {got} of {len(out)} bytes")
        got += n


def send_paced(sock: socket.socket, data: memoryview, *, bytes_per_s: float | None, deadline: float | None,
               stop: threading.Event | None = None) -> None:
    """Send ``data`` in pieces, at most ``bytes_per_s`` on average, giving up at ``deadline``
    or as soon as ``stop`` is set (another thread also shuts the socket down then)."""
    t0 = time.monotonic()
    for lo in range(0, len(data), PIECE):
        hi, sent = min(len(data), lo + PIECE), lo
        while sent < hi:  # one call per piece unless the kernel timeout cut it short
            with _kernel_timeout(sock, deadline):
                try:
                    sent += sock.send(data[sent:hi])
                except (BlockingIOError, TimeoutError):
                    raise PeerError("peer transfer took longer than its timeout; abandoned") from None
        if bytes_per_s:
            _pace(hi, bytes_per_s, t0, stop)


def _pace(done: int, bytes_per_s: float, t0: float, stop: threading.Event | None) -> None:
    """Sleep until ``done`` bytes are due at ``bytes_per_s`` since ``t0``; PeerError if
    ``stop`` is set meanwhile."""
    ahead = done / bytes_per_s - (time.monotonic() - t0)
    if ahead > 0 and stop is None:
        time.sleep(ahead)
    elif ahead > 0 and stop.wait(ahead):
        raise PeerError("send stopped")


@contextmanager
def _kernel_timeout(sock: socket.socket, deadline: float | None) -> Iterator[None]:
    """The socket in blocking mode for one call, bounded in the kernel (SO_RCVTIMEO and
    SO_SNDTIMEO) by what is left until ``deadline`` (None: the socket's own timeout). A
    socket with a Python timeout is non-blocking and polled: MSG_WAITALL would not wait,
    and a large sendall would wake once per send-buffer's worth."""
    _check(deadline)
    before = sock.gettimeout()
    left = before if deadline is None else max(0.001, deadline - time.monotonic())
    timeval = struct.pack("ll", int(left), int(left % 1 * 1e6)) if left else struct.pack("ll", 0, 0)
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    try:
        yield
    finally:
        sock.settimeout(before)


def _check(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise PeerError("peer transfer took longer than its timeout; abandoned")


def connect(addr: str, secret: bytes, timeout_s: float) -> Session:
    """An authenticated connection to a peer at ``host:port``, reached and through its
    handshake within ``timeout_s`` (a peer that drips its answer gets no longer)."""
    deadline = time.monotonic() + timeout_s
    host, port = addr.rsplit(":", 1)
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except (OSError, ValueError) as e:
        raise PeerError(f"cannot reach peer at {addr}: {e}") from e
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return handshake(sock, secret, server=False, deadline=deadline)
    except BaseException:
        sock.close()
        raise

"""The peer connection: mutual authentication with the job's secret, small JSON frames,
and raw shard bytes (paced by a bandwidth cap, bounded by a deadline).

Threat model: the ranks of a job sit on a private network. The secret (32 random
bytes chosen by rank 0 and handed to every rank through the job's control group at
start-up) keeps out stray and foreign processes: a connection proves it knows the
secret by an HMAC-SHA256 over the other side's fresh nonce, in both directions, so
neither side talks to an impostor that merely took a port. Anyone who can read the
job's rendezvous traffic can learn the secret; bytes are not encrypted. Shard bytes
are still checked against their CRC32C chunk sums on arrival, so a damaged or torn
transfer is never sealed.
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

_NONCE = 16
_MAX_FRAME = 256 << 20  # a shard manifest's limit
# Shard bytes move in pieces this big, each one blocking call that sleeps in the kernel
# until the whole piece is through (MSG_WAITALL on receipt): the thread wakes, and takes
# the GIL from the trainer, once per piece instead of once per batch of TCP segments.
PIECE = 8 << 20


class PeerError(ConnectionError):
    """A peer transfer failed: refused, timed out, closed or unauthenticated. An OSError,
    so restore treats it like any unreadable copy and tries the next source."""


def new_secret() -> bytes:
    return os.urandom(32)


def _proof(secret: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, role + nonce, hashlib.sha256).digest()


def handshake(sock: socket.socket, secret: bytes, *, server: bool) -> None:
    """Both sides prove they hold ``secret``; PeerError otherwise."""
    mine = os.urandom(_NONCE)
    sock.sendall(mine)
    theirs = recv_exact(sock, _NONCE)
    me, them = (b"server", b"client") if server else (b"client", b"server")
    sock.sendall(_proof(secret, me, theirs))
    if not hmac.compare_digest(recv_exact(sock, 32), _proof(secret, them, mine)):
        raise PeerError("peer failed authentication (not this job's secret)")


def send_frame(sock: socket.socket, doc: dict[str, Any]) -> None:
    raw = json.dumps(doc).encode()
    sock.sendall(struct.pack("!I", len(raw)) + raw)


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    (n,) = struct.unpack("!I", recv_exact(sock, 4))
    if n > _MAX_FRAME:
        raise PeerError(f"peer sent a {n}-byte frame; refusing more than {_MAX_FRAME}")
    try:
        doc = json.loads(recv_exact(sock, n))
    except ValueError as e:
        raise PeerError(f"peer sent a malformed frame: {e}") from None
    if not isinstance(doc, dict):
        raise PeerError("peer sent a frame that is not a JSON object")
    return doc


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf), deadline=None)
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
            ahead = hi / bytes_per_s - (time.monotonic() - t0)
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


def connect(addr: str, secret: bytes, timeout_s: float) -> socket.socket:
    """An authenticated connection to a peer at ``host:port``."""
    host, port = addr.rsplit(":", 1)
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except OSError as e:
        raise PeerError(f"cannot reach peer at {addr}: {e}") from e
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        handshake(sock, secret, server=False)
    except BaseException:
        sock.close()
        raise
    return sock

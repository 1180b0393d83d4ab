"""An HTTP GET bounded in time (in all, not per read) and in bytes, for servers we do not run.

A socket timeout bounds each read, so a server that drips a byte at a time, in its
headers or its body, holds a plain client for as long as it likes. Here a timer shuts
the socket down at the deadline, whatever phase the exchange is in, and the body is
read in pieces that stop at the byte cap. The agents' dcgm-exporter scraper and the
predictor's Prometheus reader both fetch through this.
"""
from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

_READ_CHUNK = 64 << 10


class Timeout(OSError):
    """No complete answer before the deadline."""


class OverCap(ValueError):
    """The body is larger than the cap."""


class Body:
    """A response's status and its body as a file-like ``read(n)`` that keeps the bounds."""

    def __init__(self, resp: http.client.HTTPResponse, sock: socket.socket, deadline: float, timeout_s: float,
                 max_bytes: int):
        self.status, self._resp, self._sock = resp.status, resp, sock
        self._deadline, self._timeout_s, self._max_bytes, self.size = deadline, timeout_s, max_bytes, 0

    def read(self, n: int = _READ_CHUNK) -> bytes:
        if n == 0:                                  # a type probe (ijson does one)
            return b""
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise Timeout(f"no complete answer within {self._timeout_s:g} s")
        self._sock.settimeout(left)
        try:
            chunk = self._resp.read1(min(n, _READ_CHUNK) if n > 0 else _READ_CHUNK)
        except TimeoutError:                        # the read was given the time left: it is spent
            raise Timeout(f"no complete answer within {self._timeout_s:g} s") from None
        except (OSError, http.client.HTTPException):
            if time.monotonic() < self._deadline:
                raise
            chunk = b""
        if time.monotonic() >= self._deadline:     # the timer shut the socket: what came is not all
            raise Timeout(f"no complete answer within {self._timeout_s:g} s")
        self.size += len(chunk)
        if self.size > self._max_bytes:
            raise OverCap(f"the answer is larger than the {self._max_bytes}-byte cap")
        return chunk

    def read_all(self) -> bytes:
        chunks = []
        while chunk := self.read():
            chunks.append(chunk)
        return b"".join(chunks)


@contextmanager
def get(url: str, headers: dict[str, str], timeout_s: float, max_bytes: int) -> Iterator[Body]:
    """GET ``url``; raises Timeout, OverCap (from reads), OSError or http.client.HTTPException."""
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"expected an http(s):// URL, got {url!r}")
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    deadline = time.monotonic() + timeout_s
    conn = cls(u.hostname, u.port, timeout=timeout_s)   # connecting: bounded by the socket timeout
    timer = None
    try:
        try:
            conn.request("GET", (u.path or "/") + (f"?{u.query}" if u.query else ""), headers=headers)
            sock = conn.sock                    # the response keeps it after a "Connection: close"
            timer = threading.Timer(max(0.0, deadline - time.monotonic()), _shut, (sock,))
            timer.daemon = True
            timer.start()
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            if isinstance(e, TimeoutError) or time.monotonic() >= deadline:
                raise Timeout(f"no complete answer within {timeout_s:g} s") from None
            raise
        yield Body(resp, sock, deadline, timeout_s, max_bytes)
    finally:
        if timer is not None:
            timer.cancel()
        conn.close()


def _shut(sock: socket.socket) -> None:
    """At the deadline: end any read in progress (it returns or raises at once)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass

"""The servers tests and benchmarks start: a free loopback port for one, its CPU time,
stopping it, politely first, for certain after a grace period, and waiting for what it
does in the background."""
from __future__ import annotations

import os
import random
import socket
import subprocess
import threading
import time
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import BinaryIO, Callable, TypeVar

T = TypeVar("T")

# a request to a server on loopback: a hang guard, not a speed limit (a loaded machine answered a
# 1.5 MB telemetry post in over 10 s)
HTTP_S = 120.0


def free_port() -> int:
    """A loopback port free right now (servers bind 127.0.0.1 only)."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` different loopback ports, free right now (never "a free port plus one": that one
    may be a client's). Drawn below the kernel's ephemeral range: a port the kernel hands out
    (``bind(0)``) is also a source port of outgoing connections, so between this check and the
    server's own bind (torchrun binds seconds later) a client could take it (EADDRINUSE seen
    under load); a port below that range is only ever taken by a server that asks for it."""
    low = _ephemeral_low()
    chosen: list[int] = []
    while len(chosen) < n:
        port = random.randrange(max(1024, low - 12000), low)
        if port not in chosen and _bindable(port):
            chosen.append(port)
    return chosen


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name (which may hold spaces): state first (Linux)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc)."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for init to reap it is not)."""
    try:
        return stat_fields(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM, wait ``grace_s``, then SIGKILL; always reaps the process."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_for(predicate: Callable[[], T], timeout: float = 60.0, interval: float = 0.05) -> T | None:
    """Poll ``predicate`` until it returns something truthy (returned) or ``timeout`` passes (None).

    The timeout is a hang guard: generous, so that a loaded machine is not a failure."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value or None
        time.sleep(interval)


class LoopbackHTTP:
    """``handler`` served on 127.0.0.1 from a daemon thread (fakes of servers we do not run)."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]):
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def drip_to(conn: socket.socket, pieces: Iterable[bytes], every_s: float, stop: threading.Event) -> None:
    """Send ``pieces`` on a raw connection, ``every_s`` apart, until ``stop`` (a server below HTTP
    that answers one byte at a time); a client that hangs up is fine."""
    for piece in pieces:
        if stop.is_set():
            return
        try:
            conn.sendall(piece)
        except OSError:
            return
        stop.wait(every_s)


def write_dripping(out: BinaryIO, pieces: Iterable[bytes], drip_s: float) -> None:
    """Write a body, in 256-byte pieces ``drip_s`` apart when dripping; a client that gives up is fine."""
    try:
        for piece in pieces:
            step = 256 if drip_s else len(piece) or 1
            for i in range(0, len(piece), step):
                out.write(piece[i:i + step])
                out.flush()
                time.sleep(drip_s)
    except (BrokenPipeError, ConnectionResetError):
        pass                                        # the client gave up: what it should do

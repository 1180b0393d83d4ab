"""The /metrics pages of the node agent and of the checkpoint engine (``ckpt.listening``) cannot
be exhausted: idle connections, a connection that drips its request, or accept() running out of
file descriptors never keep a real scrape out. Real servers on 127.0.0.1, real sockets; every
wait is a hang guard, not a timing assertion."""
from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckpt.listening import WAITING_TOTAL, MetricsServer

REPO = Path(__file__).resolve().parent.parent
KINDS = {  # how each server is made: a statement that leaves ``owner`` (to close) and ``server``
    "agent exporter": "from agents.exporter import Exporter\nfrom agents.stats import AgentStats\n"
                      "owner = Exporter(AgentStats()); owner.serve(0); server = owner.server",
    "checkpoint metrics": "from ckpt.save.metrics import CheckpointMetrics\n"
                          "owner = CheckpointMetrics(0); owner.serve(0); server = owner.server",
}


@pytest.fixture(params=list(KINDS))
def served(request) -> Iterator[MetricsServer]:
    scope: dict = {}
    exec(KINDS[request.param], scope)
    try:
        yield scope["server"]
    finally:
        scope["owner"].close()


def scrape(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        assert r.status == 200
        return r.read()


def wait_closed(socks: list[socket.socket], at_least: int, guard_s: float) -> int:
    """How many of ``socks`` the server has closed (EOF), waiting until ``at_least`` are or the guard ends."""
    open_, closed, end = list(socks), 0, time.monotonic() + guard_s
    while open_ and closed < at_least and time.monotonic() < end:
        readable, _, _ = select.select(open_, [], [], 1.0)
        for s in readable:
            try:
                data = s.recv(4096)
            except ConnectionError:
                data = b""
            if not data:
                open_.remove(s)
                closed += 1
    return closed


def test_two_hundred_idle_connections_do_not_keep_a_scrape_out(served: MetricsServer) -> None:
    """200 idle connections from 5 loopback addresses: the scrape answers, and the server holds
    no more of them than its cap (the rest are pushed out, well before the request timeout)."""
    served.request_timeout_s = 120.0  # what closes them here is the cap, not the timeout
    port = served.server_address[1]
    idle = [socket.create_connection(("127.0.0.1", port), timeout=60, source_address=(f"127.0.0.{1 + i % 5}", 0))
            for i in range(200)]
    try:
        assert b"# TYPE" in scrape(served.server_address[1])
        closed = wait_closed(idle, len(idle) - WAITING_TOTAL, guard_s=60)
        assert closed >= len(idle) - WAITING_TOTAL, f"{closed} of 200 idle connections closed"
        assert getattr(served, "dropped", 0) >= closed
    finally:
        for s in idle:
            s.close()


def test_a_connection_that_drips_its_request_is_closed(served: MetricsServer) -> None:
    served.request_timeout_s = 1.0
    with socket.create_connection(("127.0.0.1", served.server_address[1]), timeout=60) as drip:
        closed_at = None
        for byte in b"GET /metrics HTTP/1.0\r\nX-Slow: " + b"x" * 200:
            try:
                drip.sendall(bytes([byte]))
            except OSError:  # closed by the server
                closed_at = byte
                break
            if select.select([drip], [], [], 0.2)[0] and not drip.recv(4096):
                closed_at = byte
                break
        assert closed_at is not None, "the server kept a connection that never finished its request"
    assert b"# TYPE" in scrape(served.server_address[1])


CHILD = """
import os, resource, sys
{make}
server.request_timeout_s = 2.0
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 6, hard))
print(server.server_address[1], flush=True)
sys.stdin.read()  # until the test is done
print("accept_errors", getattr(server, "accept_errors", None), flush=True)
owner.close()
"""


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_scrape_answers_while_idle_connections_exhaust_the_file_descriptors(kind: str) -> None:
    """The server's process has a few file descriptors to spare; 40 idle connections take them
    (accept() fails with EMFILE) and stay open: the scrape still answers (the idle ones are
    closed after the request timeout, freeing descriptors), and again once they are gone."""
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(make=KINDS[kind])], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    idle: list[socket.socket] = []
    try:
        port = int(child.stdout.readline() or 0)
        assert port, child.stderr.read()[-2000:] if child.poll() is not None else "no port"
        idle = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(40)]
        assert b"# TYPE" in scrape(port)
        for s in idle:
            s.close()
        assert b"# TYPE" in scrape(port)
        out, err = child.communicate("", timeout=120)
        assert child.returncode == 0, err[-2000:]
        assert "accept_errors" in out and "accept_errors 0" not in out, out + err
    finally:
        for s in idle:
            s.close()
        if child.poll() is None:
            child.kill()
            child.wait()

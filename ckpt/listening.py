"""Listeners that cannot be exhausted: what every accept loop of ours shares.

``TRANSIENT_ACCEPT_ERRORS`` are the accept() failures that mean the machine is short of
something for a while (file descriptors, memory) or one connection went before it was taken:
wait, then go on (the peer server, the lifeline, and the metrics pages below).

``MetricsServer`` is the /metrics page of the node agent and of the checkpoint engine: a
threaded HTTP server whose accept loop pauses on those errors (logged once) instead of
spinning or ending, whose connections must send a complete request within
``request_timeout_s`` (a few seconds; a scrape sends its request at once), and whose
connections still waiting for their request are capped per address and in total (a new one
pushes out the oldest), so idle sockets never keep a real scrape out. torch-free: the agent
imports it.
"""
from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)

TRANSIENT_ACCEPT_ERRORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EPROTO}
REQUEST_S = 5.0  # a connection with no complete request by then is closed
WAITING_PER_ADDRESS, WAITING_TOTAL = 16, 64  # connections waiting for their request, held at once
PAUSE_S = 0.5  # accept() is not retried sooner after a transient failure


class MetricsServer(ThreadingHTTPServer):
    """GET /metrics answers ``render()`` (body, content type); any other path a 404. Bound at
    construction (port 0 picks one: ``port``), serving on a daemon thread after ``start``."""

    daemon_threads = True
    request_queue_size = 1024  # a flood waits in the kernel's queue, not in SYN retries

    def __init__(self, addr: str, port: int, render: Callable[[], tuple[bytes, str]], *, name: str,
                 request_timeout_s: float = REQUEST_S) -> None:
        self.render, self.request_timeout_s, self._name = render, request_timeout_s, name
        self._waiting: dict[socket.socket, tuple[str, float]] = {}  # no request yet -> address, accepted at
        self._guard = threading.Lock()
        self._paused = False
        self.accept_errors = 0  # accept() failures waited out
        self.dropped = 0  # connections closed with no complete request: too slow, or pushed out
        super().__init__((addr, port), _Handler)
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.5}, name=name,
                                        daemon=True)

    @property
    def port(self) -> int:
        return self.server_address[1]

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self.shutdown()
        self.server_close()

    def get_request(self) -> tuple[socket.socket, tuple]:
        try:
            conn, peer = super().get_request()
        except OSError as e:
            if e.errno in TRANSIENT_ACCEPT_ERRORS:
                self.accept_errors += 1
                if not self._paused:
                    log.warning("%s cannot accept a connection now (%s); pausing %.1f s each time until it can",
                                self._name, e, PAUSE_S)
                self._paused = True
                time.sleep(PAUSE_S)  # serve_forever would select() the same pending connection again at once
            raise  # socketserver drops this attempt and goes on serving
        self._paused = False
        with self._guard:
            mine = [c for c, (a, _) in self._waiting.items() if a == peer[0]]
            if len(mine) >= WAITING_PER_ADDRESS:
                self._drop(mine[0])
            elif len(self._waiting) >= WAITING_TOTAL:
                self._drop(next(iter(self._waiting)))
            self._waiting[conn] = (peer[0], time.monotonic())
        return conn, peer

    def service_actions(self) -> None:
        """Each turn of the accept loop (at least every poll interval): close the connections
        whose request has not come in time."""
        late = time.monotonic() - self.request_timeout_s
        with self._guard:
            for conn in [c for c, (_, since) in self._waiting.items() if since < late]:
                self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        """Under the guard: the handler's read ends (EOF) and it closes the socket; it cannot
        have closed it yet, since it leaves ``_waiting`` (under the guard) first."""
        del self._waiting[conn]
        self.dropped += 1
        if self.dropped == 1:
            log.warning("%s closed a connection that sent no complete request within %.0f s (or was pushed out "
                        "by newer ones); logged once, counted in dropped", self._name, self.request_timeout_s)
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def requested(self, conn: socket.socket) -> None:
        with self._guard:
            self._waiting.pop(conn, None)

    def shutdown_request(self, request: socket.socket) -> None:  # type: ignore[override]
        self.requested(request)
        super().shutdown_request(request)


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer

    def setup(self) -> None:
        self.timeout = self.server.request_timeout_s  # each read and write; the whole request: service_actions
        super().setup()

    def log_message(self, *args) -> None:
        pass

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if ok:
            self.server.requested(self.connection)
        return ok

    def do_GET(self) -> None:
        if self.path.split("?")[0] != "/metrics":
            body, ctype, code = b"see /metrics\n", "text/plain", 404
        else:
            (body, ctype), code = self.server.render(), 200
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

"""Test helpers for agents/: a real HTTP receiver of the wire format on 127.0.0.1.

It implements SCHEMA.md "On the wire" independently of agents.wire (plain
gzip + pyarrow.ipc), so the agent is checked against the contract, not itself.
"""
from __future__ import annotations

import collections
import gzip
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow as pa

TOKEN = "agent-test-token"


class Receiver:
    """Collects batches; ``stop()`` and ``start()`` simulate an outage on the same port."""

    def __init__(self, max_bytes: int = 16 << 20):
        self.max_bytes = max_bytes
        self.tables: dict[str, list[pa.Table]] = {"/v1/telemetry": [], "/v1/xid": []}
        self.batch_ids: set[str] = set()
        self.duplicates = 0
        self.statuses: collections.Counter = collections.Counter()
        self.forced: collections.deque[int] = collections.deque()  # answer these codes next
        self.lock = threading.Lock()
        self.port = 0
        self.connections: set[socket.socket] = set()
        self._server: ThreadingHTTPServer | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), _handler(self))
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self.lock:  # a real outage also cuts kept-alive connections
            for conn in self.connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self.connections.clear()

    def rows(self, path: str = "/v1/telemetry") -> pa.Table:
        with self.lock:
            tables = list(self.tables[path])
        return pa.concat_tables(tables) if tables else None

    def count(self, path: str = "/v1/telemetry") -> int:
        with self.lock:
            return sum(t.num_rows for t in self.tables[path])


def _handler(rx: Receiver):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep pytest output clean
            pass

        def setup(self):
            super().setup()
            with rx.lock:
                rx.connections.add(self.connection)

        def _answer(self, code: int, text: str = "") -> None:
            body = text.encode()
            with rx.lock:
                rx.statuses[code] += 1
            self.send_response(code)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path not in rx.tables:
                return self._answer(404, "no such endpoint")
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                return self._answer(401, "bad token")
            with rx.lock:
                forced = rx.forced.popleft() if rx.forced else None
            if forced:
                return self._answer(forced, f"forced {forced}")
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if len(body) > rx.max_bytes:
                return self._answer(413, "too large")
            if self.headers.get("Content-Type") != "application/vnd.apache.arrow.stream":
                return self._answer(400, "expected an Arrow IPC stream")
            try:
                table = pa.ipc.open_stream(body).read_all()
            except pa.ArrowInvalid as e:
                return self._answer(400, f"not an Arrow IPC stream: {e}")
            batch_id = self.headers.get("X-Batch-Id")
            if not batch_id:
                return self._answer(400, "X-Batch-Id missing")
            with rx.lock:
                if batch_id in rx.batch_ids:
                    rx.duplicates += 1
                else:
                    rx.batch_ids.add(batch_id)
                    rx.tables[self.path].append(table)
            self._answer(200, "ok")

    return Handler

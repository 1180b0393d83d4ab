"""Ships samples and XID events to the predictor, through the spool, in order.

One background thread: it turns buffered rows into batches (samples every
``batch_s``, XID events at once, since a critical XID is the most urgent news an
agent has), spools each batch, and sends the spool's head until the spool is
empty. Answers follow SCHEMA.md: 2xx done; 400 set aside and counted (it must
never block later batches); 413 split in two; anything else (401/403, 429, 5xx,
no answer) retried with capped exponential backoff and full jitter, while new
batches keep spooling behind it.
"""
from __future__ import annotations

import http.client
import logging
import random
import threading
import time
from urllib.parse import urlsplit

from agents import wire
from agents.spool import Entry, Spool
from agents.stats import AgentStats
from telemetry.wire import ARROW_STREAM, ENDPOINTS

log = logging.getLogger(__name__)


class _Connection:
    """A kept-alive HTTP(S) connection to the predictor, reopened after any error."""

    def __init__(self, base_url: str, timeout_s: float):
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"predictor URL must be http(s)://host[:port][/prefix], got {base_url!r}")
        self._cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        self._host, self._port, self._prefix = u.hostname, u.port, u.path.rstrip("/")
        self._timeout, self._conn = timeout_s, None

    def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, str, dict[str, str]]:
        if self._conn is None:
            self._conn = self._cls(self._host, self._port, timeout=self._timeout)
        try:
            self._conn.request("POST", self._prefix + path, body=body, headers=headers)
            resp = self._conn.getresponse()
            text = resp.read(4096).decode("utf-8", "replace")
            if resp.will_close:
                self.close()
            return resp.status, text, dict(resp.getheaders())
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class Sender:
    """Batches rows to ``{url}/v1/telemetry`` and ``{url}/v1/xid`` via ``spool``."""

    def __init__(self, url: str, token: str, spool: Spool, stats: AgentStats, *, batch_s: float = 10.0,
                 max_batch_rows: int = 20_000, timeout_s: float = 10.0, backoff_s: tuple[float, float] = (0.5, 30.0)):
        self._http = _Connection(url, timeout_s)
        self._timeout_s = timeout_s
        self._token, self.spool, self.stats = token, spool, stats
        self.batch_s, self.max_batch_rows, self.backoff_s = batch_s, max_batch_rows, backoff_s
        self._rows: dict[str, list[dict]] = {"telemetry": [], "xid": []}
        self._oldest = 0.0  # monotonic time of the oldest buffered sample
        self._cond = threading.Condition()
        self._stop = False
        self._failures = 0  # consecutive failed attempts on the spool head
        self._retry_at = 0.0
        self._thread = threading.Thread(target=self._run, name="agents-sender", daemon=True)
        self._thread.start()

    # -- called by the sampler ----------------------------------------------------

    def put(self, samples: list[dict], xids: list[dict]) -> None:
        with self._cond:
            if samples and not self._rows["telemetry"]:
                self._oldest = time.monotonic()
            self._rows["telemetry"] += samples
            self._rows["xid"] += xids
            self._cond.notify()

    def close(self, drain_s: float = 5.0) -> None:
        """Spool what is buffered, try for ``drain_s`` to send the spool, then stop.

        Whatever is left stays in the spool for the next start.
        """
        deadline = time.monotonic() + drain_s
        with self._cond:
            self._spool_buffered(force=True)
            self._retry_at = min(self._retry_at, time.monotonic())
            self._cond.notify()
        while len(self.spool) and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=self._timeout_s + 1)
        self._http.close()

    # -- the thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                with self._cond:
                    if self._stop:
                        return
                    self._spool_buffered(force=False)
                    head = self.spool.head() if time.monotonic() >= self._retry_at else None
                    if head is None:
                        self._cond.wait(timeout=self._next_wake())
                        continue
                self._send(head)
            except Exception:  # a bug or a broken disk must not silently end shipping
                log.exception("sender loop failed; retrying in %.0fs", self.backoff_s[1])
                with self._cond:
                    self._cond.wait(timeout=self.backoff_s[1])

    def _next_wake(self) -> float:
        now, waits = time.monotonic(), [30.0]  # put() and close() notify: idle means asleep
        if self._rows["telemetry"]:
            waits.append(self._oldest + self.batch_s - now)
        if len(self.spool):
            waits.append(self._retry_at - now)
        return max(0.001, min(waits))

    def _spool_buffered(self, force: bool) -> None:
        """Under the lock: turn buffered rows into spooled batches when due."""
        due = {"xid": bool(self._rows["xid"]),
               "telemetry": bool(self._rows["telemetry"]) and (force or time.monotonic() - self._oldest >= self.batch_s
                                                              or len(self._rows["telemetry"]) >= self.max_batch_rows)}
        for kind, is_due in due.items():
            if not is_due:
                continue
            rows, self._rows[kind] = self._rows[kind], []
            for i in range(0, len(rows), self.max_batch_rows):
                table, bad = wire.to_table(kind, rows[i:i + self.max_batch_rows])
                if bad:
                    log.error("dropped %d %s row(s) the wire schema cannot hold, e.g. %s: %s", len(bad), kind,
                              {k: bad[0][0].get(k) for k in ("node", "gpu", "timestamp")}, bad[0][1])
                    self.stats.add(**{_counter(kind, "dropped"): len(bad)})
                if not table.num_rows:
                    continue
                try:
                    self._count_dropped(self.spool.push(kind, wire.encode(table), table.num_rows))
                except OSError as e:  # disk full, spool removed: these rows cannot be kept
                    log.error("cannot spool a %s batch of %d rows (%s): dropped", kind, table.num_rows, e)
                    self.stats.add(**{_counter(kind, "dropped"): table.num_rows})

    def _count_dropped(self, dropped: list[Entry]) -> None:
        for e in dropped:
            self.stats.add(**{_counter(e.kind, "dropped"): e.rows})
        if dropped:
            log.warning("spool over %d bytes: dropped the %d oldest batches (%d rows)",
                        self.spool.max_bytes, len(dropped), sum(e.rows for e in dropped))

    def _send(self, entry: Entry) -> None:
        headers = {"Content-Type": ARROW_STREAM, "Content-Encoding": "gzip",
                   "Authorization": f"Bearer {self._token}", "X-Batch-Id": entry.batch_id}
        try:
            status, text, resp_headers = self._http.post(ENDPOINTS[entry.kind], entry.read(), headers)
        except FileNotFoundError:  # dropped from the spool while we looked at it
            return
        except (OSError, http.client.HTTPException) as e:
            self._retry(entry, f"no answer: {e}")
            return
        if 200 <= status < 300:
            self.spool.pop(entry)
            self.stats.add(**{_counter(entry.kind, "sent"): entry.rows, "batches_sent": 1})
            if self._failures:
                log.warning("predictor answers again after %d failed attempts; %d batches spooled",
                            self._failures, len(self.spool))
            self._failures = 0
        elif status == 400:
            log.error("predictor refused a %s batch of %d rows as malformed (set aside): %s",
                      entry.kind, entry.rows, text.strip())
            self.spool.set_aside(entry)
            self.stats.add(**{_counter(entry.kind, "rejected"): entry.rows})
        elif status == 413 and entry.rows > 1:
            try:
                table = wire.decode(entry.read())
            except (OSError, ValueError) as e:  # pyarrow.ArrowInvalid is a ValueError
                log.error("spooled batch %s is unreadable (%s): set aside", entry.path, e)
                self.spool.set_aside(entry)
                self.stats.add(**{_counter(entry.kind, "rejected"): entry.rows})
                return
            mid = table.num_rows // 2
            self.spool.split(entry, [(wire.encode(table.slice(0, mid)), mid),
                                     (wire.encode(table.slice(mid)), table.num_rows - mid)])
        elif status == 413:
            log.error("predictor refused a single %s row as too large (set aside)", entry.kind)
            self.spool.set_aside(entry)
            self.stats.add(**{_counter(entry.kind, "rejected"): 1})
        else:
            self._retry(entry, f"HTTP {status}: {text.strip()[:200]}", resp_headers.get("Retry-After"))

    def _retry(self, entry: Entry, why: str, retry_after: str | None = None) -> None:
        self.stats.add(send_errors=1)
        lo, hi = self.backoff_s
        delay = random.uniform(0, min(hi, lo * 2 ** self._failures))  # full jitter
        if retry_after and retry_after.isdigit():
            delay = max(delay, min(hi, float(retry_after)))
        self._failures += 1
        loud = self._failures <= 3 or self._failures % 100 == 0
        (log.warning if loud else log.debug)(
            "sending %s batch %s failed (%s); %d batches spooled, retry in %.1fs",
            entry.kind, entry.batch_id, why, len(self.spool), delay)
        with self._cond:
            self._retry_at = time.monotonic() + delay


def _counter(kind: str, what: str) -> str:
    return f"{'samples' if kind == 'telemetry' else 'xid_events'}_{what}"

"""Accepted batches → vectorised scoring passes in one worker thread.

Handlers queue a decoded batch and await its future; one task drains everything
queued into the scorer, so the batches that arrive while one pass runs become the
next pass (the busier the service, the larger and cheaper per sample the passes).
A batch's future resolves once its rows are scored: a sender's requests in flight
bound the queue, and an answer means the risk is current.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from threadpoolctl import threadpool_limits

from predictor.ingest.wire import timestamps_ms
from predictor.model.scoring import Scored, Scorer, Xids
from predictor.serve.metrics import ServiceMetrics
from telemetry.wire import XID_KEYS

log = logging.getLogger(__name__)
#: One scoring pass takes queued batches up to this many samples (at least one batch):
#: it bounds the pass's memory and the wait of the batches behind it.
MAX_PASS_SAMPLES = 100_000


class Stopping(Exception):
    """The service stopped before a queued batch was scored."""


@dataclass
class _Pending:
    kind: str                        # "telemetry" | "xid"
    table: pa.Table
    received: float                  # time.perf_counter() at receipt
    scored: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class ScoringQueue:
    """The queue between the handlers and the scorer thread; `on_scored(risk_before, scored)`
    publishes each pass's results on the event loop."""

    def __init__(self, scorer: Scorer, metrics: ServiceMetrics,
                 on_scored: Callable[[np.ndarray, Scored], Awaitable[None]]):
        self.scorer = scorer
        self.metrics = metrics
        self.on_scored = on_scored
        self.stopping = False
        self._pending: list[_Pending] = []
        self._rows = 0
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="scorer", initializer=_one_native_thread)
        self._task: asyncio.Task | None = None

    @property
    def pending_rows(self) -> int:
        """Samples accepted and not yet scored."""
        return self._rows

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    def stop(self) -> None:
        """Cancel the loop; batches still queued fail with Stopping (their senders retry)."""
        if self._task:
            self._task.cancel()
        self.stopping = True
        for it in self._pending:
            if not it.scored.done():
                it.scored.set_exception(Stopping())
        self._executor.shutdown(wait=False, cancel_futures=True)

    def submit(self, kind: str, table: pa.Table) -> asyncio.Future:
        """Queue a validated batch; the future resolves once it is scored (Stopping if it never will be)."""
        if self.stopping:
            raise Stopping()
        item = _Pending(kind, table, time.perf_counter())
        self._pending.append(item)
        self._rows += table.num_rows
        self._wake.set()
        return item.scored

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            items = self._take()
            if not items:
                continue
            try:
                before = self.scorer.risk.copy()
                started = time.perf_counter()
                scored = await loop.run_in_executor(self._executor, self._score, items)
                self.metrics.scoring_cycle(time.perf_counter() - started)
                await self.on_scored(before, scored)
            except Exception:                       # a bug must not stop scoring for good
                log.exception("scoring cycle failed")
            finally:                                # answered even when stopped mid-pass
                done = time.perf_counter()
                for it in items:
                    self.metrics.latency(done - it.received)
                    if not it.scored.done():
                        it.scored.set_result(None)

    def _take(self) -> list[_Pending]:
        """The oldest queued batches, up to MAX_PASS_SAMPLES (at least one); wake again if some remain."""
        rows, n = 0, 0
        while n < len(self._pending) and (n == 0 or rows + self._pending[n].table.num_rows <= MAX_PASS_SAMPLES):
            rows += self._pending[n].table.num_rows
            n += 1
        items, self._pending = self._pending[:n], self._pending[n:]
        self._rows -= rows
        if not self._pending:
            self._wake.clear()
        return items

    def _score(self, items: list[_Pending]) -> Scored:
        """Runs in the scorer thread: the batches taken become one scoring pass."""
        tel = [it.table for it in items if it.kind == "telemetry"]
        xid = [it.table for it in items if it.kind == "xid"]
        xids = Xids.from_table(_concat([t.select(list(XID_KEYS)) for t in xid])) if xid else None
        samples_before = self.scorer.samples
        scored = self.scorer.score_table(_concat(tel), xids) if tel else self.scorer.add_xids(xids)
        self.metrics.scored(self.scorer.samples - samples_before, scored.dropped)
        return scored


def _one_native_thread() -> None:
    """The scorer thread runs the model's OpenMP loops on itself alone: the other core is
    the event loop's, and on a busy machine OpenMP threads waiting on each other cost
    many times the work (measured: 12x the CPU per prediction on 2 shared cores)."""
    threadpool_limits(1, user_api="openmp")


def _concat(tables: list[pa.Table]) -> pa.Table:
    """One table from many senders' batches, in arrival order; their column sets and types may differ.

    Runs of batches with one schema (the common case: agents share theirs) are joined
    first without type promotion, which costs a tenth as much per batch."""
    runs: list[list[pa.Table]] = []
    for t in tables:
        if runs and t.schema.equals(runs[-1][0].schema):
            runs[-1].append(t)
        else:
            runs.append([t])
    parts = [pa.concat_tables(run) for run in runs]
    if len(parts) == 1:
        return parts[0]
    try:
        return pa.concat_tables(parts, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.concat_tables([_plain(t) for t in parts], promote_options="permissive")


def _plain(table: pa.Table) -> pa.Table:
    """Dictionary node names as strings, numbers as float64/int64: the common denominator."""
    cols = {}
    for name, col in zip(table.column_names, table.columns):
        if name == "timestamp":
            cols[name] = pa.array(timestamps_ms(col), pa.timestamp("ms", tz="UTC"))
        elif name in ("node", "uuid"):
            cols[name] = pc.cast(col, pa.string())
        elif pa.types.is_integer(col.type):
            cols[name] = pc.cast(col, pa.int64())
        elif pa.types.is_floating(col.type) or pa.types.is_null(col.type):
            cols[name] = pc.cast(col, pa.float64())
    return pa.table(cols)

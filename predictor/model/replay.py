"""Replay a recorded trace through the online scorer, strictly in time order.

Telemetry is streamed in row batches; rows at a batch's last timestamp wait for the
next batch so that the chunks the scorer sees never depend on where Parquet put its
batch boundaries. Each batch carries the XID events up to its last instant; the
scorer applies each before its GPU's first sample at or after it.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

from predictor.ingest.wire import timestamps_ms
from predictor.model.scoring import Scored, Scorer, Xids

ALARM_SCHEMA = pa.schema([
    ("timestamp", pa.timestamp("ms", tz="UTC")), ("node", pa.string()), ("gpu", pa.int16()),
    ("score", pa.float64()), ("reason", pa.string()),
])


def read_xids(trace_dir: str | Path, until_ms: int | None = None) -> pa.Table:
    """XID events sorted by time (empty when the trace has none)."""
    path = Path(trace_dir) / "xid.parquet"
    if not path.exists():
        return pa.table({"timestamp": pa.array([], pa.timestamp("ms", tz="UTC")), "node": pa.array([], pa.string()),
                         "gpu": pa.array([], pa.int16()), "xid": pa.array([], pa.int32())})
    t = pq.read_table(path, columns=["timestamp", "node", "gpu", "xid"])
    t = t.take(pc.sort_indices(t, [("timestamp", "ascending")]))
    if until_ms is not None:
        t = t.filter(pa.array(timestamps_ms(t.column("timestamp")) < until_ms))
    return t


def _telemetry_batches(path: Path, batch_rows: int) -> Iterator[pa.Table]:
    """Telemetry in time order: streamed when the file is sorted, else sorted in memory."""
    f = pq.ParquetFile(path)
    ts = timestamps_ms(pq.read_table(path, columns=["timestamp"]).column("timestamp"))
    if len(ts) and np.all(ts[1:] >= ts[:-1]):
        for b in f.iter_batches(batch_size=batch_rows):
            yield pa.Table.from_batches([b])
        return
    table = f.read()
    table = table.take(pa.array(np.argsort(ts, kind="stable")))
    for start in range(0, table.num_rows, batch_rows):
        yield table.slice(start, batch_rows)


def _aligned(batches: Iterator[pa.Table]) -> Iterator[pa.Table]:
    """Re-cut batches so that no timestamp straddles two of them."""
    carry = None
    for b in batches:
        if carry is not None:
            b = pa.concat_tables([carry, b])
        ts = timestamps_ms(b.column("timestamp"))
        cut = int(np.searchsorted(ts, ts[-1], side="left")) if len(ts) else 0
        carry = b.slice(cut)
        if cut:
            yield b.slice(0, cut)
    if carry is not None and carry.num_rows:
        yield carry


def _of_nodes(table: pa.Table, nodes: set[str] | None) -> pa.Table:
    if nodes is None:
        return table
    return table.filter(pc.is_in(pc.cast(table.column("node"), pa.string()), pa.array(sorted(nodes), pa.string())))


def replay(trace_dir: str | Path, scorer: Scorer, on_scored: Callable[[Scored], None],
           until_ms: int | None = None, nodes: set[str] | None = None, batch_rows: int = 200_000,
           progress: bool | None = None) -> None:
    """Feed a trace (optionally some nodes only, optionally only before `until_ms`) to `scorer`;
    `on_scored` sees every scored batch, in time order."""
    trace_dir = Path(trace_dir)
    tel = trace_dir / "telemetry.parquet"
    xids = Xids.from_table(_of_nodes(read_xids(trace_dir, until_ms), nodes))
    xi = 0
    bar = tqdm(total=pq.ParquetFile(tel).metadata.num_rows, unit="row", desc=f"replay {trace_dir.name}",
               disable=not (sys.stderr.isatty() if progress is None else progress))
    for batch in _aligned(_telemetry_batches(tel, batch_rows)):
        bar.update(batch.num_rows)
        batch = _of_nodes(batch, nodes)
        if batch.num_rows == 0:
            continue
        ts = timestamps_ms(batch.column("timestamp"))
        if until_ms is not None and ts[0] >= until_ms:
            break
        if until_ms is not None and ts[-1] >= until_ms:
            batch = batch.slice(0, int(np.searchsorted(ts, until_ms)))
            ts = ts[: batch.num_rows]
        # the XIDs up to this batch's last instant go with it (the scorer interleaves them)
        xj = int(np.searchsorted(xids.t_ms, ts[-1], side="right"))
        on_scored(scorer.score_table(batch, _xid_slice(xids, xi, xj)))
        xi = xj
    if xi < len(xids):
        on_scored(scorer.add_xids(_xid_slice(xids, xi, len(xids))))
    bar.close()


def _xid_slice(xids: Xids, start: int, stop: int) -> Xids:
    return Xids(xids.t_ms[start:stop], xids.nodes[start:stop], xids.gpus[start:stop], xids.codes[start:stop])


def score_trace(trace_dir: str | Path, scorer: Scorer, threshold: float | None = None,
                until_ms: int | None = None, nodes: set[str] | None = None,
                progress: bool | None = None) -> pa.Table:
    """Alarms (timestamp, node, gpu, score, reason): every scored instant at or above `threshold`."""
    thr = scorer.model.sensitive if threshold is None else threshold
    cols: dict[str, list] = {"timestamp": [], "slot": [], "score": [], "reason": []}

    def collect(scored: Scored) -> None:
        hot = np.flatnonzero(scored.risk >= thr)
        if len(hot):
            cols["timestamp"].append(scored.t_ms[hot])
            cols["slot"].append(scored.slots[hot])
            cols["score"].append(scored.risk[hot])
            cols["reason"] += [scored.reasons[i] for i in hot]

    replay(trace_dir, scorer, collect, until_ms=until_ms, nodes=nodes, progress=progress)
    return alarms_table(scorer, cols)


def alarms_table(scorer: Scorer, cols: dict[str, list]) -> pa.Table:
    """Collected alarm rows as the ALARM_SCHEMA table, in time order."""
    if not cols["timestamp"]:
        return ALARM_SCHEMA.empty_table()
    t = np.concatenate(cols["timestamp"])
    slots = np.concatenate(cols["slot"])
    order = np.lexsort((slots, t))
    keys = [scorer.state.slot_key[s] for s in slots[order].tolist()]
    return pa.table({
        "timestamp": pa.array(t[order], pa.timestamp("ms", tz="UTC")),
        "node": pa.array([k[0] for k in keys], pa.string()),
        "gpu": pa.array([k[1] for k in keys], pa.int16()),
        "score": pa.array(np.concatenate(cols["score"])[order], pa.float64()),
        "reason": pa.array([cols["reason"][i] for i in order.tolist()], pa.string()),
    }, schema=ALARM_SCHEMA)

"""Decoding and validating agent batches (SCHEMA.md "On the wire").

Everything here raises `BadBatch` (→ 400, with the reason) or `TooLarge` (→ 413);
nothing is half-accepted: a batch either validates completely or is refused.
"""
from __future__ import annotations

import json
import math
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from telemetry import wire as contract
from telemetry.schema import MAX_GPUS_PER_NODE, METRICS
from telemetry.wire import ARROW_STREAM, NDJSON, TELEMETRY_KEYS

MAX_GPU_INDEX = MAX_GPUS_PER_NODE - 1
#: Samples and XIDs stamped further ahead of this server's clock are refused: a GPU's state
#: only moves forward in time, so one far-future sample would hide all of its later ones.
MAX_AHEAD_S = 300.0
#: Timestamps are epoch milliseconds from 1970 to the end of year 9999 (what a date can say).
MAX_TIMESTAMP_MS = 253_402_300_799_999
#: A node name is a host name: at most 253 bytes (DNS, and Kubernetes node names).
MAX_NODE_NAME = 253


class BadBatch(ValueError):
    """The batch is malformed and will never be accepted."""


class TooLarge(ValueError):
    """The batch is over the size cap: split and resend."""


def timestamps_ms(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Epoch milliseconds from any Arrow timestamp unit (or plain integers, taken as ms)."""
    if pa.types.is_timestamp(col.type):
        col = pc.cast(col, pa.timestamp("ms", tz=col.type.tz), safe=False)
    return np.asarray(pc.cast(col, pa.int64()).to_numpy(zero_copy_only=False), dtype=np.int64)


def check_not_ahead(table: pa.Table, now_ms: int, ahead_s: float = MAX_AHEAD_S) -> None:
    """BadBatch if any row is stamped more than `ahead_s` after `now_ms` (clocks drift; a year does not)."""
    latest = int(timestamps_ms(table.column("timestamp")).max())
    if latest > now_ms + ahead_s * 1000:
        raise BadBatch(f"timestamp {datetime.fromtimestamp(latest / 1000, timezone.utc).isoformat()} is "
                       f"{(latest - now_ms) / 1000:.0f} s ahead of this server's clock (at most {ahead_s:.0f} s, "
                       "serve --max-ahead)")


_MS_PER_UNIT = {"s": 1000, "ms": 1, "us": 1 / 1000, "ns": 1 / 1_000_000}


def _check_timestamp_range(col: pa.ChunkedArray) -> None:
    """BadBatch unless every timestamp is between 1970 and 9999: an unsigned 2**64-1 or a far
    date would overflow the millisecond conversion, or every date printed from it."""
    unit = _MS_PER_UNIT[col.type.unit] if pa.types.is_timestamp(col.type) else 1
    raw = col.cast(pa.int64()) if pa.types.is_timestamp(col.type) else col
    lo_hi = pc.min_max(raw).as_py()
    for v in (lo_hi["min"], lo_hi["max"]):
        if not 0 <= v * unit <= MAX_TIMESTAMP_MS:
            raise BadBatch(f"timestamp {v} is out of range (epoch ms 0..{MAX_TIMESTAMP_MS})")


def decompress(body: bytes, encoding: str | None, cap: int) -> bytes:
    """Undo Content-Encoding, refusing to inflate past `cap` bytes (zip bombs included)."""
    enc = (encoding or "identity").strip().lower()
    if enc == "identity":
        if len(body) > cap:
            raise TooLarge(f"body is {len(body)} bytes, over the {cap}-byte cap")
        return body
    if enc not in ("gzip", "x-gzip"):
        raise BadBatch(f"unsupported Content-Encoding {encoding!r} (gzip or none)")
    try:
        return contract.inflate(body, cap)
    except contract.OverCap as e:
        raise TooLarge(str(e)) from None
    except contract.Corrupt as e:
        raise BadBatch(str(e)) from None


def decode(body: bytes, content_type: str | None, keys: tuple[str, ...]) -> pa.Table:
    """An Arrow IPC stream or NDJSON body as a validated table with `keys` columns."""
    ctype = (content_type or "").split(";")[0].strip().lower()
    if ctype == ARROW_STREAM:
        try:
            table = pa.ipc.open_stream(body).read_all()
        except (pa.ArrowInvalid, pa.ArrowException, OSError) as e:
            raise BadBatch(f"not a readable Arrow IPC stream: {e}") from None
    elif ctype in (NDJSON, "application/json", "application/jsonl"):
        table = _from_ndjson(body, keys)
    else:
        raise BadBatch(f"unsupported Content-Type {content_type!r} ({ARROW_STREAM} or {NDJSON})")
    return _validated(table, keys)


def _timestamp_ms(value, line: int) -> int:
    if isinstance(value, bool) or value is None:
        raise BadBatch(f"line {line}: timestamp missing")
    if isinstance(value, float) and not math.isfinite(value):
        raise BadBatch(f"line {line}: timestamp {json.dumps(value)} is not a finite number")
    if isinstance(value, (int, float)):
        if not 0 <= value <= MAX_TIMESTAMP_MS:
            raise BadBatch(f"line {line}: timestamp {json.dumps(value)} is out of range "
                           f"(epoch ms 0..{MAX_TIMESTAMP_MS})")
        return int(value)
    if isinstance(value, str):
        try:
            dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise BadBatch(f"line {line}: timestamp {value!r} is neither RFC 3339 nor epoch ms") from None
        if dt.tzinfo is None:
            raise BadBatch(f"line {line}: timestamp {value!r} has no time zone")
        ms = int(dt.timestamp() * 1000)
        if not 0 <= ms <= MAX_TIMESTAMP_MS:
            raise BadBatch(f"line {line}: timestamp {value!r} is before 1970")
        return ms
    raise BadBatch(f"line {line}: timestamp {value!r} is neither RFC 3339 nor epoch ms")


def _field(rec: dict, key: str, line: int):
    """A key column's value, of its type: gpu and xid integers (not 1.5, not true), node a string."""
    value = rec[key]
    if key == "node":
        if not isinstance(value, str):
            raise BadBatch(f"line {line}: node {value!r} is not a string")
    elif isinstance(value, bool) or not isinstance(value, int):
        raise BadBatch(f"line {line}: {key} {value!r} is not an integer")
    return value


def _from_ndjson(body: bytes, keys: tuple[str, ...]) -> pa.Table:
    extra = METRICS + ("uuid",) if keys == TELEMETRY_KEYS else ()
    cols: dict[str, list] = {k: [] for k in keys + extra}
    for n, raw in enumerate(body.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadBatch(f"line {n}: not JSON: {e}") from None
        if not isinstance(rec, dict):
            raise BadBatch(f"line {n}: expected a JSON object")
        for k in keys:
            if rec.get(k) is None:
                raise BadBatch(f"line {n}: missing {k!r}")
        cols["timestamp"].append(_timestamp_ms(rec["timestamp"], n))
        for k in keys[1:]:
            cols[k].append(_field(rec, k, n))
        for k in extra:
            cols[k].append(rec.get(k))
    if not cols["timestamp"]:
        raise BadBatch("empty batch")
    try:
        arrays = {"timestamp": pa.array(cols["timestamp"], pa.int64()).cast(pa.timestamp("ms", tz="UTC")),
                  "node": pa.array(cols["node"], pa.string()), "gpu": pa.array(cols["gpu"], pa.int64())}
        if "xid" in keys:
            arrays["xid"] = pa.array(cols["xid"], pa.int64())
        for k in extra:
            arrays[k] = pa.array(cols[k], pa.string() if k == "uuid" else pa.float64())
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as e:
        raise BadBatch(f"a field has the wrong type: {e}") from None
    return pa.table(arrays)


def _validated(table: pa.Table, keys: tuple[str, ...]) -> pa.Table:
    """Checks per request, so each costs a few microseconds (numpy or one Arrow kernel)."""
    if table.num_rows == 0:
        raise BadBatch("empty batch")
    schema = table.schema
    names = set(schema.names)
    if len(names) < len(schema.names):
        dupes = sorted({n for n in schema.names if schema.names.count(n) > 1})
        raise BadBatch(f"duplicated column(s) {', '.join(dupes)}")
    missing = [k for k in keys if k not in names]
    if missing:
        raise BadBatch(f"missing column(s) {', '.join(missing)}")
    ts = schema.field("timestamp").type
    if not (pa.types.is_timestamp(ts) or pa.types.is_integer(ts)):
        raise BadBatch(f"timestamp has type {ts}, expected timestamp or epoch-ms integer")
    node_t = schema.field("node").type
    if not (pa.types.is_string(node_t) or pa.types.is_large_string(node_t)
            or (pa.types.is_dictionary(node_t) and pa.types.is_string(node_t.value_type))):
        raise BadBatch(f"node has type {node_t}, expected string")
    for k in keys[2:]:
        if not pa.types.is_integer(schema.field(k).type):
            raise BadBatch(f"{k} has type {schema.field(k).type}, expected integer")
    cols = {k: table.column(k) for k in keys}
    for k, col in cols.items():
        if col.null_count:
            raise BadBatch(f"{k} is null in {col.null_count} row(s)")
    _check_timestamp_range(cols["timestamp"])
    gpu = cols["gpu"].to_numpy()
    if gpu.min() < 0 or gpu.max() > MAX_GPU_INDEX:
        raise BadBatch(f"gpu index out of range 0..{MAX_GPU_INDEX} (at most {MAX_GPUS_PER_NODE} GPUs per node)")
    node = cols["node"] if not pa.types.is_dictionary(node_t) else pc.cast(cols["node"], pa.string())
    lengths = pc.min_max(pc.binary_length(node)).as_py()
    if lengths["min"] == 0:
        raise BadBatch("empty node name")
    if lengths["max"] > MAX_NODE_NAME:
        raise BadBatch(f"node name longer than {MAX_NODE_NAME} bytes ({lengths['max']})")
    for m in METRICS:
        if m in names:
            t = schema.field(m).type
            if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_null(t)):
                raise BadBatch(f"{m} has type {t}, expected a number")
    return table

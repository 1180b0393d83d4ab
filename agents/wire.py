"""Batches on the wire (SCHEMA.md "On the wire"): gzip'd Arrow IPC streams.

Arrow, not JSON lines, because a node's samples are columns of floats: the
stream is several times smaller and needs no parsing on the predictor.
"""
from __future__ import annotations

import gzip

import pyarrow as pa

from telemetry import schema as S
from telemetry.wire import GZIP_MAGIC, inflate

SCHEMAS = {"telemetry": S.TELEMETRY_SCHEMA, "xid": S.XID_SCHEMA}


def to_table(kind: str, rows: list[dict]) -> tuple[pa.Table, list[tuple[dict, str]]]:
    """Rows as dicts (timestamps in epoch milliseconds) to a table in the wire schema, and
    the rows it cannot hold (a GPU index past int16, a missing node) with the reason each.

    One such row must not cost the batch: when the whole batch does not convert, each row
    is tried alone (only then, so the usual batch costs one conversion).
    """
    schema = SCHEMAS[kind]
    try:
        return _strict_table(rows, schema), []
    except (pa.ArrowException, OverflowError, TypeError, ValueError):
        pass
    good, bad = [], []
    for row in rows:
        try:
            _strict_table([row], schema)
        except (pa.ArrowException, OverflowError, TypeError, ValueError) as e:
            bad.append((row, str(e)))
        else:
            good.append(row)
    return pa.Table.from_pylist(good, schema=schema), bad


def _strict_table(rows: list[dict], schema: pa.Schema) -> pa.Table:
    """``from_pylist``, which leaves nulls in non-nullable fields; the predictor refuses those batches."""
    table = pa.Table.from_pylist(rows, schema=schema)
    for f in schema:
        if not f.nullable and table.column(f.name).null_count:
            raise ValueError(f"{f.name} is missing")
    return table


def encode(table: pa.Table, level: int = 1) -> bytes:
    """One Arrow IPC stream, gzip'd (level 1: most of the gain for a fraction of the CPU)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return gzip.compress(sink.getvalue().to_pybytes(), compresslevel=level)


def decode(body: bytes, max_bytes: int | None = None) -> pa.Table:
    """Inverse of ``encode``; refuses bodies that inflate past ``max_bytes`` (ValueError)."""
    raw = inflate(body, max_bytes) if body[:2] == GZIP_MAGIC else body
    if max_bytes is not None and len(raw) > max_bytes:
        raise ValueError(f"batch is over the {max_bytes}-byte cap after decompression")
    return pa.ipc.open_stream(raw).read_all()

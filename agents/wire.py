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


def to_table(kind: str, rows: list[dict]) -> pa.Table:
    """Rows as dicts (timestamps in epoch milliseconds) to a table in the wire schema."""
    return pa.Table.from_pylist(rows, schema=SCHEMAS[kind])


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

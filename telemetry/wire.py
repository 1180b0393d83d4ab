"""SCHEMA.md "On the wire": endpoints, content types, and the capped gzip inflation.

Senders and the receiver agree on these through this module; the inflation is the
one place a compressed body is expanded, so the zip-bomb cap and the "truncated"
verdict mean the same on both sides.
"""
from __future__ import annotations

import zlib

ARROW_STREAM = "application/vnd.apache.arrow.stream"
NDJSON = "application/x-ndjson"
ENDPOINTS = {"telemetry": "/v1/telemetry", "xid": "/v1/xid"}
TELEMETRY_KEYS = ("timestamp", "node", "gpu")
XID_KEYS = ("timestamp", "node", "gpu", "xid")
GZIP_MAGIC = b"\x1f\x8b"


class Corrupt(ValueError):
    """The gzip body does not decompress, or ends before its gzip trailer."""


class OverCap(ValueError):
    """The body inflates past the cap."""


def inflate(body: bytes, cap: int | None = None) -> bytes:
    """One gzip member, expanded to at most `cap` bytes (None: no cap); never more is allocated."""
    d = zlib.decompressobj(wbits=31)
    try:
        out = d.decompress(body, 0 if cap is None else cap + 1)
    except zlib.error as e:
        raise Corrupt(f"gzip body does not decompress: {e}") from None
    if cap is not None and (len(out) > cap or d.unconsumed_tail):
        raise OverCap(f"body inflates past the {cap}-byte cap")
    if not d.eof:
        raise Corrupt("gzip body is truncated")
    return out

"""Parsing untrusted JSON (manifests, ``owner.json``) in bounded time and memory.

``json.loads`` recurses once per nesting level and builds every value before a
caller can look at it: a 100,000-deep document dies with RecursionError, a
million-element one allocates without limit. Size, depth and item count are
therefore measured on the raw bytes first (numpy, a few MB at a time), and
anything over a limit is refused with ManifestError before parsing starts.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from .errors import ManifestError


def loads_bounded(data: bytes, what: str, max_depth: int, max_bytes: int, max_items: int | None = None) -> Any:
    """Parse untrusted JSON (a manifest, an ``owner.json``) in bounded time and memory.

    Size, nesting depth and item count are measured on the raw bytes first, so a
    100,000-deep or a million-element document is refused with ManifestError
    before ``json.loads`` recurses or allocates; so is anything that is not UTF-8 JSON.
    For ``owner.json``: ``loads_bounded(raw, path, 4, 64 << 10)``.
    """
    data = bytes(data)
    check_extent(data, what, max_depth, max_bytes, max_items)
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ManifestError(f"{what} is not valid JSON: {e}") from None


def check_extent(data: bytes, what: str, max_depth: int, max_bytes: int, max_items: int | None = None) -> None:
    """Refuse (ManifestError) JSON text over the size, depth or item limits, without parsing it.
    ``max_items`` None: only the size bounds them (at most one per two bytes)."""
    max_items = len(data) if max_items is None else max_items
    if len(data) > max_bytes:
        raise ManifestError(f"{what} is {len(data)} bytes, over the limit of {max_bytes}")
    depth, items = _json_extent(data, max_depth, max_items)
    if depth > max_depth:
        raise ManifestError(f"{what} is nested deeper than {max_depth} levels")
    if items > max_items:
        raise ManifestError(f"{what} holds more than {max_items} JSON items")


_SCAN_BYTES = 8 << 20
_NESTING = np.zeros(256, np.int8)
_NESTING[[ord("["), ord("{")]] = 1
_NESTING[[ord("]"), ord("}")]] = -1


def _json_extent(data: bytes, max_depth: int, max_items: int) -> tuple[int, int]:
    """(deepest nesting, items) of a JSON text, counting brackets and commas outside
    strings with numpy, a few MB at a time; stops early once past either limit.

    Items are counted as commas plus opening brackets: never fewer than the array
    elements and object members ``json.loads`` would build. Escaped backslashes and
    quotes are blanked first, so every remaining ``"`` opens or closes a string (in
    UTF-8 these bytes never occur inside a multi-byte character)."""
    if b"\\" in data:
        data = data.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    buf = np.frombuffer(data, np.uint8)
    deepest = depth = items = quotes = 0
    for lo in range(0, len(buf), _SCAN_BYTES):
        part = buf[lo:lo + _SCAN_BYTES]
        q = np.flatnonzero(part == ord('"'))
        commas = np.flatnonzero(part == ord(","))
        items += int(np.count_nonzero((np.searchsorted(q, commas) + quotes) % 2 == 0))
        nesting = _NESTING[part]
        at = np.flatnonzero(nesting)
        step = nesting[at[(np.searchsorted(q, at) + quotes) % 2 == 0]].astype(np.int64)
        if len(step):
            run = np.cumsum(step) + depth
            deepest, depth = max(deepest, int(run.max())), int(run[-1])
            items += int(np.count_nonzero(step > 0))
        quotes += len(q)
        if deepest > max_depth or items > max_items:
            break
    return deepest, items

"""Parsing untrusted JSON (manifests, ``owner.json``) in bounded time and memory.

``json.loads`` recurses once per nesting level and builds every value before a
caller can look at it: a 100,000-deep document dies with RecursionError, a
million-element one allocates without limit. Size, depth and item count are
therefore measured on the raw bytes first, and
anything over a limit is refused with ManifestError before parsing starts
(bytes methods for small texts, numpy for large ones).
"""
from __future__ import annotations

import itertools
import json
from typing import Any

from ..errors import ManifestError


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
_SMALL = 1 << 20  # below this, bytes methods beat importing numpy (the CLI starts faster)
_SAME_BRACKET = bytes.maketrans(b"{}", b"[]")  # depth and items do not tell the kinds apart
_NOT_BRACKET = bytes(set(range(256)) - set(b"[]{}"))


def _json_extent(data: bytes, max_depth: int, max_items: int) -> tuple[int, int]:
    """(deepest nesting, items) of a JSON text, counting brackets and commas outside
    strings; stops early once past either limit.

    Items are counted as commas plus opening brackets: never fewer than the array
    elements and object members ``json.loads`` would build. Escaped backslashes and
    quotes are blanked first, so every remaining ``"`` opens or closes a string (in
    UTF-8 these bytes never occur inside a multi-byte character)."""
    if b"\\" in data:
        data = data.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    if len(data) < _SMALL:
        return _extent_small(data, max_depth)
    return _extent_large(data, max_depth, max_items)


def _extent_small(data: bytes, max_depth: int) -> tuple[int, int]:
    """The same with bytes methods: strings dropped (every other piece between quotes; an
    unterminated one's tail too, whose brackets ``json.loads`` would read as text), then
    every innermost pair of brackets removed once a pass, as many passes as the nesting is
    deep. What does not empty within ``max_depth`` passes (too deep, or unbalanced, which
    ``json.loads`` refuses anyway) is walked a bracket at a time for its exact depth."""
    bare = b"".join(data.split(b'"')[::2])
    brackets = bare.translate(_SAME_BRACKET, _NOT_BRACKET)
    items = brackets.count(b"[") + bare.count(b",")
    rest, depth = brackets, 0
    while rest and depth <= max_depth:
        inner = rest.replace(b"[]", b"")
        if len(inner) == len(rest):
            break
        rest, depth = inner, depth + 1
    if rest:
        depth = max(itertools.accumulate(1 if b == ord("[") else -1 for b in brackets))
    return depth, items


def _extent_large(data: bytes, max_depth: int, max_items: int) -> tuple[int, int]:
    """The same with numpy, a few MB at a time."""
    import numpy as np

    nesting_of = np.zeros(256, np.int8)
    nesting_of[[ord("["), ord("{")]] = 1
    nesting_of[[ord("]"), ord("}")]] = -1
    buf = np.frombuffer(data, np.uint8)
    deepest = depth = items = quotes = 0
    for lo in range(0, len(buf), _SCAN_BYTES):
        part = buf[lo:lo + _SCAN_BYTES]
        q = np.flatnonzero(part == ord('"'))
        commas = np.flatnonzero(part == ord(","))
        items += int(np.count_nonzero((np.searchsorted(q, commas) + quotes) % 2 == 0))
        nesting = nesting_of[part]
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

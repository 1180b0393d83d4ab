"""Checking a Prometheus query answer as it streams in: the answer's status and type, each
series, each [time, value] pair. A malformed answer is one PrometheusError saying what was
wrong, raised before more of it is held (``prometheus_source`` reads the history with it)."""
from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator

import ijson
import numpy as np

from telemetry import bounded_get

_RESULT = "data.result.item"


class PrometheusError(RuntimeError):
    """Prometheus cannot give the history asked for; the message says what to change."""


def series(body: bounded_get.Body) -> Iterator[dict]:
    """The series of a query answer one at a time, as they arrive (ijson's C parser); the
    answer's status and type, which Prometheus writes before the series, checked first."""
    head = _Head(body)
    checked = False
    for item in ijson.items(head, _RESULT):
        if not checked:
            _check_head(head.data)
            checked = True
        if not isinstance(item, dict):
            raise PrometheusError("a series is not a JSON object")
        yield item
    if not checked:
        _check_head(head.data)


class _Head:
    """A body read through, keeping its first bytes (where the answer's status and type are)."""

    def __init__(self, body: bounded_get.Body, keep: int = 64 << 10):
        self._body, self._keep, self.data = body, keep, b""

    def read(self, n: int) -> bytes:
        chunk = self._body.read(n)
        if len(self.data) < self._keep:
            self.data += chunk[:self._keep - len(self.data)]
        return chunk


def _check_head(head: bytes) -> None:
    """PrometheusError unless the answer is an object with status "success" and a matrix."""
    status = error = result_type = None
    try:
        for prefix, event, value in ijson.parse(io.BytesIO(head)):
            if prefix == "" and event not in ("start_map", "map_key", "end_map"):
                raise PrometheusError(f"the answer is a {_JSON_KIND.get(event, event)}, not a JSON object")
            if prefix == "status":
                status = value
            elif prefix == "error":
                error = value
            elif prefix == "data.resultType":
                result_type = value
            elif prefix == "data.result" and event == "start_array":
                break
    except ijson.IncompleteJSONError:
        if not head:
            raise PrometheusError("the answer is empty") from None
        # the kept bytes end mid-answer, or the answer is not JSON (the full parse says so)
    if status != "success":
        raise PrometheusError(f"Prometheus refused the query: {error or status}")
    if result_type != "matrix":
        raise PrometheusError(f"expected a matrix answer to a range selector, got {result_type}")


_JSON_KIND = {"start_array": "list", "string": "string", "number": "number", "boolean": "boolean",
              "null": "null"}


def samples(points: list, name: str, lo_ms: int, hi_ms: int) -> tuple[np.ndarray, np.ndarray]:
    """A series' [time, "value"] pairs in (lo_ms, hi_ms] as (epoch ms, values); a value that is
    not finite reads as missing (NaN), a pair that is not one is a PrometheusError."""
    t, v = [], []
    for p in points:
        if not isinstance(p, list) or len(p) != 2:
            raise PrometheusError(f"series {name}: a sample is not a [time, value] pair: "
                                  f"{json.dumps(p, default=str)[:80]}")
        ts, value = p
        try:
            sec = float(ts) if not isinstance(ts, (str, bool)) else math.nan
        except (TypeError, ValueError, ArithmeticError):
            sec = math.nan
        if not math.isfinite(sec):
            raise PrometheusError(f"series {name}: timestamp {_show(ts)} is not a finite number")
        ms = round(sec * 1000)
        if not lo_ms < ms <= hi_ms:
            continue
        try:
            x = float(value) if not isinstance(value, bool) else math.nan
        except (TypeError, ValueError, ArithmeticError):
            raise PrometheusError(f"series {name}: value {_show(value)} is not a number") from None
        t.append(ms)
        v.append(x if math.isfinite(x) else math.nan)
    return np.asarray(t, np.int64), np.asarray(v, np.float64)


def _show(value: object) -> str:
    return repr(value) if isinstance(value, str) else str(value)

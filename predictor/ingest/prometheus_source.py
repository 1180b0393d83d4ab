"""DCGM history from Prometheus' HTTP API, as a trace directory the predictor already reads.

Raw samples only: each chunk is one instant query of a range-vector selector,
`{__name__=~"<the contract's DCGM fields>", MATCH}[CHUNK]` evaluated at the chunk's end, which
returns every stored sample in the chunk as scraped. `query_range` would resample
onto a fixed step and fill gaps from up to 5 min back (staleness), and counter
jumps and sample intervals are exactly what the features read.

The history is written to a trace directory (telemetry.parquet, xid.parquet,
trace.json) chunk by chunk, so memory is bounded by one chunk and training's two
replays read Prometheus once. Read-only: GET requests on the query API only.
Bounded: one chunk per request, and a chunk over `max_series` series or
`max_samples` samples is refused with what to change, never half-read. The bounds hold
while the answer arrives, not after: it is parsed as a stream (ijson), each series turned
into arrays as it comes and counted, bytes are capped as they are read, and
`--prometheus-timeout` is the time for the whole answer, however slowly it drips.
An answer that is not what the API documents (not an object, a series without `metric`,
a name not asked for, a timestamp that is no finite number, a value that is no number)
is one PrometheusError saying what was wrong.
"""
from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import math
import sys
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import ijson
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from predictor.ingest.prometheus_answer import PrometheusError, samples, series
from telemetry import bounded_get, dcgm
from telemetry.schema import MAX_GPUS_PER_NODE, METRICS, TELEMETRY_SCHEMA, THROTTLE, XID_ERRORS, XID_SCHEMA

log = logging.getLogger(__name__)
_NAMES = METRICS + (XID_ERRORS,)
#: Fields whose absence costs the model whole failure modes (docs/research/predictor-default-fields.md).
_BLIND_WITHOUT = {m for m in dcgm.NOT_IN_DEFAULT if m != THROTTLE}
#: Bytes of JSON per sample a response may hold on average before it is refused unread
#: (a sample is about 30 bytes: `[1780000000.123,"65.5"],`; labels add per series).
_BYTES_PER_SAMPLE = 64
#: Bytes a series' labels may take on average (dcgm-exporter's plus pod labels are ~400).
_BYTES_PER_SERIES = 2048


@dataclass
class HistoryQuery:
    """Where and what to read; the limits bound each request."""

    url: str
    start_ms: int
    end_ms: int
    match: str = ""                      # extra label matchers, e.g. job="dcgm",Hostname=~"node0.*"
    node_label: str = dcgm.NODE_LABEL
    chunk_s: float = 600.0
    max_series: int = 50_000
    max_samples: int = 5_000_000
    timeout_s: float = 60.0
    token: str | None = None             # bearer token
    basic_auth: tuple[str, str] | None = None
    headers: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.end_ms <= self.start_ms:
            raise PrometheusError("--end must be after --start")
        if self.chunk_s <= 0 or self.max_series < 1 or self.max_samples < 1 or self.timeout_s <= 0:
            raise PrometheusError("chunk, limits and timeout must be positive")
        if self.token:
            self.headers["Authorization"] = f"Bearer {self.token}"
        elif self.basic_auth:
            pair = base64.b64encode(":".join(self.basic_auth).encode()).decode()
            self.headers["Authorization"] = f"Basic {pair}"

    def selector(self, names: tuple[str, ...]) -> str:
        match = self.match.strip()
        if match.startswith("{") and match.endswith("}"):
            match = match[1:-1].strip()
        return "{" + f'__name__=~"{"|".join(names)}"' + (f",{match}" if match else "") + "}"


class PrometheusHistory:
    """Reads one `HistoryQuery` chunk by chunk."""

    def __init__(self, query: HistoryQuery):
        self.q = query
        self._xid_last: dict[tuple[str, int], float] = {}
        self._warned_duplicates = False

    # ------------------------------------------------------------ HTTP
    def _url(self, path: str, params: list[tuple[str, str]]) -> str:
        return self.q.url.rstrip("/") + path + "?" + urllib.parse.urlencode(params)

    def _get(self, path: str, params: list[tuple[str, str]], max_bytes: int = 64 * 2**20) -> object:
        """The ``data`` of a small answer (label values), read whole."""
        url = self._url(path, params)
        with self._answer(url, max_bytes) as body:
            raw = body.read_all()
        try:
            doc = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise PrometheusError(f"{url}: the answer is not JSON; is {self.q.url} a Prometheus?") from None
        if not isinstance(doc, dict):
            raise PrometheusError(f"{url}: the answer is a {type(doc).__name__}, not a JSON object; "
                                  f"is {self.q.url} a Prometheus?")
        if doc.get("status") != "success":
            raise PrometheusError(f"Prometheus refused the query: {doc.get('error', doc)}")
        return doc.get("data")

    @contextlib.contextmanager
    def _answer(self, url: str, max_bytes: int) -> Iterator[bounded_get.Body]:
        """The 200 answer's body, read within --prometheus-timeout in all and `max_bytes`; what
        goes wrong while it is read (in the caller's block too) is a PrometheusError."""
        headers = {"Accept": "application/json", **self.q.headers}
        try:
            with bounded_get.get(url, headers, self.q.timeout_s, max_bytes) as body:
                if body.status != 200:
                    raise PrometheusError(self._http_error(body.status, body.read(65536)))
                yield body
        except bounded_get.Timeout as e:
            raise PrometheusError(f"Prometheus at {self.q.url}: {e} (--prometheus-timeout)") from None
        except bounded_get.OverCap:
            raise PrometheusError(f"a chunk's answer is over {max_bytes} bytes: shorten --chunk or narrow --match") \
                from None
        except (OSError, http.client.HTTPException) as e:
            raise PrometheusError(f"Prometheus at {self.q.url} unreachable: {getattr(e, 'strerror', None) or e}") \
                from None

    def _http_error(self, code: int, text: bytes) -> str:
        if code in (401, 403):
            return (f"Prometheus at {self.q.url} refused the credentials ({code}): "
                    "give a token (--prometheus-token-file) or a user (--prometheus-user)")
        try:
            doc = json.loads(text)
            why = str(doc.get("error", "")) if isinstance(doc, dict) else ""
        except (json.JSONDecodeError, UnicodeDecodeError):
            why = ""
        hint = ""
        if code == 400:
            hint = ": check --match (label matchers, e.g. job=\"dcgm\")"
        elif code in (422, 503) and ("samples" in why or "timeout" in why or "timed out" in why):
            hint = ": shorten --chunk or narrow --match"
        return f"Prometheus answered {code} {why or http.client.responses.get(code, '')}{hint}"

    # ------------------------------------------------------------ what is there
    def present_metrics(self) -> list[str]:
        """The DCGM fields with series matching --match in the window; missing ones are logged
        once (they read as missing, as a blank DCGM field does), none at all is an error."""
        params = [("match[]", self.q.selector(_NAMES)), ("start", _sec(self.q.start_ms)),
                  ("end", _sec(self.q.end_ms))]
        data = self._get("/api/v1/label/__name__/values", params)
        if not isinstance(data, list) or not all(isinstance(n, str) for n in data):
            raise PrometheusError(f"Prometheus at {self.q.url}: label values: expected a list of names, "
                                  f"got {json.dumps(data)[:200]}")
        names = set(data)
        present = [m for m in _NAMES if m in names]
        if not any(m in names for m in METRICS):
            raise PrometheusError(f"no DCGM series match {self.q.selector(_NAMES)} between "
                                  f"{_iso(self.q.start_ms)} and {_iso(self.q.end_ms)}: check --match, the "
                                  "window, and that dcgm-exporter is scraped by this Prometheus")
        missing = [m for m in _NAMES if m not in names]
        if missing:
            log.warning("no series for %s in the window: read as missing%s%s", ", ".join(missing),
                        " (no XID events)" if XID_ERRORS in missing else "",
                        "; without the ECC and NVLink counters the model misses most HBM and NVLink failures "
                        "(enable them in dcgm-exporter's counters CSV)" if set(missing) & _BLIND_WITHOUT else "")
        return present

    # ------------------------------------------------------------ chunks
    def chunk_ends(self) -> list[int]:
        """Evaluation times (ms): each covers (end - chunk, end]; the last one is the window's end."""
        step = int(self.q.chunk_s * 1000)
        n = max(1, math.ceil((self.q.end_ms - self.q.start_ms) / step))
        return [min(self.q.start_ms + (i + 1) * step, self.q.end_ms) for i in range(n)]

    def fetch(self, lo_ms: int, hi_ms: int, names: list[str]) -> tuple[pa.Table, pa.Table]:
        """Telemetry rows and XID events with lo_ms < timestamp <= hi_ms."""
        rng = f"{max(1, math.ceil((hi_ms - lo_ms) / 1000))}s"
        params = [("query", f"{self.q.selector(tuple(names))}[{rng}]"), ("time", _sec(hi_ms)),
                  ("timeout", f"{int(self.q.timeout_s)}s")]
        url = self._url("/api/v1/query", params)
        cap = _BYTES_PER_SAMPLE * self.q.max_samples + _BYTES_PER_SERIES * self.q.max_series + 2**20
        with self._answer(url, cap) as body:
            try:
                return self._frame(series(body), lo_ms, hi_ms, set(names))
            except PrometheusError as e:
                raise PrometheusError(f"the chunk ending {_iso(hi_ms)}: {e}") from None
            except ijson.JSONError as e:
                raise PrometheusError(f"the chunk ending {_iso(hi_ms)}: the answer is not JSON ({e}); "
                                      f"is {self.q.url} a Prometheus?") from None

    def _frame(self, series: Iterator[dict], lo_ms: int, hi_ms: int, names: set[str]) -> tuple[pa.Table, pa.Table]:
        """Samples of one chunk pivoted to one row per (GPU, UUID, instant), as a trace has them;
        the series counted as they come, so a chunk over a limit is refused before it is held."""
        keys: dict[tuple[str, int, str | None], int] = {}
        k_idx, t_all, m_idx, v_all = [], [], [], []
        xid_rows: list[tuple[np.ndarray, str, int, np.ndarray]] = []
        seen: set[tuple] = set()
        n_series = n_samples = 0
        for s in series:
            n_series += 1
            if n_series > self.q.max_series:
                raise PrometheusError(f"over --max-series {self.q.max_series}: narrow --match or raise the limit")
            labels, points = s.get("metric"), s.get("values")
            if not isinstance(labels, dict):
                raise PrometheusError("a series without a 'metric' object")
            if not isinstance(points, list):
                raise PrometheusError(f"series {labels.get('__name__')}: 'values' is not a list")
            n_samples += len(points)
            if n_samples > self.q.max_samples:
                raise PrometheusError(f"over --max-samples {self.q.max_samples}: shorten --chunk or raise the limit")
            if not points:                           # nothing in the chunk: nothing to check or keep
                continue
            name = labels.get("__name__")
            if name not in names:
                raise PrometheusError(f"series {name!r} is not one of the DCGM fields asked for")
            node, gpu = self._gpu_of(labels)
            t, v = samples(points, name, lo_ms, hi_ms)  # a sample at a chunk's edge belongs to one chunk
            ident = (name, node, gpu, labels.get(dcgm.UUID_LABEL))
            if ident in seen and not self._warned_duplicates:
                self._warned_duplicates = True
                log.warning("more than one series for %s of %s GPU %d (scraped twice?): narrow --match, e.g. "
                            "job=\"...\"", name, node, gpu)
            seen.add(ident)
            if name == XID_ERRORS:
                if len(t):
                    xid_rows.append((t, node, gpu, v))
                continue
            key = (node, gpu, labels.get(dcgm.UUID_LABEL) or None)
            k = keys.setdefault(key, len(keys))
            k_idx.append(np.full(len(t), k, np.int64))
            t_all.append(t)
            m_idx.append(np.full(len(t), METRICS.index(name), np.int64))
            v_all.append(v)
        return self._telemetry(keys, k_idx, t_all, m_idx, v_all), self._xids(xid_rows)

    def _gpu_of(self, labels: dict) -> tuple[str, int]:
        node, gpu = labels.get(self.q.node_label), labels.get(dcgm.GPU_LABEL)
        if not node or gpu is None:
            raise PrometheusError(f"series {labels.get('__name__')} has no {self.q.node_label!r} or "
                                  f"{dcgm.GPU_LABEL!r} label (its labels: {', '.join(sorted(labels))}); "
                                  "name the node label with --node-label")
        try:
            index = int(gpu)
        except (TypeError, ValueError):
            index = -1
        if not 0 <= index < MAX_GPUS_PER_NODE:
            raise PrometheusError(f"series {labels['__name__']} of {node}: gpu label {gpu!r} is not an index in "
                                  f"0..{MAX_GPUS_PER_NODE - 1}")
        return node, index

    @staticmethod
    def _telemetry(keys: dict, k_idx: list, t_all: list, m_idx: list, v_all: list) -> pa.Table:
        if not keys or not sum(map(len, t_all)):
            return TELEMETRY_SCHEMA.empty_table()
        k, t, m, v = (np.concatenate(x) for x in (k_idx, t_all, m_idx, v_all))
        rows, row_of = np.unique(np.stack([t, k], axis=1), axis=0, return_inverse=True)
        values = np.full((len(rows), len(METRICS)), np.nan)
        values[row_of.ravel(), m] = v
        key_list = list(keys)
        cols = {"timestamp": pa.array(rows[:, 0], pa.int64()).cast(TELEMETRY_SCHEMA.field("timestamp").type),
                "node": pa.array([key_list[i][0] for i in rows[:, 1]], pa.string()),
                "gpu": pa.array([key_list[i][1] for i in rows[:, 1]], pa.int16()),
                "uuid": pa.array([key_list[i][2] for i in rows[:, 1]], pa.string())}
        for j, name in enumerate(METRICS):
            col = values[:, j]
            cols[name] = pa.array(col, TELEMETRY_SCHEMA.field(name).type, mask=np.isnan(col))
        return pa.table(cols, schema=TELEMETRY_SCHEMA)

    def _xids(self, rows: list[tuple[np.ndarray, str, int, np.ndarray]]) -> pa.Table:
        """XID events from the last-value gauge (telemetry/dcgm.py says what it cannot show)."""
        t_out, n_out, g_out, x_out = [], [], [], []
        for t, node, gpu, v in rows:
            order = np.argsort(t, kind="stable")
            t, v = t[order], v[order]
            new = np.asarray(dcgm.xid_changes(v, self._xid_last.get((node, gpu))), dtype=bool)
            readable = v[~np.isnan(v)]
            if len(readable):
                self._xid_last[(node, gpu)] = float(readable[-1])
            t_out += t[new].tolist()
            x_out += v[new].astype(np.int64).tolist()
            n_out += [node] * int(new.sum())
            g_out += [gpu] * int(new.sum())
        order = np.argsort(np.asarray(t_out, np.int64), kind="stable")
        return pa.table({"timestamp": pa.array(np.asarray(t_out, np.int64)[order], pa.int64()).cast(
                             XID_SCHEMA.field("timestamp").type),
                         "node": pa.array([n_out[i] for i in order], pa.string()),
                         "gpu": pa.array([g_out[i] for i in order], pa.int16()),
                         "xid": pa.array([x_out[i] for i in order], pa.int32())}, schema=XID_SCHEMA)

    # ------------------------------------------------------------ the trace
    def write_trace(self, out: str | Path, progress: bool | None = None) -> dict:
        """Read the window into `out` (a trace directory); return its trace.json summary."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        names = self.present_metrics()
        nodes: set[str] = set()
        gpus_per_node: dict[str, set[int]] = {}
        rows = xid_count = 0
        xid_parts = []
        intervals = []
        ends = self.chunk_ends()
        with pq.ParquetWriter(out / "telemetry.parquet", TELEMETRY_SCHEMA) as writer:
            lo = self.q.start_ms
            for hi in tqdm(ends, unit="chunk", desc="prometheus",
                           disable=not (sys.stderr.isatty() if progress is None else progress)):
                tel, xids = self.fetch(lo, hi, names)
                lo = hi
                if tel.num_rows:
                    tel = tel.sort_by([("timestamp", "ascending"), ("node", "ascending"), ("gpu", "ascending")])
                    writer.write_table(tel)
                    rows += tel.num_rows
                    for n, g in set(zip(tel.column("node").to_pylist(), tel.column("gpu").to_pylist())):
                        nodes.add(n)
                        gpus_per_node.setdefault(n, set()).add(g)
                    ts = np.unique(tel.column("timestamp").cast(pa.int64()).to_numpy())
                    if len(ts) > 1:
                        intervals.append(np.median(np.diff(ts)) / 1000)
                if xids.num_rows:
                    xid_parts.append(xids)
                    xid_count += xids.num_rows
        if not rows:
            raise PrometheusError(f"no samples matched {self.q.selector(tuple(names))} between "
                                  f"{_iso(self.q.start_ms)} and {_iso(self.q.end_ms)}")
        pq.write_table(pa.concat_tables(xid_parts) if xid_parts else XID_SCHEMA.empty_table(), out / "xid.parquet")
        summary = {"nodes": len(nodes), "gpus_per_node": max(len(g) for g in gpus_per_node.values()),
                   "days": (self.q.end_ms - self.q.start_ms) / 86_400_000,
                   "interval_s": float(np.median(intervals)) if intervals else None,
                   "samples": rows, "xid_events": xid_count, "chunks": len(ends),
                   "source": {"prometheus": self.q.url, "match": self.q.match, "start": _iso(self.q.start_ms),
                              "end": _iso(self.q.end_ms)},
                   "missing_metrics": [m for m in _NAMES if m not in names]}
        (out / "trace.json").write_text(json.dumps(summary, indent=1))
        return summary


def _sec(ms: int) -> str:
    return f"{ms // 1000}.{ms % 1000:03d}"


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat().replace("+00:00", "Z")

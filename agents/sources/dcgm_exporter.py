"""dcgm-exporter source: scrapes an existing exporter's ``/metrics`` instead of NVML.

A cluster that already runs NVIDIA's dcgm-exporter (the GPU Operator installs it) needs
no second process reading the GPUs: this source reads the exporter's page(s), maps the
series onto SCHEMA.md through ``telemetry.dcgm`` and streams them like any source.

What an exporter page cannot give, and how it is handled:

- Fields it does not serve (its default list has no ECC, NVLink or throttle-reason
  fields) read as blank; each is logged once per exporter and shown as
  ``ckpt_guard_agent_dcgm_field_missing{field}`` = 1.
- XIDs: the exporter's per-XID counter ``DCGM_EXP_XID_ERRORS_TOTAL`` (or its windowed
  count) when enabled gives every event; otherwise only the last-XID gauge is there, and
  a repeated XID or several XIDs between two scrapes show as at most one event. What the
  first scrape shows is history, never an event (``telemetry.dcgm.new_xid_events``).
  Events carry the scrape's time: the exporter does not say when they happened.
- A reading no batch can carry is dropped, counted by reason in
  ``ckpt_guard_agent_dcgm_series_dropped{reason}`` and logged once per exporter and reason:
  a GPU index outside 0..63 (the predictor refuses the whole batch otherwise, and past
  int16 no batch can be built), a NaN or infinite field (the column stays blank) and an XID
  reading that is not a whole number in the XID range. The rest of that page, and every
  other exporter, still flows.
- A GPU that leaves a page that still answers is logged and counted
  (``ckpt_guard_agent_dcgm_gpus_vanished``): like a failed GPU under NVML, it stops
  reporting, which is what SCHEMA.md says a failed GPU does.

Every scrape has a time limit and a size cap; a failed scrape is counted, logged on the
change from working to failing (not every tick) and leaves the other exporters' rows;
``ckpt_guard_agent_dcgm_up{url}`` says which exporter is failing now (for alerts).
"""
from __future__ import annotations

import http.client
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from agents.sources.base import Source
from telemetry import bounded_get
from telemetry import dcgm as D
from telemetry import schema as S
from telemetry.wire import GZIP_MAGIC, inflate

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MAX_BYTES = 8 << 20  # an 8-GPU page with the default fields is ~30 KB; pod labels add some
_MAX_XID_READING = 2**31 - 1  # the wire's xid column is int32; counts beyond it are no real exporter's
#: Why a reading is dropped (the ``reason`` label of ckpt_guard_agent_dcgm_series_dropped).
GPU_OUT_OF_RANGE, NON_FINITE, BAD_XID = "gpu index out of range", "non-finite value", "bad XID reading"


class ScrapeError(RuntimeError):
    """The page could not be fetched or parsed."""


def fetch(url: str, timeout_s: float = DEFAULT_TIMEOUT_S, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """The page at ``url``, within ``timeout_s`` in all (not per read) and ``max_bytes``."""
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"dcgm-exporter URL must be http(s)://host:port/metrics, got {url!r}")
    try:
        with bounded_get.get(urlunsplit(u._replace(path=u.path or "/metrics")), {"Accept": "text/plain"},
                             timeout_s, max_bytes) as resp:
            body = resp.read_all()
            if resp.status != 200:
                raise ScrapeError(f"{url}: HTTP {resp.status}: {body[:200].decode('utf-8', 'replace')}")
    except bounded_get.Timeout:
        raise ScrapeError(f"{url}: page not read within {timeout_s:g} s") from None
    except bounded_get.OverCap:
        raise ScrapeError(f"{url}: page larger than the {max_bytes}-byte cap") from None
    except (OSError, http.client.HTTPException) as e:
        raise ScrapeError(f"{url}: {type(e).__name__}: {e}") from None
    if body[:2] == GZIP_MAGIC:
        try:
            body = inflate(body, max_bytes)
        except ValueError as e:
            raise ScrapeError(f"{url}: {e}") from None
    return body.decode("utf-8", "replace")


@dataclass
class Page:
    """One exporter page, mapped: a row per GPU and the readings of each XID series."""

    rows: dict[tuple[str, int], dict] = field(default_factory=dict)
    models: dict[tuple[str, int], str] = field(default_factory=dict)
    fields: set[str] = field(default_factory=set)       # schema columns the page serves
    xid_series: set[str] = field(default_factory=set)   # XID series the page declares
    xids: dict[str, dict[tuple, float]] = field(default_factory=dict)  # series -> key -> reading
    unlabelled: int = 0                                  # device series without a usable gpu label
    dropped: Counter[str] = field(default_factory=Counter)  # readings no batch can carry, by reason


def parse_page(text: str, node_label: str = D.NODE_LABEL, default_node: str = "unknown") -> Page:
    """Map a page in Prometheus text format; ScrapeError when it is not one."""
    page = Page()
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, IndexError) as e:
        raise ScrapeError(f"not a Prometheus text page: {e}") from None
    for fam in families:
        if fam.name in D.XID_SERIES:
            page.xid_series.add(fam.name)
        for s in fam.samples:
            # the parser appends _total to a counter's samples; DCGM names are used as written
            name = fam.name if fam.type == "counter" and s.name == fam.name + "_total" else s.name
            column = D.column_for(name)
            if column is None and name not in D.XID_SERIES:
                continue
            node, gpu, uuid = D.gpu_identity(s.labels, node_label)
            if gpu is None:
                page.unlabelled += 1
                continue
            if not 0 <= gpu < S.MAX_GPUS_PER_NODE:
                page.dropped[GPU_OUT_OF_RANGE] += 1
                continue
            key = (node or default_node, gpu)
            if name in D.XID_SERIES:
                page.xid_series.add(name)
                if not _is_xid_reading(s.value):
                    page.dropped[BAD_XID] += 1
                    continue
                xkey = key if name == D.XID_LAST else key + (s.labels.get(D.XID_LABEL, ""),)
                page.xids.setdefault(name, {})[xkey] = s.value
                continue
            row = page.rows.get(key)
            if row is None:
                row = page.rows[key] = {"node": key[0], "gpu": gpu, "uuid": uuid, **dict.fromkeys(S.METRICS)}
                page.models[key] = s.labels.get(D.MODEL_LABEL) or "unknown"
            page.fields.add(column)
            if not math.isfinite(s.value):
                page.dropped[NON_FINITE] += 1
            elif row[column] is None:  # MIG instances repeat device fields: the first one stands
                row[column] = float(s.value)
    return page


@dataclass
class _Target:
    """What is remembered of one exporter between scrapes."""

    url: str
    scrapes: int = 0                      # successful ones
    failing: bool = False
    gpus: set[tuple[str, int]] = field(default_factory=set)
    xid_prev: dict[str, dict[tuple, float]] = field(default_factory=dict)
    missing: set[str] = field(default_factory=set)
    xid_series: str | None = None
    dropped_reasons: set[str] = field(default_factory=set)  # logged already


class DcgmExporterSource(Source):
    """Reads one or more dcgm-exporter pages per tick; ``node`` comes from ``node_label``."""

    def __init__(self, urls: Iterable[str], *, node_label: str = D.NODE_LABEL, default_node: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, max_bytes: int = DEFAULT_MAX_BYTES,
                 clock: Callable[[], float] = time.time):
        super().__init__()
        self.urls = list(dict.fromkeys(urls))
        if not self.urls:
            raise ValueError("--source dcgm-exporter needs at least one --dcgm-url")
        for url in self.urls:
            u = urlsplit(url)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise ValueError(f"dcgm-exporter URL must be http(s)://host:port/metrics, got {url!r}")
        self.node_label, self.timeout_s, self.max_bytes, self._clock = node_label, timeout_s, max_bytes, clock
        self._default_node = default_node
        self._targets = [_Target(u) for u in self.urls]
        self._models: dict[tuple[str, int], str] = {}
        self._pool = ThreadPoolExecutor(max_workers=min(16, len(self.urls)), thread_name_prefix="agents-dcgm")
        self.scrape_errors = 0
        self.gpus_vanished = 0
        self.series_dropped: Counter[str] = Counter()

    def _scrape(self, target: _Target) -> Page | ScrapeError:
        default = self._default_node or urlsplit(target.url).hostname or "unknown"
        try:
            return parse_page(fetch(target.url, self.timeout_s, self.max_bytes), self.node_label, default)
        except ScrapeError as e:
            return e
        except Exception as e:  # a page the parser chokes on otherwise must not cost the other exporters' rows
            return ScrapeError(f"{target.url}: {type(e).__name__}: {e}")

    def read(self) -> list[dict]:
        now = int(self._clock() * 1000)
        rows = []
        for target, page in zip(self._targets, self._pool.map(self._scrape, self._targets)):
            if isinstance(page, ScrapeError):
                self.scrape_errors += 1
                if not target.failing:
                    log.warning("scraping dcgm-exporter failed (logged again once it recovers): %s", page)
                target.failing = True
                continue
            if target.failing:
                log.info("dcgm-exporter %s answers again", target.url)
            target.failing = False
            self._take(target, page, now)
            for r in page.rows.values():
                rows.append({"timestamp": now, **r})
        return rows

    def _take(self, target: _Target, page: Page, now: int) -> None:
        first = target.scrapes == 0
        target.scrapes += 1
        self._models.update(page.models)
        if page.unlabelled and first:
            log.warning("%s: %d device series carry no %r label and are skipped", target.url, page.unlabelled,
                        D.GPU_LABEL)
        self._report_missing(target, page)
        self._report_dropped(target, page)
        gpus = set(page.rows) | {k[:2] for series in page.xids.values() for k in series}
        for node, gpu in sorted(target.gpus - gpus):
            self.gpus_vanished += 1
            log.warning("%s: GPU %d of %s is no longer on the page (failed, removed or reset?)", target.url, gpu, node)
        for node, gpu in sorted(gpus - target.gpus) if not first else ():
            log.info("%s: GPU %d of %s is on the page again (or new)", target.url, gpu, node)
        target.gpus = gpus
        self._xid_events(target, page, now, first)

    def _report_missing(self, target: _Target, page: Page) -> None:
        missing = set(S.METRICS) - page.fields if page.rows else set()
        new = sorted(missing - target.missing)
        if new:
            log.warning("%s does not serve %s: those columns stay blank (dcgm-exporter's default counter list "
                        "has no ECC, NVLink or throttle-reason fields; add them to its counters CSV)",
                        target.url, ", ".join(new))
        target.missing = missing

    def _report_dropped(self, target: _Target, page: Page) -> None:
        self.series_dropped.update(page.dropped)
        for reason in sorted(set(page.dropped) - target.dropped_reasons):
            log.warning("%s: dropped %d series sample(s) with a %s (counted in ckpt_guard_agent_dcgm_series_dropped; "
                        "logged once)", target.url, page.dropped[reason], reason)
        target.dropped_reasons |= set(page.dropped)

    def _xid_events(self, target: _Target, page: Page, now: int, first: bool) -> None:
        """Events from the best XID series the page declares; every series' readings are kept,
        so switching series (a counter that appears later) never replays history."""
        series = next((s for s in D.XID_SERIES if s in page.xid_series), None)
        if series != target.xid_series and series is not None:
            log.info("%s: XID events from %s%s", target.url, series,
                     "" if series != D.XID_LAST else " (a repeated XID, or several between two scrapes, "
                     "show as one event: enable DCGM_EXP_XID_ERRORS_TOTAL in the exporter's counters CSV)")
            target.xid_series = series
        on_page = set(page.rows)
        for name in D.XID_SERIES:
            prev = target.xid_prev.get(name, {})
            cur = page.xids.get(name, {})
            if name == series and not first:
                for key, value in cur.items():
                    n = D.new_xid_events(name, prev.get(key), value)
                    code = int(value) if name == D.XID_LAST else _int(key[2])
                    for _ in range(min(n, 100) if code is not None else 0):  # a jump of thousands is one storm
                        self._xids.append({"timestamp": now, "node": key[0], "gpu": key[1], "xid": code})
            # a GPU off the page keeps its readings (its last-XID gauge is still that XID when it
            # returns); a windowed count gone from a GPU still on the page has aged out: 0
            kept = {k: (0.0 if name == D.XID_WINDOW and k[:2] in on_page else v) for k, v in prev.items()}
            target.xid_prev[name] = {**kept, **cur}

    def model_name(self, node: str, gpu: int) -> str:
        return self._models.get((node, gpu), "unknown")

    def metrics(self) -> list:
        errors = CounterMetricFamily("ckpt_guard_agent_dcgm_scrape_errors",
                                     "Failed scrapes of a dcgm-exporter page (timeout, HTTP error, cap, bad page).")
        errors.add_metric([], self.scrape_errors)
        vanished = CounterMetricFamily("ckpt_guard_agent_dcgm_gpus_vanished",
                                       "GPUs that left a dcgm-exporter page that still answers.")
        vanished.add_metric([], self.gpus_vanished)
        dropped = CounterMetricFamily("ckpt_guard_agent_dcgm_series_dropped",
                                      "dcgm-exporter series samples dropped as no batch can carry them, by reason.",
                                      labels=["reason"])
        for reason, n in sorted(self.series_dropped.items()):
            dropped.add_metric([reason], n)
        missing = GaugeMetricFamily("ckpt_guard_agent_dcgm_field_missing",
                                    "1 for each telemetry field a scraped dcgm-exporter does not serve.",
                                    labels=["url", "field"])
        up = GaugeMetricFamily("ckpt_guard_agent_dcgm_up",
                               "1 when the last scrape of this dcgm-exporter page succeeded, 0 when it failed "
                               "(absent before the first scrape).", labels=["url"])
        for t in self._targets:
            for name in sorted(t.missing):
                missing.add_metric([t.url, name], 1)
            if t.scrapes or t.failing:
                up.add_metric([t.url], 0.0 if t.failing else 1.0)
        return [errors, vanished, dropped, missing, up]

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _is_xid_reading(value: float) -> bool:
    """An XID code or count: a whole number the wire's int32 xid column holds."""
    return math.isfinite(value) and float(value).is_integer() and 0 <= value <= _MAX_XID_READING


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None

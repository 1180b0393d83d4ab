"""A fleet's node fault history, read for replay: which node was out when, and which outages
would have stopped a job running on it; and a node ranking made from it (``ranked``).

Two formats (docs/fault-trace.md): the InfiniteHBD trace's JSON (stepfun-ai/InfiniteHBD-Trace:
a list of ``fault_start``/``fault_end`` events with ``node_id``, ``event_time`` in days and a
``fault_type`` {Level, Class, Desc}) and a CSV ``node,start,end,kind`` an operator can write
from their own records (times in days, or ISO 8601 timestamps; an empty ``end`` is a fault
still open; a row with an empty ``start`` names a node that never faulted).

Not every fault stops a job (``classify``): a stress test runs on a node outside any job, and
one that fails within ``BURN_IN_DAYS`` of the node's repair is that repair's burn-in failing,
so it is folded into the outage before it; a few kinds take a node out at a time the operator
picks (a planned change, correctable ECC errors past a threshold, a CMOS battery, a fan's
redundancy): the job gives the node back at its next checkpoint (a planned swap).
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

BURN_IN_DAYS = 2.0
INFINITEHBD_FLEET = 400  # servers in the InfiniteHBD trace (its README): the ones that never faulted are not listed
CSV_COLUMNS = ("node", "start", "end", "kind")
# kind text (case-insensitive substrings) -> class; anything else stops a job
TEST_KINDS = ("stress test", "burn-in", "burn in")
PLANNED_KINDS = ("change", "sbe", "single bit ecc", "battery", "redundancy lost", "planned")
HOST_KINDS = ("power supply", "system crash", "server down", "host down")  # the rest leave the host alive


class TraceError(ValueError):
    """A malformed fault history: the message names the file and the record."""


def classify(kind: str) -> str:
    """``test`` (a stress test or burn-in: no job on the node), ``planned`` (the node leaves at a
    checkpoint), or the restart kind of a fault that stops a job: ``host`` (host down) or ``gpu``
    (the node leaves the job, its host alive; unknown errors are counted here)."""
    k = kind.lower()
    for name, words in (("test", TEST_KINDS), ("planned", PLANNED_KINDS), ("host", HOST_KINDS)):
        if any(w in k for w in words):
            return name
    return "gpu"


@dataclass(frozen=True)
class Outage:
    """A node out of service over [start, end) days (``end`` = inf: still open at the trace's end)."""

    node: str
    start: float
    end: float
    kind: str
    cls: str  # classify(kind): what the outage's start does to a job on the node

    @property
    def interrupts(self) -> bool:
        return self.cls in ("gpu", "host")


@dataclass
class Trace:
    """Outages per node, merged where they overlap or a burn-in failed, over [0, ``days``)."""

    outages: dict[str, list[Outage]]
    nodes: list[str]  # the whole fleet, fault-free nodes included
    days: float
    source: str
    burn_in_merged: int = 0
    raw_faults: int = 0
    kinds: dict[str, int] = field(default_factory=dict)  # class -> outages
    faults: dict[str, list[Outage]] = field(default_factory=dict)  # as recorded, before merging
    unnamed: int = 0  # fault-free nodes added for --fleet-size (named fault-free-<i>, last in ``nodes``)
    declared: frozenset[str] = frozenset()  # named by a CSV row with an empty start: in the fleet from day 0
    fixed_fleet: bool = False  # the fleet's size is known (--fleet-size, the JSON's 400): it holds at any cut

    @property
    def named_nodes(self) -> list[str]:
        return self.nodes[: len(self.nodes) - self.unnamed]

    @property
    def all_outages(self) -> list[Outage]:
        return sorted((o for os_ in self.outages.values() for o in os_), key=lambda o: (o.start, o.node))

    def before(self, day: float) -> Trace:
        """The trace as known at ``day``: outages begun before it, those still open cut open; a
        node first named later is not in the fleet yet (a fault-free one, where its size is fixed)."""
        def cut(by_node: dict[str, list[Outage]]) -> dict[str, list[Outage]]:
            kept = {n: [o if o.end < day else Outage(o.node, o.start, math.inf, o.kind, o.cls)
                        for o in os_ if o.start < day] for n, os_ in by_node.items()}
            return {n: v for n, v in kept.items() if v}

        faults = cut(self.faults)
        nodes = [n for n in self.named_nodes if n in faults or n in self.declared]
        pad = len(self.nodes) - len(nodes) if self.fixed_fleet else 0
        return Trace(cut(self.outages), nodes + [f"fault-free-{i}" for i in range(pad)], day, self.source,
                     faults=faults, unnamed=pad, declared=self.declared, fixed_fleet=self.fixed_fleet)


def _merge(raw: list[Outage]) -> tuple[list[Outage], int]:
    """A node's outages in time order, overlapping ones joined (the first's kind kept) and a
    stress test failing within BURN_IN_DAYS of a repair folded into that repair's outage."""
    out: list[Outage] = []
    burn_in = 0
    for o in sorted(raw, key=lambda o: o.start):
        if out and (o.start <= out[-1].end or (o.cls == "test" and o.start - out[-1].end <= BURN_IN_DAYS)):
            prev = out[-1]
            burn_in += o.cls == "test" and o.start >= prev.end
            out[-1] = Outage(prev.node, prev.start, max(prev.end, o.end), prev.kind, prev.cls)
        else:
            out.append(o)
    return out, burn_in


def _build(raw: list[Outage], named: set[str], fleet: int | None, days: float | None, source: str) -> Trace:
    if not raw:
        raise TraceError(f"{source}: no faults in the trace")
    by_node: dict[str, list[Outage]] = {}
    for o in raw:
        by_node.setdefault(o.node, []).append(o)
    merged, burn_in = {}, 0
    for node, os_ in by_node.items():
        merged[node], b = _merge(os_)
        burn_in += b
    nodes = sorted(named | set(by_node))
    unnamed = 0
    if fleet is not None:
        if fleet < len(nodes):
            raise TraceError(f"{source}: --fleet-size {fleet} is smaller than the {len(nodes)} nodes the trace names")
        unnamed = fleet - len(nodes)
        nodes += [f"fault-free-{i}" for i in range(unnamed)]
    end = max(max(o.start, o.end if math.isfinite(o.end) else o.start) for o in raw)
    kinds: dict[str, int] = {}
    for o in (o for os_ in merged.values() for o in os_):
        kinds[o.cls] = kinds.get(o.cls, 0) + 1
    return Trace(merged, nodes, days if days is not None else end, source, burn_in, len(raw), kinds,
                 {n: sorted(os_, key=lambda o: o.start) for n, os_ in by_node.items()}, unnamed,
                 frozenset(named), fleet is not None)


def _read_json(path: Path) -> tuple[list[Outage], set[str]]:
    try:
        events = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceError(f"{path}: not a readable JSON fault trace: {e}") from None
    if not isinstance(events, list):
        raise TraceError(f"{path}: expected a JSON list of fault events")
    open_: dict[tuple[str, str], list[float]] = {}
    raw = []
    for i, e in enumerate(events):
        try:
            node, t, what, ft = e["node_id"], float(e["event_time"]), e["event_type"], e["fault_type"]
            kind = f"{ft['Class']}: {ft['Desc']}"
        except (KeyError, TypeError, ValueError) as err:
            raise TraceError(f"{path}: event {i} lacks {err} (node_id, event_time, event_type, fault_type)") from None
        if not math.isfinite(t) or what not in ("fault_start", "fault_end"):
            raise TraceError(f"{path}: event {i}: bad event_time {t!r} or event_type {what!r}")
        if what == "fault_start":
            open_.setdefault((node, kind), []).append(t)
        elif open_.get((node, kind)):
            start = open_[(node, kind)].pop(0)
            raw.append(Outage(node, start, t, kind, classify(kind)))
        else:
            raise TraceError(f"{path}: event {i}: fault_end of {node} at {t} with no fault_start before it")
    raw += [Outage(n, s, math.inf, k, classify(k)) for (n, k), starts in open_.items() for s in starts]
    return raw, set()


def _time(text: str) -> float | datetime:
    try:
        return float(text)
    except ValueError:
        t = datetime.fromisoformat(text)
        return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def _read_csv(path: Path) -> tuple[list[Outage], set[str]]:
    try:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
            header = tuple(rows[0].keys()) if rows else ()
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise TraceError(f"{path}: not a readable CSV: {e}") from None
    if not set(CSV_COLUMNS) <= set(header):
        raise TraceError(f"{path}: the header must name {','.join(CSV_COLUMNS)} (it has {','.join(header)})")
    named, parsed = set(), []
    for line, r in enumerate(rows, start=2):
        node, start, end, kind = ((r[c] or "").strip() for c in CSV_COLUMNS)
        if not node:
            raise TraceError(f"{path}:{line}: empty node")
        if not start:
            named.add(node)
            continue
        try:
            times = _time(start), (_time(end) if end else None)
        except ValueError as e:
            raise TraceError(f"{path}:{line}: {e}") from None
        parsed.append((line, node, *times, kind or "unknown"))
    stamps = [t for p in parsed for t in p[2:4] if isinstance(t, datetime)]
    if stamps and len(stamps) != sum(t is not None for p in parsed for t in p[2:4]):
        raise TraceError(f"{path}: times are either all days or all timestamps, not both")
    origin = min(stamps) if stamps else None
    raw = []
    for line, node, s, e, kind in parsed:
        s, e = ((t - origin).total_seconds() / 86400.0 if isinstance(t, datetime) else t for t in (s, e))
        if e is not None and e < s or not math.isfinite(s):
            raise TraceError(f"{path}:{line}: the fault ends ({e}) before it starts ({s})")
        raw.append(Outage(node, s, math.inf if e is None else e, kind, classify(kind)))
    return raw, named


def read_trace(path: str | Path, fleet: int | None = None, days: float | None = None) -> Trace:
    """The fault history at ``path`` (``.json``: the InfiniteHBD format, whose fleet defaults to
    its 400 servers; else the CSV), over ``days`` (default: to its last event)."""
    path = Path(path)
    is_json = path.suffix.lower() == ".json"
    raw, named = _read_json(path) if is_json else _read_csv(path)
    if fleet is None and is_json:
        fleet = max(INFINITEHBD_FLEET, len({o.node for o in raw}))
    return _build(raw, named, fleet, days, str(path))


def ranked(path: Path, top: int | None = None) -> dict[str, float]:
    """The ``top`` riskiest nodes (default: all) of a ranking CSV (``node_id,probability``,
    ``predictor nodes rank``'s), riskiest first, with their probability."""
    try:
        with path.open(newline="") as f:
            rows = [(r["node_id"], float(r["probability"])) for r in csv.DictReader(f)]
    except (OSError, KeyError, ValueError, TypeError, csv.Error) as e:
        raise ValueError(f"{path}: not a node ranking (node_id,probability): {e!r}") from None
    return dict(sorted(rows, key=lambda r: -r[1])[:top])

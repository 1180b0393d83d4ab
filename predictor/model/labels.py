"""Failure labels from the telemetry itself, for fleets with no failure record but their XIDs.

A fleet that adopts the predictor has months of DCGM history and no failures.parquet. Its
telemetry still says when a GPU was lost, three ways:

- a critical XID (telemetry.schema.CRITICAL_XIDS): the driver says the GPU must be reset
  or drained. Repeats within REPEAT_S of a label on the same GPU are the same incident;
- a GPU that vanished: it stopped reporting while its node went on reporting for at least
  VANISHED_S (a whole node going quiet is a reboot or an agent outage, not a GPU failure);
- a GPU that was replaced: a new UUID at the same index.

A vanished or replaced GPU with a critical XID in the same incident is labelled once, at the
XID. The time of a vanished/replaced GPU is its node's first sample without it, the first
moment its loss can be seen. What none of these can say is how long the failure showed
precursor signs: ``precursor_s`` is NaN (unknown), which the reference scorer counts as not
predictable (``recall`` is the metric on such labels, ``recall_of_predictable`` has none), and
``predictor train`` reads as "assume the signs span the horizon" (training.UNKNOWN_PRECURSOR_S).
The mode is a guess from the XID (``unknown`` where it says nothing), ``source`` says which
rule made the label.

Inputs are Arrow tables, not files, so a reader other than a trace directory (Prometheus)
can hand its frames to ``derive``. An operator's CSV (node, gpu, time, cause) merges in.
"""
from __future__ import annotations

import csv
import math
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from predictor.ingest.wire import timestamps_ms
from telemetry import schema as S

#: A critical XID this soon after a label on the same GPU belongs to that incident.
REPEAT_S = 3600.0
#: A GPU is vanished when its node reports this long after the GPU's last sample without it.
VANISHED_S = 600.0
#: An operator's row this close to a derived label on the same GPU is about the same failure.
MATCH_S = 3600.0
#: Operator causes that say "this was no failure": they remove the derived label they match.
NOT_A_FAILURE = frozenset({"maintenance", "none"})
#: The mode of a label whose XID says nothing about it (S.XID_FAILURE_MODE), or that has no XID.
UNKNOWN_MODE = "unknown"

LABEL_SCHEMA = pa.schema(list(S.FAILURE_SCHEMA) + [pa.field("source", pa.string(), nullable=False)])
SAMPLE_COLUMNS = ["timestamp", "node", "gpu", "uuid"]


class LabelError(ValueError):
    """An input that cannot be labelled from (bad operator CSV, missing columns)."""


def load_trace(trace_dir: str | Path) -> tuple[pa.Table, pa.Table]:
    """The columns labelling needs from a trace directory: (samples, XID events)."""
    trace_dir = Path(trace_dir)
    tel = trace_dir / "telemetry.parquet"
    if not tel.exists():
        raise LabelError(f"{trace_dir}: no telemetry.parquet")
    have = set(pq.read_schema(tel).names)
    samples = pq.read_table(tel, columns=[c for c in SAMPLE_COLUMNS if c in have])
    xid_path = trace_dir / "xid.parquet"
    xids = pq.read_table(xid_path, columns=["timestamp", "node", "gpu", "xid"]) if xid_path.exists() \
        else S.XID_SCHEMA.empty_table()
    return samples, xids


def _strings(col: pa.ChunkedArray) -> np.ndarray:
    return np.asarray(pc.cast(col, pa.string()).to_pylist(), dtype=object)


class _Samples:
    """Per-GPU and per-node sample times, sorted, with the UUID of each GPU sample."""

    def __init__(self, samples: pa.Table):
        missing = [c for c in ("timestamp", "node", "gpu") if c not in samples.column_names]
        if missing:
            raise LabelError(f"samples lack column(s) {', '.join(missing)}")
        t = timestamps_ms(samples.column("timestamp"))
        node = _strings(samples.column("node"))
        gpu = np.asarray(samples.column("gpu").to_numpy(zero_copy_only=False), np.int64)
        uuid = _strings(samples.column("uuid")) if "uuid" in samples.column_names else np.full(len(t), None, object)
        names, node_id = np.unique(node, return_inverse=True) if len(node) else (np.empty(0, object), node)
        order = np.lexsort((t, gpu, node_id))
        t, node_id, gpu, uuid = t[order], node_id[order], gpu[order], uuid[order]
        self.node_names = names
        self.gpus: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
        starts = np.flatnonzero(np.r_[True, (np.diff(node_id) != 0) | (np.diff(gpu) != 0)]) if len(t) else []
        bounds = list(starts) + [len(t)]
        for a, b in zip(bounds[:-1], bounds[1:]):
            self.gpus[(str(names[node_id[a]]), int(gpu[a]))] = (t[a:b], uuid[a:b])
        cuts = np.searchsorted(node_id, np.arange(len(names) + 1))   # rows are sorted by node first
        self.node_t = {str(names[i]): np.unique(t[cuts[i]:cuts[i + 1]]) for i in range(len(names))}


def _node_first_after(node_t: np.ndarray, t: int) -> int:
    """The node's first sample more than a second after ``t`` (its next tick)."""
    i = int(np.searchsorted(node_t, t + 1000, side="left"))
    return int(node_t[i]) if i < len(node_t) else t


def _critical(xids: pa.Table) -> list[tuple[str, int, int, int]]:
    """(node, gpu, t, xid) of critical XIDs, one per incident, time-ordered per GPU."""
    if xids.num_rows == 0:
        return []
    code = np.asarray(xids.column("xid").to_numpy(zero_copy_only=False), np.int64)
    keep = np.isin(code, sorted(S.CRITICAL_XIDS))
    t = timestamps_ms(xids.column("timestamp"))[keep]
    node = _strings(xids.column("node"))[keep]
    gpu = np.asarray(xids.column("gpu").to_numpy(zero_copy_only=False), np.int64)[keep]
    out, last = [], {}
    for i in np.lexsort((t, gpu, node)).tolist():
        key = (str(node[i]), int(gpu[i]))
        if key in last and t[i] - last[key] <= REPEAT_S * 1000:
            continue
        last[key] = int(t[i])
        out.append((key[0], key[1], int(t[i]), int(code[keep][i])))
    return out


def _lost(s: _Samples) -> list[tuple[str, int, int, int, int, str]]:
    """(node, gpu, T, last seen, back or -1, source) for each GPU that vanished or was replaced."""
    out = []
    for (node, gpu), (t, uuid) in s.gpus.items():
        node_t = s.node_t[node]
        ends = np.r_[t[1:], -1]                               # when the GPU reported next (-1: never)
        gap = np.where(ends >= 0, ends - t, node_t[-1] + 1 - t)
        for i in np.flatnonzero(gap >= VANISHED_S * 1000).tolist():
            back = int(ends[i])
            stop = back if back >= 0 else int(node_t[-1]) + 1
            lo = int(np.searchsorted(node_t, t[i] + VANISHED_S * 1000, side="left"))
            if lo < len(node_t) and node_t[lo] < stop:        # the node reported, the GPU did not
                out.append((node, gpu, _node_first_after(node_t, int(t[i])), int(t[i]), back, "vanished"))
        changed = np.flatnonzero((uuid[1:] != uuid[:-1]) & (uuid[1:] != None) & (uuid[:-1] != None))  # noqa: E711
        for i in changed.tolist():
            out.append((node, gpu, _node_first_after(node_t, int(t[i])), int(t[i]), int(t[i + 1]), "replaced"))
    return out


def derive(samples: pa.Table, xids: pa.Table) -> pa.Table:
    """failures.parquet (plus ``source``) from samples (timestamp, node, gpu[, uuid]) and XID events.

    One label per incident: the critical XIDs of a GPU from an hour before it vanished to
    shortly after it came back belong to that incident, which is labelled at its earliest
    evidence. (An XID that a last-value gauge only shows once the GPU is back must not move
    the label to the return.)"""
    xid_of: dict[tuple[str, int], list[list]] = {}
    for node, gpu, t, code in _critical(xids):
        xid_of.setdefault((node, gpu), []).append([t, code, False])
    rows, labelled = [], {}
    for node, gpu, t, seen, back, source in sorted(_lost(_Samples(samples)), key=lambda r: r[2]):
        key, end = (node, gpu), (back if back >= 0 else t) + VANISHED_S * 1000
        if any(seen - REPEAT_S * 1000 <= x <= end for x in labelled.get(key, [])):
            continue                                          # vanished and replaced: one incident
        mine = [x for x in xid_of.get(key, []) if not x[2] and seen - REPEAT_S * 1000 <= x[0] <= end]
        for x in mine:
            x[2] = True
        first = min(mine, default=None)
        code = first[1] if first else 0
        if first and first[0] <= t:
            t, source = first[0], "xid"
        labelled.setdefault(key, []).append(t)
        rows.append(_label(node, gpu, t, code, source))
    rows += [_label(node, gpu, t, code, "xid") for (node, gpu), xs in xid_of.items() for t, code, used in xs
             if not used]
    return _table(rows)


def _label(node: str, gpu: int, t: int, xid: int, source: str) -> dict:
    return {"timestamp": t, "node": node, "gpu": gpu, "mode": S.XID_FAILURE_MODE.get(xid, UNKNOWN_MODE), "xid": xid,
            "precursor_s": math.nan, "source": source}


def _table(rows: list[dict]) -> pa.Table:
    rows = sorted(rows, key=lambda r: (r["timestamp"], r["node"], r["gpu"]))
    return pa.Table.from_pylist(rows, schema=LABEL_SCHEMA)


# ------------------------------------------------------------ the operator's CSV

CSV_COLUMNS = ("node", "gpu", "time", "cause")


def _parse_time(text: str) -> int:
    """Epoch milliseconds from ISO 8601 (UTC where no zone is given) or epoch seconds."""
    text = text.strip()
    try:
        return int(round(float(text) * 1000))
    except ValueError:
        pass
    t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return int((t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp() * 1000)


def read_operator_csv(path: str | Path) -> list[dict]:
    """The operator's failure record: one row per failure, header ``node,gpu,time,cause``
    (optional ``xid``). Every bad row is named with its line; nothing is read from a file with one."""
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        header = [h.strip() for h in reader.fieldnames or []]
        missing = [c for c in CSV_COLUMNS if c not in header]
        if missing:
            raise LabelError(f"{path}: header lacks {', '.join(missing)} (expected {','.join(CSV_COLUMNS)}"
                             f"[,xid]; got {','.join(header) or 'nothing'})")
        out, errors = [], []
        for line, raw in enumerate(reader, start=2):
            r = {k.strip(): (v or "").strip() for k, v in raw.items() if k is not None}
            try:
                if not r["node"]:
                    raise ValueError("node is empty")
                gpu = int(r["gpu"])
                if not 0 <= gpu < 2**15:
                    raise ValueError(f"gpu {gpu} is not a GPU index")
                try:
                    t = _parse_time(r["time"])
                except ValueError:
                    raise ValueError(f"time {r['time']!r} is neither ISO 8601 nor epoch seconds") from None
                xid = int(r["xid"]) if r.get("xid") else 0
                cause = r["cause"].lower() or UNKNOWN_MODE
            except ValueError as e:
                errors.append(f"line {line}: {e}")
                continue
            out.append({"node": r["node"], "gpu": gpu, "timestamp": t, "cause": cause, "xid": xid})
    if errors:
        more = f" (and {len(errors) - 10} more)" if len(errors) > 10 else ""
        raise LabelError(f"{path}: " + "; ".join(errors[:10]) + more)
    return out


def merge(derived: pa.Table, operator: list[dict]) -> tuple[pa.Table, dict[str, int]]:
    """Derived labels with the operator's record merged in.

    An operator row within MATCH_S of a derived label on the same GPU confirms it: the
    telemetry's time stays (it is precise), the operator's cause becomes the mode when it is
    one of SCHEMA.md's modes. A cause of ``maintenance``/``none`` removes the label it matches.
    Unmatched rows are added (``source`` = operator)."""
    rows = derived.to_pylist()
    for r in rows:
        r["timestamp"] = int(r["timestamp"].timestamp() * 1000)
    counts = {"confirmed": 0, "removed": 0, "added": 0, "ignored": 0}
    drop = set()
    for op in sorted(operator, key=lambda r: r["timestamp"]):
        near = [i for i, r in enumerate(rows) if i not in drop and r["node"] == op["node"] and r["gpu"] == op["gpu"]
                and abs(r["timestamp"] - op["timestamp"]) <= MATCH_S * 1000]
        best = min(near, key=lambda i: abs(rows[i]["timestamp"] - op["timestamp"])) if near else None
        if op["cause"] in NOT_A_FAILURE:
            counts["removed" if best is not None else "ignored"] += 1
            if best is not None:
                drop.add(best)
            continue
        mode = op["cause"] if op["cause"] in S.FAILURE_MODES else None
        if best is not None:
            counts["confirmed"] += 1
            r = rows[best]
            r["mode"] = mode or r["mode"]
            r["xid"] = r["xid"] or op["xid"]
            r["source"] += "+operator"
        else:
            counts["added"] += 1
            rows.append({"timestamp": op["timestamp"], "node": op["node"], "gpu": op["gpu"],
                         "mode": mode or UNKNOWN_MODE, "xid": op["xid"], "precursor_s": math.nan,
                         "source": "operator"})
    return _table([r for i, r in enumerate(rows) if i not in drop]), counts


def summary(labels: pa.Table) -> dict:
    """Counts by source and mode, for the CLI."""
    def count(col: str) -> dict[str, int]:
        values, counts = np.unique(np.asarray(labels.column(col).to_pylist(), dtype=object), return_counts=True)
        return {str(v): int(c) for v, c in zip(values, counts)}
    return {"failures": labels.num_rows, "by_source": count("source") if labels.num_rows else {},
            "by_mode": count("mode") if labels.num_rows else {}}


def agreement(derived: pa.Table, truth: pa.Table, tolerance_s: float = MATCH_S) -> dict:
    """How far derived labels are from a true failures.parquet (the simulator's): labels matched
    to a true failure on the same GPU within ``tolerance_s``, nearest first, each used once."""
    def rows(t: pa.Table) -> list[tuple[str, int, int, str]]:
        cols = ("source" if "source" in t.column_names else "mode")
        return list(zip(_strings(t.column("node")).tolist(), t.column("gpu").to_pylist(),
                        timestamps_ms(t.column("timestamp")).tolist(), _strings(t.column(cols)).tolist()))
    d, f = rows(derived), rows(truth)
    true_of: dict[tuple[str, int], list[int]] = {}
    for j, (n, g, _, _) in enumerate(f):
        true_of.setdefault((n, g), []).append(j)
    pairs = sorted((abs(dt), i, j, dt) for i, (n, g, t, _) in enumerate(d) for j in true_of.get((n, g), [])
                   if abs(dt := t - f[j][2]) <= tolerance_s * 1000)
    used_d, used_f, offsets = set(), set(), []
    for _, i, j, dt in pairs:
        if i not in used_d and j not in used_f:
            used_d.add(i)
            used_f.add(j)
            offsets.append(dt / 1000)

    def share(hit: set, items: list, by: int = 3) -> dict[str, str]:
        out: dict[str, list[int]] = {}
        for k, it in enumerate(items):
            c = out.setdefault(it[by], [0, 0])
            c[0] += k in hit
            c[1] += 1
        return {key: f"{a}/{b}" for key, (a, b) in sorted(out.items())}

    off = np.asarray(offsets)
    return {"labels": len(d), "true_failures": len(f), "matched": len(offsets),
            "precision": round(len(offsets) / len(d), 4) if d else None,
            "recall": round(len(offsets) / len(f), 4) if f else None,
            "offset_s_median": round(float(np.median(off)), 1) if len(off) else None,
            "offset_s_abs_p90": round(float(np.percentile(np.abs(off), 90)), 1) if len(off) else None,
            "precision_by_source": share(used_d, d), "recall_by_mode": share(used_f, f)}

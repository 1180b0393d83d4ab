"""The same service history, read from a telemetry trace (telemetry/SCHEMA.md) instead of a CSV.

What the agents and the Prometheus reader (``--save-trace``) collect becomes stays and events:

- a GPU is its UUID (``node/gpuN`` where the trace has none); its location is ``node/gpuN``;
- a stay runs from a GPU's first sample in a slot to the first sample of the next UUID there
  (then it was taken out: replaced), or to the trace's end (still in service);
- a DBE is an increase of the double-bit ECC counter between two samples of one GPU (a drop is
  a reset, not an event; a count already there at the first sample has no known time) or an XID
  48; an OTB is an XID 79. Events of one kind on one GPU within ``MERGE_S`` are one incident
  (a counter increase and its XID 48, a burst of errors), as Titan's records are.

Times are UTC epoch seconds. The position numbers (col, row, cage, slot) are 0: a trace says
nothing about racks; ``node`` is the GPU's index on its host.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from predictor.hazard.history import History, HistoryError
from predictor.ingest.wire import timestamps_ms
from predictor.model.labels import _strings  # one helper for dictionary-encoded string columns
from predictor.model.replay import read_xids
from telemetry.schema import DBE

XID_EVENTS = {48: "DBE", 79: "OTB"}
MERGE_S = 3600.0


def _slots(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(``node/gpuN`` location, GPU index) of each row of a table with node and gpu columns."""
    idx = np.asarray(table.column("gpu").to_numpy(zero_copy_only=False), np.int64)
    return np.array([f"{n}/gpu{i}" for n, i in zip(_strings(table.column("node")), idx)], dtype=object), idx


def _missing(a: np.ndarray) -> np.ndarray:
    return np.array([v is None or v == "" for v in a], bool)


def _merge(gpu: np.ndarray, t: np.ndarray, kind: np.ndarray) -> np.ndarray:
    """Indices of the events to keep: the first of each run of one kind on one GPU closer than MERGE_S."""
    order = np.lexsort((t, kind, gpu))
    g, k, tt = gpu[order], kind[order], t[order]
    new = np.r_[True, (g[1:] != g[:-1]) | (k[1:] != k[:-1]) | (np.diff(tt) > MERGE_S)]
    return order[new]


def read_trace_history(trace_dir: str | Path) -> History:
    """Stays and DBE/OTB events of every GPU in a trace directory; ``HistoryError`` if it has no samples."""
    trace_dir = Path(trace_dir)
    tel_path = trace_dir / "telemetry.parquet"
    if not tel_path.exists():
        raise HistoryError(f"{trace_dir}: no telemetry.parquet (a trace directory, telemetry/SCHEMA.md)")
    have = set(pq.read_schema(tel_path).names)
    missing = [c for c in ("timestamp", "node", "gpu") if c not in have]
    if missing:
        raise HistoryError(f"{tel_path}: missing columns {missing}")
    tel = pq.read_table(tel_path, columns=[c for c in ("timestamp", "node", "gpu", "uuid", DBE) if c in have])
    if tel.num_rows == 0:
        raise HistoryError(f"{tel_path}: no samples")
    t = timestamps_ms(tel.column("timestamp")) / 1000.0
    slot, idx = _slots(tel)
    uuid = _strings(tel.column("uuid")) if "uuid" in have else np.full(len(t), None, object)
    serial = np.where(_missing(uuid), slot, uuid)
    dbe = np.asarray(tel.column(DBE).to_numpy(zero_copy_only=False), float) if DBE in have \
        else np.full(len(t), np.nan)
    xids = read_xids(trace_dir)
    xt = timestamps_ms(xids.column("timestamp")) / 1000.0
    end_t = float(max(t.max(), xt.max() if len(xt) else -np.inf))

    order = np.lexsort((t, slot))
    t, slot, serial, dbe, idx = t[order], slot[order], serial[order], dbe[order], idx[order]
    serials, gpu = np.unique(serial, return_inverse=True)
    # stays: runs of one GPU in one slot, in time order
    start = np.flatnonzero(np.r_[True, (slot[1:] != slot[:-1]) | (gpu[1:] != gpu[:-1])])
    stay_slot, stay_gpu, stay_in = slot[start], gpu[start], t[start]
    replaced = np.r_[stay_slot[1:] == stay_slot[:-1], False]
    stay_out_t = np.where(replaced, np.r_[stay_in[1:], end_t], end_t)

    # DBE counter increases within one GPU's run of samples (NaN readings skipped)
    ok = ~np.isnan(dbe)
    tt, gg, dd, ss = t[ok], gpu[ok], dbe[ok], slot[ok]
    rise = np.flatnonzero((gg[1:] == gg[:-1]) & (ss[1:] == ss[:-1]) & (dd[1:] > dd[:-1])) + 1
    ev_gpu, ev_t, ev_kind, ev_loc = [gg[rise]], [tt[rise]], [np.full(len(rise), "DBE", object)], [ss[rise]]

    # XID 48/79: the GPU is the one in that slot then (the latest stay begun by then, else the first)
    xcode = np.asarray(xids.column("xid").to_numpy(zero_copy_only=False), np.int64)
    keep = np.isin(xcode, list(XID_EVENTS))
    xslot, xt, xcode = _slots(xids)[0][keep], xt[keep], xcode[keep]
    stays_of: dict[str, list[int]] = {}
    for i, s in enumerate(stay_slot):
        stays_of.setdefault(s, []).append(i)
    known = np.array([s in stays_of for s in xslot], bool)
    xg = np.array([stay_gpu[stays_of[s][max(0, int(np.searchsorted(stay_in[stays_of[s]], x, "right")) - 1)]]
                   for s, x in zip(xslot[known], xt[known])], dtype=np.int64)
    ev_gpu.append(xg)
    ev_t.append(xt[known])
    ev_kind.append(np.array([XID_EVENTS[c] for c in xcode[known]], dtype=object))
    ev_loc.append(xslot[known])
    eg, et, ek, el = (np.concatenate(a) for a in (ev_gpu, ev_t, ev_kind, ev_loc))
    kept = _merge(eg, et, ek.astype(str))
    eg, et, ek, el = eg[kept], et[kept], ek[kept].astype(str), el[kept].astype(str)

    # a stay "ended with an event" if its GPU had one in it (the CSV's event column)
    stay_event = np.zeros(len(stay_in), bool)
    for g, x in zip(eg, et):
        stay_event[(stay_gpu == g) & (stay_in <= x) & (x <= stay_out_t)] = True
    loc = np.zeros((len(stay_in), 5), int)
    loc[:, 4] = idx[start]
    return History(serials=serials.astype(str), stay_gpu=stay_gpu.astype(int), stay_loc=loc,
                   stay_location=stay_slot.astype(str), stay_in=stay_in, stay_out_t=stay_out_t.astype(float),
                   stay_out=replaced, stay_event=stay_event, event_gpu=eg.astype(int), event_t=et.astype(float),
                   event_kind=ek, event_location=el, end_t=end_t)

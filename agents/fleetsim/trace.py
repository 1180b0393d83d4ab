"""Write a simulated fleet as a labelled trace directory (SCHEMA.md layout)."""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from agents.fleetsim.config import FleetConfig
from agents.fleetsim.node import NodeSim
from telemetry import schema as S

CHUNK_S = 6 * 3600.0  # wall seconds drawn per node per row group

_TELEMETRY_FILE_SCHEMA = pa.schema(
    [f.with_type(pa.dictionary(pa.int32(), pa.string())) if f.name in ("node", "uuid") else f
     for f in S.TELEMETRY_SCHEMA]
)


def _ts(ms: np.ndarray) -> pa.Array:
    return pa.array(ms.astype(np.int64), pa.int64()).cast(S.TIMESTAMP)


def _telemetry_table(chunks, sims, node_names) -> pa.Table:
    """One time-ordered table from the nodes' chunks of the same span."""
    uuid_base = np.cumsum([0] + [len(s.uuids) for s in sims[:-1]])
    ts = np.concatenate([c.timestamp_ms for c in chunks])
    node = np.concatenate([np.full(len(c.gpu), i, np.int32) for i, c in enumerate(chunks)])
    gpu = np.concatenate([c.gpu for c in chunks])
    uuid = np.concatenate([c.uuid + b for c, b in zip(chunks, uuid_base)]).astype(np.int32)
    order = np.lexsort((gpu, node, ts))
    uuids = pa.array([u for s in sims for u in s.uuids], pa.string())
    cols = {
        "timestamp": _ts(ts[order]),
        "node": pa.DictionaryArray.from_arrays(pa.array(node[order]), pa.array(node_names, pa.string())),
        "gpu": pa.array(gpu[order], pa.int16()),
        "uuid": pa.DictionaryArray.from_arrays(pa.array(uuid[order]), uuids),
    }
    for m in S.METRICS:
        v = np.concatenate([c.metrics[m] for c in chunks])[order]
        cols[m] = pa.array(v, _TELEMETRY_FILE_SCHEMA.field(m).type, from_pandas=True)  # NaN -> null
    return pa.table(cols, schema=_TELEMETRY_FILE_SCHEMA)


def write_trace(cfg: FleetConfig, out_dir: str, progress: Callable[[int], None] | None = None) -> dict:
    """Simulate ``cfg`` (which must have ``days``) into ``out_dir``; return the trace.json summary.

    ``progress`` is called with the number of node-chunks done, for a progress bar.
    """
    if cfg.days is None:
        raise ValueError("a trace needs a finite number of days")
    os.makedirs(out_dir, exist_ok=True)
    names = cfg.names()
    sims = [NodeSim(cfg, name, i) for i, name in enumerate(names)]
    total_steps = int(round(cfg.days * 86400 / cfg.interval_s))
    per_chunk = max(1, int(CHUNK_S / cfg.interval_s))
    xid_parts, failures, rows = [], [], 0
    tmp = os.path.join(out_dir, ".telemetry.parquet.tmp")
    with pq.ParquetWriter(tmp, _TELEMETRY_FILE_SCHEMA, compression="zstd") as writer:
        for done in range(0, total_steps, per_chunk):
            n = min(per_chunk, total_steps - done)
            chunks = []
            for sim in sims:
                chunks.append(sim.advance(n))
                if progress:
                    progress(1)
            table = _telemetry_table(chunks, sims, list(names))
            writer.write_table(table)
            rows += table.num_rows
            for i, c in enumerate(chunks):
                xid_parts.append((c.xid_ms, np.full(len(c.xid), i, np.int32), c.xid_gpu, c.xid))
                failures += c.failures
    os.replace(tmp, os.path.join(out_dir, "telemetry.parquet"))

    xms, xnode, xgpu, xid = (np.concatenate(p) for p in zip(*xid_parts))
    order = np.lexsort((xgpu, xnode, xms))
    xids = pa.table(
        {"timestamp": _ts(xms[order]), "node": pa.array(np.asarray(names, object)[xnode[order]], pa.string()),
         "gpu": pa.array(xgpu[order], pa.int16()), "xid": pa.array(xid[order], pa.int32())},
        schema=S.XID_SCHEMA,
    )
    pq.write_table(xids, os.path.join(out_dir, "xid.parquet"))
    failures.sort(key=lambda f: (f["timestamp"], f["node"], f["gpu"]))
    fail = pa.table(
        {"timestamp": _ts(np.array([f["timestamp"] for f in failures], np.int64)),
         **{k: [f[k] for f in failures] for k in ("node", "gpu", "mode", "xid", "precursor_s")}},
        schema=S.FAILURE_SCHEMA,
    )
    pq.write_table(fail, os.path.join(out_dir, "failures.parquet"))
    summary = {
        "generator": "ckpt-guard agents.fleetsim", "seed": cfg.seed, "nodes": len(names),
        "gpus_per_node": cfg.gpus_per_node, "days": cfg.days, "interval_s": cfg.interval_s,
        "start": cfg.start.isoformat(), "gpu_model": cfg.profile.model_name, "temp_offset_c": cfg.temp_offset_c,
        "failure_rate_per_gpu_day": cfg.failure_rate_per_gpu_day, "sudden_share": round(cfg.sudden_share, 4),
        "time_scale": cfg.time_scale, "failures": fail.num_rows, "xid_events": xids.num_rows, "rows": rows,
        "failures_by_mode": {m: sum(f["mode"] == m for f in failures) for m in S.FAILURE_MODES},
    }
    with open(os.path.join(out_dir, "trace.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    return summary


def node_chunks(cfg: FleetConfig) -> int:
    """How many ``progress`` ticks ``write_trace`` makes (for a progress bar's total)."""
    steps = int(round(cfg.days * 86400 / cfg.interval_s))
    return len(cfg.names()) * math.ceil(steps / max(1, int(CHUNK_S / cfg.interval_s)))

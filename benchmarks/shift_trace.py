#!/usr/bin/env python3
"""A labelled trace as a warmer fleet at a finer cadence would have recorded it (issue 20, point 4).

The hidden warm fleet (30 s, 4 °C warmer) raised false alarms that the simulator does not
reproduce, and the shared sample is the only data from its generator. This shifts the sample
by what running warmer physically does in the sample itself, and re-samples it:

- GPU and HBM temperature + OFFSET °C;
- the sample throttles at a fixed GPU temperature: above 87.2 °C every sample carries the
  SW and HW thermal bits (0x20|0x40) and its SM clock is 0.628x (1980 -> 1243 MHz), power
  about 6 % lower; below it none does. A warmer fleet crosses that level more often, so
  the bits, the clock drop and the power drop are set (or cleared) by the shifted temperature;
- `--interval 30` on a 60 s trace inserts a sample half-way between two consecutive ones of a
  GPU (never across a gap, a failure or a counter reset): gauges interpolated with the
  sample's own sample-to-sample noise, counters split binomially (events fall uniformly in
  time), throttle/clock from a neighbour then re-thermalised, blank fields at the sample's rate.

XIDs and failures are copied unchanged. `--validation-only` keeps only the nodes that
training holds out (predictor.model.training.is_validation_node).

usage: PYTHONPATH=. python benchmarks/shift_trace.py --trace DIR --out DIR [--temp-offset 4]
       [--interval 30] [--validation-only] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from predictor.model.training import is_validation_node
from telemetry import schema as S

THROTTLE_AT_C = 87.2          # the sample: no thermal bit at <= 87.1 °C, always at >= 87.3 °C
THROTTLE_CLOCK = 0.628        # SM clock while thermally throttled (1243 / 1980 MHz)
THROTTLE_POWER = 0.94         # board power while throttled, against the same temperature unthrottled
THERMAL = S.THROTTLE_SW_THERMAL | S.THROTTLE_HW_THERMAL
GAUGES = (S.GPU_TEMP, S.MEMORY_TEMP, S.POWER)
COUNTERS = (S.SBE, S.DBE, S.REMAP_CORR, S.REMAP_UNCORR, S.PCIE_REPLAY, S.NVLINK_CRC)


def thermalise(cols: dict[str, np.ndarray]) -> None:
    """Thermal bits, clock and power as the sample's throttling sets them at these temperatures."""
    temp = cols[S.GPU_TEMP]
    bits = np.nan_to_num(cols[S.THROTTLE]).astype(np.int64)
    was = (bits & THERMAL) != 0
    now = temp > THROTTLE_AT_C
    now = np.where(np.isnan(temp), was, now)
    start, stop = now & ~was, was & ~now
    clock, power = cols[S.SM_CLOCK], cols[S.POWER]
    cols[S.SM_CLOCK] = np.where(start, np.round(clock * THROTTLE_CLOCK),
                                np.where(stop, np.round(clock / THROTTLE_CLOCK), clock))
    cols[S.POWER] = np.where(start, np.round(power * THROTTLE_POWER, 1),
                             np.where(stop, np.round(power / THROTTLE_POWER, 1), power))
    bits = np.where(now, bits | THERMAL, bits & ~THERMAL)
    cols[S.THROTTLE] = np.where(np.isnan(cols[S.THROTTLE]), np.nan, bits.astype(float))


def midpoints(cols: dict[str, np.ndarray], t: np.ndarray, key: np.ndarray, step_ms: int,
              rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Rows half-way between consecutive samples of a GPU that are exactly `step_ms` apart."""
    nxt = np.flatnonzero((key[1:] == key[:-1]) & (t[1:] - t[:-1] == step_ms))
    a, b = nxt, nxt + 1
    out = {"timestamp": t[a] + step_ms // 2, "key": key[a]}
    blank = {m: np.isnan(v).mean() for m, v in cols.items()}
    for m in GAUGES:
        va, vb = cols[m][a], cols[m][b]
        mid = np.where(np.isnan(va), vb, np.where(np.isnan(vb), va, (va + vb) / 2))
        d2 = cols[m][:-2] - 2 * cols[m][1:-1] + cols[m][2:]
        sigma = 1.4826 * np.nanmedian(np.abs(d2 - np.nanmedian(d2))) / np.sqrt(6)
        out[m] = np.round(mid + rng.normal(0, sigma / np.sqrt(2), len(a)), 1)
    for m in COUNTERS:
        va, vb = cols[m][a], cols[m][b]
        d = vb - va
        ok = ~np.isnan(d) & (d > 0)
        mid = va.copy()
        mid[ok] = va[ok] + rng.binomial(np.minimum(d[ok], 2**31).astype(np.int64), 0.5)
        out[m] = np.where(np.isnan(va), vb, mid)
    side = np.where(rng.random(len(a)) < 0.5, a, b)
    for m in (S.SM_CLOCK, S.THROTTLE, S.REMAP_FAILURE):
        out[m] = cols[m][side].copy()
    out[S.REMAP_FAILURE] = cols[S.REMAP_FAILURE][a].copy()
    thermalise(out)
    for m in cols:
        out[m][rng.random(len(a)) < blank[m]] = np.nan
    return out


def shift(trace: Path, out: Path, offset: float, interval: int | None, validation_only: bool, seed: int) -> dict:
    tab = pq.read_table(trace / "telemetry.parquet")
    node = pc.cast(tab.column("node"), pa.string())
    if validation_only:
        keep = np.array([is_validation_node(n) for n in node.to_pylist()])
        tab, node = tab.filter(pa.array(keep)), pc.cast(tab.filter(pa.array(keep)).column("node"), pa.string())
    t = tab.column("timestamp").cast(pa.int64()).to_numpy()
    names, codes = np.unique(np.asarray(node.to_pylist(), dtype=object), return_inverse=True)
    gpu = tab.column("gpu").to_numpy().astype(np.int64)
    key = codes * 64 + gpu
    order = np.lexsort((t, key))
    t, key = t[order], key[order]
    metrics = [c for c in tab.column_names if c.startswith(S.DCGM_PREFIX)]
    cols = {m: tab.column(m).to_numpy(zero_copy_only=False).astype(float)[order] for m in metrics}
    for m in (S.GPU_TEMP, S.MEMORY_TEMP):
        cols[m] = np.round(cols[m] + offset, 1)
    thermalise(cols)
    step = int(np.median(np.diff(np.unique(t))))
    rng = np.random.default_rng(seed)
    if interval is not None and interval * 1000 < step:
        if step != 2 * interval * 1000:
            raise SystemExit(f"--interval {interval}: only halving is supported (the trace is at {step / 1000:g} s)")
        mid = midpoints(cols, t, key, step, rng)
        t = np.concatenate([t, mid.pop("timestamp")])
        key = np.concatenate([key, mid.pop("key")])
        cols = {m: np.concatenate([cols[m], mid[m]]) for m in metrics}
    order = np.lexsort((key, t))
    out.mkdir(parents=True, exist_ok=True)
    fields = {"timestamp": pa.array(t[order], pa.timestamp("ms", tz="UTC")),
              "node": pa.array(names[key[order] // 64].tolist(), pa.string()),
              "gpu": pa.array(key[order] % 64, pa.int16())}
    fields.update({m: pa.array(cols[m][order], tab.schema.field(m).type) for m in metrics})
    pq.write_table(pa.table(fields), out / "telemetry.parquet")
    kept = pa.array(names.tolist(), pa.string())
    for name in ("xid.parquet", "failures.parquet"):
        other = pq.read_table(trace / name)
        pq.write_table(other.filter(pc.is_in(pc.cast(other.column("node"), pa.string()), kept)), out / name)
    meta = json.loads((trace / "trace.json").read_text()) if (trace / "trace.json").exists() else {}
    meta.update({"interval_s": interval or step / 1000, "temp_offset": offset, "shifted_from": str(trace),
                 "rows": len(t), "nodes": len(names),
                 "failures": pq.ParquetFile(out / "failures.parquet").metadata.num_rows})
    thermal = (np.nan_to_num(cols[S.THROTTLE]).astype(np.int64) & THERMAL) != 0
    meta["thermal_throttled_share"] = round(float(thermal.mean()), 6)
    (out / "trace.json").write_text(json.dumps(meta, indent=1))
    return meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--temp-offset", type=float, default=4.0)
    ap.add_argument("--interval", type=int, default=None, help="halve the sample interval to this (s)")
    ap.add_argument("--validation-only", action="store_true", help="keep only the nodes training holds out")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(json.dumps(shift(a.trace, a.out, a.temp_offset, a.interval, a.validation_only, a.seed)))


if __name__ == "__main__":
    main()

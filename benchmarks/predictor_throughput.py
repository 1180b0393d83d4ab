"""Predictor service throughput and "checkpoint now" latency, measured on a live server.

One `predictor serve` process (the thing measured) receives realistic batches, one
node's GPUs per request, from many concurrent senders in separate client processes.
Throughput is read from the server's own counter (samples *scored*, not just
accepted). Latency: while the fleet streams, a job listens on SSE and a critical
XID batch is posted for one of its nodes; the time from that POST to the event.

    PYTHONPATH=. python benchmarks/predictor_throughput.py [--nodes 4000] [--duration 20] [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aiohttp
import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench-operator-token-0123456789"
ARROW = "application/vnd.apache.arrow.stream"
T0 = 1_780_000_000_000


def _body(node: str, t_ms: int, gpus: int, rng: np.random.Generator) -> bytes:
    n = gpus
    table = pa.table({
        "timestamp": pa.array(np.full(n, t_ms), pa.timestamp("ms", tz="UTC")),
        "node": pa.array([node] * n), "gpu": pa.array(np.arange(n), pa.int16()),
        "DCGM_FI_DEV_GPU_TEMP": rng.normal(68, 2, n), "DCGM_FI_DEV_MEMORY_TEMP": rng.normal(74, 2, n),
        "DCGM_FI_DEV_POWER_USAGE": rng.normal(600, 30, n), "DCGM_FI_DEV_SM_CLOCK": np.full(n, 1980.0),
        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": np.zeros(n), "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": np.zeros(n),
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": np.zeros(n), "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": np.zeros(n),
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": np.zeros(n), "DCGM_FI_DEV_ROW_REMAP_FAILURE": np.zeros(n),
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": np.zeros(n), "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": np.zeros(n),
    })
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


async def _send_fleet(url: str, nodes: list[str], gpus: int, interval_s: float, concurrency: int,
                      stop_at: float) -> int:
    """Each node posts its GPUs once per (simulated) interval, as fast as the server takes them."""
    rng = np.random.default_rng(abs(hash(nodes[0])) % 2**32)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": ARROW}
    sent = 0
    queue: asyncio.Queue = asyncio.Queue(concurrency * 2)

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal sent
        while True:
            body = await queue.get()
            async with session.post(url + "/v1/telemetry", data=body,
                                    headers={**headers, "X-Batch-Id": uuid.uuid4().hex}) as r:
                if r.status == 202:
                    sent += gpus
                elif r.status == 429:
                    await asyncio.sleep(0.05)
            queue.task_done()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        workers = [asyncio.create_task(worker(session)) for _ in range(concurrency)]
        step = 0
        while time.time() < stop_at:
            t_ms = T0 + int(step * interval_s * 1000)
            for node in nodes:
                if time.time() >= stop_at:
                    break
                await queue.put(_body(node, t_ms, gpus, rng))
            step += 1
        for w in workers:
            w.cancel()
    return sent


def _sender_process(url: str, nodes: list[str], gpus: int, interval_s: float, concurrency: int, stop_at: float,
                    out: mp.Queue) -> None:
    out.put(asyncio.run(_send_fleet(url, nodes, gpus, interval_s, concurrency, stop_at)))


async def _latencies(url: str, job_nodes: list[str], gpus: int, rounds: int, pause_s: float) -> list[float]:
    """POST a critical XID for a job node; time until the job's SSE stream says checkpoint."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        async with session.post(url + "/v1/jobs", json={"nodes": job_nodes, "min_interval_s": 0},
                                headers=headers) as r:
            job = await r.json()
        async with session.get(url + job["stream"], headers=headers) as stream:
            await stream.content.readline()                   # first line of the hello event
            for i in range(rounds):
                node, gpu = job_nodes[i % len(job_nodes)], (i // len(job_nodes)) % gpus
                body = json.dumps({"timestamp": T0 + i, "node": node, "gpu": gpu, "xid": 79}).encode()
                start = time.perf_counter()
                async with session.post(url + "/v1/xid", data=body, headers={
                        **headers, "Content-Type": "application/x-ndjson", "X-Batch-Id": uuid.uuid4().hex}) as r:
                    assert r.status == 202, await r.text()
                while True:
                    line = await asyncio.wait_for(stream.content.readline(), 30)
                    if line.startswith(b"event: checkpoint"):
                        out.append(time.perf_counter() - start)
                        break
                await asyncio.sleep(pause_s)
    return out


def _component_costs(model_path: str | None, nodes: int, gpus: int) -> dict:
    """CPU time of the server's two halves without HTTP: decode+validate a request, score a sample."""
    from predictor import model as model_io, wire
    from predictor.scoring import Scorer
    from predictor.server import _concat
    rng = np.random.default_rng(1)
    scorer = Scorer(model_io.load(model_path))
    decode_s, score_s = [], []
    for step in range(3):
        bodies = [_body(f"node{i:05d}", T0 + step * 10_000, gpus, rng) for i in range(nodes)]
        t = time.process_time()
        tables = [wire.decode(b, ARROW, wire.TELEMETRY_KEYS) for b in bodies]
        decode_s.append((time.process_time() - t) / nodes)
        t = time.process_time()
        scorer.score_table(_concat(tables))
        score_s.append((time.process_time() - t) / (nodes * gpus))
    return {"decode_validate_us_per_request": round(statistics.median(decode_s) * 1e6, 1),
            "scoring_us_per_sample": round(statistics.median(score_s[1:]) * 1e6, 1)}


def _scored(url: str) -> float:
    import urllib.request
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    m = re.search(r"^predictor_scored_samples_total ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=4000, help="simulated nodes (8 GPUs each)")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of load per measurement")
    ap.add_argument("--senders", type=int, default=64, help="concurrent requests per client process")
    ap.add_argument("--procs", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="client processes")
    ap.add_argument("--rounds", type=int, default=50, help="checkpoint-latency probes")
    ap.add_argument("--model", help="model file (default: the packaged one)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    costs = _component_costs(a.model, min(a.nodes, 2000), a.gpus)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREDICTOR_OPERATOR_TOKEN": TOKEN}
    cmd = [sys.executable, "-m", "predictor.cli", "serve", "--port", str(port)] + (["--model", a.model] if a.model else [])
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                _scored(url)
                break
            except OSError:
                time.sleep(0.1)
        nodes = [f"node{i:05d}" for i in range(a.nodes)]
        # warm-up: every GPU registered once, so the measurement is steady state
        asyncio.run(_send_fleet(url, nodes, a.gpus, 10.0, a.senders, time.time() + 3))
        before, t_start = _scored(url), time.time()
        stop_at = t_start + a.duration
        results: mp.Queue = mp.Queue()
        parts = [nodes[i::a.procs] for i in range(a.procs)]
        procs = [mp.Process(target=_sender_process, args=(url, p, a.gpus, 10.0, a.senders, stop_at, results))
                 for p in parts]
        for p in procs:
            p.start()
        time.sleep(min(2.0, a.duration / 4))
        lat = asyncio.run(_latencies(url, nodes[:16], a.gpus, a.rounds, max(0.0, (a.duration - 4) / a.rounds)))
        accepted = sum(results.get(timeout=a.duration + 60) for _ in procs)
        for p in procs:
            p.join()
        time.sleep(0.5)
        elapsed = time.time() - t_start
        scored = _scored(url) - before
    finally:
        server.terminate()
        server.wait(10)
    res = {"gpus": a.nodes * a.gpus, "client_processes": a.procs, "concurrent_senders": a.procs * a.senders,
           "batch_gpus": a.gpus, "seconds": round(elapsed, 1),
           "accepted_samples_per_s": round(accepted / elapsed), "scored_samples_per_s": round(scored / elapsed),
           "checkpoint_latency_s_p50": round(statistics.median(lat), 4),
           "checkpoint_latency_s_p99": round(float(np.percentile(lat, 99)), 4), "latency_probes": len(lat),
           "cpu_count": os.cpu_count(), **costs}
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        print(f"{res['scored_samples_per_s']:,} GPU samples/s scored ({res['accepted_samples_per_s']:,} accepted) "
              f"from {res['concurrent_senders']} senders, one node ({a.gpus} GPUs) per request; "
              f"POST -> checkpoint now p50 {res['checkpoint_latency_s_p50'] * 1000:.1f} ms, "
              f"p99 {res['checkpoint_latency_s_p99'] * 1000:.1f} ms ({len(lat)} probes); CPU without HTTP: "
              f"decode+validate {costs['decode_validate_us_per_request']} us/request, "
              f"scoring {costs['scoring_us_per_sample']} us/sample")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Predictor service throughput, server CPU per sample and "checkpoint now" latency, on a live server.

One `predictor serve` process (the thing measured) receives Arrow batches from many
concurrent senders in separate client processes: one node's GPUs per request, as the
agents send (`--batch-nodes 1`), or several nodes' per request, as a rack-level
aggregator would (`--batch-nodes 32`). Throughput is read from the server's own
counter (samples *scored*, not just accepted) over each window; the server's CPU time
over the same window (from /proc) gives CPU-seconds per 1000 samples, which does not
depend on how much of the machine the load generator left to the server. Latency:
while the fleet streams, a job listens on SSE and a critical XID batch is posted for
one of its nodes; the time from that POST to the event.

    PYTHONPATH=. python benchmarks/predictor_throughput.py [--nodes 4000] [--batch-nodes 1] [--runs 3] [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.harness import median_of, parser, run_meta, write_json  # noqa: E402
from tests.procs import cpu_seconds, free_port  # noqa: E402

TOKEN = "bench-operator-token-0123456789"
ARROW = "application/vnd.apache.arrow.stream"
T0 = 1_780_000_000_000
_PLACEHOLDER_MS = 0x5A5A_5A5A_5A5A       # stands for the timestamp in a body template
RUN_SPAN_MS = 10**8                      # simulated time per measurement: each starts later than the last ended


@dataclass(frozen=True)
class Shape:
    """What one request carries: `instants` samples, `interval_s` apart, of every GPU of `nodes` nodes."""

    gpus: int
    nodes: int
    instants: int
    interval_s: float

    @property
    def rows(self) -> int:
        return self.gpus * self.nodes * self.instants

    @property
    def span_ms(self) -> int:
        """Simulated time one request covers: the next request of its nodes starts this much later."""
        return int(self.instants * self.interval_s * 1000)

    def offsets_ms(self, nodes: int) -> np.ndarray:
        """Each row's time after the request's first instant (rows instant by instant)."""
        return np.repeat(np.arange(self.instants) * int(self.interval_s * 1000), nodes * self.gpus)


def _body(nodes: list[str], t_ms: np.ndarray, gpus: int, rng: np.random.Generator) -> bytes:
    """One request: every GPU of `nodes` at each distinct time of `t_ms` (one per row), as an Arrow IPC stream."""
    n = len(t_ms)
    per_instant = n // (len(nodes) * gpus)
    table = pa.table({
        "timestamp": pa.array(t_ms, pa.timestamp("ms", tz="UTC")),
        "node": pa.array(np.tile(np.repeat(nodes, gpus), per_instant)),
        "gpu": pa.array(np.tile(np.arange(gpus), len(nodes) * per_instant), pa.int16()),
        "uuid": pa.array([f"GPU-{node}-{g}" for node in nodes for g in range(gpus)] * per_instant),
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


class _Template:
    """A request body whose timestamps are patched in place: the load generator must not
    spend on encoding the CPU that the server it measures needs."""

    def __init__(self, nodes: list[str], shape: Shape, rng: np.random.Generator):
        self.offsets = shape.offsets_ms(len(nodes))
        self.rows = len(self.offsets)
        placeholder = (_PLACEHOLDER_MS + self.offsets).astype(np.int64)
        self.body = _body(nodes, placeholder, shape.gpus, rng)
        self.at_byte = self.body.find(placeholder.tobytes())
        assert self.at_byte >= 0 and self.body.count(placeholder[:1].tobytes()) == len(nodes) * shape.gpus

    def at(self, t_ms: int) -> bytes:
        b = bytearray(self.body)
        b[self.at_byte: self.at_byte + 8 * self.rows] = (t_ms + self.offsets).astype(np.int64).tobytes()
        return bytes(b)


def _templates(nodes: list[str], shape: Shape, rng: np.random.Generator) -> list[_Template]:
    return [_Template(nodes[i:i + shape.nodes], shape, rng) for i in range(0, len(nodes), shape.nodes)]


async def _send_fleet(url: str, nodes: list[str], shape: Shape, start_ms: int, concurrency: int,
                      stop_at: float) -> int:
    """Each group of nodes posts its GPUs' next samples from `start_ms` on, as fast as the server
    answers (it answers once a batch is scored: `concurrency` bounds the queue)."""
    rng = np.random.default_rng(abs(hash(nodes[0])) % 2**32)
    templates = _templates(nodes, shape, rng)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": ARROW}
    sent = 0
    queue: asyncio.Queue = asyncio.Queue(concurrency * 2)

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal sent
        while True:
            body, rows = await queue.get()
            async with session.post(url + "/v1/telemetry", data=body,
                                    headers={**headers, "X-Batch-Id": uuid.uuid4().hex}) as r:
                if r.status == 202:
                    sent += rows
                elif r.status == 429:
                    await asyncio.sleep(0.05)
            queue.task_done()

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency), timeout=timeout) as session:
        workers = [asyncio.create_task(worker(session)) for _ in range(concurrency)]
        t_ms = start_ms
        while time.time() < stop_at:
            for tpl in templates:
                if time.time() >= stop_at:
                    break
                await queue.put((tpl.at(t_ms), tpl.rows))
            t_ms += shape.span_ms
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return sent


def _sender_process(url: str, nodes: list[str], shape: Shape, start_ms: int, concurrency: int, stop_at: float,
                    out: mp.Queue) -> None:
    out.put(asyncio.run(_send_fleet(url, nodes, shape, start_ms, concurrency, stop_at)))


async def _latencies(url: str, job_nodes: list[str], gpus: int, rounds: int, pause_s: float) -> list[float]:
    """POST a critical XID for a job node; time until the job's SSE stream says checkpoint.
    Each probe takes a GPU not probed before (a critical XID holds its GPU at risk 1)."""
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
        async with session.delete(url + f"/v1/jobs/{job['id']}", headers=headers):
            pass
    return out


def _component_costs(model_path: str | None, nodes: int, shape: Shape) -> dict:
    """CPU time of the server's two halves without HTTP: decode+validate a request, score a sample
    (in one pass over `nodes` nodes, on one native thread as in the server)."""
    from threadpoolctl import threadpool_limits

    from predictor.ingest import wire
    from predictor.model import model_io
    from predictor.model.scoring import Scorer
    from predictor.serve.scoring_queue import _concat
    rng = np.random.default_rng(1)
    scorer = Scorer(model_io.load(model_path))
    names = [f"node{i:05d}" for i in range(nodes)]
    templates = _templates(names, shape, rng)
    decode_s, score_s = [], []
    with threadpool_limits(1, user_api="openmp"):
        for step in range(4):
            bodies = [tpl.at(T0 + step * shape.span_ms) for tpl in templates]
            t = time.process_time()
            tables = [wire.decode(b, ARROW, wire.TELEMETRY_KEYS) for b in bodies]
            decode_s.append((time.process_time() - t) / len(bodies))
            t = time.process_time()
            scorer.score_table(_concat(tables))
            score_s.append((time.process_time() - t) / sum(tpl.rows for tpl in templates))
    return {"decode_validate_us_per_request": round(statistics.median(decode_s) * 1e6, 1),
            "scoring_us_per_sample": round(statistics.median(score_s[1:]) * 1e6, 2)}


def _scored(url: str) -> float:
    import urllib.request
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    m = re.search(r"^predictor_scored_samples_total ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0




def _window(url: str, pid: int, nodes: list[str], shape: Shape, a: argparse.Namespace, start_ms: int,
            job_nodes: list[str]) -> dict:
    """One measurement: the fleet streams for `a.duration` s from `start_ms` on while the latency probes run."""
    before, cpu_before, t_start = _scored(url), cpu_seconds(pid), time.time()
    stop_at = t_start + a.duration
    results: mp.Queue = mp.Queue()
    groups = [nodes[i:i + shape.nodes] for i in range(0, len(nodes), shape.nodes)]
    parts = [[n for g in groups[i::a.procs] for n in g] for i in range(a.procs)]
    procs = [mp.Process(target=_sender_process, args=(url, p, shape, start_ms, a.senders, stop_at, results))
             for p in parts]
    for p in procs:
        p.start()
    time.sleep(min(2.0, a.duration / 4))
    lat = asyncio.run(_latencies(url, job_nodes, a.gpus, a.rounds, max(0.0, (a.duration - 4) / a.rounds)))
    accepted = sum(results.get(timeout=a.duration + 120) for _ in procs)
    for p in procs:
        p.join()
    elapsed = time.time() - t_start
    scored, cpu = _scored(url) - before, cpu_seconds(pid) - cpu_before
    return {"seconds": round(elapsed, 1), "scored_samples_per_s": round(scored / elapsed),
            "accepted_samples_per_s": round(accepted / elapsed),
            "server_cpu_s_per_1000_samples": round(cpu / scored * 1000, 4) if scored else None,
            "server_cores_used": round(cpu / elapsed, 2),
            "checkpoint_latency_s_p50": round(statistics.median(lat), 4),
            "checkpoint_latency_s_p99": round(float(np.percentile(lat, 99)), 4), "latency_probes": len(lat),
            "load_average_1m": round(os.getloadavg()[0], 2)}


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--nodes", type=int, default=4000, help="simulated nodes")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    ap.add_argument("--batch-nodes", type=int, default=1, help="nodes per request (1: as the agents send)")
    ap.add_argument("--instants", type=int, default=1,
                    help="samples per GPU per request (agents: --batch-seconds / --interval)")
    ap.add_argument("--interval", type=float, default=10.0, help="simulated seconds between a GPU's samples")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of load per measurement")
    ap.add_argument("--runs", type=int, default=3, help="measurements (medians are reported)")
    ap.add_argument("--senders", type=int, default=64, help="concurrent requests per client process")
    ap.add_argument("--procs", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="client processes")
    ap.add_argument("--rounds", type=int, default=50, help="checkpoint-latency probes per measurement")
    ap.add_argument("--model", help="model file (default: the packaged one)")
    a = ap.parse_args()
    meta = run_meta()

    shape = Shape(a.gpus, a.batch_nodes, a.instants, a.interval)
    costs = _component_costs(a.model, min(a.nodes, 2000), shape)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CKPT_GUARD_OPERATOR_TOKEN": TOKEN}
    cmd = ([sys.executable, "-m", "predictor.cli", "serve", "--port", str(port)]
           + (["--model", a.model] if a.model else []))
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                _scored(url)
                break
            except OSError:
                time.sleep(0.1)
        nodes = [f"node{i:05d}" for i in range(a.nodes)]
        # warm-up: every GPU registered once, so the measurements are steady state
        asyncio.run(_send_fleet(url, nodes, shape, T0, a.senders, time.time() + 3))
        per_run = -(-a.rounds // a.gpus)                   # nodes whose GPUs the probes of one run use
        runs = [_window(url, server.pid, nodes, shape, a, T0 + (i + 1) * RUN_SPAN_MS,
                        nodes[i * per_run:(i + 1) * per_run]) for i in range(a.runs)]
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    median = median_of([{k: v for k, v in r.items() if k != "latency_probes"} for r in runs])
    res = {"gpus": a.nodes * a.gpus, "batch_nodes": a.batch_nodes, "batch_instants": a.instants,
           "batch_rows": shape.rows, "interval_s": a.interval,
           "client_processes": a.procs, "concurrent_requests": a.procs * a.senders,
           "median": median, "runs": runs, **costs}
    write_json(a.json, meta, **res)
    if a.json != "-":
        m = median
        print(f"{m['scored_samples_per_s']:,.0f} GPU samples/s scored (median of {a.runs}) from "
              f"{res['concurrent_requests']} concurrent requests of {shape.rows} samples ({a.batch_nodes} node(s) x "
              f"{a.gpus} GPUs x {a.instants} instant(s)); server CPU "
              f"{m['server_cpu_s_per_1000_samples']:.4f} s per 1000 samples ({m['server_cores_used']} cores used); "
              f"POST -> checkpoint now p50 {m['checkpoint_latency_s_p50'] * 1000:.1f} ms, "
              f"p99 {m['checkpoint_latency_s_p99'] * 1000:.1f} ms; CPU without HTTP: decode+validate "
              f"{costs['decode_validate_us_per_request']} us/request, "
              f"scoring {costs['scoring_us_per_sample']} us/sample")
    return 0


if __name__ == "__main__":
    sys.exit(main())

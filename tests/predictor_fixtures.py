"""Test helpers for predictor/: small simulated traces, a trained model, a live server.

Traces come from the agents' fleet simulator (`agents simulate`), small and with an
enriched failure rate so that a few node-days hold enough failures to train on.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pyarrow as pa
import requests

from .procs import HTTP_S, free_port, stop_process

ROOT = Path(__file__).resolve().parent.parent
TOKENS = {"agent": "agent-token-0123456789", "job": "job-token-0123456789ab",
          "operator": "operator-token-0123456789"}
OTHER_JOB_TOKEN = "job-token-of-another-job-0123"  # a second job token: jobs are private to the token that made them


def run_cli(module: str, *args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` from the repository root, as a user would run it.

    One OpenMP thread: beside the other test worker on a busy machine, OpenMP threads that spin
    waiting for each other made a model fit 2.5x slower. The timeout is a hang guard only."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    res = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=full_env, capture_output=True,
                         text=True, timeout=1800)
    if check and res.returncode != 0:
        raise AssertionError(f"{module} {' '.join(args)} exited {res.returncode}:\n{res.stdout}\n{res.stderr}")
    return res


def simulate(out: Path, nodes: int, days: float, interval: int, seed: int, *extra: str) -> Path:
    run_cli("agents.cli", "simulate", "--nodes", str(nodes), "--days", str(days), "--interval", str(interval),
            "--seed", str(seed), "--out", str(out), *extra)
    return out


class LiveServer:
    """`predictor serve` in a subprocess on 127.0.0.1, tokens from a file named in the env."""

    def __init__(self, tmp: Path, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        tokens = tmp / "tokens"
        tokens.write_text("".join(f"{role} {tok}\n" for role, tok in TOKENS.items()) + f"job {OTHER_JOB_TOKEN}\n")
        tokens.chmod(0o600)
        self.log = open(tmp / f"serve-{self.port}.log", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "predictor.cli", "serve", "--port", str(self.port), *args], cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "CKPT_GUARD_TOKENS_FILE": str(tokens)},
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300  # a hang guard: beside a CPU hog, start-up took over 60 s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"predictor serve exited {self.proc.returncode}: {self.output()}")
            try:
                if requests.get(self.url + "/healthz", timeout=1).ok:
                    return
            except (requests.ConnectionError, requests.Timeout):  # not listening yet, or busy loading its model
                time.sleep(0.1)
        output = self.output()  # before stop() closes the log: a server that did not come up shows why
        self.stop()
        raise AssertionError(f"predictor serve did not come up within 300 s: {output}")

    def headers(self, role: str, **extra: str) -> dict:
        return {"Authorization": f"Bearer {TOKENS[role]}", **extra}

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


# ------------------------------------------------------------ requests to a live server
T0 = 1_780_000_000_000


def arrow_body(rows: list[dict]) -> bytes:
    table = pa.Table.from_pylist(rows)
    table = table.set_column(0, "timestamp", table.column("timestamp").cast(pa.timestamp("ms", tz="UTC")))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def node_rows(node: str, t_ms: int, uuid_prefix: str = "GPU", gpus: int = 8) -> list[dict]:
    return [{"timestamp": t_ms, "node": node, "gpu": g, "uuid": f"{uuid_prefix}-{node}-{g}",
             "DCGM_FI_DEV_GPU_TEMP": 65.0 + g, "DCGM_FI_DEV_MEMORY_TEMP": 70.0, "DCGM_FI_DEV_POWER_USAGE": 550.0,
             "DCGM_FI_DEV_SM_CLOCK": 1980.0, "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": 0.0,
             "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": 0.0, "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": 0.0} for g in range(gpus)]


def post(srv, kind: str, body: bytes, role: str = "agent", ctype: str = "application/vnd.apache.arrow.stream",
         batch_id: str | None = None, **headers) -> requests.Response:
    h = srv.headers(role, **{"Content-Type": ctype, "X-Batch-Id": batch_id or str(uuid.uuid4()), **headers})
    return requests.post(f"{srv.url}/v1/{kind}", data=body, headers=h, timeout=HTTP_S)

"""How fast a job hears that one of its nodes lost a GPU: agent sample -> job reaction.

    python benchmarks/xid_reaction_bench.py [--events 50] [--json out.json]

The real path on loopback: a node agent (``agents.agent.Agent``: its sampler, which
collects XID events every second between samples, its sender, spool and HTTP client)
whose source logs a critical XID (79) now and then; a real ``predictor serve``
(``--no-auth``) that turns it into a "node_failed" event on the job's stream; and the
job's listener (``ckpt.integrations.risk.RiskListener``, as rank 0 runs it), whose
``on_node_failed`` is the job's reaction (it then stops every rank within ``poll_s``:
``benchmarks/recovery_bench.py``, row xid79). Per event: ``total`` (the XID's sample
time, stamped by the agent's source -> the listener's callback), split into
``agent_to_predictor`` (-> the predictor sent the event) and ``predictor_to_job``.
p50/p99 over ``--events`` XIDs, each logged at a uniformly random phase of the agent's
1 s XID poll (so ``total`` is about that wait plus the path's own latency).
"""
from __future__ import annotations

import logging
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from agents.agent import Agent  # noqa: E402
from agents.sources.base import Source  # noqa: E402
from benchmarks.harness import parser, run_meta, write_json  # noqa: E402
from benchmarks.recovery_bench import healthy  # noqa: E402
from ckpt.integrations.risk import RiskListener  # noqa: E402
from ckpt.integrations.urgency import SaveRequests  # noqa: E402
from tests.procs import free_port, stop_process, wait_for  # noqa: E402

NODE = "bench-node-0"
POLL_S = 1.0  # the agent collects XID events this often between samples (agents.sampler)


class XidSource(Source):
    """A node with no telemetry worth scoring, whose GPU 0 logs XID 79 when told."""

    def read(self) -> list[dict]:
        return []

    def log_xid(self) -> float:
        now = time.time()
        self._xids.append({"timestamp": int(now * 1000), "node": NODE, "gpu": 0, "xid": 79})
        return now


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(events: int) -> dict[str, dict[str, float]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "predictor.cli", "serve", "--port", str(port), "--no-auth"],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    received: list[tuple[float, dict]] = []
    heard = threading.Condition()

    def react(event: dict) -> None:
        with heard:
            received.append((time.time(), event))
            heard.notify_all()

    listener = RiskListener(url, [NODE], SaveRequests(), name="xid-bench")
    listener.on_node_failed = react
    source = XidSource()
    try:
        if not wait_for(lambda: healthy(url), timeout=60):
            raise SystemExit("predictor serve did not come up")
        listener.start()
        if not wait_for(lambda: listener.job_id is not None, timeout=30):
            raise SystemExit("the listener did not register")
        time.sleep(0.5)  # the stream subscribed
        with tempfile.TemporaryDirectory(prefix="xid-bench-spool-") as spool:
            agent = Agent(source, interval_s=10.0, predictor=url, token="unused", spool_dir=spool, batch_s=10.0)
            runner = threading.Thread(target=agent.run, daemon=True)
            runner.start()
            for i in range(events + 1):  # the first warms the agent's connection up: not counted
                time.sleep(random.uniform(0.0, POLL_S))  # after the last poll: a uniformly random phase of it
                source.log_xid()
                with heard:
                    if not heard.wait_for(lambda n=i: len(received) > n, timeout=30):
                        raise SystemExit(f"event {i}: no node_failed within 30 s")
                print(f"\r{i}/{events} events", end="", file=sys.stderr, flush=True)
            print(file=sys.stderr)
            del received[0]
            agent.stop()
            runner.join(timeout=15)
    finally:
        listener.close()
        stop_process(server)
    total = [t - e["sampled_at_ms"] / 1000 for t, e in received]
    hop1 = [(e["sent_at_ms"] - e["sampled_at_ms"]) / 1000 for _, e in received]
    hop2 = [t - e["sent_at_ms"] / 1000 for t, e in received]
    return {name: {"p50_s": round(statistics.median(v), 3), "p99_s": round(percentile(v, 0.99), 3),
                   "max_s": round(max(v), 3)}
            for name, v in (("total", total), ("agent_to_predictor", hop1), ("predictor_to_job", hop2))}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--events", type=int, default=50)
    args = ap.parse_args()
    meta = run_meta()
    logging.getLogger("ckpt").setLevel(logging.CRITICAL + 1)  # the listener logs each event: a progress line instead
    write_json(args.json, meta, echo=args.json != "-", events=args.events, **measure(args.events))


if __name__ == "__main__":
    main()

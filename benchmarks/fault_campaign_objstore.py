"""The fault campaign's object-store row (benchmarks/fault_campaign.py): the campaign's job
draining to S3 (a moto server on 127.0.0.1, tests/objstore_fixtures.py) through
benchmarks/throttle_proxy.py, the proxy killed once worker 0 has done ``FAULT_AT`` steps (every
connection through it cut, a drain in flight among them) and started again on the same port
``OUTAGE_STEPS`` steps later. Training must go on, the upload be retried, and nothing be lost:
a fresh node (no memory, no disk) restores the newest step from the object store alone and
ends bitwise equal to the clean run.
"""
from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.fault_campaign_jobs import FAULT_AT, REPO, SPARE, STEPS, launch, reached, restored_steps
from benchmarks.fault_campaign_rows import Campaign, row
from tests.procs import free_port, stop_process, wait_for

OUTAGE_STEPS = 2  # steps worker 0 does while the store is unreachable
STEP_S = 0.5  # a slower step, so the outage spans whole steps and drains
PROXY = [sys.executable, str(REPO / "benchmarks" / "throttle_proxy.py"), "--MBps", "1000", "--latency-ms", "0"]


def _proxy(upstream: str, port: int) -> subprocess.Popen:
    """The proxy on loopback ``port``, once it accepts connections."""
    proc = subprocess.Popen([*PROXY, "--upstream", upstream.removeprefix("http://"), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def up() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return proc.poll() is not None
    wait_for(up, timeout=60, interval=0.05)
    if proc.poll() is not None:
        raise RuntimeError(f"throttle_proxy exited with {proc.returncode}")
    return proc


def objstore_unreachable(c: Campaign, fault: str) -> dict:
    """The row (module docstring); skipped where moto or s3fs is not installed."""
    try:
        import moto.server  # noqa: F401  (the S3 server this row needs)

        from tests.objstore_fixtures import create_bucket, moto_server
    except ImportError as e:
        return {"fault": fault, "skipped": f"needs moto and s3fs (pip install -e '.[dev]'): {e}"}
    work = c.workdir / fault
    work.mkdir()
    with moto_server() as s3:
        bucket, port = create_bucket(s3), free_port()
        env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": s3.key,
               "AWS_SECRET_ACCESS_KEY": s3.secret, "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_MAX_ATTEMPTS": "1"}  # no botocore retries below the tier's own (ckpt/tiers/retry.py)
        child = ["--steps", str(STEPS), "--step-s", str(STEP_S), "--object-store", f"s3://{bucket}/campaign",
                 "--log-info"]
        proxy = _proxy(s3.endpoint, port)
        cut: dict[str, float] = {}
        try:
            def outage(events: Path) -> None:  # beside the job: cut, then mend
                nonlocal proxy
                wait_for(lambda: reached(events, FAULT_AT), timeout=600, interval=0.02)
                stop_process(proxy)
                cut["at"] = time.time()
                wait_for(lambda: reached(events, FAULT_AT + OUTAGE_STEPS), timeout=600, interval=0.02)
                proxy = _proxy(s3.endpoint, port)
                cut["mended"] = time.time()

            job = launch(work, "job", SPARE, child, memory_dir=c.shm / f"{fault}-job", env=env, beside=outage)
            # a new node: its disk root and memory tier empty, the object store the only copy
            fresh = launch(work, "fresh", SPARE, child, memory_dir=c.shm / f"{fault}-fresh", env=env)
        finally:
            stop_process(proxy)
    retried = [x for x in job.log.splitlines() if "retrying in" in x]
    uploaded = sorted({int(s) for s in re.findall(r"step (\d+) is durable off-node", job.log)})
    during = [e for e in job.of("step") if e["worker"] == 0 and cut.get("at", 0) < e["t"] < cut.get("mended", 0)]
    steps = restored_steps(fresh.log)
    from_store = [x for x in fresh.log.splitlines() if "restored step" in x and "from object" in x]
    return row(fault, "in-process", detected=bool(retried), detect_steps=None, named=None, restored_step=None,
               steps_lost=0, relaunched=False, equal_to_clean=job.digests() == c.clean(),
               steps_during_outage=len(during), outage_s=round(cut["mended"] - cut["at"], 2),
               retries=len(retried), check_lines=retried[:2], uploaded_steps=uploaded,
               fresh_node_restored_step=steps[0] if steps else None, fresh_node_from_object_store=bool(from_store),
               fresh_node_equal_to_clean=fresh.digests() == c.clean())

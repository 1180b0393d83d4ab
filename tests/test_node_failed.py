"""A failed node stops the job at once (issue 19.2): a simulated agent posts XID 79 for a
node of the job to a real `predictor serve`; the predictor sends "node_failed" on the
job's stream; the listening rank writes the job's "failed" key and every rank's
watchdog exits with EXIT_NODE_FAILED; torchrun restarts the job and it finishes."""
from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

from ckpt.integrations.risk import RiskListener
from ckpt.integrations.urgency import SaveRequests
from ckpt.recovery.watchdog import EXIT_NODE_FAILED
from tests.integration_helpers import REPO, torchrun
from tests.predictor_fixtures import TOKENS, post
from tests.procs import wait_for


def post_xid(srv, node: str, xid: int) -> None:
    body = json.dumps({"timestamp": int(time.time() * 1000), "node": node, "gpu": 0, "xid": xid}) + "\n"
    r = post(srv, "xid", body.encode(), ctype="application/x-ndjson")
    assert r.status_code < 300, r.text


def test_critical_xid_reaches_the_listener_as_node_failed(live_server) -> None:
    srv = live_server()
    failed: list[dict] = []
    listener = RiskListener(srv.url, ["train-node-3"], SaveRequests(), token=TOKENS["job"], name="t")
    listener.on_node_failed = failed.append
    listener.start()
    try:
        assert wait_for(lambda: listener.job_id is not None), srv.output()[-2000:]
        time.sleep(0.5)  # registered; give the stream a moment to subscribe
        post_xid(srv, "train-node-4", 79)  # another job's node: nothing
        post_xid(srv, "train-node-3", 13)  # an application XID: nothing
        post_xid(srv, "train-node-3", 79)
        assert wait_for(lambda: failed, timeout=60), srv.output()[-2000:]
        assert [(e["node"], e["xid"]) for e in failed] == [("train-node-3", 79)]
    finally:
        listener.close()


def test_xid_79_on_a_job_node_restarts_the_job_without_a_timeout(live_server, tmp_path: Path, shm_dir: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    srv = live_server()
    monkeypatch.setenv("CKPT_GUARD_JOB_TOKEN", TOKENS["job"])
    timeline = tmp_path / "timeline.jsonl"

    def fail_the_node_mid_run() -> None:
        reached = lambda: timeline.exists() and any(json.loads(line)["step"] >= 8  # noqa: E731
                                                    for line in timeline.read_text().splitlines())
        if wait_for(reached, timeout=120):
            post_xid(srv, socket.gethostname(), 79)

    agent = threading.Thread(target=fail_the_node_mid_run, daemon=True)
    agent.start()
    log = torchrun(REPO / "examples" / "train_torchrun.py", "--root", str(tmp_path / "root"), "--steps", "30",
                   "--every", "5", "--memory-dir", shm_dir, "--step-time", "0.3", "--predictor", srv.url,
                   "--timeline", str(timeline), restarts=1)
    agent.join(timeout=5)
    assert f"predictor: node {socket.gethostname()} failed (critical XID 79 on GPU 0" in log, log[-4000:]
    for rank in (0, 1):
        assert f"rank{rank} rank {rank}: job stopped: the predictor reports node" in log, log[-4000:]
    assert f"exitcode: {EXIT_NODE_FAILED}" in log, log[-4000:]
    assert "rank0 incarnation 1: first step" in log, log[-4000:]
    assert "hang detected" not in log

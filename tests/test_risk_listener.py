"""The training side of "checkpoint now": RiskListener against a real `predictor serve`.

A critical XID posted for the job's node must reach the job's stream and become an
urgent-save request; an unreachable predictor must never stop training."""
from __future__ import annotations

import json
import logging
import time

import requests

from ckpt.integrations.risk import RiskListener
from ckpt.integrations.urgency import SaveRequests

from .predictor_fixtures import TOKENS
from .procs import HTTP_S, wait_for


def test_critical_xid_on_a_job_node_requests_an_urgent_save(live_server) -> None:
    srv = live_server()
    asks = SaveRequests()
    listener = RiskListener(srv.url, ["train-node-7", "train-node-8"], asks, token=TOKENS["job"], name="t").start()
    try:
        assert wait_for(lambda: listener.job_id is not None), "the job was never registered"
        time.sleep(0.5)  # the stream is open once registered; give it a moment to subscribe
        body = json.dumps({"timestamp": int(time.time() * 1000), "node": "train-node-8", "gpu": 3, "xid": 79}) + "\n"
        r = requests.post(srv.url + "/v1/xid", data=body, timeout=HTTP_S,
                          headers=srv.headers("agent", **{"Content-Type": "application/x-ndjson",
                                                          "X-Batch-Id": "risk-listener-test-1"}))
        assert r.status_code < 300, r.text
        assert wait_for(lambda: bool(listener.events)), srv.output()[-2000:]
        assert listener.events[0]["node"] == "train-node-8"
        assert asks.take() and listener.elevated
        assert listener.at_risk_nodes == {"train-node-8"}  # peer placement may avoid it
    finally:
        listener.close()


def test_unreachable_predictor_is_a_warning_not_a_crash(caplog) -> None:
    asks = SaveRequests()
    with caplog.at_level(logging.WARNING, logger="ckpt.integrations.risk"):
        listener = RiskListener("http://127.0.0.1:9", ["n1"], asks, token="x" * 20).start()
        assert wait_for(lambda: "unreachable" in caplog.text)
        listener.close()
    assert not asks.take() and not listener.elevated

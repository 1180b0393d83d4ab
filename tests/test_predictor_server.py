"""`predictor serve` as a real process on 127.0.0.1: auth, ingest, risk, jobs + SSE, /metrics."""
import asyncio
import gzip
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pyarrow as pa
import requests
from aiohttp import web

from predictor.model import model_io
from predictor.serve.scoring_queue import _concat
from predictor.serve.server import Service, make_app
from tests.predictor_fixtures import T0, arrow_body, node_rows, post
from tests.procs import HTTP_S, free_port, wait_for


def test_tokens_and_roles(shared_server):
    srv = shared_server
    body = arrow_body(node_rows("n1", T0))
    assert requests.post(f"{srv.url}/v1/telemetry", data=body, timeout=HTTP_S).status_code == 401
    assert post(srv, "telemetry", body, role="job").status_code == 403
    assert requests.post(f"{srv.url}/v1/jobs", json={"nodes": ["n1"]}, headers=srv.headers("agent"),
                         timeout=HTTP_S).status_code == 403
    assert requests.get(f"{srv.url}/v1/risk?node=n1", headers=srv.headers("job"), timeout=HTTP_S).status_code == 403
    assert requests.get(f"{srv.url}/metrics", timeout=HTTP_S).status_code == 200       # open, as Prometheus expects


def test_ingest_formats_duplicates_and_refusals(shared_server):
    srv = shared_server
    body = arrow_body(node_rows("n1", T0))
    r = post(srv, "telemetry", gzip.compress(body), batch_id="b-1", **{"Content-Encoding": "gzip"})
    assert r.status_code == 202 and r.json() == {"accepted": 8}
    r = post(srv, "telemetry", body, batch_id="b-1")
    assert r.status_code == 200 and r.json()["duplicate"] is True
    nd = "\n".join(json.dumps({**row, "timestamp": "2026-05-28T20:27:00Z"}) for row in node_rows("n2", 0))
    assert post(srv, "telemetry", nd.encode(), ctype="application/x-ndjson").status_code == 202
    xid = json.dumps({"timestamp": T0, "node": "n1", "gpu": 1, "xid": 13})
    assert post(srv, "xid", xid.encode(), ctype="application/x-ndjson").status_code == 202

    refusals = {
        "not arrow": (b"garbage", "application/vnd.apache.arrow.stream", "Arrow"),
        "no gpu": (b'{"timestamp": 1, "node": "n1"}', "application/x-ndjson", "gpu"),
        "bad time": (b'{"timestamp": "yesterday", "node": "n1", "gpu": 0}', "application/x-ndjson", "timestamp"),
        "text metric": (b'{"timestamp": 1, "node": "n1", "gpu": 0, "DCGM_FI_DEV_GPU_TEMP": "hot"}',
                        "application/x-ndjson", "type"),
        "content type": (b"{}", "text/plain", "Content-Type"),
    }
    for name, (data, ctype, word) in refusals.items():
        r = post(srv, "telemetry", data, ctype=ctype)
        assert r.status_code == 400, name
        assert word in r.json()["error"], (name, r.json())
    r = requests.post(f"{srv.url}/v1/telemetry", data=body, timeout=HTTP_S,
                      headers=srv.headers("agent", **{"Content-Type": "application/vnd.apache.arrow.stream"}))
    assert r.status_code == 400 and "X-Batch-Id" in r.json()["error"]
    big = arrow_body([row for t in range(40) for row in node_rows("n3", T0 + t * 1000)])
    r = post(srv, "telemetry", big)
    assert r.status_code == 413 and "split" in r.json()["error"]
    bomb = gzip.compress(b"\n" * 10_000_000)
    r = post(srv, "telemetry", bomb, ctype="application/x-ndjson", **{"Content-Encoding": "gzip"})
    assert r.status_code == 413
    # nothing refused was lost from what was accepted; late and duplicate samples are dropped
    assert post(srv, "telemetry", arrow_body(node_rows("n1", T0 - 60_000))).status_code == 202
    # GPUs are listed as soon as they are registered, scored a moment later: wait for the
    # scoring pass, then check that the late sample moved nothing back
    risk = wait_for(lambda: (r := _risk(srv, "n1")) and len(r["gpus"]) == 8
                    and all(g["at_ms"] != -1 for g in r["gpus"]) and r)
    assert risk, "the GPUs were never scored"
    assert all(g["at_ms"] == T0 for g in risk["gpus"])
    metrics = requests.get(f"{srv.url}/metrics", timeout=HTTP_S).text
    assert 'predictor_batches_total{endpoint="telemetry",outcome="malformed"} 6.0' in metrics
    assert 'predictor_batches_total{endpoint="telemetry",outcome="duplicate"} 1.0' in metrics
    assert wait_for(lambda: "predictor_dropped_samples_total 8.0" in requests.get(f"{srv.url}/metrics").text)


def _risk(srv, node: str):
    r = requests.get(f"{srv.url}/v1/risk", params={"node": node}, headers=srv.headers("operator"), timeout=HTTP_S)
    return r.json() if r.status_code == 200 else None


def _metric(srv, name: str) -> float:
    text = requests.get(f"{srv.url}/metrics", timeout=HTTP_S).text
    return float(re.search(rf"^{name} ([0-9.e+]+)$", text, re.M).group(1))


def read_events(resp: requests.Response, want: int, timeout: float = 60.0) -> list[tuple[str, dict]]:
    """Parse SSE until `want` events other than hello arrived (or, for 0, the hello)."""
    events, event, deadline = [], None, time.monotonic() + timeout
    while True:
        line = resp.raw.readline().decode()
        assert line, "stream ended"
        line = line.rstrip("\n")
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            events.append((event, json.loads(line[6:])))
            if len([e for e in events if e[0] != "hello"]) >= want:
                return [e for e in events if e[0] != "hello"] if want else events
        assert time.monotonic() < deadline, events


def test_job_hears_checkpoint_now_once_per_interval(shared_server):
    srv = shared_server
    for node in ("j1", "j2"):
        assert post(srv, "telemetry", arrow_body(node_rows(node, T0))).status_code == 202
    job = requests.post(f"{srv.url}/v1/jobs", json={"nodes": ["j1", "j9"], "name": "llm", "min_interval_s": 600},
                        headers=srv.headers("job"), timeout=HTTP_S)
    assert job.status_code == 201
    job = job.json()
    stream = requests.get(srv.url + job["stream"], headers=srv.headers("job"), stream=True, timeout=15)
    assert stream.headers["Content-Type"].startswith("text/event-stream")
    hello = read_events(stream, 0)
    assert hello[0][0] == "hello" and hello[0][1]["at_risk"] == []
    # j2 is not the job's: nothing; j1 GPU 3 logs XID 79: node failed, and checkpoint now
    xid = lambda node, gpu, t: json.dumps({"timestamp": t, "node": node, "gpu": gpu, "xid": 79}).encode()  # noqa: E731
    assert post(srv, "xid", xid("j2", 0, T0 + 1000), ctype="application/x-ndjson").status_code == 202
    assert post(srv, "xid", xid("j1", 3, T0 + 2000), ctype="application/x-ndjson").status_code == 202
    (failed_name, failed), (name, ev) = read_events(stream, 2)  # the lost GPU first: the job stops at once
    assert failed_name == "node_failed" and failed["node"] == "j1" and failed["xid"] == 79
    assert failed["sampled_at_ms"] == T0 + 2000  # the agent's sample time: the job times its restart from it
    assert name == "checkpoint" and ev["node"] == "j1" and ev["gpu"] == 3 and ev["risk"] == 1.0
    assert ev["reason"] == "critical XID 79"
    # a second GPU of the same node crossing inside the job's interval is rate-limited
    assert post(srv, "xid", xid("j1", 4, T0 + 3000), ctype="application/x-ndjson").status_code == 202
    info = wait_for(lambda: (j := requests.get(f"{srv.url}/v1/jobs/{job['id']}", headers=srv.headers("job"),
                                               timeout=HTTP_S).json())["checkpoints_suppressed"] and j)
    assert info, "the second crossing was never counted as suppressed"
    assert info["checkpoints_sent"] == 1
    risk = _risk(srv, "j1")
    assert risk["risk"] == 1.0 and risk["worst_gpu"] in (3, 4) and risk["reason"] == "critical XID 79"
    assert requests.delete(f"{srv.url}/v1/jobs/{job['id']}", headers=srv.headers("job"), timeout=HTTP_S).ok
    stream.close()
    metrics = requests.get(f"{srv.url}/metrics", timeout=HTTP_S).text
    for name in ('predictor_gpu_risk{gpu="3",node="j1"} 1.0', "predictor_checkpoint_events_total 1.0",
                 "predictor_scoring_latency_seconds_bucket", 'predictor_ingested_rows_total{endpoint="telemetry"}'):
        assert name in metrics, name


def test_job_registration_is_validated(shared_server):
    srv = shared_server
    for body in ({"nodes": []}, {"nodes": "n1"}, {"nodes": ["n1"], "min_interval_s": -1}, [1, 2]):
        r = requests.post(f"{srv.url}/v1/jobs", json=body, headers=srv.headers("job"), timeout=HTTP_S)
        assert r.status_code == 400 and r.json()["error"], body
    assert requests.get(f"{srv.url}/v1/jobs/nope/events", headers=srv.headers("job"), timeout=HTTP_S).status_code == 404


def test_concurrent_batches_are_scored_together_and_a_bad_one_is_refused_alone(shared_server):
    """Batches that arrive together share a scoring pass; each is answered once its rows are
    scored, and a malformed one among them gets its own 400 without holding up the others."""
    srv = shared_server
    cycles = lambda: _metric(srv, "predictor_scoring_cycle_seconds_count")  # noqa: E731
    before = cycles()
    bad = arrow_body([{**row, "gpu": 4096} for row in node_rows("c-bad", T0)])
    bodies = {f"c{i}": arrow_body(node_rows(f"c{i}", T0)) for i in range(24)} | {"c-bad": bad}
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = dict(zip(bodies, pool.map(lambda b: post(srv, "telemetry", b), bodies.values())))
    assert answers.pop("c-bad").status_code == 400
    assert all(r.status_code == 202 and r.json() == {"accepted": 8} for r in answers.values())
    for node in answers:                      # answered after scoring: the risk is already there
        assert [g["at_ms"] for g in _risk(srv, node)["gpus"]] == [T0] * 8, node
    assert _risk(srv, "c-bad") is None
    assert cycles() - before < len(answers)


def test_batches_of_different_schemas_keep_their_arrival_order():
    """Agents' batches are joined per run of one schema, then promoted; the order is arrival order."""
    a = pa.table({"gpu": pa.array([0, 1], pa.int16()), "x": [1.0, 2.0]})
    b = pa.table({"gpu": pa.array([2], pa.int64()), "y": [3.0]})
    joined = _concat([a, a, b, a])
    assert joined.column("gpu").to_pylist() == [0, 1, 0, 1, 2, 0, 1]
    assert joined.column("y").to_pylist() == [None] * 4 + [3.0] + [None] * 2


def test_stopping_answers_every_queued_batch():
    """A service stopped with batches queued or mid-pass answers them (503 or 202) instead of
    holding their senders until the shutdown timeout."""
    async def scenario() -> tuple[list[int], float]:
        service = Service(model_io.load(None), tokens=None)
        runner = web.AppRunner(make_app(service))
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}/v1/telemetry"
        gate = threading.Event()
        service.queue._executor.submit(gate.wait)             # the scorer thread is busy: nothing gets scored

        async def send(session: aiohttp.ClientSession, node: str) -> int:
            headers = {"Content-Type": "application/vnd.apache.arrow.stream", "X-Batch-Id": node}
            async with session.post(url, data=arrow_body(node_rows(node, T0)), headers=headers) as r:
                return r.status

        async def accepted(n: int) -> None:
            while f'outcome="accepted"}} {n}.0'.encode() not in service.metrics.render()[0]:
                await asyncio.sleep(0.01)

        try:
            async with aiohttp.ClientSession() as session:
                sends = [asyncio.create_task(send(session, "s0"))]
                await accepted(1)                       # its pass waits for the scorer thread
                sends += [asyncio.create_task(send(session, f"s{i}")) for i in (1, 2)]
                await accepted(3)                       # these wait in the queue
                started = time.monotonic()
                await runner.cleanup()
                return await asyncio.gather(*sends), time.monotonic() - started
        finally:
            gate.set()
            await runner.cleanup()

    statuses, stop_s = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert statuses == [202, 503, 503] and stop_s < 5

"""`predictor serve` against careless and hostile senders (issue 15, points 10-15).

Bodies are written to raw sockets where the point is how they arrive (in two TCP
writes, two requests interleaved), so nothing between the test and the server merges them.
"""
import gzip
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pytest
import requests

from predictor.model.features import MAX_GPUS_PER_NODE, FleetState
from tests.predictor_fixtures import OTHER_JOB_TOKEN, ROOT, T0, TOKENS, LiveServer, arrow_body, node_rows, post
from tests.procs import HTTP_S, free_port

ARROW = "application/vnd.apache.arrow.stream"
NDJSON = "application/x-ndjson"


def _open(srv, body_len: int, batch_id: str, ctype: str, **headers: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    head = {"Host": "127.0.0.1", "Authorization": f"Bearer {TOKENS['agent']}", "Content-Type": ctype,
            "X-Batch-Id": batch_id, "Content-Length": str(body_len), "Connection": "close", **headers}
    sock.sendall(("POST /v1/telemetry HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items())
                  + "\r\n").encode())
    return sock


def _answer(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _in_two_writes(srv, body: bytes, ctype: str, **headers: str) -> tuple[int, dict]:
    sock = _open(srv, len(body), f"split-{time.monotonic_ns()}", ctype, **headers)
    half = len(body) // 2
    sock.sendall(body[:half])
    time.sleep(0.3)                                 # the server reads what has arrived so far
    sock.sendall(body[half:])
    return _answer(sock)


def _ndjson(node: str, samples: int) -> bytes:
    rows = [row for t in range(samples // 8) for row in node_rows(node, T0 + t * 30_000)]
    return "\n".join(json.dumps(r) for r in rows).encode()


@pytest.fixture(scope="module")
def big_server(tmp_path_factory):
    """`predictor serve` with the default 16 MiB cap."""
    srv = LiveServer(tmp_path_factory.mktemp("serve-big"))
    yield srv
    srv.stop()


def test_a_body_in_two_writes_is_read_whole(big_server):
    status, answer = _in_two_writes(big_server, _ndjson("split-nd", 1000), NDJSON)
    assert (status, answer) == (202, {"accepted": 1000})
    rows = [row for t in range(50) for row in node_rows("split-arrow", T0 + t * 30_000)]
    status, answer = _in_two_writes(big_server, gzip.compress(arrow_body(rows), 1), ARROW,
                                    **{"Content-Encoding": "gzip"})
    assert (status, answer) == (202, {"accepted": 400})


def test_a_large_body_in_one_send_is_read_whole(big_server):
    body = _ndjson("big", 4800)
    assert len(body) > 1.4 * 2**20
    r = post(big_server, "telemetry", body, ctype=NDJSON)
    assert r.status_code == 202 and r.json() == {"accepted": 4800}


def test_a_chunked_body_over_the_cap_is_refused_whole(shared_server):
    """No Content-Length to refuse early on: the body is read up to the cap, then refused."""
    body = _ndjson("over", 200)                     # the shared server's cap is 20,000 bytes
    h = shared_server.headers("agent", **{"Content-Type": NDJSON, "X-Batch-Id": "over-1"})
    r = requests.post(f"{shared_server.url}/v1/telemetry", data=iter([body[:15_000], body[15_000:]]), headers=h,
                      timeout=HTTP_S)
    assert r.status_code == 413 and "cap" in r.json()["error"]


def test_a_far_future_sample_is_refused_and_blinds_nothing(shared_server):
    srv = shared_server
    now = int(time.time() * 1000)
    future = [{**row, "timestamp": 7_258_118_400_000} for row in node_rows("ff", now)]   # year 2200
    r = post(srv, "telemetry", arrow_body(future))
    assert r.status_code == 400 and "ahead of this server's clock" in r.json()["error"]
    xid = json.dumps({"timestamp": 7_258_118_400_000, "node": "ff", "gpu": 3, "xid": 79}).encode()
    assert post(srv, "xid", xid, ctype=NDJSON).status_code == 400
    assert post(srv, "telemetry", arrow_body(node_rows("ff", now))).status_code == 202
    # a sample a little ahead (within the allowed skew) does not hide a critical XID logged before it
    assert post(srv, "telemetry", arrow_body(node_rows("ff", now + 200_000))).status_code == 202
    xid = json.dumps({"timestamp": now + 1000, "node": "ff", "gpu": 3, "xid": 79}).encode()
    assert post(srv, "xid", xid, ctype=NDJSON).status_code == 202
    risk = requests.get(f"{srv.url}/v1/risk", params={"node": "ff"}, headers=srv.headers("operator"),
                        timeout=HTTP_S).json()
    assert {g["gpu"]: g["risk"] for g in risk["gpus"]}[3] == 1.0 and risk["reason"] == "critical XID 79"


def test_gpu_indices_are_capped_per_node(shared_server):
    r = post(shared_server, "telemetry", arrow_body([{**node_rows("wide", T0)[0], "gpu": 1023}]))
    assert r.status_code == 400 and f"at most {MAX_GPUS_PER_NODE} GPUs per node" in r.json()["error"]


def test_per_node_tables_do_not_grow_with_one_wide_gpu_index():
    """Registering GPU 63 on one node of a thousand costs its index table, not a copy of
    every node's statistics that wide."""
    state = FleetState()
    nodes = [f"n{i}" for i in range(1000)]
    state.slots_for(nodes * 8, np.repeat(np.arange(8), 1000))

    def table_bytes() -> int:
        return sum(v.nbytes for v in vars(state).values() if isinstance(v, np.ndarray))
    before = table_bytes()
    state.slots_for(["n0"], np.array([MAX_GPUS_PER_NODE - 1]))
    assert table_bytes() - before < 2**20
    with pytest.raises(ValueError, match="GPUs per node"):
        state.slots_for(["n0"], np.array([MAX_GPUS_PER_NODE]))


def test_the_same_batch_id_at_once_is_counted_once(shared_server):
    body = arrow_body(node_rows("dup-race", T0))
    first = _open(shared_server, len(body), "race-1", ARROW)
    second = _open(shared_server, len(body), "race-1", ARROW)
    first.sendall(body[:100])
    second.sendall(body[:100])                      # both are past the id check, reading their bodies
    time.sleep(0.3)
    first.sendall(body[100:])
    second.sendall(body[100:])
    answers = sorted([_answer(first), _answer(second)], key=lambda a: a[0])
    assert answers == [(200, {"accepted": 0, "duplicate": True}), (202, {"accepted": 8})]


def _serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "predictor.cli", "serve", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_no_auth_is_refused_on_a_reachable_address():
    res = _serve("--no-auth", "--host", "0.0.0.0", "--port", str(free_port()))
    assert res.returncode == 2 and "--no-auth" in res.stderr and "loopback" in res.stderr


def test_a_taken_port_is_said_in_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        res = _serve("--no-auth", "--port", str(taken.getsockname()[1]))
    assert res.returncode == 1
    assert res.stderr.strip().count("\n") == 0 and "cannot listen on 127.0.0.1:" in res.stderr, res.stderr


# ------------------------------------------------------------ issue 32.6
def _nd(**fields) -> bytes:
    return json.dumps({"timestamp": T0, "node": "bad-ts", "gpu": 0, "xid": 79, **fields}).encode()


@pytest.mark.parametrize("kind, body, message", [
    ("telemetry", _nd(timestamp=float("nan")), "line 1: timestamp NaN is not a finite number"),
    ("telemetry", _nd(timestamp=float("inf")), "line 1: timestamp Infinity is not a finite number"),
    ("xid", _nd(timestamp=-float("inf")), "line 1: timestamp -Infinity is not a finite number"),
    ("telemetry", _nd(timestamp=2**64 - 1), "line 1: timestamp 18446744073709551615 is out of range"),
    ("xid", _nd(timestamp=-1e30), "line 1: timestamp -1e+30 is out of range"),
    ("telemetry", _nd(timestamp="275760-09-13T00:00:00Z"), "neither RFC 3339 nor epoch ms"),
    ("telemetry", _nd(gpu=1.5), "line 1: gpu 1.5 is not an integer"),
    ("telemetry", _nd(gpu=True), "line 1: gpu True is not an integer"),
    ("telemetry", _nd(gpu="1"), "line 1: gpu '1' is not an integer"),
    ("xid", _nd(xid=79.5), "line 1: xid 79.5 is not an integer"),
    ("telemetry", _nd(node=7), "line 1: node 7 is not a string"),
    ("telemetry", _nd(node="n" * 300), "node name longer than 253 bytes"),
])
def test_bad_ndjson_fields_are_400_naming_them(shared_server, kind, body, message):
    """Issue 32.6: NaN, Inf and 2**64-1 timestamps gave 500; gpu 1.5 was accepted."""
    r = post(shared_server, kind, body, ctype=NDJSON)
    assert r.status_code == 400 and message in r.json()["error"], (r.status_code, r.text)


def _arrow(columns: list[tuple[str, pa.Array]]) -> bytes:
    table = pa.Table.from_arrays([a for _, a in columns], names=[n for n, _ in columns])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize("columns, message", [
    ([("timestamp", pa.array([2**64 - 1], pa.uint64())), ("node", pa.array(["a"])), ("gpu", pa.array([0]))],
     "timestamp 18446744073709551615 is out of range"),
    ([("timestamp", pa.array([-2**63], pa.int64())), ("node", pa.array(["a"])), ("gpu", pa.array([0]))],
     "is out of range"),
    ([("timestamp", pa.array([T0], pa.int64())), ("node", pa.array(["a"])), ("gpu", pa.array([0])),
      ("gpu", pa.array([1]))], "duplicated column(s) gpu"),
    ([("timestamp", pa.array([T0], pa.int64())), ("node", pa.array(["a"])), ("gpu", pa.array([0])),
      ("DCGM_FI_DEV_GPU_TEMP", pa.array([50.0])), ("DCGM_FI_DEV_GPU_TEMP", pa.array([51.0]))],
     "duplicated column(s) DCGM_FI_DEV_GPU_TEMP"),
    ([("timestamp", pa.array([T0], pa.int64())), ("node", pa.array(["n" * 300])), ("gpu", pa.array([0]))],
     "node name longer than 253 bytes"),
])
def test_bad_arrow_batches_are_400_naming_the_problem(shared_server, columns, message):
    r = post(shared_server, "telemetry", _arrow(columns))
    assert r.status_code == 400 and message in r.json()["error"], (r.status_code, r.text)


def test_distinct_nodes_are_bounded(live_server):
    """Issue 32.6: every new node name costs the service state (~3 KB) for good."""
    srv = live_server("--max-nodes", "3")
    for n in ("a", "b"):
        assert post(srv, "telemetry", arrow_body(node_rows(n, T0))).status_code == 202
    two_new = arrow_body(node_rows("c", T0) + node_rows("d", T0))
    r = post(srv, "telemetry", two_new)
    assert r.status_code == 429 and "--max-nodes 3" in r.json()["error"] and "'c'" in r.json()["error"], r.text
    assert post(srv, "telemetry", arrow_body(node_rows("c", T0 + 30_000))).status_code == 202
    r = post(srv, "xid", json.dumps({"timestamp": T0, "node": "e", "gpu": 1, "xid": 79}).encode(), ctype=NDJSON)
    assert r.status_code == 429
    assert post(srv, "telemetry", arrow_body(node_rows("a", T0 + 30_000))).status_code == 202  # known: welcome
    metrics = requests.get(f"{srv.url}/metrics", headers=srv.headers("operator"), timeout=HTTP_S).text
    assert 'predictor_batches_total{endpoint="telemetry",outcome="node_limit"} 1.0' in metrics
    assert 'predictor_batches_total{endpoint="xid",outcome="node_limit"} 1.0' in metrics
    assert "predictor_nodes 3.0" in metrics


def _strict_json(text: str) -> object:
    """json.loads that refuses NaN and Infinity, as a strict client (JavaScript's JSON.parse) does."""
    def refuse(name: str) -> None:
        raise ValueError(f"bare {name} is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("interval", ["NaN", "Infinity", "-Infinity", "-1", "1e300", "true", '"60"'])
def test_min_interval_must_be_finite_and_in_range(shared_server, interval):
    """Issue 48.6: NaN passed `interval < 0`, disabled the rate limit and came back as bare NaN."""
    body = f'{{"nodes": ["nan-node"], "min_interval_s": {interval}}}'
    r = requests.post(f"{shared_server.url}/v1/jobs", data=body, timeout=HTTP_S,
                      headers=shared_server.headers("job", **{"Content-Type": "application/json"}))
    assert r.status_code == 400, r.text
    assert "must be a finite number of seconds from 0 to 604800" in _strict_json(r.text)["error"]


def test_registered_jobs_are_capped(live_server):
    """Issue 48.6: jobs per token, nodes per job and node entries in all are bounded, each
    refusal says which limit and the option that sets it; a deleted job frees its place."""
    srv = live_server("--max-jobs-per-token", "2", "--max-nodes-per-job", "3", "--max-job-nodes", "5")

    def register(nodes: list[str], role: str = "job") -> requests.Response:
        return requests.post(f"{srv.url}/v1/jobs", json={"nodes": nodes}, headers=srv.headers(role), timeout=HTTP_S)

    too_wide = register(["a", "b", "c", "d"])
    assert too_wide.status_code == 413 and "--max-nodes-per-job" in too_wide.json()["error"]
    first = register(["a", "b"])
    assert first.status_code == 201 and _strict_json(first.text)["min_interval_s"] == 60.0
    assert register(["c"]).status_code == 201
    third = register(["d"])
    assert third.status_code == 429 and "--max-jobs-per-token" in third.json()["error"], third.text
    assert register(["x"], "operator").status_code == 201       # another token has its own count
    past_total = register(["y", "z"], "operator")                # 2 + 1 + 1 + 2 > 5 entries
    assert past_total.status_code == 429 and "--max-job-nodes" in past_total.json()["error"], past_total.text
    assert requests.delete(f"{srv.url}/v1/jobs/{first.json()['id']}", headers=srv.headers("job"), timeout=HTTP_S).ok
    assert register(["d"]).status_code == 201
    long_name = register(["n" * 254])
    assert long_name.status_code == 400 and "1 to 253 characters" in long_name.json()["error"]


def test_answers_carry_no_bare_nan():
    """A job with a node at probability 1 has an infinite hazard: it goes out as null, not Infinity."""
    from predictor.serve.strict_json import strict_dumps
    assert strict_dumps({"hazard_ratio": float("inf"), "p": [0.5, float("nan")], "n": 3}) == \
        '{"hazard_ratio": null, "p": [0.5, null], "n": 3}'
    assert _strict_json(strict_dumps({"ok": 1.0})) == {"ok": 1.0}


def test_a_job_token_sees_only_its_own_jobs(shared_server):
    """Issue 48: another job token's GET, events stream, risk and DELETE of a job answer 404, exactly as
    for a job that does not exist (ids cannot be probed), and leave the job in place; an operator
    token reads and deletes any job."""
    srv = shared_server
    mine = requests.post(f"{srv.url}/v1/jobs", json={"nodes": ["own-1"]}, headers=srv.headers("job"), timeout=HTTP_S)
    assert mine.status_code == 201, mine.text
    job = mine.json()["id"]
    other = {"Authorization": f"Bearer {OTHER_JOB_TOKEN}"}
    absent = requests.get(f"{srv.url}/v1/jobs/{'0' * 32}", headers=other, timeout=HTTP_S)
    for method, path in (("GET", f"/v1/jobs/{job}"), ("GET", f"/v1/jobs/{job}/events"),
                         ("GET", f"/v1/risk?job={job}"), ("DELETE", f"/v1/jobs/{job}")):
        r = requests.request(method, srv.url + path, headers=other, timeout=HTTP_S)
        assert (r.status_code, r.json()) == (absent.status_code, absent.json()) == (404, {"error": "no such job"}), \
            (method, path, r.text)
    assert requests.get(f"{srv.url}/v1/jobs/{job}", headers=srv.headers("job"), timeout=HTTP_S).json()["id"] == job
    assert requests.get(f"{srv.url}/v1/jobs/{job}", headers=srv.headers("operator"), timeout=HTTP_S).ok
    assert requests.delete(f"{srv.url}/v1/jobs/{job}", headers=srv.headers("operator"), timeout=HTTP_S).ok
    assert requests.get(f"{srv.url}/v1/jobs/{job}", headers=srv.headers("job"), timeout=HTTP_S).status_code == 404
    refused = requests.get(f"{srv.url}/metrics", timeout=HTTP_S).text
    assert 'predictor_requests_refused_total{route="jobs",why="not_owner"} 4.0' in refused

"""The Kubernetes responder's HTTP calls, against a stand-in API server on loopback (there
is no cluster here: what a real API server does with them is untested; the bodies are
checked against the API schemas in tests/test_k8s_manifests.py): the dry run reads and
writes nothing, a drain is GET + PATCH (strategic merge, bearer token) + POST of the
standby pod, a second alarm finds the node out of service, and RBAC's 403 is one clear
error naming the rights needed. Fail closed (issue 48): an unknown node is refused; a log
that cannot grow applies nothing (CLI and webhook, the shipped deployment's full volume);
two processes at once never pass the cap together."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from predictor.alerts.actions.kubernetes import TAINT_KEY, KubernetesNodes
from predictor.alerts.actions.record import ActionLog, Prediction
from predictor.alerts.actions.responder import Responder
from tests.predictor_fixtures import TOKENS
from tests.procs import free_port, stop_process, wait_for

REPO = Path(__file__).resolve().parents[1]

TOKEN = "sa-token-0123456789"


class FakeApi:
    """Nodes by name; records (method, path, content type, body); `forbidden` answers 403."""

    def __init__(self) -> None:
        self.nodes = {n: {"metadata": {"name": n}, "spec": {}} for n in ("gpu-7", "gpu-8")}
        self.delay_s = 0.0
        self.calls: list[tuple[str, str, str | None, dict | None]] = []
        self.forbidden = False
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                api.calls.append((self.command, self.path, self.headers.get("Content-Type"), body))
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._answer(401, {"message": "Unauthorized"})
                if api.forbidden:
                    return self._answer(403, {"message": 'nodes "gpu-7" is forbidden'})
                name = self.path.rsplit("/", 1)[-1]
                if self.command in ("GET", "PATCH") and name not in api.nodes:
                    return self._answer(404, {"message": f'nodes "{name}" not found'})
                if self.command == "GET":
                    time.sleep(api.delay_s)
                    return self._answer(200, api.nodes[name])
                if self.command == "PATCH":
                    api.nodes[name]["spec"].update(body["spec"])
                    return self._answer(200, api.nodes[name])
                return self._answer(201, {**body, "metadata": {**body["metadata"], "name": "standby-x1"}})

            do_GET = do_PATCH = do_POST = _handle

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def api():
    fake = FakeApi()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


def responder(api: FakeApi, tmp_path: Path, dry_run: bool) -> Responder:
    template = {"apiVersion": "v1", "kind": "Pod", "spec": {"containers": [{"name": "hold", "image": "pause"}]}}
    nodes = KubernetesNodes(api.url, TOKEN, namespace="ckpt-guard", standby_template=template)
    return Responder(nodes, ActionLog(tmp_path / "actions.jsonl"), max_per_hour=2, dry_run=dry_run)


def test_dry_run_only_reads(api: FakeApi, tmp_path: Path) -> None:
    entry = responder(api, tmp_path, dry_run=True).handle(Prediction("gpu-7", "alertmanager:GPUFailurePredicted"))
    assert entry["action"] == "dry-run" and "PATCH /api/v1/nodes/gpu-7" in entry["steps"][0]
    assert [c[0] for c in api.calls] == ["GET"]


def test_drain_cordons_taints_and_asks_for_a_standby_pod_once(api: FakeApi, tmp_path: Path) -> None:
    r = responder(api, tmp_path, dry_run=False)
    entry = r.handle(Prediction("gpu-7", "alertmanager:GPUFailurePredicted", {"risk": "0.93"}))
    assert entry["action"] == "drained" and entry["applied"], entry
    assert [(m, p) for m, p, _, _ in api.calls] == [
        ("GET", "/api/v1/nodes/gpu-7"), ("GET", "/api/v1/nodes/gpu-7"), ("PATCH", "/api/v1/nodes/gpu-7"),
        ("POST", "/api/v1/namespaces/ckpt-guard/pods")]
    _, _, patch_type, patch = api.calls[2]
    assert patch_type == "application/strategic-merge-patch+json"
    assert patch["spec"]["unschedulable"] is True and patch["spec"]["taints"][0]["key"] == TAINT_KEY
    assert "risk=0.93" in patch["metadata"]["annotations"]["ckpt-guard.io/drain-reason"]
    pod = api.calls[3][3]
    assert pod["metadata"]["labels"]["ckpt-guard.io/standby-for"] == "gpu-7"
    assert "created standby pod standby-x1" in entry["steps"][-1]
    again = r.handle(Prediction("gpu-7", "alertmanager:GPUFailurePredicted"))
    assert again["action"] == "already-drained" and len(api.calls) == 5   # one GET, nothing written


def test_forbidden_is_one_clear_error(api: FakeApi, tmp_path: Path) -> None:
    api.forbidden = True
    entry = responder(api, tmp_path, dry_run=False).handle(Prediction("gpu-7", "operator"))
    assert entry["action"] == "failed" and not entry["applied"]
    assert "HTTP 403" in entry["error"] and "nodes get/patch and pods create" in entry["error"]


def kube_act(api: FakeApi, tmp_path: Path, *args: str, fsize: int | None = None,
             popen: bool = False) -> subprocess.CompletedProcess | subprocess.Popen:
    """`python -m predictor.cli act ARGS --backend kubernetes` against ``api``; ``fsize``
    caps the size of any file it writes (RLIMIT_FSIZE: a volume that cannot grow)."""
    token = tmp_path / "sa.token"
    token.write_text(TOKEN)
    cmd = [sys.executable, "-m", "predictor.cli", "act", *args, "--backend", "kubernetes", "--kube-api", api.url,
           "--kube-token-file", str(token), "--log", str(tmp_path / "actions.jsonl")]
    limit = (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))) if fsize else None
    kw = dict(cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, preexec_fn=limit, text=True)
    if popen:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)
    return subprocess.run(cmd, capture_output=True, timeout=120, **kw)


def patched(api: FakeApi) -> list[str]:
    return [path for method, path, _, _ in api.calls if method in ("PATCH", "POST")]


def test_unknown_node_is_refused(api: FakeApi, tmp_path: Path) -> None:
    entry = responder(api, tmp_path, dry_run=False).handle(Prediction("gpu-99", "operator"))
    assert entry["action"] == "refused" and not entry["applied"] and "not a node of this cluster" in entry["error"]
    assert not patched(api)


def test_a_log_that_cannot_grow_applies_nothing(api: FakeApi, tmp_path: Path) -> None:
    """RLIMIT_FSIZE at the log's size: before issue 48 the node was cordoned, then its record failed."""
    log = tmp_path / "actions.jsonl"
    log.write_text(json.dumps({"t": 0, "action": "dry-run", "applied": False, "node": "gpu-8"}) + "\n")
    res = kube_act(api, tmp_path, "drain", "gpu-7", "--apply", fsize=log.stat().st_size)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "cannot record in the action log" in res.stderr and "File too large" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert not patched(api) and not api.nodes["gpu-7"]["spec"].get("unschedulable")
    assert len(log.read_text().splitlines()) == 1        # nothing half-written


def test_webhook_on_a_full_volume_applies_nothing(api: FakeApi, tmp_path: Path) -> None:
    """The shipped deployment (deploy/k8s/base/actions.yaml: `act serve --backend kubernetes`,
    the log on a volume) when that volume is full: 500 to Alertmanager (it retries), nothing
    cordoned, an ERROR line."""
    import requests
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{role} {tok}\n" for role, tok in TOKENS.items()))
    (tmp_path / "actions.jsonl").write_text("")
    port = free_port()
    proc = kube_act(api, tmp_path, "serve", "--port", str(port), "--tokens", str(tokens), "--apply", fsize=1,
                    popen=True)
    try:
        assert wait_for(lambda: _up(f"http://127.0.0.1:{port}/healthz"), timeout=60)
        alert = {"status": "firing", "labels": {"alertname": "GPUFailurePredicted", "node": "gpu-7"}}
        res = requests.post(f"http://127.0.0.1:{port}/v1/alertmanager", json={"alerts": [alert]}, timeout=60,
                            headers={"Authorization": f"Bearer {TOKENS['operator']}"})
        assert res.status_code == 500 and "cannot record in the action log" in res.json()["error"], res.text
        assert not patched(api)
    finally:
        stop_process(proc)
    assert "cannot record" in proc.stdout.read()


def test_the_cap_holds_across_processes(api: FakeApi, tmp_path: Path) -> None:
    """Two CLI drains of two nodes at once under --max-per-hour 1: one drains, one is capped
    (a thread lock let both count 0 and both drain)."""
    api.delay_s = 1.0
    procs = [kube_act(api, tmp_path, "drain", node, "--apply", "--max-per-hour", "1", "--json", popen=True)
             for node in ("gpu-7", "gpu-8")]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert sorted(p.returncode for p in procs) == [0, 1], outs
    assert len([path for path in patched(api) if "/nodes/" in path]) == 1, (api.calls, outs)
    actions = sorted(json.loads(line)["action"] for line in (tmp_path / "actions.jsonl").read_text().splitlines())
    assert actions == ["capped", "drained", "intent"]


def test_an_intent_without_outcome_counts_as_applied(api: FakeApi, tmp_path: Path) -> None:
    """A crash (or a failed record) between the intent and its outcome: the drain may have
    happened, so the cap counts it."""
    intent = {"t": time.time() - 60, "action": "intent", "intent": "abc", "node": "gpu-8", "applied": None}
    (tmp_path / "actions.jsonl").write_text(json.dumps(intent) + "\n")
    r = Responder(KubernetesNodes(api.url, TOKEN), ActionLog(tmp_path / "actions.jsonl"), 1, dry_run=False)
    entry = r.handle(Prediction("gpu-7", "operator"))
    assert entry["action"] == "capped" and not patched(api)


def _up(url: str) -> bool:
    import requests
    try:
        return requests.get(url, timeout=1).ok
    except requests.ConnectionError:
        return False

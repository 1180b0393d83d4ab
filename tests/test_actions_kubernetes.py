"""The Kubernetes responder's HTTP calls, against a stand-in API server on loopback (there
is no cluster here: what a real API server does with them is untested; the bodies are
checked against the API schemas in tests/test_k8s_manifests.py): the dry run reads and
writes nothing, a drain is GET + PATCH (strategic merge, bearer token) + POST of the
standby pod, a second alarm finds the node out of service, and RBAC's 403 is one clear
error naming the rights needed."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from predictor.alerts.actions.kubernetes import TAINT_KEY, KubernetesNodes
from predictor.alerts.actions.record import ActionLog, Prediction
from predictor.alerts.actions.responder import Responder

TOKEN = "sa-token-0123456789"


class FakeApi:
    """Nodes by name; records (method, path, content type, body); `forbidden` answers 403."""

    def __init__(self) -> None:
        self.nodes = {"gpu-7": {"metadata": {"name": "gpu-7"}, "spec": {}}}
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
                if self.command == "GET":
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

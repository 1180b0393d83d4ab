"""Strict-threshold alerts reach a real Alertmanager and a webhook; deploy/prometheus passes promtool."""
import json
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from tests.predictor_fixtures import ROOT
from tests.procs import HTTP_S, free_port, stop_process, wait_for
from tests.test_predictor_server import T0, arrow_body, node_rows, post

DEPLOY = ROOT / "deploy" / "prometheus"


def _need(binary: str, package: str) -> str:
    path = shutil.which(binary)
    if path is None:   # fail, not skip: these tests are the proof the alerting works
        pytest.fail(f"{binary} not found: install the Debian package {package} (scripts/apt-packages.txt)")
    return path


@pytest.mark.parametrize("args", [["check", "rules", "rules.yml"], ["test", "rules", "rules_test.yml"]])
def test_promtool_accepts_rules(args):
    res = subprocess.run([_need("promtool", "prometheus"), *args], cwd=DEPLOY, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.fixture
def alertmanager(tmp_path):
    """A real Alertmanager on 127.0.0.1 with a throw-away config and storage."""
    binary = _need("prometheus-alertmanager", "prometheus-alertmanager")
    cfg = tmp_path / "alertmanager.yml"
    cfg.write_text("route:\n  receiver: blackhole\n  group_wait: 1s\nreceivers:\n  - name: blackhole\n")
    port = free_port()
    log = open(tmp_path / "alertmanager.log", "w")
    proc = subprocess.Popen([binary, f"--config.file={cfg}", f"--storage.path={tmp_path / 'am-data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: _ready(url), timeout=30), "alertmanager did not become ready"
        yield url
    finally:
        stop_process(proc)
        log.close()


def _ready(url: str) -> bool:
    try:
        return requests.get(url + "/-/ready", timeout=1).ok
    except (requests.ConnectionError, requests.Timeout):  # not listening yet, or still starting
        return False


class Webhook:
    """A generic webhook receiver on 127.0.0.1 that keeps every JSON body."""

    def __init__(self):
        self.bodies: list[dict] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                hook.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def webhook():
    hook = Webhook()
    yield hook
    hook.stop()


def _our_alerts(am: str) -> list[dict]:
    alerts = requests.get(am + "/api/v2/alerts", timeout=HTTP_S).json()
    return [a for a in alerts if a["labels"].get("alertname") == "GPUFailurePredicted"]


def test_strict_risk_pages_alertmanager_and_resolves_on_replacement(live_server, alertmanager, webhook):
    srv = live_server("--alertmanager", alertmanager, "--webhook", webhook.url)
    assert post(srv, "telemetry", arrow_body(node_rows("n7", T0))).status_code == 202
    xid = json.dumps({"timestamp": T0 + 1000, "node": "n7", "gpu": 5, "xid": 95}).encode()
    assert post(srv, "xid", xid, ctype="application/x-ndjson").status_code == 202

    firing = wait_for(lambda: _our_alerts(alertmanager), timeout=60)
    assert firing, "no alert reached Alertmanager"
    (alert,) = firing
    assert alert["labels"]["node"] == "n7" and alert["labels"]["gpu"] == "5"
    assert alert["labels"]["uuid"] == "GPU-n7-5" and alert["status"]["state"] == "active"
    assert alert["annotations"]["reason"] == "critical XID 95"
    assert wait_for(lambda: webhook.bodies)[0]["status"] == "firing"

    # the GPU is swapped: a new UUID at the same index, counters from zero -> resolved
    assert post(srv, "telemetry", arrow_body(node_rows("n7", T0 + 120_000, uuid_prefix="NEW"))).status_code == 202
    assert wait_for(lambda: not _our_alerts(alertmanager), timeout=60), "the alert was not resolved"
    assert wait_for(lambda: [b for b in webhook.bodies if b["status"] == "resolved"])[0]["alerts"][0][
        "labels"]["gpu"] == "5"
    metrics = requests.get(srv.url + "/metrics", timeout=HTTP_S).text
    assert 'predictor_alert_deliveries_total{outcome="ok",target="alertmanager"} 2.0' in metrics
    assert "predictor_alerts_firing 0.0" in metrics

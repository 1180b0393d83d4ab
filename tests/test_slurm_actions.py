"""`predictor act` on a real Slurm (tests/slurm_fixtures.py) and a real Alertmanager: a
predicted failure drains the node and releases a held spare job, once (idempotent), only
with --apply, never past the hourly cap (then it pages), and a user without Slurm
operator rights gets one clear error. Every decision is a line of the action log. A name
that is not exactly one node (ALL, a nodeset, a hostlist, an unknown one) is refused, and
a log that cannot grow applies nothing (issue 48)."""
from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import sysconfig
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Iterator

import pytest
import requests

from predictor.alerts.alertmanager import Alert
from tests.predictor_fixtures import TOKENS
from tests.procs import HTTP_S, free_port, stop_process, wait_for
from tests.slurm_fixtures import NODESET, SlurmCluster
from tests.test_predictor_alerts import alertmanager  # noqa: F401 - the real Alertmanager fixture

REPO = Path(__file__).resolve().parents[1]
SPARE = "ckpt-guard-spare"
# A user without Slurm rights that every Debian has (Slurm refuses nobody as an invalid uid).
UNPRIVILEGED = "daemon"


@pytest.fixture(scope="module")
def slurm():
    cluster = SlurmCluster()
    yield cluster
    cluster.stop()


@pytest.fixture
def work(slurm: SlurmCluster, tmp_path: Path) -> Path:
    """A directory any user can write (the permission test runs as another user); the node back in service."""
    slurm.scontrol("update", f"NodeName={slurm.node}", "State=RESUME", check=False)
    slurm.run("scancel", "--user=root", "--name", SPARE, check=False)
    d = Path(slurm.dir) / f"act-{time.monotonic_ns()}"
    d.mkdir()
    d.chmod(0o777)
    return d


def python_for(slurm: SlurmCluster, user: str | None) -> tuple[str, str]:
    """An interpreter ``user`` may run, and its PYTHONPATH: this one, or (when it lives
    where the user cannot reach, as a pyenv under /root) the system's of the same minor
    version with this one's packages."""
    if user is None or slurm.run(sys.executable, "-c", "", user=user, check=False).returncode == 0:
        return sys.executable, str(REPO)
    system = "/usr/bin/python3"
    same = slurm.run(system, "-c", "import sys; print(sys.version_info[:2])", user=user, check=False)
    if same.stdout.strip() != str(tuple(sys.version_info[:2])):
        pytest.skip(f"{user} cannot run {sys.executable}, and {system} is another Python version")
    return system, f"{REPO}:{sysconfig.get_paths()['purelib']}"


def act(slurm: SlurmCluster, work: Path, *args: str, user: str | None = None,
        fsize: int | None = None) -> subprocess.CompletedProcess:
    """``predictor act ARGS --backend slurm``; ``fsize``: no file it writes may grow past that (prlimit)."""
    python, path = python_for(slurm, user)
    limit = ["prlimit", f"--fsize={fsize}:{fsize}", "--"] if fsize is not None else []
    return slurm.run(*limit, python, "-m", "predictor.cli", "act", *args, "--backend", "slurm",
                     "--log", str(work / "actions.jsonl"), check=False, user=user,
                     env={"PYTHONPATH": path, "HOME": str(work)})


def log_entries(work: Path) -> list[dict]:
    return [json.loads(line) for line in (work / "actions.jsonl").read_text().splitlines()]


def held_spare(slurm: SlurmCluster) -> str:
    return slurm.run("sbatch", "--parsable", "--hold", f"--job-name={SPARE}", "--output=/dev/null", "--wrap",
                     "sleep 300").stdout.strip()


def test_drain_is_dry_run_by_default(slurm: SlurmCluster, work: Path) -> None:
    res = act(slurm, work, "drain", slurm.node, "--reason", "xid 79 predicted")
    assert res.returncode == 0, res.stderr
    assert "dry-run" in res.stdout and "scontrol update NodeName=" in res.stdout
    assert "DRAIN" not in slurm.node_state()["State"]
    [entry] = log_entries(work)
    assert entry["action"] == "dry-run" and entry["dry_run"] and not entry["applied"]


def test_drain_releases_a_spare_once(slurm: SlurmCluster, work: Path) -> None:
    spares = [held_spare(slurm), held_spare(slurm)]
    res = act(slurm, work, "drain", slurm.node, "--apply", "--spare-job", SPARE, "--reason", "xid 79 predicted")
    assert res.returncode == 0, res.stderr
    state = slurm.node_state()
    assert "DRAIN" in state["State"] and state["Reason"].startswith("ckpt-guard: operator (xid 79 predicted)"), state
    assert slurm.job(spares[0])["Reason"] != "JobHeldUser"       # the oldest spare was released
    assert slurm.job(spares[1])["Reason"] == "JobHeldUser"
    again = act(slurm, work, "drain", slurm.node, "--apply", "--spare-job", SPARE)
    assert again.returncode == 0 and "already-drained" in again.stdout, again.stderr
    assert slurm.job(spares[1])["Reason"] == "JobHeldUser"       # idempotent: no second spare
    intent, first, second = log_entries(work)
    assert intent["action"] == "intent" and first["intent"] == intent["intent"]     # recorded before applied
    assert first["action"] == "drained" and first["applied"] and f"released spare job {spares[0]}" in first["steps"][1]
    assert first["prediction"]["detail"] == {"reason": "xid 79 predicted"}
    assert second["action"] == "already-drained" and not second["applied"]


def test_without_operator_rights_one_clear_error(slurm: SlurmCluster, work: Path) -> None:
    res = act(slurm, work, "drain", slurm.node, "--apply", user=UNPRIVILEGED)
    assert res.returncode == 1
    # what slurmctld answers (and logs as "Security violation, UPDATE_NODE RPC from uid=1")
    assert "Invalid user id" in res.stderr and "needs Slurm operator rights" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert "DRAIN" not in slurm.node_state()["State"]
    assert "Security violation, UPDATE_NODE RPC" in (Path(slurm.dir) / "slurmctld.log").read_text()
    _intent, entry = log_entries(work)
    assert entry["action"] == "failed" and not entry["applied"]


@pytest.mark.parametrize("name", ["ALL", "all", NODESET, "no-such-node", "gpu[1-3]", "a,b"])
def test_a_name_that_is_not_one_node_is_refused(slurm: SlurmCluster, work: Path, name: str) -> None:
    """Before issue 48, `ALL` passed the name check and `scontrol update NodeName=ALL` drained
    the cluster (counted as one node by the cap)."""
    res = act(slurm, work, "drain", name, "--apply")
    assert res.returncode != 0, res.stdout
    assert "Traceback" not in res.stderr
    assert ("not one node's name" in res.stderr or "not a node Slurm knows" in res.stderr
            or "does not name exactly one Slurm node" in res.stderr), res.stderr
    assert "DRAIN" not in slurm.node_state()["State"]


def test_a_log_that_cannot_grow_drains_nothing(slurm: SlurmCluster, work: Path) -> None:
    """The action log at its size limit (RLIMIT_FSIZE, as a full volume): before issue 48 the
    drain was applied, then its record failed, and the cap never saw it."""
    (work / "actions.jsonl").write_text(json.dumps({"t": 0, "action": "dry-run", "node": "x"}) + "\n")
    res = act(slurm, work, "drain", slurm.node, "--apply", fsize=(work / "actions.jsonl").stat().st_size)
    assert res.returncode == 1 and "File too large" in res.stderr, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    assert "DRAIN" not in slurm.node_state()["State"]
    assert len(log_entries(work)) == 1


def test_hourly_cap_refuses_and_pages(slurm: SlurmCluster, work: Path, alertmanager: str) -> None:  # noqa: F811
    done = {"t": time.time() - 60, "action": "drained", "applied": True, "node": "gpu-other"}
    (work / "actions.jsonl").write_text(json.dumps(done) + "\n")
    res = act(slurm, work, "drain", slurm.node, "--apply", "--max-per-hour", "1",
              "--page-alertmanager", alertmanager)
    assert res.returncode == 1 and "the cap is 1" in res.stderr, res.stderr
    assert "DRAIN" not in slurm.node_state()["State"]
    assert log_entries(work)[-1]["action"] == "capped"
    paged = wait_for(lambda: requests.get(alertmanager + "/api/v2/alerts", timeout=5).json(), timeout=30)
    assert paged and paged[0]["labels"]["alertname"] == "CkptGuardDrainCapReached", paged
    assert paged[0]["labels"]["node"] == slurm.node


@contextlib.contextmanager
def act_serve(slurm: SlurmCluster, work: Path) -> Iterator[str]:
    """`predictor act serve --apply` on loopback; yields its webhook URL."""
    tokens = work / "tokens"
    tokens.write_text("".join(f"{role} {tok}\n" for role, tok in TOKENS.items()))
    tokens.chmod(0o600)
    port = free_port()
    serve_log = open(work / "serve.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "predictor.cli", "act", "serve", "--port", str(port), "--tokens", str(tokens),
         "--backend", "slurm", "--apply", "--log", str(work / "actions.jsonl")], cwd=REPO,
        env={**slurm.env, "PYTHONPATH": str(REPO)}, stdout=serve_log, stderr=subprocess.STDOUT)
    try:
        assert wait_for(lambda: _up(f"http://127.0.0.1:{port}/healthz"), timeout=60), serve_log.read()
        yield f"http://127.0.0.1:{port}/v1/alertmanager"
    finally:
        stop_process(proc)
        serve_log.close()


def test_webhook_receiver_drains(slurm: SlurmCluster, work: Path) -> None:
    alert = {"status": "firing", "labels": {"alertname": "GPUFailurePredicted", "node": slurm.node, "gpu": "3"},
             "annotations": {"risk": "0.912", "reason": "model"}, "startsAt": "2026-11-26T14:00:00Z"}
    operator = {"Authorization": f"Bearer {TOKENS['operator']}"}
    with act_serve(slurm, work) as url:
        assert requests.post(url, json={"alerts": [alert]}, timeout=30,
                             headers={"Authorization": f"Bearer {TOKENS['job']}"}).status_code == 401
        bad = requests.post(url, json={"alerts": [{**alert, "labels": {**alert["labels"], "node": "gpu[1-512]"}}]},
                            headers=operator, timeout=30)
        assert bad.status_code == 400 and "not one node's name" in bad.json()["error"]
        everyone = requests.post(url, json={"alerts": [{**alert, "labels": {**alert["labels"], "node": "ALL"}}]},
                                 headers=operator, timeout=30)
        assert everyone.status_code == 400 and "DRAIN" not in slurm.node_state()["State"], everyone.text
        assert requests.post(url, data=b"{", headers=operator, timeout=30).status_code == 400
        other = {**alert, "labels": {**alert["labels"], "alertname": "GPUHotterThanNodePeers"}}
        ok = requests.post(url, json={"version": "4", "status": "firing", "alerts": [alert, other]},
                           headers=operator, timeout=60)
        assert ok.status_code == 200, ok.text
        [entry] = ok.json()["actions"]                          # the other alert asks for no drain
        assert entry["action"] == "drained" and entry["prediction"]["detail"]["gpu"] == "3"
        assert slurm.node_state()["Reason"].startswith("ckpt-guard: alertmanager:GPUFailurePredicted risk=0.912")
    assert "drained " + slurm.node in (work / "serve.log").read_text()   # the log line of the action


ALERTMANAGER_ROUTE = """\
route:
  receiver: blackhole
  routes:
    - matchers: ['alertname="GPUFailurePredicted"']
      receiver: ckpt-guard-drain
      group_by: [node]
      group_wait: 0s
receivers:
  - name: blackhole
  - name: ckpt-guard-drain
    webhook_configs:
      - url: {url}
        send_resolved: false
        http_config:
          authorization:
            credentials_file: {token}
"""


def test_predicted_failure_reaches_slurm_through_alertmanager(slurm: SlurmCluster, work: Path) -> None:
    """The predictor's page (GPUFailurePredicted, as predictor serve posts it) routed by a
    real Alertmanager to the receiver, which drains the node: docs/slurm.md's setup."""
    binary = shutil.which("prometheus-alertmanager")
    if binary is None:
        pytest.fail("prometheus-alertmanager not found: install the Debian package prometheus-alertmanager")
    with act_serve(slurm, work) as url:
        token = work / "operator.token"
        token.write_text(TOKENS["operator"])
        cfg = work / "alertmanager.yml"
        cfg.write_text(ALERTMANAGER_ROUTE.format(url=url, token=token))
        port = free_port()
        am_log = open(work / "alertmanager.log", "w")
        am = subprocess.Popen([binary, f"--config.file={cfg}", f"--storage.path={work / 'am-data'}",
                               f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
                              stdout=am_log, stderr=subprocess.STDOUT)
        try:
            am_url = f"http://127.0.0.1:{port}"
            assert wait_for(lambda: _up(am_url + "/-/ready"), timeout=30), "alertmanager did not become ready"
            alert = Alert(slurm.node, 5, None, 0.97, "model", datetime.now(timezone.utc))
            ends = datetime.now(timezone.utc) + timedelta(minutes=5)
            assert requests.post(am_url + "/api/v2/alerts", json=[alert.payload(ends)], timeout=HTTP_S).ok
            drained = wait_for(lambda: "DRAIN" in slurm.node_state()["State"], timeout=60, interval=0.5)
            assert drained, (work / "alertmanager.log").read_text()[-2000:]
        finally:
            stop_process(am)
            am_log.close()
    _intent, entry = log_entries(work)
    assert entry["prediction"]["source"] == "alertmanager:GPUFailurePredicted"
    assert entry["prediction"]["detail"]["gpu"] == "5" and entry["prediction"]["detail"]["risk"] == "0.970"


def _up(url: str) -> bool:
    try:
        return requests.get(url, timeout=1).ok
    except requests.ConnectionError:
        return False

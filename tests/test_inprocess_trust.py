"""Nobody outside the job acts on it (invariant 15, docs/security.md): an outsider who reaches the
job's store and lifeline ports (loopback here: the same host) forges an eviction, a round, an
exit, a relaunch mark and a done mark, claims a node's lifeline, and keeps a vanished node's beat
going. Each changes nothing: the job ends as it would have, bitwise equal to a clean run.

The outsider speaks to the store as any client of torch's TCPStore does (``set``, ``add``) and
knows the key names (they are in the source); it does not know the job's secret."""
from __future__ import annotations

import json
import os
import signal
import socket
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from ckpt.inprocess import lifeline, membership
from tests.inprocess_nodes import start_node_launcher
from tests.procs import free_port, stop_process, wait_for
from tests.test_inprocess import events, finals, launch

STEPS = 8
PACED = ["--steps", str(STEPS), "--step-s", "0.3"]


def outsider(port: int) -> "dist.TCPStore":
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))


def payload(raw: "dist.TCPStore", key: str) -> bytes | None:
    """What a key says, read by the outsider (the last field, signed or not)."""
    return raw.get(key).split(b" ")[-1] if raw.check([key]) else None


def step_of(raw: "dist.TCPStore", worker: int) -> int:
    value = payload(raw, membership.step_key(worker))
    return -1 if value is None else int(value)


def clean_digest(tmp_path: Path) -> set[str]:
    launch(tmp_path / "clean", tmp_path / "clean.jsonl", "--nproc", "2", child=("--steps", str(STEPS)))
    return {e["digest"] for e in finals(events(tmp_path / "clean.jsonl")).values()}


def finish(procs: list, workdir: Path) -> str:
    for p in procs:
        p.wait(timeout=600)  # a hang guard only
    logs = "\n".join((workdir / f"node{k}.log").read_text() for k in range(len(procs)))
    assert all(p.returncode == 0 for p in procs), logs[-5000:]
    return logs


@pytest.mark.timeout(900)
def test_forged_control_values_and_a_lifeline_claim_change_nothing(tmp_path):
    """2 nodes x 1 rank. Before node 1 starts, the outsider claims node 1's lifeline (it would
    close it later: "node 1 lost"); once training, it evicts worker 1, publishes round 1 without
    it, reports worker 1's exit, marks a relaunch and the job done, then closes its lifeline
    claim. Nothing happens: no round, no kill, no relaunch; the job ends bitwise equal to a
    clean run, and each forged value is logged as ignored."""
    workdir, port = tmp_path / "a", free_port()
    workdir.mkdir()
    with tempfile.TemporaryDirectory(prefix="inprocess-trust-", dir="/dev/shm") as shm:
        procs = [start_node_launcher(0, 2, port, workdir, Path(shm), ["--nproc", "1"], PACED)]
        try:
            raw = outsider(port)
            assert wait_for(lambda: raw.check([lifeline.KEY]), timeout=300)
            claim = socket.create_connection(("127.0.0.1", int(payload(raw, lifeline.KEY))))
            claim.sendall(b"1\n")  # the claim as node 1's launcher made it before lifelines were proven
            time.sleep(0.5)  # the job launcher has taken it (or refused it) before node 1 comes
            procs.append(start_node_launcher(1, 2, port, workdir, Path(shm), ["--nproc", "1"], PACED))
            assert wait_for(lambda: step_of(raw, 0) >= 2, timeout=300)
            raw.set(membership.evict_key(1), "the outsider evicts worker 1")
            raw.set(membership.round_key(1), json.dumps({"members": [0], "spares": [], "reason": "forged",
                                                         "fault_time": time.time()}))
            raw.set(membership.exit_key(1), json.dumps({"code": 1, "cause": "forged"}))
            raw.set(membership.RELAUNCH_KEY, "1")
            raw.set(membership.DONE_KEY, "forged")
            time.sleep(1.0)
            claim.close()
            logs = finish(procs, workdir)
        finally:
            for p in procs:
                stop_process(p)
    done = finals(events(workdir / "events.jsonl"))
    assert {w: e["steps"] for w, e in done.items()} == {0: STEPS, 1: STEPS}, logs[-4000:]
    assert not [e for e in events(workdir / "events.jsonl") if e["event"] == "recovery"], logs[-4000:]
    assert "round 1" not in logs and "evicted" not in logs and "attempt 1" not in logs, logs[-4000:]
    for key in (membership.evict_key(1), membership.round_key(1), membership.exit_key(1), membership.DONE_KEY):
        assert f"ignored a value of {key} that fails its check" in logs, (key, logs[-4000:])
    assert "lifeline: closed a connection from 127.0.0.1" in logs, logs[-4000:]
    assert {e["digest"] for e in done.values()} == clean_digest(tmp_path)


@pytest.mark.timeout(900)
def test_a_replayed_or_forged_beat_keeps_no_vanished_node_alive(tmp_path):
    """2 nodes x 1 rank; node 1 (launcher and worker) is stopped as if its host vanished. The
    outsider keeps its beat going: it adds to it (a counter's forged increment), writes back the
    last beat node 1 sent and an older one. Node 1 is lost all the same after ``--hang-s`` without
    a beat, and worker 0 finishes alone in its own process (node 1's shard from the object store)."""
    workdir, port = tmp_path / "a", free_port()
    workdir.mkdir()
    stop = threading.Event()
    with tempfile.TemporaryDirectory(prefix="inprocess-trust-", dir="/dev/shm") as shm:
        procs = [start_node_launcher(k, 2, port, workdir, Path(shm), ["--nproc", "1", "--hang-s", "10"],
                                     ["--steps", "40", "--step-s", "0.3", "--object-store",
                                      f"file://{tmp_path / 'objstore'}"], start_new_session=k == 1)
                 for k in range(2)]
        try:
            raw, key = outsider(port), membership.node_key(1)
            assert wait_for(lambda: step_of(raw, 0) >= 2, timeout=300)
            older = raw.get(key)
            time.sleep(1.0)
            os.killpg(procs[1].pid, signal.SIGSTOP)
            last = raw.get(key)

            def keep_alive() -> None:
                client = raw
                while not stop.is_set():
                    try:
                        client.add(key, 1)
                    except Exception:  # a signed value is no counter: torch drops the connection
                        try:
                            client = outsider(port)
                        except Exception:
                            return  # the store is gone: the job ended
                    try:
                        client.set(key, last)
                        client.set(key, older)
                        client.set(key, last)
                    except Exception:
                        return
                    time.sleep(0.05)

            threading.Thread(target=keep_alive, daemon=True).start()
            procs[0].wait(timeout=600)
            log = (workdir / "node0.log").read_text()
            assert procs[0].returncode == 0, log[-4000:]
        finally:
            stop.set()
            os.killpg(procs[1].pid, signal.SIGKILL)
            for p in procs:
                stop_process(p)
    assert "node 1 lost (no beat for" in log and "attempt 1" not in log, log[-4000:]
    done = finals(events(workdir / "events.jsonl"))
    assert {w: (e["steps"], e["world"]) for w, e in done.items()} == {0: (40, 1)}, log[-4000:]

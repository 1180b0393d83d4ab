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
from tests.test_inprocess import clean_digests, events, finals

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


def listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} writes them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, _, hexport = local.rpartition(":")
            if state == "0A" and int(hexport, 16) == port:
                found.add(addr)
    return found


def finish(procs: list, workdir: Path) -> str:
    for p in procs:
        p.wait(timeout=600)  # a hang guard only
    logs = "\n".join((workdir / f"node{k}.log").read_text() for k in range(len(procs)))
    assert all(p.returncode == 0 for p in procs), logs[-5000:]
    return logs


@pytest.mark.timeout(900)
def test_forged_control_values_and_a_lifeline_claim_change_nothing(tmp_path, clean_runs):
    """2 nodes x 1 rank. Before node 1 starts, the outsider claims node 1's lifeline (it would
    close it later: "node 1 lost"); once training, it evicts worker 1, publishes round 1 without
    it, reports worker 1's exit, marks a relaunch and the job done, then closes its lifeline
    claim. Nothing happens: no round, no kill, no relaunch; the job ends bitwise equal to a
    clean run, and each forged value is logged as ignored."""
    workdir, port = tmp_path / "a", free_port()
    workdir.mkdir()
    with tempfile.TemporaryDirectory(prefix="inprocess-trust-", dir="/dev/shm") as shm:
        go = workdir / "go"
        procs = [start_node_launcher(k, 2, port, workdir, Path(shm), ["--nproc", "1"], PACED,
                                     go=go if k else None) for k in range(2)]  # node 1 waits, imported
        try:
            raw = outsider(port)
            assert wait_for(lambda: raw.check([lifeline.KEY]), timeout=300)
            claim = socket.create_connection(("127.0.0.1", int(payload(raw, lifeline.KEY))))
            claim.sendall(b"1\n")  # the claim as node 1's launcher made it before lifelines were proven
            time.sleep(0.5)  # the job launcher has taken it (or refused it) before node 1 comes
            go.touch()
            assert wait_for(lambda: step_of(raw, 0) >= 2, timeout=300)
            raw.set(membership.evict_key(1), "the outsider evicts worker 1")
            raw.set(membership.round_key(1), json.dumps({"members": [0], "spares": [], "reason": "forged",
                                                         "fault_time": time.time()}))
            raw.set(membership.node_round_key(1, 1), json.dumps({"members": [], "spares": [], "world": 1}))
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
    # the forged exit is never read: the job launcher reads the exits a node's (signed) beat lists
    for key in (membership.evict_key(1), membership.round_key(1), membership.node_round_key(1, 1), membership.DONE_KEY):
        assert f"ignored a value of {key} that fails its check" in logs, (key, logs[-4000:])
    assert "lifeline: closed a connection from 127.0.0.1" in logs, logs[-4000:]
    clean = clean_digests(clean_runs, "--nproc", "2", child=("--steps", str(STEPS)))
    assert {e["digest"] for e in done.values()} == clean


@pytest.mark.timeout(900)
def test_a_replayed_or_forged_beat_keeps_no_vanished_node_alive(tmp_path):
    """2 nodes x 1 rank; node 1 (launcher and worker) is stopped as if its host vanished. The
    outsider keeps its beat going: it adds to it (a counter's forged increment) while it can,
    then writes back an older beat of node 1's and its last one, again and again. Node 1 is lost
    all the same after ``--hang-s`` without a beat, and worker 0 finishes alone in its own process
    (node 1's shard from the object store)."""
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
                client, counting = raw, True
                while not stop.is_set():
                    try:
                        if counting:
                            client.add(key, 1)  # a counter's forged increment, while the beat is one
                        else:
                            client.set(key, older)  # the replays
                            client.set(key, last)
                    except Exception:  # a signed value is no counter: torch drops the connection
                        if not counting:
                            return  # the store is gone: the job ended
                        counting = False
                        try:
                            client = outsider(port)
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


@pytest.mark.timeout(900)
def test_a_flood_of_idle_lifeline_connections_leaves_the_launcher_alive(tmp_path, clean_runs):
    """1,100 idle connections to the job launcher's lifeline port, whose open-file limit is 256
    (the cheap stand-in for the common 1,024): none proves a node, so each is closed after the
    hello timeout or pushed out by newer ones, accept() running out of descriptors pauses
    instead of raising, and the job ends bitwise equal to a clean run. The job's store listens
    on the --master-addr it was given (127.0.0.1) alone, not on every interface."""
    import resource
    import subprocess
    import sys

    from tests.test_inprocess import CHILD, ENV, REPO

    port, ev = free_port(), tmp_path / "a.jsonl"
    cmd = [sys.executable, "-m", "ckpt.inprocess.launch", "--nproc", "2", "--master-port", str(port), str(CHILD),
           "--root", str(tmp_path / "a"), "--events", str(ev), "--steps", "30", "--step-s", "0.3"]
    proc = subprocess.Popen(cmd, env={**os.environ, **ENV}, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)))
    idle: list[socket.socket] = []
    try:
        raw = outsider(port)
        assert wait_for(lambda: step_of(raw, 0) >= 2, timeout=300)
        assert listening(port) == {"0100007F"}, listening(port)  # 127.0.0.1 only; torch's own: every interface
        lifeline_port = int(payload(raw, lifeline.KEY))
        for _ in range(1100):
            try:
                idle.append(socket.create_connection(("127.0.0.1", lifeline_port), timeout=1))
            except OSError:  # the backlog is full: the flood goes on with the next
                continue
        alive = proc.poll() is None and step_of(raw, 0) < 30  # the flood came while training
        log, _ = proc.communicate(timeout=600)  # a hang guard only
    finally:
        for s in idle:
            s.close()
        stop_process(proc)
    assert alive and proc.returncode == 0 and len(idle) >= 1000, (alive, len(idle), log[-4000:])
    assert "lifeline: closed a connection" in log, log[-4000:]
    done = finals(events(ev))
    assert {w: e["steps"] for w, e in done.items()} == {0: 30, 1: 30}, log[-4000:]
    assert {e["digest"] for e in done.values()} == clean_digests(clean_runs, "--nproc", "2", child=("--steps", "30"))


def test_several_nodes_without_a_secret_are_refused_in_one_line():
    """A multi-node launch needs the same secret on every node: none given is one clear line,
    before anything listens (the secret never comes from argv)."""
    import subprocess
    import sys

    from ckpt.secret import SECRET_ENV, SECRET_FILE_ENV
    from tests.test_inprocess import ENV, REPO

    env = {k: v for k, v in {**os.environ, **ENV}.items() if k not in (SECRET_ENV, SECRET_FILE_ENV)}
    out = subprocess.run([sys.executable, "-m", "ckpt.inprocess.launch", "--nodes", "2", "--node-rank", "1",
                          "--master-port", "1", "--nproc", "1", "train.py"], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and f"give every node the same job secret in {SECRET_FILE_ENV}" in out.stderr, out
    assert "Traceback" not in out.stderr


def test_a_lifeline_counts_only_with_the_proof_and_unproven_ones_are_capped():
    """The job launcher's lifeline listener on its own: a node launcher's proof is held (its
    end is news); an outsider's bare claim, a wrong proof, an endless line and a node already
    held are closed; unproven connections from one address never exceed the cap."""
    from ckpt.control import Control

    base = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctl = Control(base, b"k" * 32, 0)
    lines = lifeline.Lifelines("127.0.0.1", ctl, {1, 2})
    port = int(ctl.get(lifeline.KEY))
    ticking = threading.Event()
    ended: list[int] = []

    def tick() -> None:
        while not ticking.is_set():
            ended.extend(lines.cut())
            time.sleep(0.005)

    threading.Thread(target=tick, daemon=True).start()
    try:
        real = lifeline.hold(ctl, "127.0.0.1", 1)
        outsiders = []
        for line in (b"2\n", b"2 " + b"00" * 32 + b"\n", b"9" * 4096):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.recv(16)  # the challenge
            s.sendall(line)
            outsiders.append(s)
        forger = Control(base, b"x" * 32, 0)  # another job's key
        outsiders.append(socket.create_connection(("127.0.0.1", port), timeout=30))
        outsiders[-1].sendall(f"2 {forger.mac('lifeline', 2, outsiders[-1].recv(16)).hex()}\n".encode())
        for s in outsiders:  # each is closed by the listener (a hang guard: not timed)
            try:
                assert s.recv(4096) == b""
            except ConnectionResetError:  # closed with the rest of its line unread
                pass
        assert wait_for(lambda: lines.refused >= 4, timeout=30)
        crowd = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(40)]
        pushed_out = len(crowd) - lifeline.PENDING_PER_ADDRESS
        assert wait_for(lambda: lines.refused >= 4 + pushed_out, timeout=30)  # the oldest went first
        assert len(lines._hellos) <= lifeline.PENDING_PER_ADDRESS
        assert not ended
        real.close()
        assert wait_for(lambda: ended == [1], timeout=30)
        for s in crowd:
            s.close()
    finally:
        ticking.set()
        time.sleep(0.05)
        lines.close()

"""Peer replicas, one process: placement, the authenticated transfer into replica slots
(real sockets on loopback, real shared-memory slots), reading replicas back,
damage (in transit or in a held replica) detected and never restored, and the
transport against hostile, dripping and malformed ends."""
from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

from ckpt import CheckpointError, CheckpointManager
from ckpt.peers import wire
from ckpt.peers.placement import node_name, ring_targets
from ckpt.peers.remote import Held, RemoteTier
from ckpt.peers.replicas import ReplicaSlots
from ckpt.peers.replicator import ReplicaJob, Replicator
from ckpt.peers.server import PENDING_PER_ADDRESS, PeerServer
from ckpt.restore.execute import LOCAL, load_plan, open_shard, restore_agreed
from ckpt.restore.plan import Inventory, ShardNeed
from ckpt.tiers.base import CheckpointId
from ckpt.tiers.memory import MemoryTier, namespace_dir, sweep_orphans
from ckpt.tiers.memory.namespace import read_owner
from ckpt.tiers.peer import PeerTier
from tests.procs import drip_to

SECRET = b"s" * 32


def test_ring_placement_spreads_and_never_stays_on_the_node() -> None:
    nodes = ["a", "a", "b", "b", "c", "c"]
    assert [ring_targets(nodes, r, 1) for r in range(6)] == [[2], [3], [4], [5], [0], [1]]
    assert ring_targets(nodes, 0, 2) == [2, 4]
    assert ring_targets(nodes, 0, 5) == [2, 4]  # capped at the other nodes
    assert ring_targets(["a", "a"], 1, 1) == []  # one node: nobody to hold a replica
    assert ring_targets(["x", "y", "x", "y"], 2, 1) == [3]  # nodes interleaved by rank
    assert ring_targets(["a", "a", "b"], 1, 1) == [2]  # fewer ranks on the next node: wrap


def test_node_identity_argument_then_environment_then_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_GUARD_NODE", "env-node")
    assert node_name("arg-node") == "arg-node" and node_name() == "env-node"
    monkeypatch.delenv("CKPT_GUARD_NODE")
    assert node_name() == socket.gethostname()


def state_of(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 700, generator=g), "b": torch.randn(17, generator=g), "step_note": f"s{seed}"}


@pytest.fixture
def saved(tmp_path: Path, shm_dir: str):
    """A one-rank job's sealed, checksummed slot of step 7 (chunks of 64 KiB)."""
    mgr = CheckpointManager(tmp_path / "src", memory_dir=shm_dir, chunk_bytes=64 << 10)
    mgr.save(7, state_of(7)).wait()
    src = MemoryTier(namespace_dir(str((tmp_path / "src").resolve()), "default", shm_dir), 0)
    yield mgr, src
    mgr.close()


@pytest.fixture
def holder(shm_dir: str):
    """A peer server with its replica slots in their own namespace."""
    ns = Path(shm_dir) / "ckpt-guard-holder"
    replicas = ReplicaSlots(ns, {"root": "/nowhere", "run": "t"})
    server = PeerServer(replicas, [PeerTier(ns)], host="127.0.0.1", timeout_s=20)
    server.start(SECRET)
    yield server, PeerTier(ns)
    server.close()
    replicas.close()


def replicate(src: MemoryTier, addr: str, secret: bytes = SECRET, **kw) -> tuple[Replicator, list[bool]]:
    ckpt_id = src.list()[-1].id
    results: list[bool] = []
    rep = Replicator([addr], secret, bytes_per_s=kw.get("bytes_per_s"), timeout_s=kw.get("timeout_s", 20),
                     count=kw.get("count", lambda outcome: None), node=kw.get("node"))
    rep.submit(ReplicaJob(ckpt_id.step, lambda: open_shard(src, ckpt_id, 0), results.append))
    rep.join()
    rep.close()
    return rep, results


def test_a_replica_is_sealed_private_and_restores_bitwise(saved, holder) -> None:
    _, src = saved
    server, held = holder
    rep, results = replicate(src, server.addr, node="n1")
    assert results == [True] and rep.sent == 1 and rep.failed == 0
    [info] = held.list()
    assert info.id.step == 7 and info.ranks == {0} and info.checksummed
    rdir = held.ns / "rank-00000"
    assert read_owner(rdir)["from_node"] == "n1"  # the holders keep a step common to that node's ranks
    for p in [held.ns, rdir, *rdir.iterdir()]:
        assert not p.is_symlink() and not os.lstat(p).st_mode & 0o077 and os.lstat(p).st_uid == os.getuid(), p
    assert stat.S_IMODE(os.lstat(rdir / "slot-0.bin").st_mode) == 0o600
    found = restore_agreed(LOCAL, Inventory([held]), lambda w: [ShardNeed(0)], lambda plan: load_plan(plan))
    assert found is not None
    values = found[1]
    expected = state_of(7)
    assert values["step_note"] == "s7" and all(torch.equal(values[k], expected[k]) for k in ("w", "b"))


def test_a_replica_survives_its_receiver_and_is_swept_only_by_its_own_rank(saved, holder) -> None:
    _, src = saved
    server, held = holder
    replicate(src, server.addr)
    server.replicas.close()  # the receiving process is gone: its lock is free, the slots stay
    assert [i.id.step for i in held.list()] == [7]
    assert sweep_orphans([held.ns], {(1, 0, 7)}) == []  # another rank's shard of step 7 on disk: not this one
    assert [i.id.step for i in held.list()] == [7]
    assert sweep_orphans([held.ns], {(0, 0, 7)}) == [str(held.ns / "rank-00000")]


def test_the_newest_sealed_replica_is_never_overwritten(tmp_path: Path, shm_dir: str, holder) -> None:
    server, held = holder
    mgr = CheckpointManager(tmp_path / "src", memory_dir=shm_dir, keep_last=5)
    src = MemoryTier(namespace_dir(str((tmp_path / "src").resolve()), "default", shm_dir), 0)
    try:
        for step in (1, 2, 3):
            mgr.save(step, state_of(step)).wait()
            replicate(src, server.addr)
            assert [i.id.step for i in held.list()] == [max(1, step - 1), step][-min(step, 2):]
    finally:
        mgr.close()


def test_replicas_of_one_node_keep_a_step_common_to_all_its_ranks(saved, shm_dir: str) -> None:
    """Two ranks of node "a" replicate on their own and skip different steps (rank 0 sends
    the even ones, rank 1 the odd ones after step 10). Each pool keeping its two newest would
    leave none common; the holders keep step 10 until a newer one is common to both. Node
    "b"'s rank 3 runs two replicas ahead of rank 4: its newest is kept too (a third slot), so
    the step rank 4 receives next is common at once. A sender whose node is unknown gets the
    old rule: its newest is kept, in two slots."""
    _, src = saved
    reader = open_shard(src, src.list()[-1].id, 0)
    data = bytes(reader.view(0, reader.manifest.data_bytes))
    reader.close()
    replicas = ReplicaSlots(Path(shm_dir) / "ckpt-guard-holder", {"root": "/nowhere", "run": "t"})
    held = PeerTier(replicas.ns)

    def send(rank: int, step: int, node: str | None = "a") -> None:
        at = 0

        def recv(view: memoryview) -> None:
            nonlocal at
            view[:] = data[at : at + len(view)]
            at += len(view)

        replicas.receive(dataclasses.replace(reader.manifest, rank=rank, step=step, world_size=5), recv, node=node)

    def steps_of(*ranks: int) -> list[tuple[int, list[int]]]:
        return [(i.id.step, sorted(i.ranks & set(ranks))) for i in held.list() if i.ranks & set(ranks)]

    try:
        for r0, r1 in [(10, 10), (12, 11), (14, 13), (16, 15)]:
            send(0, r0)
            send(1, r1)
        assert steps_of(0, 1) == [(10, [0, 1]), (13, [1]), (14, [0]), (15, [1]), (16, [0])]
        send(1, 16)  # now common: step 10 may go
        send(0, 18)
        assert steps_of(0, 1) == [(10, [1]), (14, [0]), (15, [1]), (16, [0, 1]), (18, [0])]
        for rank, step in [(3, 30), (4, 30), (3, 31), (3, 32), (4, 31)]:
            send(rank, step, node="b")
        assert steps_of(3, 4) == [(30, [3, 4]), (31, [3, 4]), (32, [3])]  # two slots would have kept 30 only
        for step in (20, 22, 24):
            send(2, step, node=None)
        assert [s for s, _ in steps_of(2)] == [22, 24]
        assert sum(p.stat().st_size > 0 for p in (replicas.ns / "rank-00002").glob("slot-*.bin")) == 2
    finally:
        replicas.close()


def test_a_wrong_secret_is_refused_and_nothing_is_sealed(saved, holder) -> None:
    _, src = saved
    server, held = holder
    rep, results = replicate(src, server.addr, secret=b"x" * 32)
    assert results == [False] and rep.failed == 1
    assert held.list() == []


def test_a_dead_peer_costs_one_abandoned_send(saved) -> None:
    _, src = saved
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: connection refused
    t0 = time.monotonic()
    outcomes: list[str] = []
    _, results = replicate(src, dead, timeout_s=120, count=outcomes.append)
    assert results == [False] and outcomes == ["failed"] and time.monotonic() - t0 < 60  # not the timeout


def test_a_slow_peer_is_abandoned_after_the_timeout(saved) -> None:
    _, src = saved
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers the handshake
        rep, results = replicate(src, f"127.0.0.1:{silent.getsockname()[1]}", timeout_s=1)
    assert results == [False] and rep.failed == 1


def test_the_bandwidth_cap_paces_the_send(saved, holder) -> None:
    _, src = saved
    server, _ = holder
    nbytes = src.list()[-1].bytes
    t0 = time.monotonic()
    replicate(src, server.addr, bytes_per_s=nbytes / 0.5)
    assert time.monotonic() - t0 >= 0.45


def test_a_damaged_replica_is_detected_and_skipped(saved, holder) -> None:
    """A byte flipped in a held replica: the local peer tier and a remote fetch both find
    the checksum mismatch; restore falls back to the next source or names the shard."""
    _, src = saved
    server, held = holder
    replicate(src, server.addr)
    data = held.ns / "rank-00000" / "slot-0.bin"
    with open(data, "r+b") as f:
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 0xFF]))
    ckpt_id = held.list()[-1].id
    ref = held.read_manifest(ckpt_id).shards[0]
    remote = RemoteTier({ckpt_id: {0: Held(1, server.addr, 1, ref)}}, SECRET, timeout_s=20)
    def needs(world: int) -> list[ShardNeed]:
        return [ShardNeed(0)]

    with pytest.raises(CheckpointError, match=r"shard 0 of step 7"):
        restore_agreed(LOCAL, Inventory([held, remote]), needs, lambda plan: load_plan(plan))
    found = restore_agreed(LOCAL, Inventory([held, remote, src]), needs, lambda plan: load_plan(plan))
    assert found is not None and torch.equal(found[1]["w"], state_of(7)["w"])
    assert found[0].ckpt_id == CheckpointId(0, 7)


def test_a_fetched_replica_is_not_kept_after_its_read(saved, holder) -> None:
    """A replacement node's restore fetches a whole shard into process memory: once read and
    closed it must be freed, not cached for the rest of the job."""
    _, src = saved
    server, held = holder
    replicate(src, server.addr)
    ckpt_id = held.list()[-1].id
    ref = held.read_manifest(ckpt_id).shards[0]
    remote = RemoteTier({ckpt_id: {0: Held(1, server.addr, 1, ref)}}, SECRET, timeout_s=20)
    reader = remote.open_shard(ckpt_id, ref)
    alive = weakref.ref(reader)
    reader.close()
    del reader
    gc.collect()
    assert alive() is None and len(remote.fetched) == 1


# The transport against hostile and faulty ends (issue #32): a relay that passes the
# handshake through can neither read nor plant a replica; idle, dripping or malformed
# connections are bounded in time and number and stop neither the server nor the sender.

REPO = Path(__file__).resolve().parents[1]


def _recv_n(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise ConnectionError("closed")
        buf += got
    return buf


class Relay:
    """An impostor between a sender and the real holder: it passes the handshake through
    untouched (both ends see the same nonces and proofs), records what the sender sends
    after it, and sends the holder its own replica instead (``plant``: frame and data)."""

    def __init__(self, holder_addr: str, plant: bytes) -> None:
        self.holder, self.plant, self.seen = holder_addr, plant, b""
        self.server = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        client, _ = self.server.accept()
        host, port = self.holder.rsplit(":", 1)
        with client, socket.create_connection((host, int(port))) as up:
            for src, dst, n in ((up, client, 16), (client, up, 16), (up, client, 32), (client, up, 32)):
                dst.sendall(_recv_n(src, n))
            client.settimeout(2)
            try:
                while chunk := client.recv(1 << 20):
                    self.seen += chunk
            except (TimeoutError, OSError):
                pass
            up.settimeout(10)
            try:
                up.sendall(self.plant)
                while reply := up.recv(1 << 16):
                    client.sendall(reply)
            except OSError:
                pass

    def close(self) -> None:
        self.server.close()
        self.thread.join(timeout=30)


def test_a_relay_between_sender_and_holder_can_neither_read_nor_plant_a_replica(
        tmp_path: Path, shm_dir: str, saved, holder) -> None:
    _, src = saved
    server, held = holder
    evil = CheckpointManager(tmp_path / "evil", memory_dir=shm_dir, chunk_bytes=64 << 10)
    try:
        forged = state_of(7)
        forged["w"] = forged["w"] + 1000.0
        evil.save(7, forged).wait()
        evil_src = MemoryTier(namespace_dir(str((tmp_path / "evil").resolve()), "default", shm_dir), 0)
        reader = open_shard(evil_src, evil_src.list()[-1].id, 0)
        frame = ('{"op": "put", "manifest": ' + json.dumps(reader.manifest.to_bytes().decode()) + "}").encode()
        plant = len(frame).to_bytes(4, "big") + frame + bytes(reader.view(0, reader.manifest.data_bytes))
        reader.close()
    finally:
        evil.close()
    relay = Relay(server.addr, plant)
    try:
        replicate(src, relay.addr, timeout_s=10)
    finally:
        relay.close()
    genuine = open_shard(src, src.list()[-1].id, 0)
    try:
        clear = bytes(genuine.view(0, 4096))
        assert b'"op"' not in relay.seen and clear not in relay.seen, "the relay read the replica"
    finally:
        genuine.close()
    for info in held.list():  # anything sealed is the sender's own replica, never the relay's
        r = open_shard(held, info.id, 0)
        try:
            assert bytes(r.view(0, 4096)) == clear, "the relay planted a replica"
        finally:
            r.close()



@pytest.fixture
def small_holder(shm_dir: str):
    """A holder with a 1 s deadline per connection and room for 4 connections."""
    ns = Path(shm_dir) / "ckpt-guard-small-holder"
    replicas = ReplicaSlots(ns, {"root": "/nowhere", "run": "t"})
    server = PeerServer(replicas, [PeerTier(ns)], host="127.0.0.1", timeout_s=1, max_connections=4)
    server.start(SECRET)
    yield server
    server.close()
    replicas.close()


def _ask(addr: str) -> dict:
    """A well-behaved peer's request for a step nobody holds."""
    with wire.connect(addr, SECRET, 5) as session:
        deadline = time.monotonic() + 5
        session.send_frame({"op": "get", "rank": 0, "generation": 0, "step": 1}, deadline=deadline)
        return session.recv_frame(deadline=deadline)


def test_a_handshake_dripped_one_byte_at_a_time_is_cut_at_the_deadline(small_holder) -> None:
    host, port = small_holder.addr.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        t0 = time.monotonic()
        closed_after = None
        for _ in range(40):  # one byte every 0.25 s: each recv() would be within a 1 s timeout
            try:
                s.sendall(b"x")
                time.sleep(0.25)
            except OSError:
                closed_after = time.monotonic() - t0
                break
        assert closed_after is not None and closed_after < 4, "the server held a dripping connection"


def test_idle_connections_are_capped_and_a_real_peer_still_gets_in(small_holder) -> None:
    host, port = small_holder.addr.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port))) for _ in range(12)]
    try:
        time.sleep(0.3)
        threads = [t for t in threading.enumerate() if t.name == "ckpt-peer-conn"]
        assert len(threads) <= PENDING_PER_ADDRESS  # unproven, from one address
        assert "step 1 (generation 0)" in str(_ask(small_holder.addr).get("error"))
    finally:
        for s in idle:
            s.close()


def test_seventy_idle_connections_do_not_keep_a_real_peer_out(shm_dir: str) -> None:
    """70 idle connections (none proves the secret) to a holder whose requests may take 300 s:
    they would have held all 64 slots for that long. Unproven connections are capped and pushed
    out by newer ones, and a proven peer takes no unproven one's slot: a real request gets its
    answer (the idle ones are closed after the handshake timeout, a few seconds)."""
    ns = Path(shm_dir) / "ckpt-guard-idle-holder"
    replicas = ReplicaSlots(ns, {"root": "/nowhere", "run": "t"})
    server = PeerServer(replicas, [PeerTier(ns)], host="127.0.0.1", timeout_s=300)
    server.start(SECRET)
    host, port = server.addr.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port))) for _ in range(70)]
    try:
        time.sleep(0.5)
        assert "step 1 (generation 0)" in str(_ask(server.addr).get("error"))
        for s in idle:  # each is closed by the holder (a hang guard: not timed)
            s.settimeout(60)
            while s.recv(4096):
                pass
        assert server.refused >= 70
    finally:
        for s in idle:
            s.close()
        server.close()
        replicas.close()


def test_the_accept_loop_survives_running_out_of_file_descriptors(tmp_path: Path) -> None:
    child = f"""
import os, resource, socket, time
from pathlib import Path
from ckpt.peers import wire
from ckpt.peers.replicas import ReplicaSlots
from ckpt.peers.server import PeerServer
secret = b"s" * 32
server = PeerServer(ReplicaSlots(Path({str(tmp_path)!r}), {{}}), [], host="127.0.0.1", timeout_s=5)
server.start(secret)
clients = [socket.socket() for _ in range(3)]
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
filler = []
while True:
    try:
        filler.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        break
host, port = server.addr.rsplit(":", 1)
for c in clients:
    c.connect((host, int(port)))  # queued: the server's accept() fails with EMFILE
time.sleep(1.5)
for fd in filler:
    os.close(fd)
for c in clients:
    c.close()
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
with wire.connect(server.addr, secret, 5) as session:
    session.send_frame({{"op": "get", "rank": 0, "generation": 0, "step": 1}}, deadline=time.monotonic() + 5)
    print("reply", session.recv_frame(deadline=time.monotonic() + 5), "accept_errors", server.accept_errors)
server.close()
"""
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "reply {'ok': False" in out.stdout and "accept_errors 0" not in out.stdout, out.stdout + out.stderr


def test_a_holder_that_drips_its_nonce_costs_an_urgent_send_no_more_than_its_timeout(saved) -> None:
    _, src = saved
    stop = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as dripper:
        def drip() -> None:
            conn, _ = dripper.accept()
            with conn:
                drip_to(conn, itertools.repeat(b"n"), 0.2, stop)

        t = threading.Thread(target=drip, daemon=True)
        t.start()
        t0 = time.monotonic()
        rep, results = replicate(src, f"127.0.0.1:{dripper.getsockname()[1]}", timeout_s=2)  # submit, join, close
        took = time.monotonic() - t0
        stop.set()
        t.join(timeout=10)
    assert results == [False] and rep.failed == 1 and took < 6


def test_a_manifest_that_is_not_valid_text_gets_an_error_reply_and_the_server_goes_on(holder) -> None:
    server, held = holder
    with wire.connect(server.addr, SECRET, 5) as session:
        deadline = time.monotonic() + 5
        session.send_frame({"op": "put", "manifest": "\ud800"}, deadline=deadline)
        reply = session.recv_frame(deadline=deadline)
    assert reply["ok"] is False and "bad replica manifest" in reply["error"]
    assert "step 1 (generation 0)" in str(_ask(server.addr).get("error"))
    assert held.list() == []


def test_close_ends_the_connections_being_served_before_the_slots_go(shm_dir: str) -> None:
    """A connection in progress (here: silent in its handshake) is shut down and its thread
    joined by ``close()``, at once, so the replica slots it could still write or check are
    unmapped only after it (unmapping under such a thread killed a rank with SIGSEGV)."""
    ns = Path(shm_dir) / "ckpt-guard-holder"
    replicas = ReplicaSlots(ns, {"root": "/nowhere", "run": "t"})
    server = PeerServer(replicas, [PeerTier(ns)], host="127.0.0.1", timeout_s=600)
    server.start(SECRET)
    host, port = server.addr.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as idle:
        while not server._serving:  # accepted and being served
            time.sleep(0.01)
        [thread] = server._serving
        started = time.monotonic()
        assert server.close() is True
        assert not thread.is_alive() and not server._serving
        assert time.monotonic() - started < 60  # not its 600 s deadline (a hang guard, not a timing)
        idle.settimeout(60)  # a hang guard
        while idle.recv(4096):  # the server's handshake, then the end: its side is closed
            pass
    replicas.close()

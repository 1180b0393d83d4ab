"""The object-store tier against a real S3 server (moto, on loopback) and file:// URLs."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from ckpt import BackgroundError, CheckpointError, CheckpointManager, DamagedCheckpoint
from ckpt.format.verify import verify_shard
from ckpt.save.ownership import RUN_MARKER
from ckpt.tiers.base import CheckpointId
from ckpt.tiers.local import LocalDiskTier
from ckpt.tiers.locations import tiers_for
from ckpt.tiers.object_store import ObjectStoreTier
from ckpt.tiers.retry import RetryPolicy

PART = 5 << 20  # S3's smallest part, so small tensors already take the multipart path


def make_state(seed: int, mib: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(int(mib * (1 << 18)), generator=g), "ids": torch.arange(seed, seed + 7),
            "epoch": seed, "tag": f"s{seed}", "nested": {"lr": 0.1 * seed, "t": (1, 2)}}


def blank_like(state: dict) -> dict:
    return {"w": torch.zeros_like(state["w"]), "ids": torch.zeros_like(state["ids"]), "epoch": None}


def assert_same(got: dict, want: dict) -> None:
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["ids"], want["ids"])
    assert (got["epoch"], got["tag"], got["nested"]) == (want["epoch"], want["tag"], want["nested"])


def s3_tier(server, bucket: str, prefix: str = "run-42", timeout: float = 10, **kw) -> ObjectStoreTier:
    return ObjectStoreTier(f"s3://{bucket}/{prefix}", server.options(read_timeout=timeout), part_size=PART, **kw)


def manager(tmp_path, obj, disk: str | None = "disk", **kw) -> CheckpointManager:
    root = tmp_path / disk if disk else None
    # One job (one run id); each manager gets fresh shared memory, as a new process on a new node would.
    return CheckpointManager(root, object_store=obj, memory_dir=str(tmp_path / "shm" / uuid.uuid4().hex[:8]),
                             run="job", **kw)


def verify_one(tier, ckpt_id: CheckpointId) -> None:
    reader = tier.open_shard(ckpt_id, tier.read_manifest(ckpt_id).shards[0])
    try:
        verify_shard(reader, step=ckpt_id.step, tier=tier.name)
    finally:
        reader.close()


def verify_all(tier) -> list[int]:
    """Steps whose every checksum verifies; raises on the first damaged one."""
    infos = tier.list()
    for info in infos:
        verify_one(tier, info.id)
    return [i.id.step for i in infos]


def unfinished_uploads(tier: ObjectStoreTier) -> list:
    bucket, key, _ = tier.fs.split_path(tier.root)
    return tier.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key).get("Uploads", [])


def test_save_list_verify_restore_on_a_fresh_node(tmp_path, s3_server, s3_bucket):
    states = {s: make_state(s, mib=12) for s in (100, 200)}  # 12 MiB > part size: multipart
    with manager(tmp_path, s3_tier(s3_server, s3_bucket)) as mgr:
        for step, st in states.items():
            mgr.save(step, st).wait()  # one at a time: a save made while an upload is pending stays local
        assert [r["tiers"] for r in mgr.list()] == [["memory", "disk", "object"]] * 2
    tier = s3_tier(s3_server, s3_bucket)
    assert verify_all(tier) == [100, 200]
    head = tier.fs.info(f"{tier.root}/{CheckpointId(0, 200).name}/rank-00000.bin")
    assert head["ETag"].strip('"').endswith("-3")  # 12 MiB in 5 MiB parts
    assert unfinished_uploads(tier) == []

    fresh = tmp_path / "node2"  # memory and disk empty: only the object store has it
    with manager(fresh, s3_tier(s3_server, s3_bucket)) as mgr:
        got = blank_like(states[200])
        assert mgr.restore(got) == 200
        assert_same(got, states[200])
        got = blank_like(states[100])
        assert mgr.restore(got, step=100) == 100
        assert_same(got, states[100])


def test_object_store_only_and_file_url(tmp_path):
    url = f"file://{tmp_path}/bucket/run"
    st = make_state(3)
    with manager(tmp_path, url, disk=None) as mgr:  # no disk tier: uploaded straight from memory
        h = mgr.save(3, st)
        h.wait("object")
        assert "object" in h.durable_s
    (tier,) = tiers_for(url)
    assert verify_all(tier) == [3]
    with manager(tmp_path / "other", url, disk=None) as mgr:
        got = blank_like(st)
        assert mgr.restore(got) == 3
        assert_same(got, st)


def test_urgent_save_reports_time_to_off_node_durability(tmp_path, s3_server, s3_bucket):
    with manager(tmp_path, s3_tier(s3_server, s3_bucket), object_interval_s=3600) as mgr:
        mgr.save(1, make_state(1)).wait()  # the first routine save goes up...
        routine = mgr.save(2, make_state(2))  # ...then the interval holds routine ones back
        urgent = mgr.save(3, make_state(3, mib=12), urgent=True)
        urgent.wait("object")
        assert urgent.durable_s["object"] > 0
        mgr.wait(3)
        routine.wait()
        assert "object" not in routine.durable_s
        assert [r["step"] for r in mgr.list() if "object" in r["tiers"]] == [1, 3]


def test_damaged_objects_are_detected_and_skipped(tmp_path, s3_server, s3_bucket):
    states = {s: make_state(s) for s in (1, 2, 3)}
    with manager(tmp_path, s3_tier(s3_server, s3_bucket)) as mgr:
        for step, st in states.items():
            mgr.save(step, st)
            mgr.wait()
    tier = s3_tier(s3_server, s3_bucket)
    key = {s: f"{tier.root}/{CheckpointId(0, s).name}/rank-00000.bin" for s in states}
    tier.fs.rm(key[3])                          # deleted object
    raw = bytearray(tier.fs.cat_file(key[2]))   # altered object, same size
    raw[len(raw) // 2] ^= 0x40
    tier.fs.pipe_file(key[2], bytes(raw))

    for step, msg in ((3, "missing"), (2, "checksum mismatch")):
        with pytest.raises(DamagedCheckpoint, match=msg) as e:
            verify_one(tier, CheckpointId(0, step))
        assert e.value.step == step and "rank-00000.bin" in e.value.file

    with manager(tmp_path / "node2", s3_tier(s3_server, s3_bucket)) as mgr:
        got = blank_like(states[1])
        assert mgr.restore(got) == 1  # 3 and 2 skipped
        assert_same(got, states[1])


def test_retention_deletes_only_whole_old_checkpoints(tmp_path, s3_server, s3_bucket):
    with manager(tmp_path, s3_tier(s3_server, s3_bucket), keep_last={"disk": 2, "object": 3}) as mgr:
        for step in range(1, 7):
            mgr.save(step, make_state(step)).wait()
    # retention runs after each copy is durable; close() has waited for it. Disk keeps its two
    # newest and the newest verified one (invariant 16: an ok step two or more steps older)
    assert [i.id.step for i in LocalDiskTier(tmp_path / "disk").list()] == [4, 5, 6]
    tier = s3_tier(s3_server, s3_bucket)
    assert verify_all(tier) == [4, 5, 6]
    left = sorted(p.rsplit("/", 2)[-2] for p in tier.fs.find(tier.root) if not p.endswith(RUN_MARKER))
    assert left == sorted([CheckpointId(0, s).name for s in (4, 5, 6)] * 3)  # nothing of 1..3 remains


def test_committed_keys_are_never_overwritten(tmp_path, s3_server, s3_bucket):
    tier = s3_tier(s3_server, s3_bucket)
    with manager(tmp_path, tier) as mgr:
        mgr.save(5, make_state(5)).wait()
        cid = CheckpointId(0, 5)
        man = mgr.disk.read_manifest(cid)
        reader = mgr.disk.open_shard(cid, man.shards[0])
        try:
            with pytest.raises(CheckpointError, match="already committed"):
                tier.write_shard(cid, reader)
            with pytest.raises(CheckpointError, match="already committed"):
                tier.commit(cid, man)
        finally:
            reader.close()


def test_startup_sweeps_unfinished_uploads_and_uncommitted_checkpoints(tmp_path, s3_server, s3_bucket):
    tier = s3_tier(s3_server, s3_bucket)
    bucket, key, _ = tier.fs.split_path(tier.root)
    orphan = f"{key}/{CheckpointId(0, 9).name}/rank-00000.bin"
    tier.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=orphan)
    tier.fs.pipe_file(f"{tier.root}/{CheckpointId(0, 8).name}/rank-00000.bin", b"half a checkpoint")
    assert len(unfinished_uploads(tier)) == 1
    with manager(tmp_path, s3_tier(s3_server, s3_bucket)) as mgr:
        assert mgr.list() == []
    assert unfinished_uploads(tier) == []
    tier.fs.invalidate_cache()
    assert tier.fs.find(tier.root) == [f"{tier.root}/{RUN_MARKER}"]  # only the job's claim on the prefix


def test_bad_configuration_fails_fast_with_a_clear_error(tmp_path, s3_server, s3_bucket):
    with pytest.raises(ValueError, match="5 MiB"):
        ObjectStoreTier(f"s3://{s3_bucket}/x", s3_server.options(), part_size=1 << 20)
    with pytest.raises(FileNotFoundError):  # no such bucket: refused at construction, not at the first upload
        manager(tmp_path, s3_tier(s3_server, "no-such-bucket"))
    with pytest.raises(ValueError, match="nothing durable"):
        CheckpointManager(None)


def freeze_mid_upload(server, tier: ObjectStoreTier, timeout: float = 30) -> None:
    """Freeze the server once a multipart upload under ``tier`` has begun (parts in flight)."""
    deadline = time.monotonic() + timeout
    while not unfinished_uploads(tier):
        assert time.monotonic() < deadline, "no upload started"
        time.sleep(0.01)
    server.freeze()


def test_upload_that_cannot_finish_is_aborted(tmp_path, s3_server, s3_bucket):
    """The store goes away mid-upload for longer than the retry deadline: the write fails, its
    multipart upload is aborted once the store answers again, nothing is committed, wait()
    reports it, and the local copy and the manager carry on."""
    tier = s3_tier(s3_server, s3_bucket, timeout=1, request_timeout_s=2,
                   retry=RetryPolicy(deadline_s=3, base_s=0.1, cap_s=0.5))
    watch = s3_tier(s3_server, s3_bucket)
    with manager(tmp_path, tier) as mgr:
        try:
            h = mgr.save(1, make_state(1, mib=40))
            freeze_mid_upload(s3_server, watch)
            h.wait("disk", timeout=30)  # training goes on
            thaw = threading.Timer(5, s3_server.thaw)  # back while the abort is still being retried
            thaw.start()
            with pytest.raises(BackgroundError, match="step 1"):
                h.wait("object", timeout=60)
            thaw.join()
        finally:
            s3_server.thaw()
        assert mgr.disk.list()[-1].id.step == 1  # the local copy is intact
        with pytest.raises(BackgroundError):  # reported at the next save, once
            mgr.save(2, make_state(2))
        mgr.save(2, make_state(2)).wait()
    assert [i.id.step for i in watch.list()] == [2] and unfinished_uploads(watch) == []


def test_an_upload_started_twice_leaves_no_stray(tmp_path, s3_server, s3_bucket):
    """The store begins a multipart upload but its reply is lost (it answered too late), so the
    start is retried: the upload completes, and the one begun by the lost start is aborted, not
    left for the next start-up's sweep."""
    tier = s3_tier(s3_server, s3_bucket)
    call, lost = tier._uploader._call, []

    def reply_lost_once(method: str, **kwargs):
        answer = call(method, **kwargs)  # the store acts on it ...
        if method == "create_multipart_upload" and not lost:
            lost.append(answer["UploadId"])
            raise TimeoutError(f"{method}: no answer")  # ... but the answer never arrives
        return answer

    tier._uploader._call = reply_lost_once
    with manager(tmp_path, tier) as mgr:
        mgr.save(1, make_state(1, mib=12)).wait()  # 12 MiB > part size: multipart
    assert lost and [i.id.step for i in tier.list()] == [1]
    assert unfinished_uploads(tier) == []


def test_outage_mid_upload_training_goes_on_and_the_upload_is_retried(tmp_path, s3_server, s3_bucket, caplog):
    """SIGSTOP the server while parts are in flight: save() keeps returning and the disk tier keeps
    up; after SIGCONT the upload is retried and completes. A watcher listing the store all the
    while never sees a checkpoint listed as complete that does not fully verify."""
    caplog.set_level(logging.WARNING, logger="ckpt.tiers.retry")
    tier = s3_tier(s3_server, s3_bucket, timeout=1, request_timeout_s=3)
    watch = s3_tier(s3_server, s3_bucket)
    seen, torn, stop = set(), [], threading.Event()

    def watcher() -> None:
        while not stop.is_set():
            for info in watch.list():
                if info.complete and info.id.step not in seen:
                    try:
                        verify_one(watch, info.id)
                        seen.add(info.id.step)
                    except CheckpointError as e:
                        torn.append(e)
            time.sleep(0.05)

    states = {s: make_state(s, mib=40 if s == 1 else 1) for s in (1, 2, 3, 4)}
    with manager(tmp_path, tier) as mgr:
        first = mgr.save(1, states[1])
        freeze_mid_upload(s3_server, watch)
        try:
            first.wait("disk", timeout=30)
            later = [mgr.save(s, states[s]) for s in (2, 3)]  # training goes on during the outage
            for h in later:
                h.wait("disk", timeout=30)
            assert not first.done  # still waiting for the store
            time.sleep(4)  # long enough for requests to time out and be retried
        finally:
            s3_server.thaw()
        thread = threading.Thread(target=watcher, daemon=True)
        thread.start()
        first.wait("object", timeout=120)
        mgr.save(4, states[4]).wait(timeout=60)
        stop.set()
        thread.join()
    assert any("retrying" in r.getMessage() for r in caplog.records)
    assert not torn and seen
    assert verify_all(watch) == [1, 4]  # 2 and 3 stayed local: the upload of 1 was still pending
    assert unfinished_uploads(watch) == []
    with manager(tmp_path / "node2", s3_tier(s3_server, s3_bucket)) as mgr:
        got = blank_like(states[1])
        assert mgr.restore(got, step=1) == 1
        assert_same(got, states[1])


def test_cli_on_s3_urls_with_endpoint_and_credentials_from_the_aws_environment(tmp_path, s3_server, s3_bucket):
    url = f"s3://{s3_bucket}/run-42"
    st = make_state(7)
    with manager(tmp_path, s3_tier(s3_server, s3_bucket)) as mgr:
        mgr.save(6, make_state(6)).wait()
        mgr.save(7, st).wait()
    env = {**os.environ, "AWS_ENDPOINT_URL_S3": s3_server.endpoint, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1", "PYTHONPATH": os.getcwd()}

    def ckpt(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ckpt.cli", *args], env=env, capture_output=True, text=True,
                              timeout=120)

    ls = ckpt("ls", url, "--json")
    assert ls.returncode == 0, ls.stderr
    assert [(r["step"], r["tiers"]) for r in json.loads(ls.stdout)] == [(6, ["object"]), (7, ["object"])]
    gc = ckpt("gc", url, "--keep", "1", "--json")
    assert gc.returncode == 0, gc.stderr
    assert json.loads(gc.stdout)["checkpoints_deleted"] == [6]
    assert [i.id.step for i in s3_tier(s3_server, s3_bucket).list()] == [7]
    out = ckpt("restore", url, "--to", str(tmp_path / "restored"), "--json")
    assert out.returncode == 0, out.stderr
    with CheckpointManager(tmp_path / "restored", memory_dir=str(tmp_path / "shm2")) as mgr:
        got = blank_like(st)
        assert mgr.restore(got) == 7
        assert_same(got, st)


def test_two_ranks_upload_their_shards_and_a_fresh_node_restores_from_the_store(tmp_path):
    from tests.integration_helpers import torchrun

    log = torchrun(Path(__file__).with_name("objstore_dist_child.py"), str(tmp_path), str(tmp_path / "shm"))
    assert log.count("objstore dist ok") == 2, log[-3000:]
    (tier,) = tiers_for(f"file://{tmp_path}/store")
    assert [i.id.step for i in tier.list()] == [2, 3]
    assert all(len(tier.read_manifest(i.id).shards) == 2 for i in tier.list())


def test_another_run_on_the_same_prefix_is_refused_before_it_sweeps_anything(tmp_path, s3_server, s3_bucket):
    """A second job on r1's prefix would abort r1's uploads in its start-up sweep and
    prune r1's checkpoints; it refuses first, and r1 finds everything as it left it."""
    st = make_state(1)
    with CheckpointManager(tmp_path / "r1", object_store=s3_tier(s3_server, s3_bucket), run="r1",
                           memory_dir=str(tmp_path / "shm1")) as r1:
        r1.save(1, st).wait()
        tier = s3_tier(s3_server, s3_bucket)
        bucket, key, _ = tier.fs.split_path(f"{tier.root}/step-000000000002.g0/rank-00000.bin")
        pending = tier.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)  # r1's upload in flight
        with pytest.raises(CheckpointError, match="belongs to run 'r1'"):
            CheckpointManager(tmp_path / "r2", object_store=s3_tier(s3_server, s3_bucket), run="r2",
                              memory_dir=str(tmp_path / "shm2"), keep_last=1)
        assert [u["UploadId"] for u in unfinished_uploads(tier)] == [pending["UploadId"]]
        tier.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=pending["UploadId"])
    assert verify_all(s3_tier(s3_server, s3_bucket)) == [1]


def test_the_newest_step_reaches_the_store_when_saves_outpace_uploads(tmp_path, s3_server, s3_bucket):
    """save(10), save(20) while 10 uploads, wait(), close(): 20 used to stay local, and a
    fresh node restored 10. Now the step skipped for a pending upload goes up at close."""
    states = {s: make_state(s, mib=32) for s in (10, 20)}
    with manager(tmp_path, s3_tier(s3_server, s3_bucket)) as mgr:
        for step, st in states.items():
            mgr.save(step, st)
        mgr.wait()
    assert [i.id.step for i in s3_tier(s3_server, s3_bucket).list()] == [10, 20]
    with manager(tmp_path, s3_tier(s3_server, s3_bucket), disk="fresh-node") as mgr:
        got = blank_like(states[20])
        assert mgr.restore(got) == 20
        assert_same(got, states[20])


def test_close_uploads_the_newest_step_even_between_periodic_uploads(tmp_path, s3_server, s3_bucket):
    """object_interval_s spaces routine uploads during training; at close the newest step
    goes up whatever the interval, the ones in between stay local."""
    with manager(tmp_path, s3_tier(s3_server, s3_bucket), object_interval_s=3600) as mgr:
        first = mgr.save(10, make_state(10))
        first.wait("object")
        for step in (20, 30):
            handle = mgr.save(step, make_state(step))
            handle.wait()
            assert "object" not in handle.durable_s
        assert [i.id.step for i in s3_tier(s3_server, s3_bucket).list()] == [10]
    assert [i.id.step for i in s3_tier(s3_server, s3_bucket).list()] == [10, 30]

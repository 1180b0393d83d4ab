"""Sender + spool against a real HTTP receiver: nothing lost while the spool has room."""
import os
import time

import pyarrow.compute as pc
import pytest

from agents.fleetsim import FleetConfig
from agents.sampler import Sampler
from agents.sender import Sender
from agents.sources.sim import SimSource
from agents.spool import Spool
from agents.stats import AgentStats
from telemetry import schema as S
from tests.agents_fixtures import TOKEN
from tests.procs import wait_for


def make_rows(n, t0=1_700_000_000_000, node="n0"):
    return [{"timestamp": t0 + i * 1000, "node": node, "gpu": i % 8, "uuid": f"GPU-{i % 8}", S.GPU_TEMP: 50.0 + i % 7,
             S.SBE: float(i), S.NVLINK_CRC: None} for i in range(n)]


def sender_for(rx, tmp_path, stats=None, token=TOKEN, max_spool=64 << 20, **kw):
    kw.setdefault("batch_s", 0.05)
    return Sender(rx.url, token, Spool(str(tmp_path / "spool"), max_spool), stats or AgentStats(),
                  backoff_s=(0.02, 0.2), timeout_s=2.0, **kw)


def test_outage_loses_nothing_and_resends_in_order(receiver, tmp_path):
    stats, seen = AgentStats(), []
    cfg = FleetConfig(nodes=1, node_names=("nodeA",), interval_s=0.05, time_scale=200, seed=5, days=None)
    sender = sender_for(receiver, tmp_path, stats, batch_s=0.1)
    sampler = Sampler(SimSource(cfg), [sender.put, lambda s, x: seen.extend(s)], 0.05, stats)
    sampler.start()
    try:
        assert wait_for(lambda: receiver.count() > 40, 30.0), "timed out"
        receiver.stop()
        assert wait_for(lambda: len(sender.spool) >= 5, 30.0), "timed out"  # batches pile up on disk meanwhile
        assert stats.snapshot()["send_errors"] > 0
        receiver.start()
        assert wait_for(lambda: receiver.count() > len(seen) // 2 + 40, 30.0), "timed out"
    finally:
        sampler.stop()
        sender.close(drain_s=10)
    got = receiver.rows()
    assert got.num_rows == len(seen) == stats.snapshot()["samples_sent"] > 100
    assert len(sender.spool) == 0 and sender.spool.bytes == 0
    ts = got.column("timestamp").cast("int64").to_numpy()
    assert (ts[1:] >= ts[:-1]).all(), "batches re-sent out of order"
    assert set(zip(ts.tolist(), got.column("gpu").to_pylist())) == {(r["timestamp"], r["gpu"]) for r in seen}
    assert got.schema.field(S.GPU_TEMP).type == S.TELEMETRY_SCHEMA.field(S.GPU_TEMP).type


def test_malformed_batch_is_set_aside_and_does_not_block(receiver, tmp_path):
    stats = AgentStats()
    sender = sender_for(receiver, tmp_path, stats)
    receiver.forced.append(400)
    sender.put(make_rows(8), [])
    assert wait_for(lambda: stats.snapshot()["samples_rejected"] == 8, 30.0), "timed out"
    sender.put(make_rows(16, t0=1_800_000_000_000),
               [{"timestamp": 1_800_000_000_000, "node": "n0", "gpu": 3, "xid": 79}])
    sender.close()
    assert receiver.count() == 16 and receiver.count("/v1/xid") == 1
    assert receiver.rows("/v1/xid").column("xid").to_pylist() == [79]
    assert len(os.listdir(tmp_path / "spool" / "rejected")) == 1


def test_too_large_batches_are_split(tmp_path):
    from tests.agents_fixtures import Receiver

    rx = Receiver(max_bytes=6000)  # a 600-row batch is ~30 kB of Arrow: split until it fits
    try:
        stats = AgentStats()
        sender = sender_for(rx, tmp_path, stats)
        sender.put(make_rows(600), [])
        sender.close()
        assert rx.count() == 600 and stats.snapshot()["samples_sent"] == 600
        assert rx.statuses[413] >= 3 and len(rx.tables["/v1/telemetry"]) >= 4
        ts = rx.rows().column("timestamp").cast("int64").to_numpy()
        assert (ts[1:] > ts[:-1]).all(), "split halves re-sent out of order"
    finally:
        rx.stop()


def test_full_spool_drops_the_oldest_and_counts_them(receiver, tmp_path):
    receiver.stop()
    stats = AgentStats()
    sender = sender_for(receiver, tmp_path, stats, max_spool=6000)
    for i in range(30):
        sender.put(make_rows(40, t0=1_700_000_000_000 + i * 100_000), [])
        time.sleep(0.01)
    sender.close(drain_s=0)
    snap = stats.snapshot()
    assert snap["samples_dropped"] > 0 and sender.spool.bytes <= 6000 + 3000
    # the survivors are the newest, and a new agent on the same spool sends them
    receiver.start()
    sender = sender_for(receiver, tmp_path, stats, max_spool=6000)
    sender.close(drain_s=10)
    got = receiver.count()
    assert got + snap["samples_dropped"] == 30 * 40
    last = receiver.rows().column("timestamp")
    assert pc.max(last).cast("int64").as_py() == 1_700_000_000_000 + 29 * 100_000 + 39_000


def test_refused_token_retries_without_losing(receiver, tmp_path):
    stats = AgentStats()
    sender = sender_for(receiver, tmp_path, stats, token="wrong")
    sender.put(make_rows(8), [])
    assert wait_for(lambda: stats.snapshot()["send_errors"] >= 2, 30.0), "timed out"
    sender.close(drain_s=0)
    assert receiver.statuses[401] >= 2 and receiver.count() == 0
    assert len(Spool(str(tmp_path / "spool"))) == 1  # still there for when the token is fixed


@pytest.mark.parametrize("bad", ["ftp://x", "localhost:8080"])
def test_bad_predictor_url_is_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="http"):
        Sender(bad, TOKEN, Spool(str(tmp_path)), AgentStats())


def test_a_row_the_wire_schema_cannot_hold_is_dropped_alone_and_counted(receiver, tmp_path, caplog):
    """Issue 32.4: one gpu=40000 row (int16 on the wire) dropped every buffered batch, counted as 0."""
    stats = AgentStats()
    sender = sender_for(receiver, tmp_path, stats, batch_s=30)
    rows = make_rows(16)
    rows[5]["gpu"] = 40000
    rows[9]["node"] = None
    sender.put(rows, [{"timestamp": 1_800_000_000_000, "node": "n0", "gpu": 3, "xid": 79},
                      {"timestamp": 1_800_000_000_000, "node": "n0", "gpu": 70000, "xid": 79}])
    sender.close()
    snap = stats.snapshot()
    assert receiver.count() == 14 and snap["samples_sent"] == 14 and snap["samples_dropped"] == 2
    assert receiver.count("/v1/xid") == 1 and snap["xid_events_dropped"] == 1
    assert any("gpu" in r.getMessage() and "dropped" in r.getMessage() for r in caplog.records)

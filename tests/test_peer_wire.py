"""The peer connection's bulk transfers on real sockets: whole pieces in blocking calls
bounded in the kernel by the transfer's deadline, and periodic replication on threads
that yield the CPU to training (a higher nice value) while urgent work keeps its own."""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from ckpt.peers import wire
from ckpt.peers.priority import at_low_priority, replication_nice


def test_bytes_arrive_whole_and_in_order() -> None:
    data = memoryview(os.urandom(3 * wire.PIECE + 12345))
    out = memoryview(bytearray(len(data)))
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(5)  # a Python timeout, as the peer connections have
        t = threading.Thread(target=wire.send_paced, args=(a, data),
                             kwargs={"bytes_per_s": None, "deadline": time.monotonic() + 30})
        t.start()
        wire.recv_into(b, out, deadline=time.monotonic() + 30)
        t.join()
        assert a.gettimeout() == 5  # left as it was
    assert out == data


def test_a_peer_that_stops_reading_is_abandoned_at_the_deadline() -> None:
    a, b = socket.socketpair()  # b never reads: a's buffers fill, then the send blocks
    with a, b:
        t0 = time.monotonic()
        with pytest.raises(wire.PeerError, match="timeout"):
            wire.send_paced(a, memoryview(bytes(64 << 20)), bytes_per_s=None, deadline=t0 + 1)
        assert time.monotonic() - t0 < 30  # bounded (without its deadline it would block for ever)


def test_a_peer_that_stops_sending_is_abandoned_at_the_deadline() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"x" * 1000)  # a little, then nothing
        t0 = time.monotonic()
        with pytest.raises(wire.PeerError, match="timeout"):
            wire.recv_into(b, memoryview(bytearray(1 << 20)), deadline=t0 + 1)
        assert time.monotonic() - t0 < 30  # bounded (without its deadline it would block for ever)


def test_periodic_replication_runs_niced_and_the_caller_keeps_its_priority() -> None:
    def mine() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = mine()
    assert at_low_priority(mine, 10, "t") == max(before, 10)
    assert at_low_priority(mine, 0, "t") == before  # 0: on the caller's thread, unchanged
    assert mine() == before
    with pytest.raises(ValueError, match="boom"):  # an error comes back to the caller
        at_low_priority(lambda: int("boom"), 10, "t")


def test_the_nice_value_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPT_GUARD_PEER_NICE", raising=False)
    assert replication_nice() == 10
    monkeypatch.setenv("CKPT_GUARD_PEER_NICE", "0")
    assert replication_nice() == 0
    monkeypatch.setenv("CKPT_GUARD_PEER_NICE", "99")
    assert replication_nice() == 19

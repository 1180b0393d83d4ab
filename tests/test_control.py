"""``Control.many`` on a real TCPStore (``ckpt/control.py``): once every key is there it costs one
``check`` and one ``multi_get`` however many keys (the launchers read every member's step and
every node's beat that way, issue 52), each value's MAC checked here; missing keys read as
None, a forged value is ignored (the newest good one kept) and counted once."""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from ckpt.control import Control

KEY, OTHER = b"k" * 32, b"o" * 32


class Counted:
    """A store client that counts its round trips by kind."""

    def __init__(self, store: dist.Store) -> None:
        self._s, self.calls = store, {}

    def __getattr__(self, name: str):
        def call(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return getattr(self._s, name)(*args)
        return call


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    yield Counted(dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=60)))
    del server


def test_many_reads_every_key_in_two_round_trips(store) -> None:
    writer = Control(store, KEY, 0)
    keys = [f"step/{w}" for w in range(200)]
    for w, k in enumerate(keys):
        writer.put(k, str(w))
    reader = Control(store, KEY, 0)
    store.calls.clear()
    assert reader.many(keys) == [str(w).encode() for w in range(200)]
    assert store.calls == {"check": 1, "multi_get": 1}
    assert [s.payload for s in reader.many_signed(keys[:3])] == [b"0", b"1", b"2"]


def test_missing_keys_read_as_none_and_cost_a_check_each_until_seen(store) -> None:
    writer, reader = Control(store, KEY, 0), Control(store, KEY, 0)
    keys = [f"step/{w}" for w in range(10)]
    for k in keys[:6]:
        writer.put(k, "1")
    assert reader.many(keys) == [b"1"] * 6 + [None] * 4
    store.calls.clear()
    assert reader.many(keys) == [b"1"] * 6 + [None] * 4
    assert store.calls == {"check": 1 + 1 + 4, "multi_get": 1}  # all, the six seen together, each unseen
    assert reader.many([]) == []


def test_a_forged_value_is_ignored_the_good_one_kept_and_counted_once(store) -> None:
    writer, reader = Control(store, KEY, 0), Control(store, KEY, 0)
    writer.put("beat/1", "good")
    assert reader.many(["beat/1"]) == [b"good"]
    Control(store, OTHER, 0).put("beat/1", "forged")
    assert reader.many(["beat/1"]) == [b"good"] and reader.many(["beat/1"]) == [b"good"]
    assert reader.rejected == 1

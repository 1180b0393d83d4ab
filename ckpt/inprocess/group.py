"""Leaving a broken process group without waiting on it, and joining the next round's.

``destroy_process_group`` shuts every gloo group down, which joins its worker threads: with
a peer that is stopped rather than dead, that can block for the whole collective timeout.
So a survivor forgets the broken groups at once (torch's registry is cleared, the objects
are kept) and a daemon thread shuts them down; once it has, nothing of them is left
(``leaked()`` counts what is still held, for the no-accumulation check).
"""
from __future__ import annotations

import logging
import threading
from datetime import timedelta

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

log = logging.getLogger(__name__)

_held: list[object] = []  # broken groups whose shutdown has not returned yet
_held_lock = threading.Lock()


def join(store: "dist.Store", round_id: int, rank: int, world_size: int, timeout_s: float) -> None:
    """The default (gloo) group of membership round ``round_id``, on keys of its own."""
    prefix = dist.PrefixStore(f"ckpt-guard/inprocess/pg/{round_id}", store)
    dist.init_process_group("gloo", store=prefix, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def leave() -> None:
    """Forget every process group now; shut them down in the background."""
    if not dist.is_initialized():
        return
    world = c10d._world
    groups = list(world.pg_names)
    world.pg_map.clear()
    world.pg_names.clear()
    world.pg_group_ranks.clear()
    world.pg_backend_config.clear()
    world.pg_to_tag.clear()
    world.tags_to_pg.clear()
    world.pg_coalesce_state.clear()
    world.group_count = 0
    c10d._update_default_pg(None)
    c10d._unregister_all_process_groups()
    with _held_lock:
        _held.extend(groups)
    threading.Thread(target=_shut_down, args=(groups,), name="ckpt-inprocess-reap", daemon=True).start()


def _shut_down(groups: list) -> None:
    for pg in groups:
        try:
            pg.shutdown()
        except Exception as e:  # a broken group may refuse: it is released all the same
            log.debug("shutting down a broken group: %s", e)
        with _held_lock:
            _held.remove(pg)


def leaked() -> int:
    """Broken groups still held (a shutdown blocked on a stopped peer)."""
    with _held_lock:
        return len(_held)

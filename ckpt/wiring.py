"""How a ``CheckpointManager``'s save side is built from its arguments: the peer replicas
and the save path (drains, pacing, replica digests, quarantine strikes, the canary). Kept
apart from ``manager.py`` so the manager reads as what it does, not how its parts are made;
the parts' state stays on the manager, which holds what this returns."""
from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Iterable

from .peers.placement import node_name
from .peers.priority import at_low_priority, replication_nice
from .recovery.quarantine import record_path, strike
from .save.canary import Canary
from .save.canary import record_path as canary_path
from .save.drain import Pace
from .save.save_path import SavePath

if TYPE_CHECKING:
    from .manager import CheckpointManager
    from .peers.peering import Peering


def wire_saves(mgr: "CheckpointManager", *, memory_dir: str, node: str | None, peers: int,
               peer_bytes_per_s: float | None, peer_timeout_s: float, peer_avoid_at_risk: bool,
               overlap_verify: bool, drain_interval_s: float,
               rank_local: Iterable[str], compare: bool) -> "tuple[Peering | None, SavePath]":
    """The peer replicas (None without ``peers`` or alone) and the save path over ``mgr``'s
    tiers, committer, metrics and coordinator, which must exist already."""
    peering = None
    if peers and mgr.world_size > 1:
        from .peers.peering import Peering

        peering = Peering(mgr.coord, peers=peers, node=node, owner_root=mgr._owner_root, run=mgr.run,
                          memory_dir=memory_dir, bytes_per_s=peer_bytes_per_s, timeout_s=peer_timeout_s,
                          registry=mgr.metrics.registry if mgr.metrics is not None else None,
                          object_store=mgr.object.location if mgr.object is not None else None,
                          avoid_at_risk=peer_avoid_at_risk)
    records = mgr._owner_root if mgr.disk else mgr._ns  # where the quarantine and canary records live
    saves = SavePath(rank=mgr.rank, world_size=mgr.world_size, memory=mgr.memory, disk=mgr.disk,
                     offload=mgr._offload, committer=mgr.committer, peering=peering, metrics=mgr.metrics,
                     threads=mgr.threads, chunk_bytes=mgr.chunk_bytes, replicated=mgr.replicated,
                     overlap=mgr.overlap, verify=overlap_verify, pace=Pace(drain_interval_s),
                     yielding=partial(at_low_priority, nice=replication_nice(), name="ckpt-drain-low"),
                     rank_local=tuple(rank_local), compare=compare, node=node_name(node),
                     strike=partial(strike, record_path(records, mgr.run), node_name(node)),
                     canary=Canary(mgr.rank, mgr.world_size, canary_path(records, mgr.run), mgr.coord.any))
    return peering, saves

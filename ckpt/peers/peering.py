"""One rank's part in peer replication, as the manager sees it: start-up (node
identity, placement, secret, this rank's server), a replica after each drain (an
urgent one first: evacuation), placement away from nodes at risk, the extra restore
sources, and the log of the window a restored shard is unprotected.

Shared memory per node: (2 + 3 x peers) x the node's shards: two slots per own
shard, three replica slots per shard it holds for others (``replicas.py``).
"""
from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from .. import secret
from ..coordination import Coordinator
from ..errors import CheckpointError
from ..format.manifest import ShardManifest, ShardRef
from ..restore.fresh_start import JobListing
from ..restore.plan import RestorePlan
from ..save.drain import SaveHandle
from ..tiers.base import CheckpointId, TierReader
from ..tiers.memory import MemoryTier, namespace_dir
from ..tiers.memory.namespace import slot_file_bytes
from ..tiers.memory.reader import SlotReader, slot_epoch
from ..tiers.memory.slots import ShmSlot
from ..tiers.peer import NodeMemoryTier, PeerTier, replica_namespace
from . import wire
from .placement import node_name, ring_targets
from .priority import replication_nice
from .remote import Held, RemoteTier
from .replicas import ReplicaSlots
from .replicator import ReplicaJob, Replicator
from .server import PeerServer

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)


class Peering:
    """Collective at construction (every rank, same point): ranks gather (node, server
    address) and agree on the replicas' key (``_peer_key``)."""

    def __init__(self, coord: Coordinator, *, peers: int, node: str | None, owner_root: str, run: str,
                 memory_dir: str, bytes_per_s: float | None = None, timeout_s: float = 300.0,
                 registry: "CollectorRegistry | None" = None, object_store: str | None = None,
                 avoid_at_risk: bool = False) -> None:
        self.rank, self.node, self.timeout_s = coord.rank, node_name(node), timeout_s
        self.peers, self.avoid_at_risk = peers, avoid_at_risk
        self._avoided: frozenset[str] = frozenset()
        ns = replica_namespace(owner_root, run, memory_dir)
        self.held = PeerTier(ns)
        self.node_memory = NodeMemoryTier(namespace_dir(owner_root, run, memory_dir))  # every rank's own slots
        # the job's object store too: there every rank's shard of a step is durable, so gc may drop its replicas
        self.replicas = ReplicaSlots(ns, {"root": owner_root, "run": run, "object": object_store})
        nice = replication_nice()
        self.server = PeerServer(self.replicas, [self.held, self.node_memory], host=_bind_host(), timeout_s=timeout_s,
                                 nice=nice)
        try:
            self._secret, everyone = _peer_key(coord, self.node, self.server.addr)
        except CheckpointError:
            self.server.close()
            self.replicas.close()
            raise
        self.nodes, self.addrs = [e[0] for e in everyone], [e[1] for e in everyone]
        self.server.start(self._secret)
        self.holders = ring_targets(self.nodes, self.rank, peers)
        self.held_for = [r for r in range(len(self.nodes)) if self.rank in ring_targets(self.nodes, r, peers)]
        self.replica_ns = ns
        if not self.holders:
            log.warning("peers=%d but every rank is on node %s: no peer replicas (set CKPT_GUARD_NODE or node=)",
                        peers, self.node)
        else:
            log.info("rank %d (node %s) replicates to %s", self.rank, self.node,
                     ", ".join(f"rank {r} (node {self.nodes[r]})" for r in self.holders))
        self.replicator = Replicator([self.addrs[r] for r in self.holders], self._secret, bytes_per_s=bytes_per_s,
                                     timeout_s=timeout_s, count=_counter(registry, self.rank), nice=nice,
                                     node=self.node)
        if registry is not None:
            _shm_gauge(registry, self.rank, ns)
        self._remote: RemoteTier | None = None
        self._unprotected: tuple[int, float] | None = None  # (restored step, since) until a replica is sealed

    @property
    def ring(self) -> list[str]:
        """The job's distinct nodes, in placement order (the same on every rank)."""
        return list(dict.fromkeys(self.nodes))

    def avoid(self, at_risk: set[str]) -> None:
        """Place the next replicas away from the nodes the predictor reports at risk (every
        rank is told the same set, agreed at a step boundary)."""
        at_risk = frozenset(at_risk)
        if at_risk == self._avoided:
            return
        self._avoided = at_risk
        self.holders = ring_targets(self.nodes, self.rank, self.peers, at_risk)
        self.replicator.holders = [self.addrs[r] for r in self.holders]
        log.info("rank %d replicates to %s%s", self.rank, ", ".join(f"rank {r} (node {self.nodes[r]})"
                                                                    for r in self.holders),
                 f" (avoiding at-risk node(s) {', '.join(sorted(at_risk))})" if at_risk else "")

    # -- saving ---------------------------------------------------------------------

    def replicate(self, slot: ShmSlot, sealed: ShardManifest, handle: SaveHandle, *, urgent: bool = False) -> None:
        """After the drain re-sealed ``slot`` with checksums: send it in the background
        (``urgent``: ahead of anything else, see ``Replicator``). ``handle`` learns when
        every holder sealed it (``durable_s["peer"]``)."""
        if not self.holders:
            handle.give_up("peer")
            return
        epoch = slot_epoch(slot.meta_path)  # the drain holds the slot: nothing unseals it meanwhile

        def done(ok: bool) -> None:
            if not ok:
                handle.give_up("peer")
                return
            handle.mark("peer")
            if self._unprotected is not None:
                step, since = self._unprotected
                log.info("rank %d has a peer replica again (step %d): unprotected for %.2f s since restoring "
                         "step %d", self.rank, handle.step, time.monotonic() - since, step)
                self._unprotected = None

        self.replicator.submit(ReplicaJob(handle.step, lambda: SlotReader(slot.meta_path, slot.data_path, sealed,
                                                                          slot.buffer, epoch=epoch), done,
                                          urgent=urgent))

    # -- restoring ------------------------------------------------------------------

    def restore_tiers(self, coord: Coordinator, tiers: Sequence[TierReader]) -> list[TierReader]:
        """``tiers`` plus what this node holds in memory beyond this rank's own slots (the
        replicas, and every rank's own snapshots, which a rank renumbered by torchrun left
        under its old number) and what other ranks hold so (fetched, before the object
        store). Collective: ranks gather their inventories."""
        mine = set()
        for tier in (self.held, self.node_memory):
            for info in tier.list():
                try:
                    manifest = tier.read_manifest(info.id)
                except (OSError, ValueError):
                    continue
                mine |= {(info.id.generation, info.id.step, manifest.world_size, ref.rank, ref.manifest_crc32c,
                          ref.data_bytes) for ref in manifest.shards}
        offers: dict[CheckpointId, dict[int, list[Held]]] = {}
        for holder, inventory in enumerate(coord.gather(sorted(mine))):
            if holder == self.rank:
                continue
            for gen, step, world, rank, crc, nbytes in inventory:
                offers.setdefault(CheckpointId(gen, step), {}).setdefault(rank, []).append(
                    Held(holder, self.addrs[holder], world, ShardRef(rank, crc, nbytes)))
        # Ranks of one node all list its replicas and slots: spread the fetches over them.
        held = {i: {rank: found[rank % len(found)] for rank, found in by_rank.items()} for i, by_rank in offers.items()}
        self._remote = RemoteTier(held, self._secret, timeout_s=self.timeout_s)
        fast = [t for t in tiers if isinstance(t, MemoryTier)]
        slow = [t for t in tiers if not isinstance(t, MemoryTier) and t.name == "object"]
        rest = [t for t in tiers if t not in fast and t not in slow]
        others_here = NodeMemoryTier(self.node_memory.ns, besides=self.rank)  # this rank's slots are in ``fast``
        return [*fast, others_here, self.held, *rest, self._remote, *slow]

    def restored(self, plan: RestorePlan) -> bool:
        """Whether this rank's own shard came from another node (a peer's replica, the object
        store): then it has a single copy, logged as unprotected until re-replicated."""
        fetched = [(held, seconds) for ckpt_id, held, seconds in (self._remote.fetched if self._remote else [])
                   if ckpt_id == plan.ckpt_id and held.ref.rank == self.rank]
        self._remote = None
        own = next((s for s in plan.shards if s.rank == self.rank), None)
        if own is None or own.sources[0].name not in (RemoteTier.name, "object"):
            return False
        for held, seconds in fetched:
            log.warning("rank %d restored its shard of step %d from rank %d's replica (node %s) in %.2f s; "
                        "unprotected (one copy, on node %s) until re-replicated", self.rank, plan.ckpt_id.step,
                        held.holder, self.nodes[held.holder], seconds, self.nodes[held.holder])
        if not fetched:
            log.warning("rank %d restored its shard of step %d from the object store; no copy in any node's memory "
                        "until re-replicated", self.rank, plan.ckpt_id.step)
        self._unprotected = (plan.ckpt_id.step, time.monotonic())
        return True

    def nothing_readable(self, listing: JobListing) -> None:
        """Restore found no step every rank can read. If the job has checkpoints, raise,
        naming the shards no rank holds anywhere, rather than let training start over and
        drop what the other ranks still hold (``listing``: every rank's, gathered once)."""
        held = listing.held()
        if not held:
            return
        newest = max(held)
        missing = sorted(set(range(listing.world_size)) - held[newest])
        lost = (f"no copy of the shard(s) of rank(s) {', '.join(map(str, missing))} is left in any node's memory, "
                "peer replicas or disk, or in the object store" if missing else
                "every shard has a copy, but some only where the rank that needs it cannot read it (another node's "
                "disk: ranks read only their own node's disk, other nodes' memory and the object store)")
        raise CheckpointError(
            f"no checkpoint that every rank can read, yet step {newest.step} (generation {newest.generation}) "
            f"exists: {lost}. Refusing to start over; bring back a copy (or clear the checkpoints to start from "
            "scratch)")

    def send_last(self) -> None:
        """Send the last pending replica (bounded by the timeout) and stop sending; this rank
        still serves the replicas other ranks send it, until ``close``."""
        self.replicator.close()

    def close(self, *, abort: bool = False) -> None:
        """Send the last pending replica (bounded by the timeout), then stop serving;
        ``abort``: cut the replicas off instead (``Replicator.abort``)."""
        try:
            (self.replicator.abort if abort else self.replicator.close)()
        finally:
            if self.server.close():  # else a connection may still touch the replica slots: leave them mapped
                self.replicas.close()


def _peer_key(coord: Coordinator, node: str, addr: str) -> tuple[bytes, list[tuple]]:
    """The replicas' key and every rank's (node, address, key fingerprint). With a job secret
    (``ckpt.secret``: always under ``python -m ckpt.inprocess.launch``) every rank derives the
    key from it and nothing secret crosses the process group; ranks that disagree (one started
    without the secret or with another job's) are refused at once rather than at the first
    replica. Without one (torchrun, no secret given) rank 0 draws a key and hands it to the others
    over the first process group: anyone who can join that group's rendezvous can learn it."""
    job = secret.load()
    key = secret.derive(job, "peer replicas") if job is not None else None
    drawn = wire.new_secret().hex() if key is None and coord.rank == 0 else None
    everyone = coord.gather((node, addr, key and secret.fingerprint(key), drawn))
    if len({e[2] for e in everyone}) > 1:
        odd = [r for r, e in enumerate(everyone) if e[2] != everyone[0][2]]
        raise CheckpointError(f"rank(s) {', '.join(map(str, odd))} hold another job secret than rank 0 (or "
                              f"none): give every rank the same {secret.SECRET_FILE_ENV} or {secret.SECRET_ENV}")
    return key or bytes.fromhex(everyone[0][3]), everyone


def _counter(registry: "CollectorRegistry | None", rank: int) -> Callable[[str], None]:
    """Replica outcomes as a Prometheus counter, when the manager exports metrics."""
    if registry is None:
        return lambda outcome: None
    from prometheus_client import Counter

    counter = Counter("ckpt_peer_replicas", "Replicas sent to peers, by outcome (sent, failed, superseded)",
                      ["rank", "outcome"], registry=registry)
    return lambda outcome: counter.labels(rank=str(rank), outcome=outcome).inc()


def _shm_gauge(registry: "CollectorRegistry", rank: int, ns: Path) -> None:
    """The replica slots' shared memory on this node, read when scraped (every rank of a
    node reports the same namespace: the node's total, not to be summed over ranks)."""
    from prometheus_client import Gauge

    Gauge("ckpt_peer_replica_shm_bytes", "Shared memory of the peer replica slots this node holds for other nodes",
          ["rank"], registry=registry).labels(rank=str(rank)).set_function(lambda: slot_file_bytes(ns))


def _bind_host() -> str:
    """The address peers reach this rank at: CKPT_GUARD_PEER_HOST, else the interface that
    routes to the rendezvous host (loopback when that is this machine)."""
    if os.environ.get("CKPT_GUARD_PEER_HOST"):
        return os.environ["CKPT_GUARD_PEER_HOST"]
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(master), 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"

"""Who holds whose replicas: node identity and the ring placement.

Node identity: ``CheckpointManager(node=...)``, else the ``CKPT_GUARD_NODE``
environment variable, else the host name. Ranks gather (rank, node) at start-up.

Placement (a ring of distinct nodes): the distinct nodes are ordered by their lowest
rank; a rank's *local index* is its position among its node's ranks (by rank). The
k-th replica (k = 1..peers) of a rank on node ``n`` goes to the rank with the same
local index on the k-th next node of the ring (wrapping to that node's ranks when
it has fewer). So every node sends to and receives from a fixed neighbour, load is
spread evenly (each rank holds ``peers`` replicas when nodes have equal rank
counts), and ranks of the same node never hold each other's replicas. ``peers`` is
capped at the number of other nodes; with a single node there are no replicas.

Avoiding nodes at risk (``CheckpointManager(peer_avoid_at_risk=True)``): while the
failure predictor reports a node at risk, the ring walk skips it, so replicas go to
the next healthy nodes instead of one that may fail first; when fewer than ``peers``
healthy nodes are left, at-risk ones fill the gap (a replica there still survives the
loss of the sender's node).

Placement only decides where replicas are *sent*. At restore, holders are found by
gathering every rank's inventory (torchrun may renumber nodes after a restart).
"""
from __future__ import annotations

import os
import socket


def node_name(node: str | None = None) -> str:
    """This process's node identity (argument, then CKPT_GUARD_NODE, then the host name)."""
    return node or os.environ.get("CKPT_GUARD_NODE") or socket.gethostname()


def ring_targets(nodes: list[str], rank: int, peers: int, avoid: frozenset[str] = frozenset()) -> list[int]:
    """The ranks that hold ``rank``'s replicas, given every rank's node (by rank), passing
    over the nodes in ``avoid`` while others are left."""
    ring: list[str] = list(dict.fromkeys(nodes))  # distinct nodes, ordered by their lowest rank
    members = {n: [r for r, m in enumerate(nodes) if m == n] for n in ring}
    mine = nodes[rank]
    local = members[mine].index(rank)
    at = ring.index(mine)
    others = [ring[(at + k) % len(ring)] for k in range(1, len(ring))]  # in ring order from this node
    chosen = ([n for n in others if n not in avoid] + [n for n in others if n in avoid])[:peers]
    chosen.sort(key=others.index)
    return [members[n][local % len(members[n])] for n in chosen]

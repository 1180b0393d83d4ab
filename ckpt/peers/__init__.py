"""Peer replicas: each rank's newest sealed snapshot also kept in the memory of ranks
on other nodes, so losing a node costs what losing a process costs.

placement.py   node identity; which ranks hold whose replicas (a ring of nodes)
wire.py        the authenticated, encrypted TCP connection between ranks
replicas.py    writing replicas into this node's replica slots (memory-tier slots)
server.py      each rank's server: takes replicas, hands them out at restore
replicator.py  the background sender (bandwidth cap, timeout, newest-only)
remote.py      replicas held by other ranks, as a restore source
peering.py     the manager's view: start-up, replicate after a drain, restore sources

The read side of the replicas this node holds is ``ckpt/tiers/peer.py``.
"""

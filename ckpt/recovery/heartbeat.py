"""Progress beats aggregated per node: the job's store sees one write per node per
interval, however many ranks the node runs, and a hang is still named by rank.

Each rank writes its own beat to a file in its node's shared-memory directory (no
store traffic). The lowest rank of the node whose file is fresh is the node's
*aggregator*: it collects the node's files into one store key, ``node/<name>``, and is
the only rank of its node that polls the job's "failed" key, which it relays to its
node through a file. A stopped aggregator's file goes stale, and the next rank of the
node takes over within ``STALE_BEATS`` intervals. So the store serves one write per
node per interval and one check per node per poll (at 1,000 nodes of 8 GPUs: 1,000
writes and, at the default poll, 4,000 checks a second, against 8,000 and 32,000 with
a key per rank); every rank's beat is read only once some rank has stalled.
"""
from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

FAILED_KEY = "failed"  # the store key that stops every rank of the job (its value: why)
DONE = "done"  # a rank's beat once it finished training (or unwinds): not hung
STALE_BEATS = 3  # a rank whose file is older than this many intervals no longer aggregates


class NodeBeats:
    """One rank's side of its node's beats; ``store`` returns the calling thread's client
    of the job's store (keys private to this incarnation); ``local_dir`` is this
    incarnation's node-local directory, the same for every rank of the node."""

    def __init__(self, store: Callable[[], object], local_dir: Path, rank: int, node: str, nodes: list[str],
                 interval_s: float) -> None:
        self._store, self.rank, self.node, self.interval_s = store, rank, node, interval_s
        self.nodes = sorted(set(nodes))
        self.dir = local_dir / _safe(node)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._file = self.dir / f"rank-{rank}"
        self._relay = self.dir / FAILED_KEY
        self.aggregating = False

    def publish(self, value: str) -> None:
        """This rank's beat (``<boundaries> <beat>``): its file; and, if this rank is its
        node's aggregator, the node's one store key."""
        _write(self._file, f"{time.time():.3f} {value}")
        local = self._local()
        fresh = [r for r, (t, v) in local.items() if v != DONE and time.time() - t < STALE_BEATS * self.interval_s]
        self.aggregating = min(fresh, default=self.rank) == self.rank
        if self.aggregating:
            self._store().set(f"node/{self.node}", json.dumps({r: v for r, (_, v) in local.items()}))

    def done(self) -> None:
        """Training is over on this rank: say so, in the node's key too (one last write:
        no aggregator may run on this node any more)."""
        _write(self._file, f"{time.time():.3f} {DONE}")
        self._store().set(f"node/{self.node}", json.dumps({r: v for r, (_, v) in self._local().items()}))

    def failed(self) -> str | None:
        """The job's "failed" value once some rank set it: the aggregator polls the store
        and relays it to the node; the other ranks read the relay."""
        if self.aggregating:
            store = self._store()
            if not store.check([FAILED_KEY]):
                return None
            value = store.get(FAILED_KEY).decode()
            _write(self._relay, value)
            return value
        try:
            return self._relay.read_text()
        except OSError:
            return None

    def fail(self, value: str) -> None:
        """Stop the whole job (any rank, any thread)."""
        self._store().set(FAILED_KEY, value)

    def read_all(self) -> dict[int, str]:
        """Every rank's last published beat, from every node's key (one round trip when all
        nodes have written; a rank missing here never reported)."""
        store = self._store()
        keys = [f"node/{n}" for n in self.nodes]
        present = keys if store.check(keys) else [k for k in keys if store.check([k])]
        beats: dict[int, str] = {}
        for value in store.multi_get(present) if present else []:
            beats.update({int(r): v for r, v in json.loads(value).items()})
        return beats

    def _local(self) -> dict[int, tuple[float, str]]:
        """This node's ranks' files: rank -> (when written, beat)."""
        out = {}
        for path in self.dir.glob("rank-*"):
            try:
                t, value = path.read_text().split(" ", 1)
                out[int(path.name[5:])] = (float(t), value)
            except (OSError, ValueError):  # being replaced right now: next interval
                continue
        return out


def _write(path: Path, text: str) -> None:
    """Replace ``path``'s content atomically: a reader sees the old or the new, never half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _safe(node: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", node) or "_"

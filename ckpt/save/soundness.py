"""Replica digests and the non-finite guard at every drained save (invariant 16).

Under data parallelism (DDP; the replica groups of HSDP) every replica applies the same
all-reduced gradient with an elementwise-deterministic optimizer step, so its parameters
and optimizer state stay bitwise equal to the other replicas'. A rank whose optimizer step
or memory went wrong is then the replica that differs. The drain thread checksums each
snapshot's slot anyway (``with_checksums``); in the same read of the bytes it checks every
floating value of the compared state for NaN/Inf, and the CRCs of the compared tensors
make the replica's *digest*: nothing more is read, and nothing runs on the trainer's thread.

Compared: the parameters of each ``DistributedDataParallel`` module in the saved state (and of
each module under a ``replicated=`` key), and the state of each optimizer over those
parameters only, except keys (or dotted path prefixes) named ``rank_local``. Not compared:
buffers (BatchNorm statistics differ between DDP broadcasts), RNG, data position, plain
values, and modules that are not DDP replicas (each rank's own model). The assumption
holds for DDP and HSDP replica groups (ranks whose compared tensors have the same layouts
are one group: a DTensor shard is compared only with the same shard on other replicas). It does not hold for ZeRO-1/2
optimizer sharding on plain tensors, local SGD/DiLoCo, stochastic rounding or mixed hardware:
mark those keys ``rank_local``.

The report travels with the commit's announcement (``commit.py``); each volume's leader
turns every rank's report into one ``verdict`` recorded in the commit (``format/health.py``).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cache, partial
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from ..format.checksum import crc32c_of
from ..format.manifest import ShardManifest, TensorEntry

# numpy's own floating dtypes (float16 has no BLAS dot: ``isfinite``, into a small bool array)
_NUMPY_FLOAT = {"float64": np.float64, "float32": np.float32, "float16": np.float16}
# bfloat16, which numpy lacks: the exponent bits, all set for Inf or NaN (float8 types are not checked)
_BF16_EXPONENT = np.uint16(0x7F80)
_NAMED_MAX = 4  # non-finite tensors named per rank in a report


@dataclass(frozen=True)
class Scope:
    """Which flattened paths of a snapshot are looked at: ``checked`` for NaN/Inf (the parameters
    of every module, every optimizer's state), ``compared`` across replicas (module docstring)."""

    checked: Callable[[str], bool]
    compared: Callable[[str], bool]


NOTHING = Scope(lambda path: False, lambda path: False)


def scope_of(state: Mapping[str, Any], rank_local: Iterable[str], replicated: Iterable[str] = (), *,
             compare: bool = True) -> Scope:
    """The ``Scope`` of ``state``; ``rank_local`` paths are in neither part; without ``compare``
    nothing is compared across replicas (only the NaN/Inf check runs). The paths are found at
    its first use, on the drain's thread: walking every module's parameters at each save took
    0.13 ms of the trainer's thread for a 4-layer MLP (``sound_bench.py --mode cost``), and a
    state's modules and optimizers keep their parameters while it trains."""
    found = cache(partial(_scope_now, dict(state), tuple(rank_local), tuple(replicated), compare))
    return Scope(lambda path: found().checked(path), lambda path: found().compared(path))


def _scope_now(state: Mapping[str, Any], rank_local: tuple[str, ...], replicated: tuple[str, ...],
               compare: bool) -> Scope:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    claimed = set(replicated)
    params: dict[str, set[str]] = {"all": set(), "replica": set()}
    replica_ids: set[int] = set()
    optimizers: dict[str, set[str]] = {"all": set(), "replica": set()}
    for key, value in state.items():
        if isinstance(value, torch.nn.Module):
            replica = isinstance(value, DistributedDataParallel) or key in claimed
            for name, p in value.named_parameters():
                params["all"].add(f"{key}.{name}")
                if replica:
                    params["replica"].add(f"{key}.{name}")
                    replica_ids.add(id(p))
    for key, value in state.items():
        if isinstance(value, torch.optim.Optimizer):
            optimizers["all"].add(f"{key}.state.")
            if all(id(p) in replica_ids for g in value.param_groups for p in g["params"]):
                optimizers["replica"].add(f"{key}.state.")
    local = tuple(rank_local)

    def within(kind: str) -> Callable[[str], bool]:
        exact, prefixes = params[kind], tuple(optimizers[kind])

        def test(path: str) -> bool:
            if any(path == p or path.startswith(p + ".") for p in local):
                return False
            return path in exact or (bool(prefixes) and path.startswith(prefixes))

        return test

    return Scope(within("all"), within("replica") if compare else NOTHING.compared)


def where(node: str) -> dict[str, str]:
    """This rank's node and GPU, as a report names them (the GPU to pull)."""
    gpu = "cpu"
    try:
        import torch

        if torch.cuda.is_initialized():
            i = torch.cuda.current_device()
            uuid = getattr(torch.cuda.get_device_properties(i), "uuid", "")
            gpu = f"cuda:{i}" + (f" (GPU-{uuid})" if uuid else "")
    except Exception:  # noqa: BLE001 - a report without the GPU's name beats none
        pass
    return {"node": node, "gpu": gpu}


class Inspection:
    """One drain's look at the compared state of a snapshot: ``visit`` goes to ``with_checksums``,
    ``report`` is read once the checksums are computed."""

    def __init__(self, manifest: ShardManifest, scope: Scope) -> None:
        self.entries = [e for e in manifest.tensors if scope.compared(e.path)]
        self._checked = {e.id for e in manifest.tensors if scope.checked(e.path)}
        self.nonfinite: list[str] = []

    def visit(self, entry: TensorEntry) -> Callable[[memoryview], None] | None:
        if entry.id not in self._checked or (entry.dtype not in _NUMPY_FLOAT and entry.dtype != "bfloat16"):
            return None
        kind = _NUMPY_FLOAT.get(entry.dtype)

        def nonfinite(piece: memoryview) -> bool:
            if kind is None:
                return bool(np.any(np.bitwise_and(np.frombuffer(piece, dtype=np.uint16), _BF16_EXPONENT)
                                   == _BF16_EXPONENT))
            values = np.frombuffer(piece, dtype=kind)
            # The sum of squares is finite exactly when every value is, unless it overflows: one
            # pass with no temporary array (BLAS), a third less CPU than ``isfinite`` on float32;
            # a non-finite sum is decided by ``isfinite`` itself, so the answer stays exact.
            if kind is not np.float16:
                with np.errstate(over="ignore", invalid="ignore"):  # an overflow is decided below
                    if np.isfinite(np.dot(values, values)):
                        return False
            return not np.isfinite(values).all()

        def check(piece: memoryview) -> None:
            if (not self.nonfinite or self.nonfinite[-1] != entry.path) and nonfinite(piece):
                self.nonfinite.append(entry.path)

        return check

    def report(self, sealed: ShardManifest, who: Mapping[str, str]) -> dict:
        """This rank's report: digest of the compared tensors' CRCs (None when it holds none),
        their layout group, the non-finite tensors found, and where it runs."""
        by_id = {e.id: e for e in sealed.tensors}
        digest, group = 0, 0
        for e in sorted(self.entries, key=lambda e: e.path):
            sums = by_id[e.id].checksums or ()
            digest = crc32c_of(struct.pack(f"<{len(sums)}I", *sums), crc32c_of(e.path.encode(), digest))
            layout = e.layout.to_json() if e.layout is not None else None
            group = crc32c_of(repr((e.path, e.dtype, e.shape, layout)).encode(), group)
        return {"digest": digest if self.entries else None, "group": group,
                "nonfinite": sorted(set(self.nonfinite))[:_NAMED_MAX], **who}


def verdict(reports: Mapping[int, dict | None]) -> dict:
    """Every rank's report (rank -> report) as one health record (``format/health.py``): NaN/Inf
    anywhere makes it ``unhealthy``; replicas of a group whose digests differ make it
    ``suspect``, naming the minority (three or more replicas) or both (two). It carries no
    canary references: each commit record adds its own ranks' (``with_canary``)."""
    return _judge({r: rep for r, rep in reports.items() if rep})


def with_canary(health: dict, reports: Mapping[int, dict | None]) -> dict:
    """``health`` with the canary's references for the save before (``canary.py``) in these
    ranks' reports, by rank, as a commit record keeps them; ``health`` itself when none has one."""
    refs = {str(r): rep["canary"] for r, rep in reports.items() if rep and isinstance(rep.get("canary"), dict)}
    return {**health, "canary": {"after": next(iter(refs.values()))["after"], "by_rank": refs}} if refs else health


def _judge(got: Mapping[int, dict]) -> dict:
    if not got:
        return {"state": "unchecked", "reason": "no rank reported a digest", "culprits": []}

    def who(r: int) -> dict:
        return {"rank": r, "node": str(got[r].get("node", "?")), "gpu": str(got[r].get("gpu", "?"))}

    bad = sorted(r for r, rep in got.items() if rep.get("nonfinite"))
    if bad:
        named = "; ".join(f"rank {r}: {', '.join(map(str, got[r]['nonfinite']))}" for r in bad)
        return {"state": "unhealthy", "reason": f"NaN/Inf in the saved state ({named})",
                "culprits": [who(r) for r in bad]}
    groups: dict[Any, dict[int, Any]] = {}
    for r, rep in got.items():
        if rep.get("digest") is not None:
            groups.setdefault(rep.get("group"), {})[r] = rep["digest"]
    culprits: list[int] = []
    compared = 0
    for members in groups.values():
        if len(members) < 2:
            continue
        compared += len(members)
        counts: dict[Any, int] = {}
        for d in members.values():
            counts[d] = counts.get(d, 0) + 1
        if len(counts) == 1:
            continue
        top = sorted(counts.values(), reverse=True)
        if len(members) >= 3 and top[0] > top[1]:  # a majority: the others are wrong
            agreed = max(counts, key=counts.get)
            culprits += [r for r, d in members.items() if d != agreed]
        else:  # two replicas, or no majority: every one of them is named
            culprits += list(members)
    if culprits:
        culprits.sort()
        return {"state": "suspect", "culprits": [who(r) for r in culprits],
                "reason": "replicas disagree: " + ", ".join(f"rank {r} (node {who(r)['node']}, {who(r)['gpu']})"
                                                            for r in culprits)}
    if not compared:
        return {"state": "ok", "reason": "finite; no replica to compare with", "culprits": []}
    return {"state": "ok", "reason": f"{compared} replicas agree; finite", "culprits": []}

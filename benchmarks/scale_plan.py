"""Planning a restore of an N-rank FSDP checkpoint, on one rank of the job that restores it.

    python benchmarks/scale_plan.py [--max-ranks 4096] [--json OUT]

The checkpoint is a 70B Llama-like model (80 layers of 9 tensors, embeddings, final norm and
output: 723 parameters, their real shapes) with AdamW's state (``exp_avg`` and ``exp_avg_sq``
laid out as their parameter, ``step`` a plain scalar): 2,892 tensors, each DTensor ``Shard(0)``
over a 1-D mesh of N ranks, as FSDP2 saves it. Its N shard manifests and its commit record
are written in a temporary directory on local disk by the format's own code
(``ShardManifest.to_bytes``, ``LocalDiskTier.commit``); the data files are sparse, since
only planning is measured. One target rank (a third of the way into the new job, holding
DTensors on a fake process group of M ranks, their local shards on the meta device) then plans
the restore through the real path: ``Inventory``, ``plans``, ``reshard.plan_load`` (the
sources, their normalisation, which saved chunks to read: everything before the first tensor
byte). Rows:

- `restore_plan_to_half`: into M = N/2 ranks (resharding: which saved shards overlap this rank's);
- `restore_plan_same`: into M = N ranks (this rank's own shard, read whole).

``manifests_read`` and ``bytes_read`` count the files the disk tier read (shard manifests, and
commit records, which list every shard); ``seconds`` is the wall time of the plan on this machine.
No store is involved (``store_ops`` 0). ``scale_bench.py --components restore_plan_to_half,restore_plan_same``
runs the same rows (a checkpoint written for each, as with ``--overlaps-only``) and prints their
fitted exponents.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the repository first
from benchmarks.harness import run_meta, write_json  # noqa: E402

COMPONENTS = ("restore_plan_to_half", "restore_plan_same")
SIZES = (64, 256, 1024, 4096, 16384)
LAYERS, HIDDEN, FFN, VOCAB, KV = 80, 8192, 28672, 128256, 1024  # Llama 3 70B: 8 KV heads of 128
CHUNK = 16 << 20


def parameters() -> dict[str, tuple[int, ...]]:
    """The model's parameters and their global shapes."""
    shapes = {"tok_embeddings.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        shapes.update({p + "attention.wq.weight": (HIDDEN, HIDDEN), p + "attention.wk.weight": (KV, HIDDEN),
                       p + "attention.wv.weight": (KV, HIDDEN), p + "attention.wo.weight": (HIDDEN, HIDDEN),
                       p + "feed_forward.w1.weight": (FFN, HIDDEN), p + "feed_forward.w2.weight": (HIDDEN, FFN),
                       p + "feed_forward.w3.weight": (FFN, HIDDEN), p + "attention_norm.weight": (HIDDEN,),
                       p + "ffn_norm.weight": (HIDDEN,)})
    shapes.update({"norm.weight": (HIDDEN,), "output.weight": (VOCAB, HIDDEN)})
    return shapes


def leaves() -> list[tuple[str, tuple[str, ...], tuple[int, ...] | None]]:
    """(path, tree keys, global shape; None: a plain scalar) of every tensor, in save order."""
    out: list[tuple[str, tuple[str, ...], tuple[int, ...] | None]] = []
    for name, shape in parameters().items():
        out.append((f"model.{name}", ("model", name), shape))
    for name, shape in parameters().items():
        out += [(f"optim.state.{name}.{k}", ("optim", "state", name, k), None if k == "step" else shape)
                for k in ("exp_avg", "exp_avg_sq", "step")]
    return out


def _tree(make) -> dict:
    """The state's nesting with ``make(id, global shape)`` at each tensor; the optimizer's
    param_groups as plain values."""
    tree: dict = {}
    for i, (_, keys, shape) in enumerate(leaves()):
        node = tree
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = make(i, shape)
    tree["optim"]["param_groups"] = [{"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                      "params": list(parameters())}]
    return tree


def write_checkpoint(root: Path, n: int, only: set[int] | None = None) -> None:
    """Rank ``r``'s shard manifest for every r < n (``only``: for those, the others listed in the
    commit with CRC 0 and no file, so that opening one fails) and the commit record, as an
    n-rank FSDP2 save writes them."""
    from ckpt.format.checksum import crc32c_of
    from ckpt.format.layout import Layout, layout_at
    from ckpt.format.manifest import (
        Manifest,
        ShardManifest,
        ShardRef,
        TensorEntry,
        shard_data_file,
        shard_manifest_file,
    )
    from ckpt.tiers.base import CheckpointId
    from ckpt.tiers.local import LocalDiskTier

    tier, cid = LocalDiskTier(root), CheckpointId(1, 0)
    d = root / cid.name
    d.mkdir(parents=True)
    tree = _tree(lambda i, shape: {"__dtensor__" if shape else "__tensor__": i})
    templates = {s: Layout(s, (n,), ("",), ("Shard(0)",), (0,), (), 0) for _, _, s in leaves() if s}
    refs = []
    for r in range(n):
        if only is not None and r not in only:
            refs.append(ShardRef(r, 0, 0))
            continue
        layouts = {s: layout_at(t, (r,)) for s, t in templates.items()}
        entries, offset = [], 0
        for i, (path, _, shape) in enumerate(leaves()):
            layout = layouts[shape] if shape else None
            local = layout.local_shape if layout else ()
            nbytes = 4 * math.prod(local)
            entries.append(TensorEntry(i, path, "float32", local, offset, nbytes,
                                       (0,) * max(1, math.ceil(nbytes / CHUNK)), layout))
            offset += nbytes
        raw = ShardManifest(r, cid.step, cid.generation, offset, entries, tree, CHUNK, n).to_bytes()
        (d / shard_manifest_file(r)).write_bytes(raw)
        with open(d / shard_data_file(r), "wb") as f:
            f.truncate(offset)  # sparse: no tensor byte is read
        refs.append(ShardRef(r, crc32c_of(raw), offset))
    tier.commit(cid, Manifest(cid.step, cid.generation, n, refs))


def target_state(rank: int, m: int) -> dict:
    """Rank ``rank`` of an M-rank job's state: DTensors ``Shard(0)`` on a fake process group,
    local shards on the meta device (planning reads shapes, never values)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=m, store=FakeStore())
    mesh = init_device_mesh("cpu", (m,))

    def make(_: int, shape: tuple[int, ...] | None):
        if shape is None:
            return torch.zeros(())
        local = (len(range(shape[0])[rank * -(-shape[0] // m):(rank + 1) * -(-shape[0] // m)]), *shape[1:])
        return DTensor.from_local(torch.empty(local, device="meta"), mesh, [Shard(0)], run_check=False,
                                  shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())

    return _tree(make)


class Reads:
    """Counts what the disk tier reads (it reads every file through ``read_nofollow``)."""

    def __init__(self) -> None:
        from ckpt.tiers import local
        self.manifests = self.commits = self.bytes = 0
        real = local.read_nofollow

        def counted(path: Path) -> bytes:
            data = real(path)
            self.bytes += len(data)
            if Path(path).name.startswith("rank-"):
                self.manifests += 1
            else:
                self.commits += 1
            return data

        local.read_nofollow = counted


def plan_one(root: Path, n: int, m: int, reads: Reads) -> dict:
    """One target rank of an M-rank job plans the restore of the n-rank checkpoint in ``root``."""
    from ckpt.restore.execute import OpenShards
    from ckpt.restore.plan import Inventory, plans, shard_needs
    from ckpt.restore.reshard import plan_load
    from ckpt.tiers.local import LocalDiskTier

    rank = m // 3
    state = target_state(rank, m)
    reads.manifests = reads.commits = reads.bytes = 0
    t0 = time.perf_counter()
    inventory = Inventory([LocalDiskTier(root)])
    chosen = plans(inventory, lambda world: shard_needs(world, rank=rank, world=m, replicated=frozenset(),
                                                        holder=0))[0]
    with OpenShards(chosen.ckpt_id) as opened:
        _, _, planned = plan_load(chosen, state, rank, m, opened)
    seconds = time.perf_counter() - t0
    return {"component": "restore_plan_to_half" if m < n else "restore_plan_same", "ranks": n, "target_ranks": m,
            "target_rank": rank, "seconds": seconds, "manifests_read": reads.manifests,
            "commit_reads": reads.commits, "bytes_read": reads.bytes, "chunk_reads": len(planned.chunks),
            "store_ops": 0, "store_keys": 0, "ops_per_rank": 0.0, "server_s_per_op": 0.0,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def rows() -> dict:
    """scale_bench's components of this module: name -> (N -> row)."""
    return {c: functools.partial(run_one, c) for c in COMPONENTS}


def run_one(component: str, n: int) -> dict:
    """``scale_bench.py``'s entry: one component at ``n`` saved ranks, in this process; only the
    shards a narrowed restore opens are written (``--overlaps-only``: a restore that opens any
    other fails the row), since writing every one takes hours here from 4,096 ranks."""
    return _measure(n, [component], overlaps_only=True)[0]


def overlapping(n: int, m: int, rank: int) -> set[int]:
    """The saved ranks (of n) whose rows of some tensor overlap ``rank``'s of m (torch.chunk's split),
    and saved rank 0: what a restore that opens only the overlapping shards reads."""
    def rows(size: int, r: int, w: int) -> range:
        q = -(-size // w)
        return range(size)[r * q:(r + 1) * q]

    sizes = {s[0] for _, _, s in leaves() if s}
    return {0} | {s for g in sizes for s in range(n) if set(rows(g, s, n)) & set(rows(g, rank, m))}


def _measure(n: int, components: list[str], overlaps_only: bool = False) -> list[dict]:
    root = Path(tempfile.mkdtemp(prefix=f"scale-plan-{n}-"))
    targets = [n // 2 if c == "restore_plan_to_half" else n for c in components]
    try:
        t0 = time.perf_counter()
        write_checkpoint(root, n, set().union(*(overlapping(n, m, m // 3) for m in targets)) if overlaps_only
                         else None)
        written = time.perf_counter() - t0
        reads = Reads()
        rows = [plan_one(root, n, m, reads) for m in targets]
        for row in rows:
            row["write_s"], row["written"] = written, "overlapping" if overlaps_only else "every shard"
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="OUT")
    ap.add_argument("--max-ranks", type=int, default=4096)
    ap.add_argument("--min-ranks", type=int, default=64)
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per size")
    ap.add_argument("--overlaps-only", action="store_true",
                    help="write only the shards a restore that opens the overlapping ones reads (any other it "
                         "opens fails): sizes a full write would take hours here")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        for row in _measure(args.one, list(COMPONENTS), args.overlaps_only):
            print(json.dumps(row), flush=True)
        return
    rows, skipped = [], []
    for n in (s for s in SIZES if args.min_ranks <= s <= args.max_ranks):  # a fresh process a size: its own RSS
        try:
            flags = ["--overlaps-only"] if args.overlaps_only else []
            out = subprocess.run([sys.executable, __file__, "--one", str(n), *flags], capture_output=True, text=True,
                                 timeout=args.timeout_s, env={**os.environ, "PYTHONPATH": str(ROOT)})
        except subprocess.TimeoutExpired:
            skipped.append(f"N={n}: over {args.timeout_s:.0f} s")
            break
        if out.returncode:
            skipped.append(f"N={n}: exit {out.returncode}: {out.stderr.strip().splitlines()[-1:]}")
            break
        for line in out.stdout.splitlines():
            row = json.loads(line)
            rows.append(row)
            print(f"{row['component']:22s} N={n:6d} -> {row['target_ranks']:6d}  {row['seconds']:8.3f} s  "
                  f"{row['manifests_read']:6d} manifests  {row['bytes_read'] / 1e6:9.1f} MB  "
                  f"{row['peak_rss_mb']:6.0f} MB RSS  (written in {row['write_s']:.0f} s)", flush=True)
    write_json(args.json, run_meta(model="llama-70b-like", tensors=len(leaves()), overlaps_only=args.overlaps_only),
               rows, skipped=skipped)


if __name__ == "__main__":
    main()

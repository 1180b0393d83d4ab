"""torchrun child for test_reshard: saves and restores DTensor state (Shard(0), Shard(1),
an FSDP2 ``fully_shard`` MLP with AdamW moments, an FSDP2 language-model stub whose head
is tied to its embedding) at whatever world size it is started with.

    reshard_child.py MEMORY_DIR [--restore ROOT STEP] [--save ROOT] [--damage]

``--restore``: restore ROOT into a freshly initialised state; it must be step STEP and
bitwise equal to the full tensors saved beside it (``ROOT/ref-STEP.pt``), then train one
step. ``--damage``: rank 0 first flips a byte inside the part of saved rank 1's sharded
tensor that a partial read at this world size covers. ``--save``: save steps 1 and 2
(training in between), write their full tensors as references, and restore step 2 at
the same world size into a fresh state (a fresh optimizer too). At 4 ranks, the layout
recorded for ``_StridedShard`` is checked too.
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ckpt import CheckpointManager
from ckpt.distributed import exit_rank, init_process_group

CHUNK = 64 << 10  # the smallest checksum chunk: "big" spans 16 of them


class TiedLM(torch.nn.Module):
    """A language-model stub: the output head shares the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def fresh_state(seed: int, mesh) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 10))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    lm = TiedLM()
    fully_shard(lm, mesh=mesh)
    big = torch.randn(256, 1024)  # 1 MiB, rows split unevenly at 3
    wide = torch.randn(6, 10)
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-2),
            "lm": lm, "lm_optim": torch.optim.AdamW(lm.parameters(), lr=1e-2),
            "big": distribute_tensor(big, mesh, [Shard(0)]), "wide": distribute_tensor(wide, mesh, [Shard(1)]),
            "epoch": seed}


def train(state: dict, steps: int) -> None:
    for i in range(steps):
        x = torch.full((4, 16), float(i + 1)) + torch.arange(16.0)
        state["model"](x).square().mean().backward()
        state["optim"].step()
        state["optim"].zero_grad()
        state["lm"](torch.arange(10) % (i + 2)).square().mean().backward()
        state["lm_optim"].step()
        state["lm_optim"].zero_grad()
    with torch.no_grad():
        state["big"].mul_(1.5)
        state["wide"].add_(1.0)


def full(state: dict) -> dict:
    """Every tensor of the state, whole (a collective: every rank calls it)."""
    out = {f"model.{k}": v.full_tensor() for k, v in state["model"].state_dict().items()}
    for i, p in enumerate(state["model"].parameters()):
        for k, v in state["optim"].state[p].items():
            out[f"optim.{i}.{k}"] = v.full_tensor() if isinstance(v, DTensor) else v
    out.update({f"lm.{k}": v.full_tensor() for k, v in state["lm"].state_dict().items()})
    for i, p in enumerate(state["lm"].parameters()):
        for k, v in state["lm_optim"].state[p].items():
            out[f"lm_optim.{i}.{k}"] = v.full_tensor() if isinstance(v, DTensor) else v
    assert state["lm"].head.weight is state["lm"].emb.weight, "the tie was broken"
    out["big"], out["wide"] = state["big"].full_tensor(), state["wide"].full_tensor()
    return out


def damage(root: Path, step: int) -> None:
    """Flip a byte in saved rank 1's chunk 1 of "big": its rows 16..31, which target rank 0
    reads at 3 ranks (its rows 0..85 span saved rank 1's rows 0..21)."""
    from ckpt.tiers.local import LocalDiskTier

    tier = LocalDiskTier(root)
    ckpt_id = next(i.id for i in tier.list() if i.id.step == step)
    reader = tier.open_shard(ckpt_id, next(s for s in tier.read_manifest(ckpt_id).shards if s.rank == 1))
    entry = next(e for e in reader.manifest.tensors if e.path == "big")
    reader.close()
    path = root / ckpt_id.name / "rank-00001.bin"
    with open(path, "r+b") as f:
        f.seek(entry.offset + CHUNK + 100)
        byte = f.read(1)
        f.seek(entry.offset + CHUNK + 100)
        f.write(bytes([byte[0] ^ 0xFF]))


def check_strided_layout(world: int) -> None:
    """FSDP2 over tensor parallelism shards dim 0 twice ([_StridedShard(0, 2), Shard(0)] on a
    (dp, tp) mesh): the recorded runs must name exactly the rows each rank holds."""
    from torch.distributed.tensor.placement_types import _StridedShard

    from ckpt.format.layout import layout_of

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(11 * 3, dtype=torch.float32).reshape(11, 3)
    t = distribute_tensor(full, mesh, [_StridedShard(0, split_factor=world // 2), Shard(0)], src_data_rank=None)
    layout = layout_of(t, "strided")
    rows = [r for start, n in layout.runs[0] for r in range(start, start + n)]
    assert torch.equal(t.to_local(), full[rows]), (layout, t.to_local(), rows)
    assert layout.placements == ("_StridedShard(0,2)", "Shard(0)") and layout.mesh_dims == ("dp", "tp")


def restore_and_check(root: Path, step: int, memory_dir: str, mesh) -> None:
    """Restore ``root`` into a freshly initialised state: it must be ``step``, bitwise equal
    to the full tensors saved beside it, and train on (the moments are usable DTensors)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    state = fresh_state(1000 + world, mesh)
    with CheckpointManager(root, memory_dir=memory_dir, run="reshard", chunk_bytes=CHUNK) as mgr:
        assert mgr.restore(state) == step
        stats = mgr.last_reshard
    want = torch.load(root / f"ref-{step}.pt")
    got = full(state)
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"rank {rank}: not bitwise equal after restore: {bad}"
    assert state["epoch"] == step, state["epoch"]
    origin = "the same size" if stats is None else f"{stats.saved_world}: amplification {stats.amplification:.2f}"
    print(f"rank {rank} restored step {step} at {world} from {origin}", flush=True)
    train(state, 1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("memory_dir")
    p.add_argument("--restore", nargs=2)
    p.add_argument("--save")
    p.add_argument("--damage", action="store_true")
    args = p.parse_args()
    init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    if world == 4:
        check_strided_layout(world)
    if args.restore:
        root, step = Path(args.restore[0]), int(args.restore[1])
        if args.damage and rank == 0:
            damage(root, 2)
        dist.barrier()
        restore_and_check(root, step, args.memory_dir, mesh)
    if args.save:
        root = Path(args.save)
        state = fresh_state(0, mesh)
        with CheckpointManager(root, memory_dir=args.memory_dir, run="reshard", chunk_bytes=CHUNK) as mgr:
            for step in (1, 2):
                train(state, 2)
                state["epoch"] = step
                mgr.save(step, state).wait()
                ref = full(state)
                if rank == 0:
                    torch.save(ref, root / f"ref-{step}.pt")
        print(f"rank {rank} saved at {world}", flush=True)
        restore_and_check(root, 2, args.memory_dir + "-same", mesh)  # the same world size, fresh optimizer
    exit_rank()


if __name__ == "__main__":
    sys.exit(main())

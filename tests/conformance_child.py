# Several cases below are ported from PyTorch's own distributed checkpoint tests
# (test/distributed/checkpoint/), each naming its upstream file and test in conformance_cases.py.
# PyTorch is BSD-3-Clause licensed:
#   Copyright (c) 2016-     Facebook, Inc            (Adam Paszke)
#   Copyright (c) Meta Platforms, Inc. and affiliates. All rights reserved.
#   Redistribution and use in source and binary forms, with or without modification, are
#   permitted provided that the conditions of the BSD 3-Clause licence are met
#   (https://github.com/pytorch/pytorch/blob/main/LICENSE).
"""torchrun child of the conformance suite: many cases per launch, every rank going through
them in the same order (so collectives pair up).

    conformance_child.py save CASES_JSON OUT MEMORY_DIR
    conformance_child.py load CASES_JSON OUT MEMORY_DIR SAVED_WORLD...

``save``: each case's state saved at this world size by ckpt-guard (``OUT/<id>/ckpt-<N>``) and
by ``dcp.save`` (``OUT/<id>/dcp-<N>``), which saved rank 0 then imports (``ckpt import``'s
functions: ``OUT/<id>/imp-<N>``). ``load``: each case restored at this world size from each
saved size, by ``CheckpointManager.restore``, from the import, and by ``dcp.load`` (the
control), each compared bitwise (``uint8`` views: NaN payloads, −0.0) with the saved full
tensor, on every rank. Results: ``OUT/<phase>-<world>-rank<r>.json``, one verdict per case
and path: ``ok``, ``wrong: ...`` (a silent wrong result) or ``error: ...``.
"""
from __future__ import annotations

import json
import sys
import traceback
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ckpt import CheckpointManager
from ckpt.distributed import exit_rank, init_process_group
from ckpt.format.manifest import DTYPES

COMMIT_TIMEOUT_S = 60.0  # a hang guard: a save that cannot commit fails the case, not the launch


def full_value(case: dict) -> torch.Tensor:
    """The case's full tensor, from its seed alone (every rank, every launch alike): random
    bytes, so floats include NaNs, infinities and -0.0; bools are 0 or 1."""
    shape, dtype = tuple(case["shape"]), DTYPES[case["dtype"]]
    g = torch.Generator().manual_seed(case["seed"])
    base_shape = _base_shape(case["view"], shape)
    n = 1
    for s in base_shape:
        n *= s
    if dtype == torch.bool:
        base = torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).bool()
    else:
        base = torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.uint8).view(dtype)
    return _view(case["view"], base.reshape(base_shape), shape)


def _base_shape(view: str, shape: tuple) -> tuple:
    if view == "transposed":
        return tuple(reversed(shape))
    if view in ("narrowed", "strided"):
        return (shape[0] * 2 + 1, *shape[1:])
    if view == "expanded":
        return (1, *shape[1:])
    return shape


def _view(view: str, base: torch.Tensor, shape: tuple) -> torch.Tensor:
    """The saved value: a view of ``base`` (what the upstream tests and users hand a checkpoint)."""
    if view == "transposed":
        return base.permute(*reversed(range(base.dim())))
    if view == "narrowed":
        return base.narrow(0, 1, shape[0])
    if view == "strided":
        return base[1::2]
    if view == "expanded":
        return base.expand(*shape)
    if view == "conj":
        return base.conj()
    if view == "neg":
        return torch._neg_view(base)
    if view == "channels_last":
        return base.contiguous(memory_format=torch.channels_last)
    return base


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values as bytes, for a bitwise comparison (NaN == NaN, -0.0 != 0.0)."""
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.detach().resolve_conj().resolve_neg().reshape(-1))
    return flat.view(torch.uint8) if t.dtype != torch.bool else flat.to(torch.uint8)


def mesh_for(kind: str | None, world: int):
    if kind is None:
        return None
    if kind == "1d":
        return init_device_mesh("cpu", (world,))
    if kind == "sub":  # the first half of the ranks; the others hold nothing
        return DeviceMesh("cpu", list(range(max(1, world // 2))))
    dims = (2, world // 2) if world % 2 == 0 else (1, world)
    return init_device_mesh("cpu", dims, mesh_dim_names=("dp", "tp"))


def placements(names: list[str]) -> list:
    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in names]


def value(case: dict, spec: dict, world: int, *, target: bool) -> torch.Tensor:
    """The case's tensor as ``spec`` lays it out at ``world`` ranks: its saved value, or
    (``target``) a tensor of the same kind filled with zeros to restore into."""
    full = full_value(case)
    if target:
        full = torch.zeros(full.shape, dtype=full.dtype)
    mesh = mesh_for(spec.get("mesh"), world)
    if mesh is None:
        return full
    dt = distribute_tensor(full.contiguous(), mesh, placements(spec["placements"]), src_data_rank=None)
    if spec.get("local") == "noncontiguous" and dt.to_local().dim() == 2:
        local = dt.to_local().t().contiguous().t()  # the same values, column-major
        dt = DTensor.from_local(local, mesh, dt.placements, run_check=False, shape=dt.shape, stride=dt.stride())
    return dt


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def state_of(case: dict, spec: dict, world: int, *, target: bool) -> dict:
    t = value(case, spec, world, target=target)
    state = {"t": t}
    if case.get("with_conj"):  # a tensor and its conj() view in one state (a tie only in memory)
        state["c"] = t.conj() if not target else torch.zeros_like(t)
    return state


def expected(case: dict) -> dict[str, torch.Tensor]:
    full = full_value(case)
    out = {"t": full}
    if case.get("with_conj"):
        out["c"] = full.conj()
    return out


def compare(case: dict, state: dict) -> str:
    """``ok`` when every tensor of ``state`` is bitwise the saved one (a collective for DTensors)."""
    wrong = []
    for key, want in expected(case).items():
        if isinstance(state[key], DTensor) and state[key].device_mesh.get_coordinate() is None:
            continue  # a rank outside a sub-mesh holds nothing (its full_tensor() is empty)
        got = whole(state[key])
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            wrong.append(f"{key}: {tuple(got.shape)} {got.dtype}, saved {tuple(want.shape)} {want.dtype}")
        elif not torch.equal(as_bytes(got), as_bytes(want)):
            wrong.append(f"{key}: other bytes")
    return "ok" if not wrong else "wrong: " + "; ".join(wrong)


def attempt(fn) -> str:
    try:
        return fn()
    except (Exception, CheckpointException) as e:  # a verdict, not a crash (DCP's is a BaseException)
        line = " / ".join(x.strip() for x in str(e).strip().splitlines()[:3])  # a refusal says why on its next lines
        if "--trace" in sys.argv:
            traceback.print_exc()
        return f"error: {type(e).__name__}: {line[:300]}"


def agreed(verdict: str) -> str:
    """The worst verdict of any rank (so every rank takes the same branch next)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, verdict)
    return next((v for v in out if v.startswith("wrong")), next((v for v in out if v != "ok"), "ok"))


def save(cases: list[dict], out: Path, memory_dir: str) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    for case in cases:
        folder = out / case["id"]
        state = state_of(case, case["save"], world, target=False)
        verdicts = {"ckpt": agreed(attempt(partial(save_ours, state, folder / f"ckpt-{world}",
                                                   f"{memory_dir}/{case['id']}-{world}"))),
                    "dcp": agreed(attempt(partial(save_theirs, state, folder / f"dcp-{world}")))}
        if rank == 0 and verdicts["dcp"] == "ok":
            verdicts["import"] = attempt(partial(import_dcp, folder / f"dcp-{world}", folder / f"imp-{world}"))
        results[case["id"]] = verdicts
        dist.barrier()
    return results


def save_ours(state: dict, root: Path, memory_dir: str) -> str:
    with CheckpointManager(root, memory_dir=memory_dir, run="conformance", commit_timeout_s=COMMIT_TIMEOUT_S) as mgr:
        mgr.save(1, state).wait()
    return "ok"


def save_theirs(state: dict, folder: Path) -> str:
    dcp.save(dict(state), checkpoint_id=str(folder))
    return "ok"


def import_dcp(source: Path, dest: Path) -> str:
    """What ``ckpt import --from dcp`` does, in this process."""
    from ckpt.interop import dcp_import
    from ckpt.interop.offline_write import import_target, write_state
    from ckpt.tiers.local import LocalDiskTier

    dest.mkdir(parents=True, exist_ok=True)
    tier = LocalDiskTier(dest)
    ckpt_id = import_target(tier, 1, run="conformance")
    write_state(tier, ckpt_id, dcp_import.read_dcp(source), run="conformance")
    return "ok"


def load(cases: list[dict], out: Path, memory_dir: str, saved_worlds: list[int]) -> dict:
    world = dist.get_world_size()
    results: dict[str, dict] = {}
    for case in cases:
        folder = out / case["id"]
        for n in saved_worlds:
            verdicts = results.setdefault(f"{case['id']}@{n}", {})
            for path, root in (("ckpt", folder / f"ckpt-{n}"), ("import", folder / f"imp-{n}")):
                if root.exists():  # else not saved (DCP refused it, so nothing was imported)
                    verdicts[path] = restored_verdict(case, partial(restore_ours, case, world, root,
                                                                    f"{memory_dir}/{case['id']}-{n}-{path}"))
            if (folder / f"ckpt-{n}").exists():  # the differential: every tensor through the overlaps
                verdicts["ckpt-overlaps"] = restored_verdict(case, partial(restore_overlaps, case, world,
                                                                           folder / f"ckpt-{n}"))
            if (folder / f"dcp-{n}" / ".metadata").exists():
                verdicts["dcp"] = restored_verdict(case, partial(restore_theirs, case, world, folder / f"dcp-{n}"))
    return results


def restore_ours(case: dict, world: int, root: Path, memory_dir: str) -> tuple[str, dict]:
    state = state_of(case, case["load"], world, target=True)
    with CheckpointManager(root, memory_dir=memory_dir, run="conformance", commit_timeout_s=COMMIT_TIMEOUT_S) as mgr:
        got = mgr.restore(state)
    return ("ok" if got == 1 else f"error: restored step {got}"), state


def restore_overlaps(case: dict, world: int, root: Path) -> tuple[str, dict]:
    """The same restore with every tensor read from the overlaps of every saved shard, none
    whole from this rank's own (the plan ``CheckpointManager.restore`` takes when layouts
    differ): both plans of the one restore path must give the same bytes."""
    from ckpt.restore.execute import LOCAL, restore_agreed
    from ckpt.restore.plan import Inventory, ShardNeed
    from ckpt.restore.reshard import load_values
    from ckpt.restore.state_load import load_into
    from ckpt.tiers.local import LocalDiskTier

    state = state_of(case, case["load"], world, target=True)
    found = restore_agreed(LOCAL, Inventory([LocalDiskTier(root)]), lambda saved: [ShardNeed(r) for r in range(saved)],
                           lambda plan: load_values(plan, state, dist.get_rank(), world, overlaps=True)[0])
    if found is None:
        return "error: nothing restored", state
    load_into(state, found[1])
    return "ok", state


def restore_theirs(case: dict, world: int, folder: Path) -> tuple[str, dict]:
    state = state_of(case, case["load"], world, target=True)
    dcp.load(state, checkpoint_id=str(folder))
    return "ok", state


def restored_verdict(case: dict, restore) -> str:
    """Restore (agreed on every rank), then compare on every rank; the worst verdict."""
    holder: dict = {}

    def run() -> str:
        verdict, holder["state"] = restore()
        return verdict

    verdict = agreed(attempt(run))
    if verdict != "ok":
        return verdict
    return agreed(attempt(lambda: compare(case, holder["state"])))


def main(save_phase=None, load_phase=None, prefix: str = "") -> None:
    """Run the phase named on the command line over the cases (``save_phase``/``load_phase``:
    another child's, writing ``OUT/<prefix><phase>-<world>-rank<r>.json``)."""
    phase, cases_file, out, memory_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    init_process_group("gloo")
    cases = json.loads(cases_file.read_text())
    if phase == "save":
        results = (save_phase or save)(cases, out, memory_dir)
    else:
        results = (load_phase or load)(cases, out, memory_dir, [int(w) for w in sys.argv[5:] if w.isdigit()])
    world, rank = dist.get_world_size(), dist.get_rank()
    (out / f"{prefix}{phase}-{world}-rank{rank}.json").write_text(json.dumps(results, indent=1, sort_keys=True))
    print(f"rank {rank}: {prefix}{phase} of {len(cases)} cases at {world} done", flush=True)
    exit_rank()


if __name__ == "__main__":
    sys.exit(main())

"""torchrun child of the model-and-optimizer conformance cases (issue 47): a model and its
optimizer held as FSDP2, HSDP, FSDP2+TP (a real ``_StridedShard``), DDP or a bare module
users hold them, trained one step, saved at N ranks and restored at M (N = M included),
compared bitwise by parameter name with what was saved, on every rank.

    conformance_models_child.py save CASES_JSON OUT MEMORY_DIR
    conformance_models_child.py load CASES_JSON OUT MEMORY_DIR SAVED_WORLD...

A case: {"id", "save": KIND, "load": KIND, "groups": bool, "reorder": bool, "extras": bool,
"stateful": bool, "dcp_saver": "save" | "async" | "planner"}; KIND is "plain", "ddp",
"fsdp", "hsdp", "tp_fsdp" or "permuted" (FSDP2 over a mesh of the ranks in reverse order).

``save`` (at N): ckpt-guard's save (``ckpt-N``); ``dcp.save`` (or ``async_save``, or a save
with planner and writer options) of ``get_model_state_dict``/``get_optimizer_state_dict``
(``dcp-N``), imported by rank 0 (``imp-N``); rank 0 exports ``ckpt-N`` to DCP (``exp-N``)
and imports that back (``reimp-N``); the reference (every tensor whole, by name) in
``ref-N.pt``. ``load`` (at M): each restored by ckpt-guard (``ckpt``, ``import``,
``export-import``), the export read by ``dcp.load`` (``export``), ``ckpt-N`` read by
``dcp.load`` through ``CheckpointReader`` (``reader``), and DCP's own by ``dcp.load``
(the control). Verdicts as in ``conformance_child.py``.
"""
from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from ckpt import CheckpointManager
from tests.conformance_child import COMMIT_TIMEOUT_S, agreed, as_bytes, attempt, main


class Net(torch.nn.Module):
    """Uneven dims (7 and 5 rows over 2 or 4 ranks; TP's layers get 8: DTensor's matmuls need
    even shards), two layers TP can split."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.up, self.down = torch.nn.Linear(6, hidden), torch.nn.Linear(hidden, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class AppState:
    """DCP's recommended Stateful: the model and optimizer by name (get/set_state_dict)."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict:
        return {"model": get_model_state_dict(self.model), "optim": get_optimizer_state_dict(self.model, self.optim)}

    def load_state_dict(self, sd: dict) -> None:
        set_model_state_dict(self.model, sd["model"])
        set_optimizer_state_dict(self.model, self.optim, sd["optim"])


def wrapped(kind: str, world: int, hidden: int) -> torch.nn.Module:
    """The model as ``kind`` holds it at ``world`` ranks (a layout needing more ranks falls back to FSDP2)."""
    from torch.distributed.fsdp import fully_shard

    model = Net(hidden)
    if kind == "plain":
        return model
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if kind == "tp_fsdp" and world % 2 == 0:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        return fully_shard(model, mesh=mesh["dp"])
    if kind == "hsdp" and world % 2 == 0:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    elif kind == "permuted":
        mesh = DeviceMesh("cpu", list(reversed(range(world))))
    else:
        mesh = init_device_mesh("cpu", (world,))
    for layer in (model.up, model.down):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def built(case: dict, kind: str, world: int, *, target: bool) -> dict:
    """The case's state at ``world`` ranks: trained one step (the saved one), or (``target``)
    as a fresh job builds it before restoring (its parameters listed in reverse when ``reorder``)."""
    model = wrapped(kind, world, 8 if "tp_fsdp" in (case["save"], case["load"]) else 7)
    def flip(xs: list) -> list:
        return xs[::-1] if target and case["reorder"] else xs

    params = list(model.named_parameters())
    if case["groups"]:  # one group per layer; reordered: each group and their order reversed
        groups = flip([{"params": flip([p for n, p in params if layer in n]), **extra}
                       for layer, extra in (("up", {}), ("down", {"lr": 0.02}))])
    else:
        groups = [{"params": flip([p for _, p in params])}]
    optim = torch.optim.AdamW(groups, lr=0.01)
    state: dict[str, Any] = {"model": model, "optim": optim}
    if case["extras"]:
        state["sched"] = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
        state["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        state["ema"] = torch.zeros(5, 7).t() if target else torch.arange(35.0).reshape(7, 5)  # a view target
    if not target:
        torch.manual_seed(11)
        loss = model(torch.randn(4, 6)).sum()
        if case["extras"]:
            state["scaler"].scale(loss)  # the scaler's state exists once it has scaled a loss
        loss.backward()
        optim.step()
        if case["extras"]:
            state["sched"].step()
            state["scaler"].update(2.0**12)
    return {"app": AppState(model, optim), **{k: v for k, v in state.items() if k not in ("model", "optim")}} \
        if case["stateful"] else state


def model_optim(state: dict) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    return (state["app"].model, state["app"].optim) if "app" in state else (state["model"], state["optim"])


def reference(state: dict) -> dict[str, Any]:
    """Every saved value, whole, by name (a collective for DTensors)."""
    model, optim = model_optim(state)
    out: dict[str, Any] = {}
    names = {id(p): n.replace("module.", "").replace("_orig_mod.", "") for n, p in model.named_parameters()}
    for p in model.parameters():
        out[f"param {names[id(p)]}"] = full(p)
    for group in optim.param_groups:
        for p in group["params"]:
            out[f"lr {names[id(p)]}"] = group["lr"]
            for k, v in optim.state.get(p, {}).items():
                out[f"moment {names[id(p)]}.{k}"] = full(v) if isinstance(v, torch.Tensor) else v
    for key in ("sched", "scaler"):
        if key in state:
            out[key] = state[key].state_dict()
    if "ema" in state:
        out["ema"] = state["ema"].contiguous()
    return out


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def compare(want: dict, state: dict) -> str:
    got, wrong = reference(state), []
    for key, value in want.items():
        mine = got.get(key)
        if isinstance(value, torch.Tensor):
            same = isinstance(mine, torch.Tensor) and mine.shape == value.shape and mine.dtype == value.dtype \
                and torch.equal(as_bytes(mine), as_bytes(value))
        else:
            same = mine == value
        if not same:
            wrong.append(key)
    if got.keys() - want.keys():
        wrong.append(f"unexpected {sorted(got.keys() - want.keys())[:3]}")
    return "ok" if not wrong else f"wrong: {', '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}"


def dcp_state(state: dict) -> dict:
    """The state as DCP users save it: get_state_dict's dicts (under "app" for a Stateful)."""
    model, optim = model_optim(state)
    out = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    rest = {k: v for k, v in state.items() if k not in ("app", "model", "optim")}
    return {"app": out, **rest} if "app" in state else {**out, **rest}


def save(cases: list[dict], out: Path, memory_dir: str) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    for case in cases:
        folder = out / case["id"]
        state = built(case, case["save"], world, target=False)
        ref = reference(state)
        if rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(ref, folder / f"ref-{world}.pt")
        verdicts = {"ckpt": agreed(attempt(partial(save_ours, state, folder / f"ckpt-{world}",
                                                   f"{memory_dir}/{case['id']}-{world}"))),
                    "dcp": agreed(attempt(partial(save_theirs, case, dcp_state(state), folder / f"dcp-{world}")))}
        if rank == 0:
            if verdicts["dcp"] == "ok":
                verdicts["import"] = attempt(partial(import_dcp, folder / f"dcp-{world}", folder / f"imp-{world}"))
            if verdicts["ckpt"] == "ok":
                verdicts["export"] = attempt(partial(export_import, folder, world))
        results[case["id"]] = verdicts
        dist.barrier()
    return results


def save_ours(state: dict, root: Path, memory_dir: str) -> str:
    with CheckpointManager(root, memory_dir=memory_dir, run="conformance", commit_timeout_s=COMMIT_TIMEOUT_S) as mgr:
        mgr.save(1, state).wait()
    return "ok"


def save_theirs(case: dict, state: dict, folder: Path) -> str:
    saver = case.get("dcp_saver", "save")
    if saver == "async":
        dcp.async_save(state, checkpoint_id=str(folder)).result()
    elif saver == "planner":
        from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

        dcp.save(state, storage_writer=FileSystemWriter(str(folder), single_file_per_rank=False, thread_count=2,
                                                        per_thread_copy_ahead=1 << 10),
                 planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True, flatten_sharded_tensors=False))
    else:
        dcp.save(state, checkpoint_id=str(folder))
    return "ok"


def import_dcp(source: Path, dest: Path) -> str:
    from tests.conformance_child import import_dcp as imported

    return imported(source, dest)


def export_import(folder: Path, world: int) -> str:
    """``ckpt export --format dcp`` of ckpt-guard's save, and ``ckpt import`` of that export."""
    from ckpt.interop.export import write_dcp
    from ckpt.restore.reshard import read_whole

    write_dcp(read_whole(str(folder / f"ckpt-{world}"), by_name=True)[1], folder / f"exp-{world}")
    return import_dcp(folder / f"exp-{world}", folder / f"reimp-{world}")


def load(cases: list[dict], out: Path, memory_dir: str, saved_worlds: list[int]) -> dict:
    world = dist.get_world_size()
    results: dict[str, dict] = {}
    for case in cases:
        folder = out / case["id"]
        for n in saved_worlds:
            if not (folder / f"ref-{n}.pt").exists():
                continue
            want = torch.load(folder / f"ref-{n}.pt", weights_only=True)
            verdicts = results.setdefault(f"{case['id']}@{n}", {})
            for path, name in (("ckpt", "ckpt"), ("import", "imp"), ("export-import", "reimp")):
                if (folder / f"{name}-{n}").exists():
                    verdicts[path] = restored(case, world, want, partial(restore_ours, folder / f"{name}-{n}",
                                                                         f"{memory_dir}/{case['id']}-{n}-{path}"))
            for path, name in (("dcp", "dcp"), ("export", "exp")):
                if (folder / f"{name}-{n}" / ".metadata").exists():
                    verdicts[path] = restored(case, world, want, partial(restore_theirs, folder / f"{name}-{n}"))
            if (folder / f"ckpt-{n}").exists():
                from ckpt.dcp_reader import CheckpointReader

                reader = partial(CheckpointReader, str(folder / f"ckpt-{n}"), memory_dir=f"{memory_dir}/none")
                verdicts["reader"] = restored(case, world, want, partial(restore_theirs, None, reader=reader))
    return results


def restore_ours(root: Path, memory_dir: str, state: dict) -> str:
    with CheckpointManager(root, memory_dir=memory_dir, run="conformance", commit_timeout_s=COMMIT_TIMEOUT_S) as mgr:
        got = mgr.restore(state)
    return "ok" if got == 1 else f"error: restored step {got}"


def restore_theirs(folder: Path | None, state: dict, reader: Any = None) -> str:
    """The control: ``dcp.load`` into get_state_dict's dicts, then set_state_dict (DCP's way);
    with ``reader``, ``dcp.load`` reads ckpt-guard's checkpoint through ``CheckpointReader``."""
    model, optim = model_optim(state)
    loaded = dcp_state(state)
    if reader is not None:
        Path(reader.keywords["memory_dir"]).mkdir(parents=True, exist_ok=True)
        dcp.load(loaded, storage_reader=reader())
    else:
        dcp.load(loaded, checkpoint_id=str(folder))
    dicts = loaded.get("app", loaded)
    set_model_state_dict(model, dicts["model"])
    set_optimizer_state_dict(model, optim, dicts["optim"])
    return "ok"  # the scheduler and scaler (Stateful) and the view target were loaded by dcp.load itself


def restored(case: dict, world: int, want: dict, restore) -> str:
    holder: dict = {}

    def run() -> str:
        holder["state"] = built(case, case["load"], world, target=True)
        return restore(holder["state"])

    verdict = agreed(attempt(run))
    if verdict != "ok":
        return verdict
    return agreed(attempt(lambda: compare(want, holder["state"])))


if __name__ == "__main__":
    sys.exit(main(save, load, "models-"))

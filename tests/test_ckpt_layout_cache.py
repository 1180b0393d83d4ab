"""A save reuses the last save's layout while the state keeps its structure
(``ckpt/save/layout_cache.py``): what it saves is byte for byte what a freshly planned
save of the same state saves, and every structural change (a key added or removed or
renamed, a tensor of another shape or dtype, a DTensor placed otherwise) plans anew,
while plain values are read anew at every save."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from ckpt import CheckpointManager
from ckpt.format.state import flatten
from ckpt.save.flat_cache import FlatCache
from ckpt.save.layout_cache import LayoutCache
from ckpt.tiers.base import CheckpointId
from ckpt.tiers.memory.copier import plan_layout
from tests.ckpt_helpers import assert_same


def build(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "opt": opt, "sched": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5),
            "rng": torch.get_rng_state(), "table": np.arange(12, dtype=np.int32), "data": {"position": 0}}


def train_step(state: dict[str, Any]) -> None:
    loss = state["model"](torch.randn(16, 8)).square().mean()
    loss.backward()
    state["opt"].step()
    state["opt"].zero_grad()
    state["sched"].step()
    state["data"]["position"] += 16
    state["rng"] = torch.get_rng_state()


def snapshot_of(state: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy({k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in state.items()})


def shard_files(mgr: CheckpointManager, step: int) -> tuple[bytes, bytes]:
    """The disk tier's shard manifest (with its checksums) and data file of ``step``."""
    info = next(i for i in mgr.list() if i["step"] == step)
    d = mgr.disk.root / CheckpointId(info["generation"], step).name
    return (d / "rank-00000.json").read_bytes(), (d / "rank-00000.bin").read_bytes()


@pytest.mark.parametrize("overlap", [True, False])
def test_a_reused_layout_saves_what_a_fresh_plan_saves_byte_for_byte(tmp_path: Path, shm_dir: str,
                                                                      overlap: bool) -> None:
    state = build()
    with CheckpointManager(tmp_path / "cached", memory_dir=shm_dir, keep_last=10, overlap=overlap,
                           state=state) as cached:
        for step in range(1, 6):
            train_step(state)
            cached.save(step, state)
        expected = snapshot_of(state)
        cached.wait()
        assert (cached._saves.layouts.built, cached._saves.layouts.reused) == (1, 4)
        with CheckpointManager(tmp_path / "fresh", memory_dir=shm_dir, run="fresh", overlap=overlap,
                               state=state) as fresh:
            fresh.save(5, state)  # the same state, its layout planned for this save alone
            fresh.wait()
            assert (fresh._saves.layouts.built, fresh._saves.layouts.reused) == (1, 0)
            assert shard_files(cached, 5) == shard_files(fresh, 5)
        probe = build(seed=7)
        assert cached.restore(probe, step=5) == 5
        assert_same(snapshot_of(probe), expected)


def test_a_changed_structure_is_planned_anew_and_each_step_restores_bitwise(tmp_path: Path, shm_dir: str) -> None:
    """Saving every step (overlapped) through each kind of change, and back."""
    state = build()
    changes: dict[int, Callable[[dict[str, Any]], None]] = {
        3: lambda s: s.update(extra=torch.arange(6, dtype=torch.float32)),  # a key added
        4: lambda s: s.update(extra=torch.arange(600, dtype=torch.float32)),  # another shape (the slot grows)
        5: lambda s: s.update(extra=torch.arange(600, dtype=torch.float64)),  # another dtype
        6: lambda s: s.update(renamed=s.pop("extra")),  # the same tensor under another key
        7: lambda s: s.pop("renamed"),  # a key removed
    }
    expected, planned = {}, {}
    with CheckpointManager(tmp_path / "ckpt", memory_dir=shm_dir, keep_last=20, overlap=True, state=state) as mgr:
        for step in range(1, 10):
            train_step(state)
            if step in changes:
                changes[step](state)
            expected[step] = snapshot_of(state)
            mgr.save(step, state)
            planned[step] = mgr._saves.layouts.built
            mgr.wait()  # every step to disk, none skipped for a newer one
        assert [planned[s] - planned[s - 1] for s in range(2, 10)] == [0, 1, 1, 1, 1, 1, 0, 0]
        for step in range(1, 10):
            probe = build(seed=100 + step)
            assert mgr.restore(probe, step=step) == step
            assert_same(snapshot_of(probe), expected[step], f"step {step}")


def planned(cache: LayoutCache, state: dict[str, Any]) -> tuple[list, int]:
    return cache.plan(flatten(state))


def fresh_plan(state: dict[str, Any]) -> tuple[list, int]:
    return LayoutCache().plan(flatten(state))


CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "key added": lambda s: s.update(c=torch.zeros(3)),
    "key removed": lambda s: s.pop("b"),
    "key renamed": lambda s: s.update(c=s.pop("b")),
    "another shape": lambda s: s.update(b=torch.zeros(2, 3)),
    "another dtype": lambda s: s.update(b=torch.zeros(6, dtype=torch.int16)),
    "an array of another shape": lambda s: s.update(n=np.zeros(5)),
    "a nested tensor added": lambda s: s["d"].update(t=torch.ones(1)),
}


@pytest.mark.parametrize("change", CHANGES)
def test_each_structural_change_plans_the_layout_anew(change: str) -> None:
    state = {"a": torch.ones(4), "b": torch.zeros(6), "n": np.zeros(4), "d": {"lr": 0.1}}
    cache = LayoutCache()
    first = planned(cache, state)
    assert planned(cache, state) is first and (cache.built, cache.reused) == (1, 1)
    CHANGES[change](state)
    again = planned(cache, state)
    assert cache.built == 2 and again is not first
    assert again == fresh_plan(state) == plan_layout(flatten(state).tensors)


def test_plain_values_and_storage_are_read_at_every_save() -> None:
    """Neither is part of the layout: the entries are reused, the tree and the tensors are new."""
    state = {"a": torch.ones(4), "d": {"lr": 0.1, "position": 3}}
    cache = LayoutCache()
    first = planned(cache, state)
    state["d"]["lr"], state["a"] = 0.05, torch.full((4,), 2.0)  # a scheduler's step; a new tensor, same kind
    flat = flatten(state)
    assert cache.plan(flat) is first
    assert flat.tree["d"]["lr"] == 0.05 and torch.equal(flat.tensors[0][1], torch.full((4,), 2.0))


def test_a_dtensor_placed_otherwise_plans_anew(tmp_path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        full = torch.arange(8.0).reshape(4, 2)
        state = {"w": distribute_tensor(full, mesh, [Shard(0)])}
        cache = LayoutCache()
        first = planned(cache, state)
        assert planned(cache, state) is first
        state["w"] = distribute_tensor(full, mesh, [Replicate()])  # same local shape, dtype and path
        again = planned(cache, state)
        assert cache.built == 2 and again == fresh_plan(state)
        assert first[0][0].layout.placements != again[0][0].layout.placements
    finally:
        dist.destroy_process_group()


# (the innermost dict, the most dicts around it accepted, the path its first refusal names): a value
# ``d`` levels deep is kept while d + 3 <= MAX_JSON_DEPTH (the deepest tag opens 3 levels); the state
# is the manifest's level 1, each "k" one more, a list's items one more, a ``__dict__``'s items three more
DEPTHS = [({"x": 1, "y": "s"}, 123, "x"), ({"x": [1, 2.5, "s", None, True]}, 122, "x.0"),
          ({"__x__": 1}, 121, "<key>")]


@pytest.mark.parametrize("leaf, deepest, refused", DEPTHS)
def test_plain_values_kept_without_a_call_meet_the_same_depth_limit(leaf: dict, deepest: int, refused: str) -> None:
    """``flatten`` keeps a plain value of a dict or list as it is, without encoding it, only
    where the depth check it skips would pass: the deepest state accepted, and the error of
    the first one refused (naming the same path), are those of encoding every value."""
    from ckpt.errors import CheckpointError
    from ckpt.format.manifest import MAX_JSON_DEPTH

    def nested(n: int) -> dict:
        state = copy.deepcopy(leaf)
        for _ in range(n):
            state = {"k": state}
        return state

    assert MAX_JSON_DEPTH == 128
    tree = flatten(nested(deepest)).tree
    for _ in range(deepest):
        tree = tree["k"]
    assert tree == (leaf if "__x__" not in leaf else {"__dict__": [["__x__", 1]]})
    with pytest.raises(CheckpointError, match=r"^" + r"k\." * deepest + "k." + refused + ": the state is nested"):
        flatten(nested(deepest + 1))


def test_the_keys_flatten_read_are_those_the_optimizer_step_writes_read_anew() -> None:
    """``step_written`` takes the optimizer state's keys from ``FlatState.by_id`` (the same live
    objects): the same set as reading every tensor again, and so the same deferred copies."""
    from ckpt.save.overlap import deferrable, step_written

    state = build()
    train_step(state)
    state["alias"] = state["opt"].state_dict()["state"][0]["exp_avg"][:3]  # a view: another key, copied at once
    flat = flatten(state)
    assert len(flat.by_id) >= 8  # the optimizer's moments and steps, saved as themselves
    assert step_written([state["opt"]], flat.by_id) == step_written([state["opt"]])
    later = deferrable(flat, step_written([state["opt"]], flat.by_id))
    assert later == deferrable(flat, step_written([state["opt"]]))
    assert [path for (path, _), defer in zip(flat.tensors, later) if not defer] == [
        "model.1.running_mean", "model.1.running_var", "model.1.num_batches_tracked", "rng", "table", "alias"]


def facts(state: dict[str, Any]) -> tuple[dict, list]:
    """What a save records from the state's parameters: their names, and what its soundness scope checks."""
    from ckpt.restore.optim_names import param_names
    from ckpt.save.soundness import scope_of

    scope = scope_of(state, (), ())
    paths = [path for path, _ in flatten(state).tensors]
    return param_names(state), [(p, scope.checked(p), scope.compared(p)) for p in paths]


PARAM_CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "a parameter replaced in place of its module": lambda s: setattr(s["model"][0], "weight",
                                                                      nn.Parameter(s["model"][0].weight.detach())),
    "a module added": lambda s: s["model"].append(nn.Linear(4, 4)),
    "a module renamed": lambda s: s.update(net=s.pop("model")),
    "a parameter group added": lambda s: s["opt"].add_param_group({"params": [nn.Parameter(torch.ones(2))]}),
    "an optimizer with its names": lambda s: s["opt"].param_groups[0].update(param_names=["a"]),
    "another optimizer": lambda s: s.update(opt=torch.optim.SGD(s["model"].parameters(), lr=0.1)),
    "a module added beside it": lambda s: s.update(other=nn.Linear(2, 2)),
}


@pytest.mark.parametrize("change", PARAM_CHANGES)
def test_what_a_save_derives_from_the_parameters_is_derived_anew_at_each_change(change: str) -> None:
    from ckpt.save.layout_cache import ParamsCache

    state = build()
    cache = ParamsCache()
    first = cache.of(state, lambda: facts(state))
    assert cache.of(state, lambda: facts(state)) is first and (cache.built, cache.reused) == (1, 1)
    PARAM_CHANGES[change](state)
    again = cache.of(state, lambda: facts(state))
    assert cache.built == 2 and again == facts(state)


def test_the_same_ids_with_an_object_gone_are_not_taken_for_the_same_parameters() -> None:
    """An ``id()`` is another object's once the first is gone: a dead reference derives anew."""
    from ckpt.save.layout_cache import ParamsCache

    state = {"model": nn.Linear(3, 3)}
    cache = ParamsCache()
    cache.of(state, lambda: facts(state))
    cache._alive.append(lambda: None)  # the same ids as now, one of the objects they named gone
    cache.of(state, lambda: facts(state))
    assert (cache.built, cache.reused) == (2, 0)


def same_flat(got: Any, want: Any) -> None:
    """The same tree, paths, keys and layouts, and tensors that view the same memory now (not stale views)."""
    from ckpt.format.state import tensor_key

    assert got.tree == want.tree
    assert [p for p, _ in got.tensors] == [p for p, _ in want.tensors]
    assert got.keys == want.keys == [tensor_key(t) for _, t in got.tensors] and got.layouts == want.layouts
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got.tensors, want.tensors))
    assert sorted(map(repr, got.by_id.values())) == sorted(map(repr, want.by_id.values()))


def first_param(s: dict[str, Any]) -> nn.Parameter:
    return s["model"][0].weight


def first_state(s: dict[str, Any]) -> dict[str, Any]:
    """The optimizer's state of its first parameter (the model's may have been replaced)."""
    return s["opt"].state[s["opt"].param_groups[0]["params"][0]]


HOOKED = torch.ones(1)  # what a state-dict hook adds (the same tensor at each call)
FLAT_CHANGES: dict[str, tuple[Callable[[dict[str, Any]], Any], bool]] = {  # (change, whether a piece is made anew)
    "lr changed by a scheduler": (lambda s: [s["sched"].step() for _ in range(2)], False),
    "a buffer written in place": (lambda s: s["model"][1].running_mean.add_(1), False),
    "the model's load_state_dict (a copy in place)": (lambda s: s["model"].load_state_dict(s["model"].state_dict()),
                                                      False),
    "Adam's state created at its first step": (train_step, True),
    "a parameter replaced": (lambda s: setattr(s["model"][0], "weight", nn.Parameter(first_param(s).detach() + 1)),
                             True),
    ".data reassigned": (lambda s: setattr(first_param(s), "data", torch.randn(64, 8)), True),
    ".data made another view of its storage": (  # the same pointer and shape, other strides
        lambda s: setattr(first_param(s), "data", first_param(s).data.as_strided((64, 8), (1, 64))), True),
    "an optimizer state tensor's .data reassigned": (
        lambda s: setattr(first_state(s)["exp_avg"], "data", torch.zeros(64, 8)), True),
    "Adam's step replaced": (lambda s: first_state(s).update(step=torch.tensor(9.0)), True),
    "the optimizer's load_state_dict": (lambda s: s["opt"].load_state_dict(s["opt"].state_dict()), True),
    "a buffer registered": (lambda s: s["model"][1].register_buffer("extra", torch.ones(2)), True),
    "a non-persistent buffer registered": (lambda s: s["model"][1].register_buffer("tmp", torch.ones(2),
                                                                                   persistent=False), True),
    "a module added": (lambda s: s["model"].append(nn.Linear(4, 4)), True),
    "a module replaced by one of its type": (lambda s: s["model"].__setitem__(0, nn.Linear(8, 64)), True),
    "a child module registered as None": (lambda s: s["model"][1].register_module("gone", None), True),
    "a state-dict hook added": (lambda s: s["model"].register_state_dict_post_hook(
        lambda m, sd, prefix, meta: sd.__setitem__(prefix + "hooked", HOOKED)), True),
    "a parameter group added": (lambda s: s["opt"].add_param_group({"params": [nn.Parameter(torch.ones(2))]}), True),
    "a group's lr made a tensor": (lambda s: s["opt"].param_groups[0].update(lr=torch.tensor(0.01)), True),
}


@pytest.mark.parametrize("change", FLAT_CHANGES)
def test_a_proven_piece_flattens_as_the_full_walk_and_each_change_walks_anew(change: str) -> None:
    """``FlatCache`` (``ckpt/save/flat_cache.py``) gives what ``flatten`` gives, before, at and after each change."""
    state = build()
    do, anew = FLAT_CHANGES[change]
    if change != "Adam's state created at its first step":
        train_step(state)
    cache = FlatCache()
    for _ in range(2):
        same_flat(cache.flatten(state), flatten(state))
    assert (cache.built, cache.reused) == (2, 2)  # the model's piece and the optimizer's, then both taken
    do(state)
    same_flat(cache.flatten(state), flatten(state))
    assert cache.built > 2 if anew else (cache.built, cache.reused) == (2, 4)
    train_step(state)
    for _ in range(2):
        same_flat(cache.flatten(state), flatten(state))


def test_state_dict_hooks_present_from_the_first_save_run_at_every_save() -> None:
    """A module's or optimizer's state-dict hook may add what changes from one call to the next: a value with one
    is walked at every save (its hook called), never taken from the last save."""
    state = build()
    train_step(state)
    now = [torch.zeros(1)]
    state["model"].register_state_dict_post_hook(lambda m, sd, prefix, meta: sd.__setitem__(prefix + "now", now[0]))
    state["opt"].register_state_dict_post_hook(lambda opt, sd: {**sd, "now": now[0]})
    cache = FlatCache()
    for i in range(3):
        now[0] = torch.full((1,), float(i))
        same_flat(cache.flatten(state), flatten(state))
    assert cache.reused == 0


def test_saving_every_step_keeps_each_slots_copy_pairs_while_nothing_changes(tmp_path: Path, shm_dir: str) -> None:
    """The staged copy's pairs (``SlotPool.start_snapshot``) are a slot's last ones while the layout, the tensors and
    which of them wait are the same lists (a state of modules, optimizers and plain values), and made anew after a
    change; every step restores bitwise."""
    def part(s: dict[str, Any]) -> dict[str, Any]:  # no top-level tensor: one made anew each step makes new lists
        return {k: s[k] for k in ("model", "opt", "sched", "data")}

    state = build()
    train_step(state)
    with CheckpointManager(tmp_path, memory_dir=shm_dir, keep_last=10, overlap=True, state=part(state)) as mgr:
        last: dict[int, Any] = {}  # a slot's plan at its last save
        kept = {}  # each step: whether its slot took that plan again
        for step in range(1, 13):
            if step == 5:
                FLAT_CHANGES[".data reassigned"][0](state)
            train_step(state)
            mgr.save(step, part(state))
            mgr.wait()
            slot = next(s for s in mgr.memory.pool.slots if s.holds and s.holds[1] == step)
            kept[step], last[id(slot)] = slot.copy_plan[1] is last.get(id(slot)), slot.copy_plan[1]
            fresh = part(build(seed=1))
            mgr.restore(fresh, step=step)
            assert_same(snapshot_of(fresh), snapshot_of(part(state)))
        assert not kept[5] and kept[12]  # (the lists are the same again from step 6: a slot takes its plan again)


class Walked(FlatCache):
    """A ``FlatCache`` that keeps nothing: every save walks the whole state (the path before it)."""

    def flatten(self, state: Any) -> Any:
        self._held = {}
        return super().flatten(state)


def test_saves_through_every_change_are_byte_for_byte_those_of_the_full_walk(tmp_path: Path, shm_dir: str) -> None:
    """Saving every step (overlapped) while the state changes each way: the shard manifest and data
    file of every step are those of a manager that walks the whole state at every save."""
    state = build()
    order = list(FLAT_CHANGES)
    with CheckpointManager(tmp_path / "cached", memory_dir=shm_dir, keep_last=40, overlap=True, state=state) as a, \
            CheckpointManager(tmp_path / "walked", memory_dir=shm_dir, run="walked", keep_last=40, overlap=True,
                              state=state) as b:
        b._saves.flat = Walked()
        for step in range(1, 2 * len(order) + 1):
            train_step(state)
            if step % 2 == 0:
                FLAT_CHANGES[order[step // 2 - 1]][0](state)
            for mgr in (a, b):
                mgr.save(step, state)
                mgr.wait()
        assert a._saves.flat.reused > len(order)
        for step in range(1, 2 * len(order) + 1):
            assert shard_files(a, step) == shard_files(b, step), f"step {step}"

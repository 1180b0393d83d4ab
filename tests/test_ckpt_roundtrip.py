"""Round trip of every supported type through each tier, bitwise, and restore in place."""
from __future__ import annotations

import logging
import math
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckpt import CheckpointError, CheckpointManager
from ckpt.format.manifest import DTYPES, ShardManifest
from ckpt.format.state import is_stateful
from ckpt.restore.execute import LOCAL, restore_agreed
from ckpt.restore.plan import Inventory, RestorePlan, ShardNeed
from ckpt.restore.reshard import load_values
from ckpt.restore.state_load import load_into
from ckpt.tiers.local import LocalDiskTier
from tests.ckpt_helpers import assert_same, ckpt_dir, flip_byte, restored


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4))


def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """A model, an AdamW with moments and a scheduler, after two steps."""
    model = make_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        model(torch.randn(5, 8)).square().mean().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def every_dtype_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    bits = torch.randint(0, 256, (4 * 6 * 16,), dtype=torch.uint8, generator=g)  # every bit pattern, NaNs included
    out = {name: bits[: 4 * 6 * torch.empty((), dtype=dt).element_size()].view(dt).view(4, 6)
           for name, dt in DTYPES.items() if dt is not torch.bool}
    out["bool"] = bits[:24].view(4, 6) > 127
    return out


def special_tensors() -> dict[str, torch.Tensor]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "empty": torch.empty(0, 3),
        "transposed": base.t(),  # non-contiguous
        "strided_view": base[::2, 1::3],
        "conj": torch.tensor([1 + 2j, 3 - 4j]).conj(),  # lazily conjugated
        "requires_grad": torch.ones(3, requires_grad=True),
    }


def numpy_values() -> dict[str, Any]:
    rng = np.random.default_rng(3)
    arrays = {str(dt): rng.integers(0, 100, (3, 5)).astype(dt)
              for dt in ("bool", "int8", "uint16", "int32", "uint64", "float16", "float32", "float64",
                         "complex64", "complex128")}
    arrays["zero_d"] = np.array(2.5)
    arrays["fortran"] = np.asfortranarray(rng.random((3, 4)))
    arrays["sliced"] = rng.random((6, 6))[::2, ::3]
    scalars = {"f32": np.float32(1.5), "f16": np.float16(-0.5), "i64": np.int64(-2**62), "u8": np.uint8(255),
               "bool": np.bool_(True), "c128": np.complex128(1 + 2j)}
    return {"arrays": arrays, "scalars": scalars}


def plain_values() -> dict[str, Any]:
    return {
        "ints": [0, -1, 2**100, -(2**100)], "floats": [1.5, -0.0, math.inf, -math.inf, math.nan, 1e-310],
        "strings": ["", "naïve ✓ 日本", "__tensor__"], "flags": [True, False, None],
        "nested": {"a": [1, [2, [3, {"b": ()}]]], "empty_list": [], "empty_dict": {}},
        "tuples": (1, (2, "x"), [3, (4,)]), "bytes": [b"", b"\x00\xff" * 100],
        "odd_keys": {1: "int", (1, 2): "tuple", None: "none", 2.5: "float", "__tensor__": "dunder"},
        "torch_meta": [torch.float16, torch.bfloat16, torch.device("cpu"), torch.Size([2, 3])],
    }


def rng_states() -> dict[str, Any]:
    torch.manual_seed(11)
    np.random.seed(12)
    random.seed(13)
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "numpy_generator": np.random.default_rng(14).bit_generator.state}


def every_type_state() -> dict[str, Any]:
    model, opt, sched = trained(0)
    return {"model": model, "optim": opt, "sched": sched, "tensors": every_dtype_tensors(),
            "special": special_tensors(), "numpy": numpy_values(), "plain": plain_values(), "rng": rng_states(),
            "epoch": 3}


def as_saved(obj: Any) -> Any:
    """What a restore into an empty dict returns for ``obj``: stateful objects as their
    state_dict, tensors contiguous and detached, everything else unchanged."""
    if is_stateful(obj):
        return as_saved(obj.state_dict())
    if isinstance(obj, torch.Tensor):
        return obj.detach().resolve_conj().contiguous()
    if isinstance(obj, dict):
        return {k: as_saved(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(as_saved(v) for v in obj)
    return obj


@pytest.fixture(params=["memory", "disk"])
def tier(request: pytest.FixtureRequest) -> str:
    return request.param


def save_then_reopen(root: Path, shm_dir: str, tier: str, state: dict, tmp_path: Path,
                     step: int = 7) -> CheckpointManager:
    """Save ``state``, close, and reopen so that only ``tier`` holds the checkpoint."""
    with CheckpointManager(root, memory_dir=shm_dir, keep_memory=True) as mgr:
        mgr.save(step, state)
        mgr.wait()
    if tier == "memory":
        shutil.rmtree(root)  # the disk copy is gone: the restore must come from shared memory
        return CheckpointManager(root, memory_dir=shm_dir)
    fresh = tmp_path / "no-slots"  # a different memory_dir: no slots, so disk it is
    fresh.mkdir()
    return CheckpointManager(root, memory_dir=str(fresh))


def test_every_supported_type_round_trips_bitwise(root: Path, shm_dir: str, tier: str, tmp_path: Path) -> None:
    state = every_type_state()
    with save_then_reopen(root, shm_dir, tier, state, tmp_path) as mgr:
        assert [r["tiers"] for r in mgr.list()] == [[tier]]
        step, back = restored(mgr)
    assert step == 7
    assert_same(back, as_saved(state))


def test_restore_in_place_keeps_objects_and_returns_plain_values(root: Path, shm_dir: str, tier: str,
                                                                 tmp_path: Path) -> None:
    model, opt, sched = trained(0)
    state = {"model": model, "optim": opt, "sched": sched, "weights": torch.randn(5, 5), "moments": np.arange(6.0),
             "epoch": 3, "pair": (1, 2**80), "blob": b"\x00\x01", "rng": rng_states(), "scale": np.float32(0.5)}
    expected = as_saved(state)
    draws = (torch.rand(4), np.random.rand(4), random.random())

    # A "new process": fresh objects with other values and no optimizer state.
    model2 = make_model(1)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=5.0)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=9)
    weights2, moments2 = torch.zeros(5, 5), np.zeros(6)
    params = [(p, p.data_ptr()) for p in model2.parameters()]
    target = {"model": model2, "optim": opt2, "sched": sched2, "weights": weights2, "moments": moments2, "epoch": 0}
    with save_then_reopen(root, shm_dir, tier, state, tmp_path) as mgr:
        assert mgr.restore(target) == 7

    assert target["model"] is model2 and target["optim"] is opt2 and target["sched"] is sched2
    assert all(a is b and a.data_ptr() == ptr for (a, ptr), b in zip(params, model2.parameters())), \
        "module parameters must be loaded in place"
    assert target["weights"] is weights2 and target["moments"] is moments2
    assert_same(as_saved(target), expected)
    assert opt2.param_groups[0]["params"] == list(model2.parameters())
    assert opt2.state[next(model2.parameters())]["exp_avg"].abs().sum() > 0
    assert type(target["pair"]) is tuple and target["pair"][1] == 2**80 and target["blob"] == b"\x00\x01"
    assert type(target["scale"]) is np.float32

    rng = target["rng"]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    assert_same((torch.rand(4), np.random.rand(4), random.random()), draws)


def test_restore_rejects_a_tensor_of_another_shape_clearly(root: Path, shm_dir: str) -> None:
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        mgr.save(1, {"w": torch.ones(3, 4)})
        mgr.wait()
        with pytest.raises(CheckpointError, match=r"w: checkpoint has shape \(3, 4\), target \(4, 3\)"):
            mgr.restore({"w": torch.zeros(4, 3)})


@pytest.mark.parametrize("value", [object(), {1, 2}, lambda: 0, np.array(["a"], dtype=object),
                                   torch.ones(2).to_sparse()], ids=["object", "set", "function", "object-array",
                                                                    "sparse"])
def test_unsupported_values_are_refused_at_save_naming_where(root: Path, shm_dir: str, value: Any) -> None:
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        with pytest.raises(CheckpointError, match=r"extra\.bad"):
            mgr.save(1, {"extra": {"bad": value}, "ok": torch.ones(2)})
        assert mgr.list() == []


def test_changes_after_save_returns_do_not_leak_into_the_checkpoint(root: Path, shm_dir: str) -> None:
    state = {"w": torch.arange(1 << 16, dtype=torch.float32), "n": np.ones(5), "meta": {"lr": 0.1}}
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        mgr.save(1, state)
        state["w"].add_(1)  # the training loop goes on while the drain runs
        state["n"][:] = 7
        state["meta"]["lr"] = 0.2
        mgr.wait()
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        step, back = restored(mgr)
    assert step == 1
    assert_same(back, {"w": torch.arange(1 << 16, dtype=torch.float32), "n": np.ones(5), "meta": {"lr": 0.1}})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_state_round_trips_through_pinned_shared_memory(root: Path, shm_dir: str) -> None:
    model, opt, _ = trained(0)
    model.cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 8, device="cuda")).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt, "x": torch.randn(1000, device="cuda", dtype=torch.bfloat16)}
    expected = as_saved(state)
    model2 = make_model(1).cuda()
    target = {"model": model2, "optim": torch.optim.AdamW(model2.parameters()), "x": torch.zeros(1000, device="cuda",
                                                                                                dtype=torch.bfloat16)}
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        mgr.save(1, state)
        mgr.wait()
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        assert mgr.restore(target) == 1
    assert target["model"] is model2 and next(model2.parameters()).is_cuda and target["x"].is_cuda
    assert_same(as_saved(target), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_restore_from_each_tier_skips_damage_and_unpins_slots(root: Path, shm_dir: str, tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    def state_at(step: int) -> dict:
        g = torch.Generator(device="cuda").manual_seed(step)
        return {"big": torch.randn(9 << 20, device="cuda", generator=g),  # 36 MiB: several 16 MiB pieces
                "half": torch.randn(1000, device="cuda", generator=g).half(), "step": step}

    def zeros() -> dict:
        return {"big": torch.zeros(9 << 20, device="cuda"), "half": torch.zeros(1000, device="cuda").half()}

    with CheckpointManager(root, memory_dir=shm_dir, state=state_at(1)) as mgr:
        for step in (1, 2):
            mgr.save(step, state_at(step))
            mgr.wait()
        target = zeros()
        assert mgr.restore(target) == 2  # from the pinned slot, in place on the GPU
        assert target["big"].is_cuda and torch.equal(target["big"], state_at(2)["big"])
        # damage in the slot is caught on the device (the pieces are checked there): the
        # disk copy of the same step is loaded instead
        seal = next(p for p in Path(shm_dir).rglob("slot-*.json") if ShardManifest.from_bytes(p.read_bytes()).step == 2)
        big = next(t for t in ShardManifest.from_bytes(seal.read_bytes()).tensors if t.path == "big")
        flip_byte(seal.with_suffix(".bin"), big.offset + (20 << 20))
        target = zeros()
        with caplog.at_level(logging.WARNING):
            assert mgr.restore(target) == 2
        assert_same({k: target[k] for k in ("big", "half")}, {k: state_at(2)[k] for k in ("big", "half")})
        assert "checksum mismatch in tensor 'big'" in caplog.text and "tier memory" in caplog.text
    # the slots were unregistered before they were unmapped: memory reusing their
    # address range can be copied to the GPU (it failed with "resource already mapped")
    for _ in range(4):
        torch.ones(48 << 20, dtype=torch.uint8).cuda()
    torch.cuda.synchronize()

    flip_byte(ckpt_dir(root, 2) / "rank-00000.bin", 20 << 20)  # inside the second piece of "big"
    with CheckpointManager(root, memory_dir=str(tmp_path / "empty-shm")) as mgr:  # memory gone: disk only
        target = zeros()
        assert mgr.restore(target) == 1  # step 2's damage detected on the way in, step 1 loaded
        assert_same({k: target[k] for k in ("big", "half")}, {k: state_at(1)[k] for k in ("big", "half")})


class _CountingDisk(LocalDiskTier):
    """A disk tier that counts how often each saved rank's shard is opened (its shard
    manifest read from disk and parsed)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.opened: dict[int, int] = {}

    def open_shard(self, ckpt_id, ref):  # type: ignore[no-untyped-def]
        self.opened[ref.rank] = self.opened.get(ref.rank, 0) + 1
        return super().open_shard(ckpt_id, ref)


@pytest.mark.parametrize("resharded", [False, True], ids=["same-world", "resharded"])
def test_each_shard_is_opened_once_per_restore(root: Path, shm_dir: str, resharded: bool) -> None:
    """The layout check before any byte lands and the read share one opened shard: its
    manifest is read and parsed once (a restore of many small tensors paid for it twice)."""
    model, opt, _ = trained(1)
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        mgr.save(3, {"model": model, "opt": opt, "epoch": 2}).wait()
    disk = _CountingDisk(root)
    target_model, target_opt, _ = trained(2)
    target = {"model": target_model, "opt": target_opt, "epoch": 0}

    def execute(plan: RestorePlan) -> dict:
        # at another world size (as rank 0 of 2), the same shard goes through the resharding path
        return load_values(plan, target, 0, 2 if resharded else 1)[0]

    found = restore_agreed(LOCAL, Inventory([disk]), lambda world: [ShardNeed(0)], execute)
    assert found is not None and found[0].ckpt_id.step == 3
    load_into(target, found[1])
    assert_same(target_model.state_dict(), model.state_dict())
    assert disk.opened == {0: 1}

"""One restore path (issue 47): whatever the source (our tiers, an import of DCP's save) and
whichever plan reads it (this rank's whole shard, or the overlaps of every saved shard), the
saved state is first matched to the target the same way: optimizer moments by parameter
name, module prefixes (DDP's ``module.``), key types, any kind of target tensor (a conj()
view). Each case runs both plans and requires the same bytes; single process (the same
world size is 1 -> 1; the forced reshard reads as rank 0 of 2 would)."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt import CheckpointManager
from ckpt.errors import StateMismatch
from ckpt.restore.execute import LOCAL, restore_agreed
from ckpt.restore.plan import Inventory, ShardNeed
from ckpt.restore.reshard import load_values
from ckpt.restore.state_load import load_into
from ckpt.tiers.local import LocalDiskTier

PLANS = ["own-shard", "forced-reshard"]


class Net(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc0, self.fc1 = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(torch.relu(self.fc0(x)))


class Wrapped(torch.nn.Module):
    """DDP's and FSDP1's shape: the model under ``module`` (its keys gain ``module.``)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


def trained(seed: int, *, reverse: bool = False) -> tuple[Net, torch.optim.Adam]:
    model = Net(seed)
    params = list(model.parameters())
    optim = torch.optim.Adam(params[::-1] if reverse else params, lr=1e-2)
    model(torch.randn(5, 4)).sum().backward()
    optim.step()
    return model, optim


def moments(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, dict]:
    """Each parameter's optimizer state by the parameter's name."""
    return {name: optim.state[p] for name, p in model.named_parameters() if p in optim.state}


def assert_same_moments(got: dict[str, dict], want: dict[str, dict]) -> None:
    assert got.keys() == want.keys()
    for name, state in want.items():
        for k, v in state.items():
            assert torch.equal(got[name][k], v), f"{name}.{k}"


def restore(root: Path, state: dict, plan: str) -> int:
    """Restore ``state`` from ``root`` by ``plan``: the own shard (a one-process job), or
    as rank 0 of two would read it (every saved shard's overlaps)."""
    world = 1 if plan == "own-shard" else 2
    found = restore_agreed(LOCAL, Inventory([LocalDiskTier(root)]), lambda w: [ShardNeed(r) for r in range(w)],
                           lambda p: load_values(p, state, 0, world)[0])
    assert found is not None
    load_into(state, found[1])
    return found[0].ckpt_id.step


def dcp_import(state: dict, work: Path) -> Path:
    """``dcp.save`` of ``state``, then what ``ckpt import`` does: returns the imported root."""
    from ckpt.interop.dcp_import import read_dcp
    from ckpt.interop.offline_write import import_target, write_state

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process": it is
        dcp.save(state, checkpoint_id=str(work / "dcp"))
    root = work / "imported"
    root.mkdir()
    tier = LocalDiskTier(root)
    write_state(tier, import_target(tier, 1, run="imp"), read_dcp(work / "dcp"), run="imp")
    return root


@pytest.mark.parametrize("plan", PLANS)
def test_moments_follow_their_parameter_when_the_optimizer_lists_them_otherwise(
        tmp_path: Path, shm_dir: str, plan: str) -> None:
    model, optim = trained(1)
    with CheckpointManager(tmp_path, memory_dir=shm_dir) as mgr:
        mgr.save(1, {"model": model, "optim": optim}).wait()
    target_model, target_optim = trained(2, reverse=True)
    assert restore(tmp_path, {"model": target_model, "optim": target_optim}, plan) == 1
    assert_same_moments(moments(target_model, target_optim), moments(model, optim))


@pytest.mark.parametrize("plan", PLANS)
def test_an_import_of_fqn_keyed_optimizer_state_restores_by_name(tmp_path: Path, plan: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model, optim = trained(1)
    root = dcp_import({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)},
                      tmp_path)
    target_model, target_optim = trained(2, reverse=True)
    assert restore(root, {"model": target_model, "optim": target_optim}, plan) == 1
    assert_same_moments(moments(target_model, target_optim), moments(model, optim))
    assert torch.equal(target_model.fc0.weight, model.fc0.weight)


@pytest.mark.parametrize("plan", PLANS)
def test_a_positional_import_is_refused_naming_the_choice(tmp_path: Path, plan: str) -> None:
    """``optimizer.state_dict()`` keys moments by position: nothing says which parameter they
    belong to, so restoring them is a guess unless the user says the order is the same."""
    from ckpt import match_by_position

    model, optim = trained(1)
    root = dcp_import({"model": model.state_dict(), "optim": optim.state_dict()}, tmp_path)
    target_model, target_optim = trained(2)
    with pytest.raises(StateMismatch, match=r"optim: .*by position.*match_by_position"):
        restore(root, {"model": target_model, "optim": target_optim}, plan)
    assert restore(root, {"model": target_model, "optim": match_by_position(target_optim)}, plan) == 1
    assert_same_moments(moments(target_model, target_optim), moments(model, optim))


@pytest.mark.parametrize("plan", PLANS)
def test_a_conj_view_target_gets_the_saved_values(tmp_path: Path, shm_dir: str, plan: str) -> None:
    saved = torch.randn(3, 4, dtype=torch.complex64)
    with CheckpointManager(tmp_path, memory_dir=shm_dir) as mgr:
        mgr.save(1, {"z": saved, "n": torch.randn(5)}).wait()
    base, nbase = torch.zeros(3, 4, dtype=torch.complex64), torch.zeros(5)
    target = {"z": base.conj(), "n": torch._neg_view(nbase)}
    restore(tmp_path, target, plan)
    assert torch.equal(target["z"].resolve_conj(), saved) and torch.equal(base, saved.conj())
    assert torch.equal(target["n"].resolve_neg(), ckpt_load(tmp_path)["n"])


def ckpt_load(root: Path) -> dict:
    import ckpt

    return ckpt.load(str(root))


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("source", ["ours", "import"])
def test_a_bare_model_restores_into_a_ddp_wrapped_one_and_back(tmp_path: Path, shm_dir: str, plan: str,
                                                               source: str) -> None:
    model, optim = trained(1)
    if source == "ours":
        with CheckpointManager(tmp_path / "ours", memory_dir=shm_dir) as mgr:
            mgr.save(1, {"model": model, "optim": optim}).wait()
        root = tmp_path / "ours"
    else:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        root = dcp_import({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optim)}, tmp_path)
    target_model, target_optim = trained(2, reverse=True)
    wrapped = Wrapped(target_model)
    assert restore(root, {"model": wrapped, "optim": target_optim}, plan) == 1
    assert all(torch.equal(a, b) for a, b in zip(target_model.state_dict().values(), model.state_dict().values()))
    assert_same_moments(moments(target_model, target_optim), moments(model, optim))


def test_a_complex_value_survives_save_import_and_export(tmp_path: Path, shm_dir: str) -> None:
    from ckpt.interop.export import write_dcp
    from ckpt.restore.reshard import read_whole

    with CheckpointManager(tmp_path / "ours", memory_dir=shm_dir) as mgr:
        mgr.save(1, {"z": 1.5 - 2j, "t": torch.ones(2)}).wait()
    target = {"z": 0j, "t": torch.zeros(2)}
    restore(tmp_path / "ours", target, "own-shard")
    assert target["z"] == 1.5 - 2j and isinstance(target["z"], complex)
    write_dcp(read_whole(str(tmp_path / "ours"))[1], tmp_path / "exported")
    root = dcp_import({"z": 3 + 4j, "t": torch.ones(2)}, tmp_path)
    assert ckpt_load(root)["z"] == 3 + 4j
    back = {"z": 0j, "t": torch.zeros(2)}
    dcp.load(back, checkpoint_id=str(tmp_path / "exported"))
    assert back["z"] == 1.5 - 2j


@pytest.mark.parametrize("plan", PLANS)
def test_an_empty_container_in_the_target_matches_an_import_as_dcp_load_does(tmp_path: Path, plan: str) -> None:
    """DCP records no empty dict or list: the import has none, and ``dcp.load`` leaves the target's."""
    root = dcp_import({"t": torch.ones(2), "sub": {}, "seen": [], "more": {"inner": {}, "x": 1}}, tmp_path)
    target = {"t": torch.zeros(2), "sub": {}, "seen": [], "more": {"inner": {}, "x": 0}}
    restore(root, target, plan)
    assert target["sub"] == {} and target["seen"] == [] and target["more"] == {"inner": {}, "x": 1}
    assert torch.equal(target["t"], torch.ones(2))


def test_the_quickstart_state_exports_and_imports_back(tmp_path: Path, shm_dir: str) -> None:
    """What the library writes (an RNG state included) comes back through export -> import."""
    import ckpt
    from ckpt.interop.export import write_dcp
    from ckpt.restore.reshard import read_whole

    model, optim = trained(1)
    with CheckpointManager(tmp_path / "ours", memory_dir=shm_dir) as mgr:
        mgr.save(1, {"model": model, "optim": optim, "rng": ckpt.RNGState(), "epoch": 2}).wait()
    write_dcp(read_whole(str(tmp_path / "ours"), by_name=True)[1], tmp_path / "work" / "dcp")
    from ckpt.interop.dcp_import import read_dcp
    from ckpt.interop.offline_write import import_target, write_state

    (tmp_path / "back").mkdir()
    tier = LocalDiskTier(tmp_path / "back")
    write_state(tier, import_target(tier, 1, run="imp"), read_dcp(tmp_path / "work" / "dcp"), run="imp")
    target_model, target_optim = trained(2, reverse=True)
    state = {"model": target_model, "optim": target_optim, "rng": ckpt.RNGState(), "epoch": 0}
    assert restore(tmp_path / "back", state, "own-shard") == 1
    assert state["epoch"] == 2
    assert_same_moments(moments(target_model, target_optim), moments(model, optim))


@pytest.mark.parametrize("plan", PLANS)
def test_torchtitans_flattened_optimizer_imports_by_name_into_several_groups(tmp_path: Path, plan: str) -> None:
    """torchtitan saves ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``:
    "state.<fqn>.<moment>" and "param_groups.<fqn>.<hyperparameter>" keys; groups rebuilt by name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    model = Net(1)
    optim = torch.optim.Adam([{"params": [model.fc0.weight, model.fc1.bias]},
                              {"params": [model.fc0.bias, model.fc1.weight], "lr": 0.5}])
    model(torch.randn(5, 4)).sum().backward()
    optim.step()
    flat = get_optimizer_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True))
    root = dcp_import({"model": model.state_dict(), "optimizer": flat}, tmp_path)
    target_model = Net(2)
    target_optim = torch.optim.Adam([{"params": [target_model.fc1.bias, target_model.fc0.weight]},
                                     {"params": [target_model.fc1.weight, target_model.fc0.bias], "lr": 0.1}])
    assert restore(root, {"model": target_model, "optimizer": target_optim}, plan) == 1
    assert_same_moments(moments(target_model, target_optim), moments(model, optim))
    assert [g["lr"] for g in target_optim.param_groups] == [optim.defaults["lr"], 0.5]
    regrouped = torch.optim.Adam([{"params": [target_model.fc1.bias, target_model.fc0.bias]},
                                  {"params": [target_model.fc1.weight, target_model.fc0.weight]}])
    with pytest.raises(StateMismatch, match="groups its parameters otherwise.*as they were saved"):
        restore(root, {"model": target_model, "optimizer": regrouped}, plan)


def test_ls_says_which_optimizer_state_is_keyed_by_position(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from tests.test_ckpt_cli import ckpt as ckpt_cli

    model, optim = trained(1)
    root = dcp_import({"model": model.state_dict(), "optim": optim.state_dict(),
                       "named": get_optimizer_state_dict(model, optim)}, tmp_path)
    r = ckpt_cli("ls", root, "--json")
    assert r.returncode == 0, r.stderr
    import json

    assert json.loads(r.stdout)[0]["optimizers"] == {"optim": "by position", "named": "by name"}
    r = ckpt_cli("import", tmp_path / "dcp", "--from", "dcp", "--to", tmp_path / "again", "--step", "2", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["optimizers"] == {"optim": "by position", "named": "by name"}
    assert "optim: optimizer state by position" in ckpt_cli("ls", root).stdout


def test_dcp_load_through_our_reader_matches_moments_by_name(tmp_path: Path, shm_dir: str) -> None:
    """The DCP reader describes a named optimizer by name too: ``get_state_dict`` /
    ``set_state_dict`` into an optimizer listing its parameters otherwise gets each its own."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ckpt.dcp_reader import CheckpointReader

    model, optim = trained(1)
    with CheckpointManager(tmp_path / "ours", memory_dir=shm_dir) as mgr:
        mgr.save(1, {"model": model, "optim": optim}).wait()
    target_model, target_optim = trained(2, reverse=True)
    model_sd, optim_sd = get_state_dict(target_model, target_optim)
    state = {"model": model_sd, "optim": optim_sd}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=CheckpointReader(str(tmp_path / "ours"), memory_dir=shm_dir))
    set_state_dict(target_model, target_optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert_same_moments(moments(target_model, target_optim), moments(model, optim))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("plan", PLANS)
def test_on_the_gpu_moments_by_name_and_a_conj_view_target_from_pinned_memory(tmp_path: Path, shm_dir: str,
                                                                              plan: str) -> None:
    """The same normalisation into CUDA targets, read from the memory tier's pinned slot (the
    device-checked path) or through the overlaps."""
    model, optim = trained(1)
    model.cuda()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4, device="cuda")).sum().backward()
    optim.step()
    z = torch.randn(64, 1024, dtype=torch.complex64, device="cuda")
    with CheckpointManager(tmp_path, memory_dir=shm_dir) as mgr:
        mgr.save(1, {"model": model, "optim": optim, "z": z}).wait()
        memory = mgr.memory  # the pinned slot: the device-checked read
        target_model, target_optim = trained(2, reverse=True)
        target_model.cuda()
        target_optim = torch.optim.Adam(list(target_model.parameters())[::-1], lr=1e-2)
        base = torch.zeros_like(z)
        state = {"model": target_model, "optim": target_optim, "z": base.conj()}
        found = restore_agreed(LOCAL, Inventory([memory]), lambda w: [ShardNeed(r) for r in range(w)],
                               lambda p: load_values(p, state, 0, 1 if plan == "own-shard" else 2)[0])
        assert found is not None
        load_into(state, found[1])
    assert_same_moments(moments(target_model, target_optim), moments(model, optim))
    assert torch.equal(base, z.conj().resolve_conj())


@settings(derandomize=True, database=None, max_examples=8, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(st.permutations(range(4)), st.permutations(range(4)), st.integers(1, 3), st.sampled_from(PLANS))
def test_any_parameter_order_and_grouping_restores_by_name(tmp_path_factory: pytest.TempPathFactory,
                                                            saved_order: list[int], target_order: list[int],
                                                            split: int, plan: str) -> None:
    """Property: whatever order either side lists its parameters in, and wherever the groups
    split them (the same members, groups in either order), every moment and learning rate
    lands on its own parameter."""
    def built(seed: int, order: list[int], flip: bool) -> tuple[Net, torch.optim.Adam]:
        model = Net(seed)
        params = [list(model.parameters())[i] for i in order]
        members = sorted(params[:split], key=id), sorted(params[split:], key=id)
        by_name = {id(p): n for n, p in model.named_parameters()}
        groups = [{"params": sorted(members[0], key=lambda p: by_name[id(p)])},
                  {"params": sorted(members[1], key=lambda p: by_name[id(p)]), "lr": 0.5}]
        return model, torch.optim.Adam(groups[::-1] if flip else groups, lr=1e-2)

    work = tmp_path_factory.mktemp("prop")
    model, optim = built(1, saved_order, False)
    model(torch.randn(5, 4)).sum().backward()
    optim.step()
    with CheckpointManager(work, memory_dir=str(work / "shm")) as mgr:
        mgr.save(1, {"model": model, "optim": optim}).wait()
    # the target's groups hold the same members (split by the saved order), listed otherwise
    target_model, target_optim = built(2, saved_order, True)
    rank = {id(p): target_order.index(k) for k, p in enumerate(target_model.parameters())}
    for g in target_optim.param_groups:
        g["params"] = sorted(g["params"], key=lambda p: rank[id(p)])
    assert restore(work, {"model": target_model, "optim": target_optim}, plan) == 1
    assert_same_moments(moments(target_model, target_optim), moments(model, optim))
    lr = {n: g["lr"] for g in target_optim.param_groups for n, p in target_model.named_parameters()
          if any(p is q for q in g["params"])}
    want = {n: g["lr"] for g in optim.param_groups for n, p in model.named_parameters()
            if any(p is q for q in g["params"])}
    assert lr == want


@pytest.mark.parametrize("route", ["export", "reader"])
def test_a_ddp_save_loads_into_dcps_names_by_export_and_reader(tmp_path: Path, shm_dir: str, route: str) -> None:
    """DCP users load ``get_state_dict``'s names (no ``module.``): an export, and our reader,
    give them those names as well as the saved ones."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ckpt.dcp_reader import CheckpointReader
    from ckpt.interop.export import write_dcp
    from ckpt.restore.reshard import read_whole

    model, optim = trained(1)
    wrapped = Wrapped(model)
    with CheckpointManager(tmp_path / "ours", memory_dir=shm_dir) as mgr:
        mgr.save(1, {"model": wrapped, "optim": optim}).wait()
    target_model, target_optim = trained(2, reverse=True)
    model_sd, optim_sd = get_state_dict(target_model, target_optim)
    state = {"model": model_sd, "optim": optim_sd}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if route == "export":
            write_dcp(read_whole(str(tmp_path / "ours"), by_name=True)[1], tmp_path / "exported")
            dcp.load(state, checkpoint_id=str(tmp_path / "exported"))
        else:
            dcp.load(state, storage_reader=CheckpointReader(str(tmp_path / "ours"), memory_dir=shm_dir))
    set_state_dict(target_model, target_optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert torch.equal(target_model.fc0.weight, model.fc0.weight)
    assert_same_moments(moments(target_model, target_optim), moments(model, optim))


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adam(ps, lr=1e-3), lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-3)),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), lambda ps: torch.optim.RMSprop(ps, lr=1e-2),
    lambda ps: torch.optim.NAdam(ps, lr=1e-3), lambda ps: torch.optim.Adamax(ps, lr=1e-3)],
    ids=["adam", "adamw-tensor-lr", "sgd-momentum", "rmsprop", "nadam", "adamax"])
def test_our_zero_step_makes_what_torchs_init_optim_state_makes(make) -> None:
    """``normalise._zero_step`` is torch's ``_init_optim_state`` written out (its module's import
    costs every restoring process 1.5 s of CPU): the same moments, learning rates and
    parameters, so a torch that changes its own fails here, not in a user's restore."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    from ckpt.restore.normalise import _zero_step

    made = []
    for init in (_init_optim_state, _zero_step):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
        optim = make(list(model.parameters()))
        init(optim)
        made.append((model, optim))
    (m1, o1), (m2, o2) = made
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
    assert [g["lr"] for g in o1.param_groups] == [g["lr"] for g in o2.param_groups]
    s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]
    assert s1.keys() == s2.keys() and s1
    for k in s1:
        assert s1[k].keys() == s2[k].keys()
        for name, v in s1[k].items():
            assert torch.equal(v, s2[k][name]) if torch.is_tensor(v) else v == s2[k][name], (k, name)
    assert all(p.grad is None for p in m2.parameters())

"""`ckpt import DIR --from dcp`: a torch.distributed.checkpoint directory, saved by one
process or by FSDP2 ranks (torchtitan's way), becomes one of our checkpoints that
`ckpt.load` and a one-process `CheckpointManager` restore bitwise; pickled items and
hostile metadata are refused without being unpickled."""
from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path, PosixPath

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import ckpt
from ckpt import CheckpointManager
from tests.ckpt_helpers import REPO
from tests.integration_helpers import torchrun
from tests.test_ckpt_cli import ckpt as ckpt_cli


class Net(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 6), torch.nn.Linear(6, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](torch.relu(self.layers[0](x)))


class Opaque:
    """A value only pickle can store."""

    def __init__(self) -> None:
        self.note = "x"


def trained(seed: int) -> tuple[Net, torch.optim.AdamW]:
    model = Net(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model(torch.randn(3, 8)).sum().backward()
    optim.step()
    return model, optim


def dcp_save(state: dict, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.save(state, checkpoint_id=str(path))


def test_a_single_process_dcp_save_restores_bitwise(tmp_path: Path, root: Path, shm_dir: str) -> None:
    model, optim = trained(1)
    dcp_save({"model": model.state_dict(), "optim": optim.state_dict(), "epoch": 3, "tag": "warmup",
              "sizes": [1, 2.5]}, tmp_path / "step-40")
    r = ckpt_cli("import", tmp_path / "step-40", "--from", "dcp", "--to", root, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["step"] == 40  # from the directory's name, as torchtitan names them
    loaded = ckpt.load(str(root))
    assert (loaded["epoch"], loaded["tag"], loaded["sizes"]) == (3, "warmup", [1, 2.5])
    assert all(torch.equal(loaded["model"][k], v) for k, v in model.state_dict().items())
    fresh = Net(2)
    fresh_optim = torch.optim.AdamW(fresh.parameters())
    # optimizer.state_dict() keys moments by position: restoring them is the user's explicit choice
    state = {"model": fresh, "optim": ckpt.match_by_position(fresh_optim), "epoch": 0, "tag": "", "sizes": []}
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        assert mgr.restore(state) == 40
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    want, got = optim.state_dict(), fresh_optim.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for p, moments in want["state"].items():
        assert all(torch.equal(got["state"][p][k], v) for k, v in moments.items())
    assert ckpt_cli("verify", root).returncode == 0


def test_a_dcp_checkpoint_saved_by_two_fsdp_ranks_is_imported_whole(tmp_path: Path, root: Path,
                                                                     shm_dir: str) -> None:
    out, reference = tmp_path / "titan" / "step-7", tmp_path / "whole.safetensors"
    torchrun(REPO / "tests" / "dcp_save_child.py", str(out), str(reference))
    assert len(list(out.glob("*.distcp"))) == 2
    r = ckpt_cli("import", out, "--from", "dcp", "--to", root, "--json")
    assert r.returncode == 0, r.stderr
    whole = load_file(str(reference))
    loaded = ckpt.load(str(root))
    assert loaded["epoch"] == 3
    for name, t in whole.items():
        node = loaded
        for part in name.split("/"):
            node = node[part]
        assert torch.equal(node, t), name
    model = Net(5)  # the same model, unsharded, in one process
    optim = torch.optim.AdamW(model.parameters())
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        assert mgr.restore({"model": model, "optim": optim, "epoch": 0}) == 7
    assert all(torch.equal(model.state_dict()[k], whole[f"model/{k}"]) for k in model.state_dict())
    by_name = dict(zip([n for n, _ in model.named_parameters()], model.parameters()))
    assert all(torch.equal(optim.state[p]["exp_avg"], whole[f"optim/state/{n}/exp_avg"]) for n, p in by_name.items())


def test_a_pickled_item_is_refused_by_name_and_nothing_is_written(tmp_path: Path, root: Path) -> None:
    model, _ = trained(1)
    dcp_save({"model": model.state_dict(), "extra": Opaque(), "epoch": 1}, tmp_path / "dcp")
    r = ckpt_cli("import", tmp_path / "dcp", "--from", "dcp", "--to", root, "--step", "3")
    assert r.returncode == 1
    assert "extra" in r.stderr and "Opaque" in r.stderr and "never unpickles" in r.stderr, r.stderr
    assert "epoch" not in r.stderr  # plain values are not refused
    assert not root.exists() or not any(root.glob("step-*"))


def test_hostile_metadata_is_refused_without_running_it(tmp_path: Path, root: Path) -> None:
    marker = tmp_path / "ran"

    class Hostile:
        def __reduce__(self) -> tuple:
            return os.system, (f"touch {marker}",)

    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(Hostile()))
    r = ckpt_cli("import", tmp_path / "dcp", "--from", "dcp", "--to", root, "--step", "1")
    assert r.returncode == 1 and "posix.system" in r.stderr, r.stderr
    assert not marker.exists()


def test_an_import_into_a_root_with_checkpoints_needs_force_and_becomes_the_newest(tmp_path: Path, root: Path,
                                                                                 shm_dir: str) -> None:
    model, _ = trained(1)
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        mgr.save(100, {"model": Net(3)}).wait()
    dcp_save({"model": model.state_dict()}, tmp_path / "dcp")
    args = ("import", tmp_path / "dcp", "--from", "dcp", "--to", root, "--step", "5")
    r = ckpt_cli(*args)
    assert r.returncode == 1 and "--force" in r.stderr
    assert ckpt_cli(*args, "--force").returncode == 0
    fresh = Net(4)
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        assert mgr.restore({"model": fresh}) == 5  # a new generation: newer than step 100
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())


def test_metadata_naming_a_file_outside_the_directory_is_refused(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

    from ckpt.interop.dcp_import import read_metadata

    for name in ("../elsewhere", "..", "sub/x"):
        (tmp_path / ".metadata").write_bytes(pickle.dumps(Metadata(
            {"x": BytesStorageMetadata()}, storage_data={MetadataIndex("x"): _StorageInfo(name, 0, 10)})))
        with pytest.raises(ckpt.CheckpointError, match="outside the directory"):
            read_metadata(tmp_path)


def test_an_import_goes_to_an_object_store_url_as_well(tmp_path: Path) -> None:
    model, _ = trained(1)
    dcp_save({"model": model.state_dict(), "epoch": 2}, tmp_path / "dcp")
    url = f"file://{tmp_path / 'bucket' / 'run-1'}"
    r = ckpt_cli("import", tmp_path / "dcp", "--from", "dcp", "--to", url, "--step", "9", "--json")
    assert r.returncode == 0, r.stderr
    loaded = ckpt.load(url)
    assert loaded["epoch"] == 2 and all(torch.equal(loaded["model"][k], v) for k, v in model.state_dict().items())
    assert ckpt_cli("verify", url).returncode == 0


def test_an_optimizer_that_has_not_stepped_imports_too(tmp_path: Path, root: Path, shm_dir: str) -> None:
    """DCP stores no empty dict: the optimizer's empty ``state`` comes back as {}."""
    model = Net(1)
    dcp_save({"model": model.state_dict(), "optim": torch.optim.AdamW(model.parameters()).state_dict()},
             tmp_path / "dcp")
    assert ckpt_cli("import", tmp_path / "dcp", "--from", "dcp", "--to", root, "--step", "1").returncode == 0
    fresh = Net(2)
    optim = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        assert mgr.restore({"model": fresh, "optim": optim}) == 1
    assert optim.param_groups[0]["lr"] == 1e-3 and not optim.state


def test_planner_data_placing_an_item_at_a_huge_list_index_is_refused(tmp_path: Path, root: Path) -> None:
    from ckpt.interop.dcp_import import read_metadata

    dcp_save({"model": Net(1).state_dict(), "sizes": [1, 2]}, tmp_path / "dcp")
    metadata = read_metadata(tmp_path / "dcp")
    metadata.planner_data["sizes"] = ("sizes", 10**12)  # would grow a list to 10**12 entries
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(metadata))
    r = ckpt_cli("import", tmp_path / "dcp", "--from", "dcp", "--to", root, "--step", "1")
    assert r.returncode == 1 and "not a path in a state" in r.stderr, r.stderr


class _CraftedPath:
    """Pickles as a PosixPath whose cached text is a plain name while its parts lead
    elsewhere (what a hostile .metadata can hold)."""

    def __init__(self, shown: str, real: Path) -> None:
        self.shown, self.real = shown, real

    def __reduce__(self) -> tuple:
        return PosixPath, (str(self.real),), (None, {"_str": self.shown})


def _tamper(directory: Path, change) -> None:
    """Rewrite ``directory``'s .metadata after ``change(metadata, the .distcp file)``."""
    from ckpt.interop.dcp_import import read_metadata

    metadata = read_metadata(directory)
    [data_file] = directory.glob("*.distcp")
    change(metadata, data_file)
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))


def _storage(metadata, fqn_prefix: str = "epoch"):
    return next(info for index, info in metadata.storage_data.items() if index.fqn.startswith(fqn_prefix))


def _outside_copy(data_file: Path) -> Path:
    outside = data_file.parent.parent / "outside.distcp"
    outside.write_bytes(data_file.read_bytes())
    return outside


def _crafted_path(metadata, data_file: Path) -> None:
    outside = _outside_copy(data_file)
    for info in metadata.storage_data.values():
        info.relative_path = _CraftedPath(data_file.name, outside)
    data_file.rename(data_file.with_name("moved-away"))


def _symlinked(metadata, data_file: Path) -> None:
    outside = _outside_copy(data_file)
    data_file.unlink()
    data_file.symlink_to(outside)


def _set(field: str, value, prefix: str = "epoch"):
    def change(metadata, data_file: Path) -> None:
        setattr(_storage(metadata, prefix), field, value)
    return change


def _tensor_size(metadata, data_file: Path) -> None:
    metadata.state_dict_metadata["model.layers.0.weight"].size = "big"


def _huge_tensor(metadata, data_file: Path) -> None:
    """A 4 TiB tensor declared over the bytes of a small one (issue 48)."""
    md = metadata.state_dict_metadata["model.layers.0.weight"]
    md.size = torch.Size([1 << 40])
    md.chunks[0].sizes = torch.Size([1 << 40])


def _deep_path(metadata, data_file: Path) -> None:
    metadata.planner_data["epoch"] = ("a",) * 100_000


@pytest.mark.parametrize("change, message", [
    (_crafted_path, "outside the directory"),
    (_symlinked, "not a regular file"),
    (lambda metadata, data_file: data_file.unlink(), "missing"),
    (_set("offset", -5), "not in the file"),
    (_set("length", 1 << 40), "not in the file"),
    (_set("length", "10"), "not in the file"),
    (_tensor_size, "not a list of non-negative integers"),
    (_deep_path, "not a path in a state"),
    (_huge_tensor, "more than its stored bytes hold"),
], ids=["crafted-posixpath", "symlinked-distcp", "missing-file", "negative-offset", "1-tib-length",
        "string-length", "string-tensor-size", "100k-deep-path", "4-tib-tensor"])
def test_hostile_storage_metadata_gets_one_clear_line_and_nothing_is_read_or_written(
        tmp_path: Path, root: Path, change, message: str) -> None:
    dcp_save({"model": Net(1).state_dict(), "epoch": 7}, tmp_path / "dcp")
    _tamper(tmp_path / "dcp", change)
    r = ckpt_cli("import", tmp_path / "dcp", "--from", "dcp", "--to", root, "--step", "1")
    assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not root.exists() or not any(root.glob("step-*"))

"""Restore at another world size (issue 18): DTensor Shard(0)/Shard(1), an FSDP2 MLP with
AdamW moments and an FSDP2 model with tied weights, saved at 4 ranks restored at 2 and 3,
at 3 restored at 4, at 2 restored in one process, each bitwise equal to the saved
``full_tensor()``; a damaged chunk inside a partial read; a checkpoint from before the
layout record refused with its reason.

Four torchrun launches in all, each doing several cases (reshard_child.py)."""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from ckpt import CheckpointManager
from ckpt.format.checksum import crc32c_of
from ckpt.format.layout import Layout
from ckpt.format.manifest import Manifest, ManifestError, ShardManifest
from ckpt.restore.reshard import NotReshardable
from ckpt.tiers.local import LocalDiskTier
from ckpt.tiers.object_store import ObjectStoreTier
from tests.integration_helpers import torchrun
from tests.reshard_child import TiedLM

CHILD = Path(__file__).with_name("reshard_child.py")


def plain_state(seed: int) -> dict:
    """The child's state without a mesh: what one process restores into."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 10))
    lm = TiedLM()
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-2),
            "lm": lm, "lm_optim": torch.optim.AdamW(lm.parameters(), lr=1e-2),
            "big": torch.zeros(256, 1024), "wide": torch.zeros(6, 10), "epoch": -1}


class Wrapped(torch.nn.Module):
    """A model held as DDP holds it: its keys start with ``module.``."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


def whole(state: dict) -> dict:
    model = state["model"].module if isinstance(state["model"], Wrapped) else state["model"]
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        out.update({f"optim.{i}.{k}": v for k, v in state["optim"].state[p].items()})
    out.update({f"lm.{k}": v for k, v in state["lm"].state_dict().items()})
    for i, p in enumerate(state["lm"].parameters()):
        out.update({f"lm_optim.{i}.{k}": v for k, v in state["lm_optim"].state[p].items()})
    assert state["lm"].head.weight is state["lm"].emb.weight, "the tie was broken"
    out["big"], out["wide"] = state["big"], state["wide"]
    return out


def as_format_1_1(src: Path, dst: Path) -> None:
    """A copy of ``src`` as this engine wrote it before the layout record (format 1.1)."""
    shutil.copytree(src, dst)
    tier = LocalDiskTier(dst)
    for info in tier.list():
        folder = dst / info.id.name
        commit = Manifest.from_bytes((folder / "manifest.json").read_bytes())
        refs = []
        for ref in commit.shards:
            man = ShardManifest.from_bytes((folder / ref.manifest_file).read_bytes())
            old = dataclasses.replace(man, format_version="1.1",
                                      tensors=[dataclasses.replace(e, layout=None) for e in man.tensors])
            raw = old.to_bytes()
            (folder / ref.manifest_file).write_bytes(raw)
            refs.append(dataclasses.replace(ref, manifest_crc32c=crc32c_of(raw)))
        old_commit = dataclasses.replace(commit, shards=refs, format_version="1.1")
        (folder / "manifest.json").write_bytes(old_commit.to_bytes())


def test_restore_at_other_world_sizes(tmp_path: Path, shm_dir: str) -> None:
    at4, at3, at2 = tmp_path / "at4", tmp_path / "at3", tmp_path / "at2"
    log = torchrun(CHILD, f"{shm_dir}/a", "--save", str(at3), nproc=3)
    assert log.count("restored step 2 at 3 from the same size") == 3, log[-3000:]
    log = torchrun(CHILD, f"{shm_dir}/b", "--restore", str(at3), "2", "--save", str(at4), nproc=4)
    assert log.count("restored step 2 at 4 from 3") == 4, log[-3000:]
    assert log.count("restored step 2 at 4 from the same size") == 4, log[-3000:]
    log = torchrun(CHILD, f"{shm_dir}/c", "--restore", str(at4), "2", "--save", str(at2), nproc=2)
    assert log.count("restored step 2 at 2 from 4") == 2, log[-3000:]
    # Damage inside a partial read at 3 ranks: found, the step skipped on every rank, the previous one restored.
    log = torchrun(CHILD, f"{shm_dir}/d", "--restore", str(at4), "1", "--damage", nproc=3)
    assert "checksum mismatch in tensor 'big' bytes 65536..131072" in log, log[-3000:]
    assert log.count("restored step 1 at 3 from 4") == 3, log[-3000:]

    # 2 -> 1: one process, no mesh: every tensor whole, the optimizer's moments created to read
    # into; from the disk into a model wrapped as DDP wraps it (``module.``) and an optimizer
    # listing its parameters in reverse (moments follow names, not positions), then from an
    # object store alone (ranged reads).
    bucket = tmp_path / "bucket"
    shutil.copytree(at2, bucket)
    for where, order in (({"root": at2}, -1), ({"root": None, "object_store": ObjectStoreTier(f"file://{bucket}")}, 1)):
        state = plain_state(7)
        state["optim"] = torch.optim.AdamW(list(state["model"].parameters())[::order], lr=1e-2)
        if order == -1:
            state["model"] = Wrapped(state["model"])
        with CheckpointManager(**where, memory_dir=f"{shm_dir}/e", run="reshard") as mgr:
            assert mgr.restore(state) == 2
            assert mgr.last_reshard is not None and mgr.last_reshard.saved_world == 2
            assert mgr.last_reshard.amplification == 1.0
        want, got = torch.load(at2 / "ref-2.pt"), whole(state)
        assert sorted(got) == sorted(want)
        assert [k for k in want if not torch.equal(got[k], want[k])] == []
        assert state["epoch"] == 2

    old = tmp_path / "old"
    as_format_1_1(at2, old)
    with CheckpointManager(old, memory_dir=f"{shm_dir}/f", run="reshard") as mgr:
        with pytest.raises(NotReshardable, match=r"saved by 2 ranks in manifest format 1\.1, which does not "
                                                  r"record where each rank's shard of a DTensor lies; restore it "
                                                  r"with 2 ranks"):
            mgr.restore(plain_state(7))


def test_hostile_layouts_are_refused() -> None:
    good = {"global_shape": [8, 4], "mesh_shape": [2], "mesh_dims": ["dp"], "placements": ["Shard(0)"],
            "coordinate": [1], "runs": [[[4, 4]], [[0, 4]]]}
    assert Layout.from_json(good, (4, 4), "t").local_shape == (4, 4)
    for bad, why in [({"runs": [[[6, 4]], [[0, 4]]]}, "run outside"), ({"runs": [[[4, 3]], [[0, 4]]]}, "add up"),
                     ({"placements": ["Partial(sum)"]}, "placements"), ({"coordinate": [2]}, "coordinate"),
                     ({"runs": [[[4, 4]]]}, "lengths"), ({"global_shape": "x"}, "integers")]:
        with pytest.raises(ManifestError, match=why):
            Layout.from_json({**good, **bad}, (4, 4), "t")

"""`ckpt export`: a checkpoint as safetensors weights (what inference and the HF example
load) or as a torch.distributed.checkpoint directory (what `dcp.load` reads)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException

from ckpt import CheckpointError, CheckpointManager
from ckpt.dcp_reader import CheckpointReader
from ckpt.interop.export import model_weights
from tests.ckpt_helpers import flip_byte
from tests.test_ckpt_cli import ckpt


class Tied(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(50, 16)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight  # tied, as language models do

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(ids)))


@pytest.fixture
def saved_model(root: Path, shm_dir: str) -> tuple[Path, torch.nn.Module]:
    model = Tied(1)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.tensor([3, 4])).sum().backward()
    optim.step()
    with CheckpointManager(root, memory_dir=shm_dir) as mgr:
        mgr.save(4, {"model": model, "optim": optim, "epoch": 2}).wait()
    return root, model


def test_safetensors_export_loads_into_a_fresh_model(saved_model, tmp_path: Path, shm_dir: str) -> None:
    root, model = saved_model
    r = ckpt("export", root, "--format", "safetensors", "--to", tmp_path / "st", "--json")
    assert r.returncode == 0, r.stderr
    assert [Path(f).name for f in json.loads(r.stdout)["files"]] == ["model.safetensors"]
    weights = load_file(str(tmp_path / "st" / "model.safetensors"))
    fresh = Tied(2)
    fresh.load_state_dict(weights, strict=True)
    for name, t in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name


def test_a_large_model_is_written_in_shards_with_an_index(saved_model, tmp_path: Path) -> None:
    root, model = saved_model
    assert ckpt("export", root, "--format", "safetensors", "--to", tmp_path / "st", "--max-shard-size",
                "4000").returncode == 0
    index = json.loads((tmp_path / "st" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    merged = {k: v for f in files for k, v in load_file(str(tmp_path / "st" / f)).items()}
    assert merged.keys() == model.state_dict().keys()
    assert all(torch.equal(merged[k], v) for k, v in model.state_dict().items())


def test_dcp_export_is_read_by_dcp_load(saved_model, tmp_path: Path) -> None:
    root, model = saved_model
    assert ckpt("export", root, "--format", "dcp", "--to", tmp_path / "dcp").returncode == 0
    fresh = Tied(3)
    target = {"model": fresh.state_dict(), "epoch": 0}
    dcp.load(target, checkpoint_id=str(tmp_path / "dcp"))
    assert target["epoch"] == 2
    assert all(torch.equal(target["model"][k], v) for k, v in model.state_dict().items())


def test_ddp_prefixes_are_dropped_and_top_level_tensors_are_exported_all() -> None:
    w = torch.ones(2)
    assert list(model_weights({"model": {"module.fc.weight": w}})) == ["fc.weight"]
    # no model entry: the checkpoint's tensors sit at the top level, each is a weight (issue 31)
    assert list(model_weights({"w": w, "b": w, "epoch": 3})) == ["w", "b"]
    with pytest.raises(CheckpointError, match="pass --key"):
        model_weights({"epoch": 3})


def test_export_refuses_a_non_empty_destination(saved_model, tmp_path: Path) -> None:
    root, _ = saved_model
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("mine")
    r = ckpt("export", root, "--format", "safetensors", "--to", tmp_path / "busy")
    assert r.returncode == 2 and "--force" in r.stderr


def test_dcp_load_reads_our_checkpoint_directly_with_its_own_planner(saved_model, tmp_path: Path) -> None:
    root, model = saved_model
    fresh = Tied(5)
    optim = torch.optim.AdamW(fresh.parameters())
    fresh(torch.tensor([1, 2])).sum().backward()
    optim.step()  # so the target has optimizer state to load into
    target = {"model": fresh.state_dict(), "optim": optim.state_dict(), "epoch": 0}
    dcp.load(target, storage_reader=CheckpointReader(root))
    assert target["epoch"] == 2
    assert all(torch.equal(target["model"][k], v) for k, v in model.state_dict().items())
    assert target["optim"]["param_groups"][0]["lr"] == 1e-3


def test_a_damaged_chunk_fails_the_dcp_load(saved_model, tmp_path: Path) -> None:
    root, _ = saved_model
    no_slots_dir = tmp_path / "no-slots"
    no_slots_dir.mkdir()
    flip_byte(next(root.glob("step-*/rank-00000.bin")), 100)
    target = {"model": Tied(6).state_dict()}
    with pytest.raises(CheckpointException, match="checksum mismatch"):  # DCP wraps what readers raise
        dcp.load(target, storage_reader=CheckpointReader(root, memory_dir=str(no_slots_dir)))


def test_the_hf_examples_checkpoint_exports_to_what_from_pretrained_loads(tmp_path: Path, shm_dir: str) -> None:
    """The real example (a Trainer with the HF callback) saves; the export, whole and in
    shards with an index, is a directory that ``from_pretrained`` loads bitwise."""
    import subprocess
    import sys

    from transformers import GPT2LMHeadModel

    from examples.train_torchrun import weights_digest
    from tests.ckpt_helpers import REPO

    root, out = tmp_path / "run", tmp_path / "out.json"
    subprocess.run([sys.executable, str(REPO / "examples" / "train_hf.py"), "--root", str(root), "--steps", "3",
                    "--every", "2", "--memory-dir", shm_dir, "--out", str(out)], check=True, cwd=REPO,
                   capture_output=True, timeout=300)
    digest = json.loads(out.read_text())["digest"]
    for name, shard_size in (("whole", "5000000000"), ("sharded", "100000")):
        r = ckpt("export", root, "--format", "safetensors", "--to", tmp_path / name, "--max-shard-size", shard_size,
                 "--json")
        assert r.returncode == 0, r.stderr
        files = {Path(f).name for f in json.loads(r.stdout)["files"]}
        assert "config.json" in files and ("model.safetensors.index.json" in files) == (name == "sharded")
        assert weights_digest(GPT2LMHeadModel.from_pretrained(tmp_path / name)) == digest, name


def test_force_over_an_earlier_export_leaves_none_of_its_files(saved_model, tmp_path: Path) -> None:
    """A single-file export, then a sharded one with --force: the old model.safetensors
    would be what transformers loads; it is gone, and only the new files are there."""
    root, _ = saved_model
    out = tmp_path / "st"
    assert ckpt("export", root, "--format", "safetensors", "--to", out).returncode == 0
    (out / "notes.txt").write_text("the user's own file")
    r = ckpt("export", root, "--format", "safetensors", "--to", out, "--max-shard-size", "4000", "--force", "--json")
    assert r.returncode == 0, r.stderr
    assert not (out / "model.safetensors").exists()
    assert sorted(p.name for p in out.iterdir()) == sorted([*(Path(f).name for f in json.loads(r.stdout)["files"]),
                                                           "notes.txt"])


def test_a_dangling_destination_is_one_clear_line(saved_model, tmp_path: Path) -> None:
    root, _ = saved_model
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    r = ckpt("export", root, "--format", "safetensors", "--to", tmp_path / "link")
    assert r.returncode in (1, 2) and "Traceback" not in r.stderr and "link" in r.stderr, r.stderr


def test_a_write_that_fails_midway_leaves_the_earlier_export_whole(saved_model, tmp_path: Path) -> None:
    """The disk fills during the export (here: a file size limit, EFBIG): one clear line,
    and the earlier export is left as it was, with no partial file beside it."""
    import resource
    import signal
    import subprocess
    import sys

    from tests.ckpt_helpers import REPO

    root, _ = saved_model
    out = tmp_path / "st"
    assert ckpt("export", root, "--format", "safetensors", "--to", out).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))

    for fmt in ("safetensors", "dcp"):
        r = subprocess.run([sys.executable, "-m", "ckpt.cli", "export", str(root), "--format", fmt, "--to", str(out),
                            "--force"], cwd=REPO, capture_output=True, text=True, timeout=120, preexec_fn=small_files,
                           env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                                "PYTHONDONTWRITEBYTECODE": "1"})  # the limit would truncate .pyc files
        assert r.returncode == 1 and "Traceback" not in r.stderr and "error:" in r.stderr, r.stderr
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before

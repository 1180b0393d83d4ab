"""The Lightning integration on a real Trainer and a small real model (the example GPT
with dropout): a run SIGKILLed mid-epoch, preempted by SIGTERM, and SIGKILLed after an
epoch-end checkpoint, restarted each time as a new process, ends bitwise equal to an
uninterrupted run with the same seed; on one process, and on two DDP ranks under
torchrun, where only the last rank is hit and the other must follow it."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

import ckpt
from tests.ckpt_helpers import REPO
from tests.integration_helpers import assert_ddp_resumes_exactly, assert_resumes_exactly


def test_interrupted_lightning_run_resumes_exactly(tmp_path: Path, shm_dir: str) -> None:
    # every 4 steps, 6 batches an epoch: 4 is mid-epoch; SIGTERM after step 10 saves at
    # the end of step 11; 12 ends epoch 2
    assert_resumes_exactly("examples.train_lightning", tmp_path, shm_dir, restored=[4, 11, 12])


def test_two_ddp_ranks_resume_exactly_and_save_together(tmp_path: Path, shm_dir: str) -> None:
    """And a crash by an exception on one rank is timed for the restart, as in ``ckpt.resumable``
    (the same launch: ``assert_ddp_resumes_exactly``)."""
    assert_ddp_resumes_exactly("examples.train_lightning", tmp_path, shm_dir, restored=[4, 11, 12])


def test_data_loader_position_is_the_batches_delivered() -> None:
    """Workers prefetch ahead; the saved position is what the loop received."""
    data = torch.utils.data.TensorDataset(torch.arange(40))

    def loader() -> ckpt.ResumableDataLoader:
        return ckpt.ResumableDataLoader(data, sampler=ckpt.ResumableSampler(data, seed=3), batch_size=4,
                                        num_workers=2)

    def batches(it: object) -> list[list[int]]:
        return [b[0].tolist() for b in it]

    ref = loader()
    epochs = [batches(ref) for _ in range(3)]
    first = loader()
    assert batches(first) == epochs[0]
    it = iter(first)
    seen = [next(it)[0].tolist() for _ in range(3)]
    state = first.state_dict()
    del it
    assert state == {"epoch": 1, "consumed": 12, "start": 0, "world_size": 1}
    resumed = loader()
    resumed.load_state_dict(state)
    assert seen + batches(resumed) == epochs[1]
    assert resumed.state_dict() == {"epoch": 1, "consumed": 40, "start": 0, "world_size": 1}
    assert batches(resumed) == epochs[2]


def test_an_object_store_only_manager_works_with_the_lightning_io(tmp_path: Path, shm_dir: str) -> None:
    """root=None (no disk tier): the integration names the store when there is nothing to
    resume from (it used to die on mgr.disk.root), and resumes from the store when there is."""
    from ckpt.integrations.lightning import RESUME, LightningCheckpoint  # Lightning: imported by this test only

    url = f"file://{tmp_path}/store"
    with ckpt.CheckpointManager(None, object_store=url, memory_dir=shm_dir) as mgr:
        guard = LightningCheckpoint(mgr)
        with pytest.raises(ckpt.CheckpointError, match="store"):
            guard.io.load_checkpoint(RESUME)
        mgr.save(7, {"global_step": 7, "w": torch.ones(3)}, urgent=True).wait()
        assert guard.io.load_checkpoint(RESUME)["global_step"] == 7


INTEGRATIONS = REPO / "ckpt" / "integrations"


@pytest.mark.parametrize("module", ["lightning.py", "huggingface.py"])
def test_the_framework_integrations_use_no_private_api(module: str) -> None:
    """No ``obj._name`` on anything but the integration's own objects, and nothing
    imported from a private module or by a private name: a framework's private API
    changes without notice (Lightning's ``_checkpoint_connector`` was used here)."""
    tree = ast.parse((INTEGRATIONS / module).read_text())
    private = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) \
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            private.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [*node.module.split("."), *(alias.name for alias in node.names)]
            private += [f"line {node.lineno}: {name}" for name in names if _private(name)]
    assert not private, f"{module} uses private API: {private}"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_lightning_saves_and_restores_through_public_api_only(tmp_path: Path, shm_dir: str) -> None:
    """A Trainer that refuses every private attribute to ckpt's code runs a job that
    crashes after a mid-epoch checkpoint and resumes it in a new Trainer: the weights
    end bitwise equal to an uninterrupted run's, and a user callback's and the
    datamodule's states come back."""
    import lightning.pytorch as pl

    from ckpt.integrations.lightning import LightningCheckpoint

    class PublicOnlyTrainer(pl.Trainer):
        def __getattribute__(self, name: str) -> object:
            if _private(name) and sys._getframe(1).f_globals.get("__name__", "").startswith("ckpt."):
                raise AssertionError(f"ckpt reached into trainer.{name}")
            return super().__getattribute__(name)

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.drop = torch.nn.Linear(4, 1), torch.nn.Dropout(0.2)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(self.drop(x)), y)

        def configure_optimizers(self) -> dict:
            optim = torch.optim.AdamW(self.parameters(), lr=0.05)
            sched = torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.5)
            return {"optimizer": optim, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Data(pl.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            gen = torch.Generator().manual_seed(1)
            x, y = torch.randn(24, 4, generator=gen), torch.randn(24, 1, generator=gen)
            self.data = torch.utils.data.TensorDataset(x, y)
            self.loaders = 0  # a state of its own: the loaders it built, restarts included

        def train_dataloader(self) -> ckpt.ResumableDataLoader:
            self.loaders += 1
            return ckpt.ResumableDataLoader(self.data, sampler=ckpt.ResumableSampler(self.data, seed=2), batch_size=4)

        def state_dict(self) -> dict:
            return {"loaders": self.loaders}

        def load_state_dict(self, state_dict: dict) -> None:
            self.loaders += state_dict["loaders"]

    class Counter(pl.Callback):
        def __init__(self, crash_at: int | None = None) -> None:
            self.batches, self.crash_at = 0, crash_at

        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            self.batches += 1
            if trainer.global_step == self.crash_at:
                raise RuntimeError("injected crash")

        def state_dict(self) -> dict:
            return {"batches": self.batches}

        def load_state_dict(self, state_dict: dict) -> None:
            self.batches = state_dict["batches"]

    def fit(name: str, counter: Counter, data: Data) -> Model:
        pl.seed_everything(0, verbose=False)
        with ckpt.CheckpointManager(tmp_path / name, memory_dir=shm_dir + "/" + name) as mgr:
            guard = LightningCheckpoint(mgr, every=4)
            trainer = PublicOnlyTrainer(max_steps=10, callbacks=[counter, guard], plugins=[guard.io],
                                        enable_checkpointing=False, logger=False, accelerator="cpu",
                                        enable_progress_bar=False, enable_model_summary=False,
                                        default_root_dir=tmp_path)
            model = Model()
            trainer.fit(model, datamodule=data, ckpt_path=guard.resume_path())
        return model

    clean_counter, clean_data = Counter(), Data()
    clean = fit("clean", clean_counter, clean_data)
    with pytest.raises(RuntimeError, match="injected crash"):
        fit("faulty", Counter(crash_at=7), Data())  # 6 batches an epoch: saved at step 4, mid-epoch
    counter, data = Counter(), Data()
    resumed = fit("faulty", counter, data)
    assert all(torch.equal(a, b) for a, b in zip(clean.state_dict().values(), resumed.state_dict().values(),
                                                   strict=True)), "the resumed run diverged"
    assert counter.batches == clean_counter.batches == 10  # 4 restored (it counts before the save) + 6
    assert data.loaders == 2 and clean_data.loaders == 1  # the crashed run's loader, restored, + its own

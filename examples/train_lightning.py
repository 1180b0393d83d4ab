"""Train the tiny GPT with PyTorch Lightning, checkpointed by ckpt-guard.

    python examples/train_lightning.py --root /tmp/ckpt-lightning

    torchrun --nproc-per-node=2 --max-restarts=3 examples/train_lightning.py --root /tmp/ckpt-lightning

Interrupt it at any moment (Ctrl-C, SIGTERM, SIGKILL) and run the same command again:
it resumes from the newest checkpoint (from shared memory when that survived) and ends
with the same weights as an uninterrupted run. SIGTERM makes it save at the next step
and exit 143. ``--faults 6:kill,10:term`` injects faults for the tests (on the last rank
only: under torchrun the other ranks must follow it).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ckpt  # noqa: E402
from ckpt.integrations.lightning import LightningCheckpoint  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from examples.harness import Faults, parse_args, world_size  # noqa: E402
from examples.train_torchrun import synthetic_corpus, weights_digest  # noqa: E402


class TinyLM(pl.LightningModule):
    """The example GPT; dropout on the logits makes every step draw random numbers. Its
    hyper-parameters hold a dataclass, which the checkpoint leaves out (see
    ckpt.integrations.lightning)."""

    def __init__(self, cfg: GPTConfig, steps: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.gpt, self.drop, self.steps = GPT(cfg), nn.Dropout(0.1), steps

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.drop(self.gpt(x))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def configure_optimizers(self) -> dict:
        optim = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=self.steps)
        return {"optimizer": optim, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class FaultCallback(pl.Callback):
    def __init__(self, faults: Faults) -> None:
        self.faults = faults

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        self.faults.fire(trainer.global_step)


def main() -> None:
    args = parse_args(__doc__)
    world = world_size()  # first: the manager and the sampler take rank and world size from its group
    pl.seed_everything(args.seed, verbose=False)

    data = synthetic_corpus(args.batch * args.batches_per_epoch, GPTConfig.tiny())
    loader = ckpt.ResumableDataLoader(data, sampler=ckpt.ResumableSampler(data, seed=args.seed), batch_size=args.batch)
    # DDP keeps the weights, optimizer and scheduler identical on every rank: rank 0 stores them
    replicated = ("state_dict", "optimizer_states", "lr_schedulers")
    with ckpt.CheckpointManager(args.root, memory_dir=args.memory_dir, keep_last=2, replicated=replicated) as mgr:
        guard = LightningCheckpoint(mgr, every=args.every)
        trainer = pl.Trainer(max_steps=args.steps, callbacks=[guard, FaultCallback(Faults(args.faults, args.root))],
                             plugins=[guard.io], enable_checkpointing=False, logger=False, accelerator="cpu",
                             devices=world, strategy="ddp" if world > 1 else "auto",
                             use_distributed_sampler=False,  # the ResumableSampler splits the data by rank
                             enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=args.root)
        module = TinyLM(GPTConfig.tiny(), args.steps)
        trainer.fit(module, loader, ckpt_path=guard.resume_path())
    if args.out and trainer.global_rank == 0:
        Path(args.out).write_text(json.dumps({"digest": weights_digest(module), "steps": trainer.global_step}))


if __name__ == "__main__":
    main()

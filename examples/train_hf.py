"""Train a tiny GPT-2 with the Hugging Face Trainer, checkpointed by ckpt-guard.

    python examples/train_hf.py --root /tmp/ckpt-hf
    torchrun --nproc-per-node=2 --max-restarts=3 examples/train_hf.py --root /tmp/ckpt-hf

Interrupt it at any moment (Ctrl-C, SIGTERM, SIGKILL) and run the same command again:
it resumes from the newest checkpoint (from shared memory when that survived) and ends
with the same weights as an uninterrupted run. SIGTERM makes it save at the next step
and exit 143. ``--faults 6:kill,10:term`` injects faults for the tests (on the last rank
only: under torchrun the other ranks must follow it). The model is
built from a config (random weights, dropout on): nothing is downloaded.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ckpt  # noqa: E402
from ckpt.integrations.huggingface import HFCheckpoint  # noqa: E402
from examples.gpt import GPTConfig  # noqa: E402
from examples.harness import Faults, parse_args, world_size  # noqa: E402
from examples.train_torchrun import synthetic_corpus, weights_digest  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    """The synthetic corpus as the dicts a causal LM takes (the model shifts the labels)."""

    def __init__(self, n: int) -> None:
        self.tokens = synthetic_corpus(n, GPTConfig.tiny()).tensors[0]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class FaultCallback(TrainerCallback):
    def __init__(self, faults: Faults) -> None:
        self.faults = faults

    def on_step_end(self, args: TrainingArguments, state: object, control: object, **kwargs: object) -> None:
        self.faults.fire(state.global_step)


def main() -> None:
    args = parse_args(__doc__)
    world_size()  # under torchrun: join its process group before the Trainer builds one
    targs = TrainingArguments(output_dir=str(Path(args.root) / "trainer"), max_steps=args.steps, seed=args.seed,
                              per_device_train_batch_size=args.batch, learning_rate=3e-3, lr_scheduler_type="cosine",
                              save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
                              logging_steps=5, dataloader_num_workers=0)
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                       bos_token_id=0, eos_token_id=0))
    # DDP keeps these identical on every rank: rank 0 stores them
    replicated = ("model", "optimizer", "scheduler", "scaler")
    with ckpt.CheckpointManager(args.root, memory_dir=args.memory_dir, keep_last=2, replicated=replicated) as mgr:
        guard = HFCheckpoint(mgr, every=args.every)
        trainer = Trainer(model=model, args=targs, train_dataset=Tokens(args.batch * args.batches_per_epoch),
                          callbacks=[guard, FaultCallback(Faults(args.faults, args.root))])
        trainer.train(resume_from_checkpoint=guard.resume(trainer))
    if args.out and targs.process_index == 0:
        Path(args.out).write_text(json.dumps({"digest": weights_digest(model), "steps": trainer.state.global_step}))


if __name__ == "__main__":
    main()

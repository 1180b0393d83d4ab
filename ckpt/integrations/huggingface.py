"""Hugging Face transformers: checkpoints into a ``CheckpointManager``, exact resume.

    guard = HFCheckpoint(mgr, every=50)
    trainer = Trainer(model, TrainingArguments(..., save_strategy="no"), train_dataset=data,
                      callbacks=[guard])
    trainer.train(resume_from_checkpoint=guard.resume(trainer))

Saving: the model, optimizer, LR scheduler, grad scaler, RNG states, the Trainer's
state (global step, epoch, log history, callback states; the global step is the data
position) and the model's config (so ``ckpt export --format safetensors`` writes the
``config.json`` that ``from_pretrained`` reads) go to the manager every ``every``
optimizer steps, at urgent requests and on SIGTERM (agreed across ranks; then the save
is waited for and ``ckpt.Preempted`` is raised for the Trainer to unwind: the process
ends 143), and at the end. A step is
saved when the next one begins, after the Trainer fetched that step's batches and
before it trains on them: that is where a resumed Trainer
stands when it has skipped the consumed batches, so the RNG states put back there are
the ones the uninterrupted run had.

Resuming keeps the Trainer's own logic: ``resume()`` restores the model in place and
hands the Trainer a staging directory with what it reads itself, its
``trainer_state.json`` (so it skips the consumed epochs and batches) and the restored
weights as ``model.safetensors`` (it refuses a checkpoint directory without weights).
The optimizer, scheduler and scaler are loaded when training begins, the RNG states at
the first resumed step. Nothing is pickled: the Trainer's own optimizer, scheduler
and RNG files are pickles, so the directory has none and the Trainer skips them.
Set ``save_strategy="no"`` unless the Trainer's own (pickled) checkpoints are wanted too.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState
from transformers.utils import SAFE_WEIGHTS_NAME

from ..errors import CheckpointError
from ..interop.export import HF_CONFIG_KEY
from ..manager import CheckpointManager
from ..recovery.watchdog import HangDetection, Watchdog, start_watchdog
from ..save.canary import figures
from .loop import save_at_boundary
from .rng import RNGState
from .urgency import SaveRequests

_LOADED_AT_TRAIN_BEGIN = ("optimizer", "scheduler", "scaler")


class HFCheckpoint(TrainerCallback):
    """Saves the Trainer's full training state into ``mgr``; see the module docstring."""

    def __init__(self, mgr: CheckpointManager, *, every: int | None = None, requests: SaveRequests | None = None,
                 preemption: bool = True, hang: HangDetection | None = None) -> None:
        self.mgr, self.every, self.preemption, self.hang = mgr, every, preemption, hang
        self.requests = requests or SaveRequests()
        self._watchdog: Watchdog | None = None
        self._trainer: Trainer | None = None
        self._restored: dict[str, Any] = {}
        self._staging: str | None = None
        self._saved = 0  # the last step saved or restored

    def resume(self, trainer: Trainer) -> str | None:
        """Call before ``trainer.train``: restores the newest checkpoint and returns the
        ``resume_from_checkpoint`` directory for it, or None for a fresh start."""
        self._trainer = trainer
        restored: dict[str, Any] = {"model": trainer.model}
        if self.mgr.restore(restored) is None:
            return None
        self._staging = tempfile.mkdtemp(prefix="ckpt-guard-resume-")
        Path(self._staging, TRAINER_STATE_NAME).write_text(restored.pop("trainer_state"))
        save_file(_unshared(trainer.model.state_dict()), str(Path(self._staging, SAFE_WEIGHTS_NAME)))
        self._restored = restored
        return self._staging

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if self._trainer is None:
            raise CheckpointError("call HFCheckpoint.resume(trainer) before trainer.train()")
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)  # the Trainer has read it
            self._staging = None
        for key, obj in self._training_objects().items():
            if key in self._restored and key in _LOADED_AT_TRAIN_BEGIN:
                obj.load_state_dict(self._restored.pop(key))
        self._saved = state.global_step
        if self.preemption:
            self.requests.catch_sigterm()
        self._watchdog = start_watchdog(self.mgr, self.hang)

    def on_prediction_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                           **kwargs: Any) -> None:
        if self._watchdog is not None:
            self._watchdog.progress()  # an evaluation batch

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        if "rng" in self._restored:
            RNGState().load_state_dict(self._restored.pop("rng"))
        step = state.global_step
        if step != self._saved and save_at_boundary(self.mgr, self.requests, step,
                                                    lambda: self._state(state, control), self.every,
                                                    watchdog=self._watchdog):
            self._saved = step

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict | None = None, **kwargs: Any) -> None:
        """The canary (docs/sound-state.md): with ``logging_steps=1`` the Trainer logs every
        step's loss and grad norm; otherwise its logs average several steps: not recorded."""
        if args.logging_steps == 1 and logs and "loss" in logs and (loss := figures(logs)) is not None:
            self.mgr.record(*loss)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None
        if state.global_step != self._saved:
            self.mgr.save(state.global_step, self._state(state, control))
            self._saved = state.global_step
        self.mgr.wait()

    def _training_objects(self) -> dict[str, Any]:
        t = self._trainer
        objects = {"model": t.model, "optimizer": t.optimizer, "scheduler": t.lr_scheduler,
                   "scaler": getattr(t.accelerator, "scaler", None)}
        return {k: v for k, v in objects.items() if v is not None}

    def _state(self, state: TrainerState, control: TrainerControl) -> dict[str, Any]:
        out = {**self._training_objects(), "rng": RNGState(),
               "trainer_state": _trainer_state_json(self._trainer, state, control)}
        config = getattr(self._trainer.model, "config", None)
        if hasattr(config, "to_json_string"):
            out[HF_CONFIG_KEY] = config.to_json_string(use_diff=False)
        return out


def _unshared(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every key, tied ones as copies: safetensors refuses shared memory, and a key left
    out would make the Trainer warn that it is missing."""
    out, seen = {}, set()
    for key, t in sd.items():
        ptr = t.untyped_storage().data_ptr()
        out[key] = t.detach().clone() if ptr in seen else t.detach().contiguous()
        seen.add(ptr)
    return out


def _trainer_state_json(trainer: Trainer, state: TrainerState, control: TrainerControl) -> str:
    """The Trainer's state as its own ``trainer_state.json`` holds it, callback states included."""
    sd = dataclasses.asdict(state)
    by_name: dict[str, list[dict]] = {}
    for cb in [*trainer.callback_handler.callbacks, control]:
        if isinstance(cb, ExportableState):
            by_name.setdefault(type(cb).__name__, []).append(cb.state())
    sd["stateful_callbacks"] = {name: states[0] if len(states) == 1 else states for name, states in by_name.items()}
    return json.dumps(sd, sort_keys=True)

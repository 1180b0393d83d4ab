"""PyTorch Lightning: checkpoints into a ``CheckpointManager``, exact resume from it.

    guard = LightningCheckpoint(mgr, every=50)
    trainer = L.Trainer(callbacks=[guard], plugins=[guard.io], enable_checkpointing=False)
    trainer.fit(module, ResumableDataLoader(data, sampler=ResumableSampler(data), batch_size=8),
                ckpt_path=guard.resume_path())

Saving: every ``every`` optimizer steps, at urgent requests and on SIGTERM (agreed
across ranks; after SIGTERM the save is waited for and ``ckpt.Preempted`` is raised,
which Lightning unwinds through its teardown: the process ends 143; during training
the callback owns the SIGTERM handler), the
callback builds Lightning's full checkpoint, in the layout Lightning documents for
its own checkpoint files, from public APIs only (see ``_resumable_state``: weights,
optimizers, schedulers, precision plugin, loop progress with the position of a
stateful data loader such as ``ResumableDataLoader``, callback and datamodule states)
on every rank, and hands it to the manager, which stores every rank's shard. Its own
callback state adds the torch, CUDA, numpy and Python RNG states.

Restoring goes through Lightning's own, public path: ``fit(ckpt_path=guard.resume_path())``
asks the ``io`` plugin (a ``CheckpointIO``), which loads the newest valid checkpoint from the manager;
Lightning then puts every piece back and continues mid-epoch. The RNG states are put
back just before the first resumed batch, after Lightning's set-up, which may draw
random numbers (building the module, the data loader) that an uninterrupted run drew
long before.

Lightning's copies of the hyper-parameters (``hparams_name``, ``hyper_parameters``,
``hparams_type`` and the datamodule's) are left out: they may be any Python object,
which the format stores only by pickling, which it never does; only
``load_from_checkpoint`` reads them, and a resuming script builds its module itself.
Anything else that cannot be stored safely raises CheckpointError naming it.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import lightning.pytorch as pl
from lightning.pytorch.plugins.io import TorchCheckpointIO

from ..errors import CheckpointError
from ..manager import CheckpointManager
from ..recovery.watchdog import HangDetection, Watchdog, start_watchdog
from ..save.canary import figures
from .loop import save_at_boundary
from .rng import RNGState
from .urgency import SaveRequests

RESUME = "ckpt-guard:newest"


class ManagerCheckpointIO(TorchCheckpointIO):
    """Loads ``ckpt_path=RESUME`` from the manager; any other path stays Lightning's
    ordinary file IO (a ``ModelCheckpoint`` the user keeps writes its own files)."""

    def __init__(self, mgr: CheckpointManager) -> None:
        super().__init__()
        self.mgr = mgr

    def load_checkpoint(self, path: Any, map_location: Optional[Callable] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        if str(path) != RESUME:
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        checkpoint: dict[str, Any] = {}
        if self.mgr.restore(checkpoint) is None:
            raise CheckpointError("no checkpoint to resume from in "
                                  + ", ".join(t.location for t in self.mgr.tiers))
        return checkpoint


class LightningCheckpoint(pl.Callback):
    """Saves Lightning's full training state into ``mgr`` every ``every`` optimizer
    steps and at the end of training; see the module docstring."""

    def __init__(self, mgr: CheckpointManager, *, every: int | None = None, requests: SaveRequests | None = None,
                 preemption: bool = True, hang: HangDetection | None = None) -> None:
        self.mgr, self.every, self.preemption, self.hang = mgr, every, preemption, hang
        self.requests = requests or SaveRequests()
        self.io = ManagerCheckpointIO(mgr)
        self._watchdog: Watchdog | None = None
        self._rng_to_load: dict[str, Any] | None = None
        self._boundary: int | None = None  # the last global step the save policy looked at
        self._saved: int | None = None  # the last step saved or restored

    def resume_path(self) -> str | None:
        """``ckpt_path`` for ``fit``: RESUME when some rank holds a checkpoint, else None."""
        held = any(row["status"] == "complete" for row in self.mgr.list())
        return RESUME if self.mgr.agree(held)[0] else None

    def state_dict(self) -> dict[str, Any]:
        return {"rng": RNGState().state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._rng_to_load = state_dict["rng"]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._boundary = self._saved = trainer.global_step  # the restored step is saved already
        if self.preemption:
            # Replaces Lightning's handler (it restores the previous one at teardown), which
            # would stop training after the current batch without a checkpoint.
            self.requests.catch_sigterm()
        self._watchdog = start_watchdog(self.mgr, self.hang)

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._watchdog is not None:
            self._watchdog.progress()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_watchdog(finished=False)  # the crash is recorded for the restart timing, as in ckpt.resumable

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._rng_to_load is not None:
            RNGState().load_state_dict(self._rng_to_load)
            self._rng_to_load = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._boundary:
            return  # accumulating gradients: no optimizer step since the last boundary
        self._boundary = trainer.global_step
        if (loss := figures(outputs)) is not None:  # the canary (docs/sound-state.md)
            self.mgr.record(*loss)
        if save_at_boundary(self.mgr, self.requests, trainer.global_step, lambda: _resumable_state(trainer),
                            self.every, watchdog=self._watchdog):
            self._saved = trainer.global_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_watchdog()
        if trainer.global_step != self._saved:
            self.mgr.save(trainer.global_step, _resumable_state(trainer))
        self.mgr.wait()

    def _stop_watchdog(self, *, finished: bool = True) -> None:
        if self._watchdog is not None:
            self._watchdog.close(finished=finished)
            self._watchdog = None


def _resumable_state(trainer: pl.Trainer) -> dict[str, Any]:
    """What Lightning's own ``dump_checkpoint`` holds, from public APIs only, so that
    Lightning's public restore path (``fit(ckpt_path=...)``) puts every piece back. The
    keys are those of Lightning's documented checkpoint contents; each comes from:

    - ``state_dict``: ``trainer.strategy.lightning_module_state_dict()``
    - ``optimizer_states``: ``trainer.strategy.optimizer_state(opt)`` for each of
      ``trainer.optimizers`` (the strategy's view: sharded strategies consolidate)
    - ``lr_schedulers``: ``config.scheduler.state_dict()`` for each of ``trainer.lr_scheduler_configs``
    - ``loops``: ``trainer.{fit,validate,test,predict}_loop.state_dict()`` (``_Loop.state_dict``;
      the fit loop's holds the data loaders' ``state_dict()``, hence the sampler position)
    - ``callbacks``: ``callback.state_dict()`` keyed by ``callback.state_key``, for every
      one of ``trainer.callbacks`` with a state, as Lightning keeps them
    - the precision plugin's ``state_dict()`` under its class name, then its
      ``on_save_checkpoint(checkpoint)`` hook
    - the datamodule's ``state_dict()`` under its class name
    - ``epoch``, ``global_step``: ``trainer.current_epoch``, ``trainer.global_step``;
      ``pytorch-lightning_version``: ``lightning.pytorch.__version__`` (which checkpoint
      migrations Lightning applies when it loads)
    - the hooks ``Callback.on_save_checkpoint(trainer, module, checkpoint)`` and
      ``LightningModule.on_save_checkpoint(checkpoint)``, last, as Lightning calls them.

    Hyper-parameters are left out (see the module docstring).
    """
    strategy, module, datamodule = trainer.strategy, trainer.lightning_module, trainer.datamodule
    checkpoint: dict[str, Any] = {
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "pytorch-lightning_version": pl.__version__,
        "state_dict": strategy.lightning_module_state_dict(),
        "loops": {name: getattr(trainer, name).state_dict()
                  for name in ("fit_loop", "validate_loop", "test_loop", "predict_loop")},
        "callbacks": {cb.state_key: state for cb in trainer.callbacks if (state := cb.state_dict())},
        "optimizer_states": [strategy.optimizer_state(opt) for opt in trainer.optimizers],
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
    }
    precision = trainer.precision_plugin
    if precision_state := precision.state_dict():
        checkpoint[type(precision).__qualname__] = precision_state
    precision.on_save_checkpoint(checkpoint)
    if datamodule is not None and (datamodule_state := datamodule.state_dict()):
        checkpoint[type(datamodule).__qualname__] = datamodule_state
    for cb in trainer.callbacks:
        cb.on_save_checkpoint(trainer, module, checkpoint)
    module.on_save_checkpoint(checkpoint)
    return checkpoint

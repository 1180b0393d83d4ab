"""The saved state matched to the target before any byte is read, the same way for every
restore (any world size, our tiers or an import; invariant 14): what differs only in how it
is named is renamed, what cannot be matched is refused, never guessed.

* module prefixes: a model saved under DDP (``module.``) or torch.compile (``_orig_mod.``)
  restores into one without, or the reverse;
* optimizer state by parameter name (``optim_names.py``), never by position unless asked;
* dict key types: DCP names every key as a string, the state may hold 0 where it saved "0".

Only the saved trees a rank reads anyway are touched (its own shard's, or saved rank 0's
at another world size): no other manifest is opened to normalise.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .optim_names import match_optimizers
from .plan import canonical_path
from .state_load import align_key_types


def normalise(tree: Any, state: Mapping[str, Any], recorded: Mapping[str, list[str]]) -> Any:
    """``tree`` (a saved shard's, for the keys of ``state`` it covers) renamed to ``state``'s
    names: module keys, optimizer numbering (``recorded``: the saved optimizers' parameter
    names), key types. Raises StateMismatch where a name cannot be matched."""
    if not isinstance(tree, dict):
        return tree
    _align_module_keys(tree, state)
    match_optimizers(tree, state, recorded)
    return align_key_types(tree, state)


def _align_module_keys(tree: dict, state: Mapping[str, Any]) -> None:
    """Rename a saved model's keys to the target module's where they differ only by wrapper
    prefixes (saved under DDP, restored into FSDP2 or a bare module, or the reverse)."""
    for key, module in state.items():
        saved = tree.get(key) if isinstance(module, torch.nn.Module) else None
        if not isinstance(saved, dict) or "__dict__" in saved:
            continue
        names = {canonical_path(k): k for k in module.state_dict()}
        if set(saved) != set(names.values()) and {canonical_path(k) for k in saved} == set(names):
            tree[key] = {names[canonical_path(k)]: v for k, v in saved.items()}


def create_optimizer_state(state: Mapping[str, Any]) -> None:
    """Moments to read into, laid out like their parameters (DCP's own initialisation: one
    step of zero gradients at lr 0), for each optimizer of ``state`` that has not stepped:
    FSDP2's moments must be DTensors to read a shard into, not the plain tensors
    ``load_state_dict`` would otherwise keep. LBFGS is left alone: its step needs a closure,
    and its state is one history for all parameters, not moments laid out like each one."""
    for value in state.values():
        if isinstance(value, torch.optim.Optimizer) and not isinstance(value, torch.optim.LBFGS) \
                and not value.state:
            _zero_step(value)


def _zero_step(optim: torch.optim.Optimizer) -> None:
    """torch.distributed.checkpoint.state_dict's ``_init_optim_state``, step for step: importing
    that module pulls in DTensor and sympy (some 1.5 s of CPU) in every process that may restore
    at another world size, a model with no DTensor included. An optimizer whose parameters
    already have gradients is left alone, as there (a stateless one, such as SGD)."""
    params = [p for group in optim.param_groups for p in group["params"]]
    if any(p.grad is not None for p in params):
        return
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    with_lr = [group for group in optim.param_groups if "lr" in group]
    lrs = [group["lr"] for group in with_lr]
    for group in with_lr:  # some optimizers move parameters whatever the gradient: lr 0 for this step
        group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    optim.step(closure=None)
    for group, lr in zip(with_lr, lrs):
        group["lr"] = lr
    optim.zero_grad(set_to_none=True)

"""Optimizer state by parameter name.

torch keys an optimizer's state by each parameter's position in its groups; an
optimizer built over the same parameters in another order (another wrapping order,
parameters listed otherwise) would take another parameter's moments. So each shard
manifest records, per optimizer of the state, its parameters' names (their FQNs in the
modules of the same state, DDP's ``module.`` and torch.compile's ``_orig_mod.``
dropped, tied weights under their first name), and a restore at another world size
renumbers the saved state to the target optimizer's order by name.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

import torch

from ..errors import StateMismatch
from ..format.manifest import ShardManifest
from .plan import canonical_path


def param_names(state: Mapping[str, Any]) -> dict[str, list[str]]:
    """For each top-level optimizer whose parameters all belong to modules of ``state``:
    their names, in the optimizer's order (its groups concatenated)."""
    names: dict[int, str] = {}
    for value in state.values():
        if isinstance(value, torch.nn.Module):
            for fqn, p in value.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), canonical_path(fqn))
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.optim.Optimizer):
            params = [p for g in value.param_groups for p in g["params"]]
            if all(id(p) in names for p in params):
                out[key] = [names[id(p)] for p in params]
    return out


def renumber(manifests: Mapping[int, ShardManifest], state: Mapping[str, Any]) -> None:
    """Rewrite the saved optimizer state of ``manifests`` (rank 0's tree, every shard's
    tensor paths) into the numbering of ``state``'s optimizers, matched by parameter name.
    Raises StateMismatch when the names or their grouping differ."""
    first = manifests[0]
    for key, target in param_names(state).items():
        saved = first.param_names.get(key)
        if saved is None or saved == target:
            continue
        if sorted(saved) != sorted(target) or len(set(target)) != len(target):
            raise StateMismatch(f"{key}: the checkpoint's optimizer has other parameters "
                                f"({sorted(set(saved) ^ set(target))[:5]})")
        perm = {i: target.index(name) for i, name in enumerate(saved)}
        node = first.tree.get(key) if isinstance(first.tree, dict) else None
        groups = _target_groups(state[key])
        try:
            saved_groups = [g["params"] for g in node["param_groups"]]
            if [sorted(perm[i] for i in g) for g in saved_groups] != [sorted(g) for g in groups]:
                raise StateMismatch(f"{key}: the checkpoint's optimizer groups its parameters otherwise")
            for g, want in zip(node["param_groups"], groups):
                g["params"] = want
            if node["state"]:  # {} before the first step
                node["state"]["__dict__"] = [[perm[k], v] for k, v in node["state"]["__dict__"]]
        except (KeyError, TypeError, ValueError) as e:
            raise StateMismatch(f"{key}: the checkpoint's optimizer state is not laid out as torch's ({e})") from None
        pattern = re.compile(rf"^{re.escape(key)}\.state\.(\d+)\.")

        def renumber(m: re.Match, key: str = key, perm: dict = perm) -> str:
            return f"{key}.state.{perm.get(int(m[1]), m[1])}."

        for man in manifests.values():
            man.tensors = [dataclasses.replace(e, path=pattern.sub(renumber, e.path))
                           if pattern.match(e.path) else e for e in man.tensors]


def _target_groups(optim: torch.optim.Optimizer) -> list[list[int]]:
    out, i = [], 0
    for g in optim.param_groups:
        out.append(list(range(i, i + len(g["params"]))))
        i += len(g["params"])
    return out

"""Loading saved values into a live training state, all or nothing.

A restore must change everything or nothing: ``check_restorable`` compares the state
with a shard's manifest before any byte is read into it, and ``load_into`` checks the
values read, whole, before the first ``load_state_dict``. Both list every difference
(shape, dtype, kind, a module's keys, an optimizer's groups) in one StateMismatch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..errors import StateMismatch
from ..format.manifest import DTYPE_NAMES, MAX_JSON_DEPTH, ManifestError, TensorEntry
from ..format.state import decode_tree, is_dtensor, is_stateful, local_tensor


@dataclass(frozen=True)
class _Saved:
    """A checkpoint's tensor or array as its manifest entry describes it, before any byte is read."""

    tag: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    whole: bool = False  # ``shape`` is a DTensor's global shape (restore at another world size)


def check_restorable(state: Mapping[str, Any], tree: Any, tensors: Sequence[TensorEntry], *,
                     whole: bool = False) -> None:
    """Raise StateMismatch listing every difference between ``state`` and one shard's
    saved ``tree`` and ``tensors``, before anything is read into ``state``, so that a
    restore changes everything or nothing. A hostile tree raises ManifestError.

    Refused: a tensor or array of another shape or dtype (a DTensor: its local shard),
    a DTensor where a plain tensor was saved or the reverse; a module whose keys differ
    either way (what ``load_state_dict(strict=True)`` refuses, found before the first
    one is loaded); an optimizer with other parameter groups; a key of a plain dict in
    ``state`` that the checkpoint lacks (it would be left unrestored). Keys only the
    checkpoint has are fine: restore adds them to the dict.

    ``whole``: compare tensors by their global shapes, a DTensor alike with a tensor
    (restore at another world size, where the local shards differ by design)."""
    by_id = {e.id: e for e in tensors}

    def leaf(tag: str, i: int) -> _Saved:
        e = by_id[i]
        return _Saved(tag, e.layout.global_shape if whole and e.layout else e.shape, e.torch_dtype, whole=whole)

    saved = decode_tree(tree, leaf)
    if not isinstance(saved, dict):
        raise ManifestError("the checkpoint's top level is not a dict")
    _raise_mismatches(state, saved)


def align_key_types(tree: Any, state: Any, depth: int = 0) -> Any:
    """``tree`` with each dict's keys typed as ``state``'s are, where they differ only by
    ``str()``: DCP names every dict key as a string, so an imported checkpoint holds "0"
    where the state has 0 (``dcp.load`` matches them the same way). Unchanged elsewhere."""
    if depth > MAX_JSON_DEPTH:
        return tree
    if is_stateful(state):
        state = state.state_dict()
    if isinstance(state, Mapping) and isinstance(tree, dict) and not any(k.startswith("__") for k in tree):
        renamed = {str(k): k for k in state if not isinstance(k, str)}
        if renamed and all(k in tree for k in renamed) and not any(k in state for k in renamed):
            return {"__dict__": [[renamed.get(k, k), align_key_types(v, state.get(renamed.get(k, k)), depth + 1)]
                                 for k, v in tree.items()]}
        return {k: align_key_types(v, state[k], depth + 1) if k in state else v for k, v in tree.items()}
    if isinstance(state, (list, tuple)) and isinstance(tree, list) and len(tree) == len(state):
        return [align_key_types(v, s, depth + 1) for v, s in zip(tree, state)]
    return tree


def load_into(state: dict, saved: Mapping[str, Any]) -> None:
    """Load ``saved`` into ``state`` in place: stateful objects via load_state_dict,
    tensors and arrays by copy, everything else by assignment into the dict. Checked
    whole first (as ``check_restorable`` does), so a mismatch changes nothing."""
    _raise_mismatches(state, saved)
    for key, value in saved.items():
        state[key] = _apply(state.get(key), value)


def _apply(target: Any, value: Any) -> Any:
    if is_stateful(target) and isinstance(value, Mapping):
        target.load_state_dict(value)
        return target
    if isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor):
        with torch.no_grad():  # a DTensor's local shard read apart from it (not contiguous): into the shard
            (local_tensor(target) if not is_dtensor(value) else target).copy_(value)
        return target
    if isinstance(target, np.ndarray) and isinstance(value, np.ndarray):
        target[...] = value
        return target
    if isinstance(target, dict) and isinstance(value, Mapping):
        for k, v in value.items():
            target[k] = _apply(target.get(k), v)
        return target
    return value


_SHOWN = 10


def _raise_mismatches(state: Mapping[str, Any], saved: Mapping[str, Any]) -> None:
    found: list[str] = []
    _mismatches(state, saved, "", found, strict=True, depth=0)
    if found:
        more = f"\n  ... and {len(found) - _SHOWN} more" if len(found) > _SHOWN else ""
        raise StateMismatch(f"the state does not match the checkpoint ({len(found)} difference"
                            f"{'s' if len(found) > 1 else ''}; nothing was loaded):\n  "
                            + "\n  ".join(found[:_SHOWN]) + more + "\n  to restore it, build the state as it was "
                            "saved (the same keys, global shapes, dtypes and parameter groups; keys only the "
                            "checkpoint has are added)")


def _mismatches(target: Any, value: Any, path: str, found: list[str], strict: bool, depth: int) -> None:
    """Append to ``found`` where ``value`` (from the checkpoint) cannot be loaded into
    ``target``. ``strict``: ``target`` is the user's own container, whose keys must all
    be in the checkpoint; inside a stateful object's state_dict only what that object's
    load_state_dict would refuse counts."""
    if depth > MAX_JSON_DEPTH:
        return  # the saved side is no deeper than this (decoding bounds it): nothing left to compare
    mine = _layout(target)
    if mine is not None:
        if isinstance(target, torch.Tensor) and torch._debug_has_internal_overlap(local_tensor(target)) == 1:
            found.append(f"{path}: target {_what(target)} cannot be written in place (an expanded view: its "
                         "elements share memory); restore into a tensor of its own")
            return
        theirs = _layout(value)
        whole = isinstance(value, _Saved) and value.whole
        if whole and isinstance(target, torch.Tensor):
            mine = (mine[0], tuple(target.shape), mine[2])
        if theirs is None or not _same_kind(mine[0], theirs[0], exact=isinstance(value, _Saved) and not whole):
            found.append(f"{path}: checkpoint has {_what(value)}, target {_what(target)}")
        elif theirs[1] != mine[1]:
            found.append(f"{path}: checkpoint has shape {theirs[1]}, target {mine[1]}")
        elif theirs[2] != mine[2]:
            found.append(f"{path}: checkpoint has dtype {theirs[2]}, target {mine[2]}")
        return
    if is_stateful(target) or (strict and isinstance(target, Mapping)):
        if not isinstance(value, Mapping):
            found.append(f"{path}: checkpoint has {_what(value)}, target {_what(target)}")
            return
        if is_stateful(target):
            if isinstance(target, torch.nn.Module):
                found += _module_keys(target, value, path)
            elif isinstance(target, torch.optim.Optimizer):
                found += _param_groups(target, value, path)
            target, strict = target.state_dict(), False
        for k, sub in target.items():
            if k in value:
                _mismatches(sub, value[k], _join(path, k), found, strict, depth + 1)
            elif strict and not _empty_container(sub):  # DCP records none: dcp.load leaves it too
                found.append(f"{_join(path, k)}: in the state but not in the checkpoint")
    elif isinstance(target, Mapping) and isinstance(value, Mapping):
        for k, sub in target.items():
            if k in value:
                _mismatches(sub, value[k], _join(path, k), found, strict, depth + 1)
    elif isinstance(target, (list, tuple)) and isinstance(value, (list, tuple)) and len(target) == len(value):
        for i, (t, v) in enumerate(zip(target, value)):
            _mismatches(t, v, _join(path, i), found, strict, depth + 1)


def _empty_container(x: Any) -> bool:
    return isinstance(x, (Mapping, list, tuple)) and not is_stateful(x) and len(x) == 0


def _same_kind(mine: str, theirs: str, exact: bool) -> bool:
    """Once read, a DTensor's shard may come back as a plain tensor: only saved entries tell them apart."""
    if exact:
        return mine == theirs
    return mine.replace("DTensor", "tensor") == theirs.replace("DTensor", "tensor")


def _module_keys(module: torch.nn.Module, value: Mapping, path: str) -> list[str]:
    keys = module.state_dict().keys()
    return ([f"{_join(path, k)}: in the module but not in the checkpoint" for k in keys if k not in value]
            + [f"{_join(path, k)}: in the checkpoint but not in the module" for k in value if k not in keys])


def _param_groups(optim: torch.optim.Optimizer, value: Mapping, path: str) -> list[str]:
    groups = value.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(optim.param_groups):
        n = len(groups) if isinstance(groups, list) else "no"
        return [f"{path}.param_groups: checkpoint has {n} parameter groups, target {len(optim.param_groups)}"]
    out = []
    for i, (saved, group) in enumerate(zip(groups, optim.param_groups)):
        n = len(saved["params"]) if isinstance(saved, Mapping) and isinstance(saved.get("params"), list) else "no"
        if n != len(group["params"]):
            out.append(f"{path}.param_groups.{i}: checkpoint has {n} parameters, target {len(group['params'])}")
    return out


def _layout(x: Any) -> tuple[str, tuple[int, ...], str] | None:
    """(kind, shape, dtype) of a tensor, array or saved entry; None for anything else."""
    if isinstance(x, _Saved):
        kind = {"__tensor__": "tensor", "__dtensor__": "DTensor", "__ndarray__": "numpy array"}[x.tag]
        return kind, x.shape, DTYPE_NAMES.get(x.dtype, str(x.dtype))
    if isinstance(x, torch.Tensor):
        local = local_tensor(x)
        return ("DTensor" if is_dtensor(x) else "tensor", tuple(local.shape),
                DTYPE_NAMES.get(x.dtype, str(x.dtype)))
    if isinstance(x, np.ndarray):
        return "numpy array", x.shape, _numpy_dtype_name(x.dtype)
    return None


def _numpy_dtype_name(dtype: np.dtype) -> str:
    """The name the manifest gives an array of ``dtype`` (flatten stores arrays via torch.from_numpy)."""
    try:
        return DTYPE_NAMES[torch.from_numpy(np.empty(0, dtype)).dtype]
    except (TypeError, KeyError):
        return f"numpy {dtype}"


def _what(x: Any) -> str:
    layout = _layout(x)
    if layout is not None:
        return f"a {layout[0]} {layout[1]} of {layout[2]}"
    if x is None:
        return "None"
    name = type(x).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)

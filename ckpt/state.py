"""Flattening a training state into tensors + a JSON tree, and loading it back in place.

``flatten`` walks the user's state (modules, optimizers, anything with
``state_dict()``, tensors, numpy arrays, plain values) and returns the tensors in
order plus a JSON-able tree that refers to them by index. Plain values keep their
types (tuples, big ints, bytes, numpy scalars, torch dtypes) through tagged JSON
objects, so no pickle is ever needed: decoding only builds the types listed here.
Nesting is bounded both ways (``manifest.MAX_JSON_DEPTH``): ``flatten`` refuses a
state deeper than readers accept, and decoding a hostile tree raises ManifestError,
never RecursionError.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from .errors import CheckpointError, StateMismatch
from .layout import Layout, layout_of
from .manifest import DTYPE_NAMES, DTYPES, MAX_JSON_DEPTH, ManifestError, TensorEntry

try:  # DTensor (FSDP2, tensor parallel): each rank keeps its local shard
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    DTensor = ()  # type: ignore[assignment,misc]

_TAGS = ("__tensor__", "__dtensor__", "__ndarray__", "__tuple__", "__bytes__", "__dict__", "__dtype__",
         "__device__", "__size__", "__npscalar__")
_NP_KINDS = set("biufc")
_DEEPEST_TAG = 3  # {"__npscalar__": ["<c16", [re, im]]}: a value's encoding opens at most 3 levels


@dataclass
class FlatState:
    tensors: list[tuple[str, torch.Tensor]]  # (path in the tree, tensor); index == id
    tree: Any
    layouts: dict[int, Layout] = field(default_factory=dict)  # a DTensor's id -> where its local shard lies


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The bytes this rank holds: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def flatten(state: Mapping[str, Any]) -> FlatState:
    """Split ``state`` into tensors and a JSON tree; raises on types it cannot keep safely."""
    tensors: list[tuple[str, torch.Tensor]] = []
    layouts: dict[int, Layout] = {}
    seen: dict[tuple, int] = {}  # tied weights (same memory, same view) are stored once

    def enc(obj: Any, path: str, depth: int) -> Any:
        """``depth``: the JSON nesting ``obj``'s encoding sits at in the shard manifest."""
        if depth + _DEEPEST_TAG > MAX_JSON_DEPTH:
            raise CheckpointError(f"{path}: the state is nested too deeply to checkpoint "
                                  f"(readers accept {MAX_JSON_DEPTH} levels of JSON)")
        if isinstance(obj, DTensor):
            index = enc(obj.to_local(), path, depth)["__tensor__"]
            layouts[index] = layout_of(obj, path)
            return {"__dtensor__": index}
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided or obj.is_quantized or obj.device.type == "meta":
                raise CheckpointError(f"{path}: cannot checkpoint a {obj.layout} / quantized / meta tensor")
            if obj.dtype not in DTYPE_NAMES:
                raise CheckpointError(f"{path}: unsupported dtype {obj.dtype}")
            key = (obj.device, obj.data_ptr(), obj.dtype, tuple(obj.shape), obj.stride())
            if obj.numel() and key in seen:
                return {"__tensor__": seen[key]}
            tensors.append((path, obj.detach().resolve_conj().resolve_neg()))
            seen[key] = len(tensors) - 1
            return {"__tensor__": len(tensors) - 1}
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind not in _NP_KINDS:
                raise CheckpointError(f"{path}: numpy arrays of dtype {obj.dtype} are not supported")
            # ascontiguousarray turns a 0-d array into shape (1,); keep the shape
            tensors.append((path, torch.from_numpy(np.ascontiguousarray(obj).reshape(obj.shape))))
            return {"__ndarray__": len(tensors) - 1}
        if is_stateful(obj):
            return enc(obj.state_dict(), path, depth)
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, np.generic):
            if obj.dtype.kind not in _NP_KINDS:
                raise CheckpointError(f"{path}: numpy scalar of dtype {obj.dtype} is not supported")
            return {"__npscalar__": [obj.dtype.str,
                                     obj.item() if obj.dtype.kind != "c" else [obj.real.item(), obj.imag.item()]]}
        if isinstance(obj, (int, float)):
            return obj
        if isinstance(obj, bytes):
            return {"__bytes__": base64.b64encode(obj).decode()}
        if isinstance(obj, torch.dtype):
            return {"__dtype__": DTYPE_NAMES[obj]}
        if isinstance(obj, torch.device):
            return {"__device__": str(obj)}
        if isinstance(obj, torch.Size):
            return {"__size__": list(obj)}
        if isinstance(obj, tuple):
            return {"__tuple__": [enc(v, f"{path}.{i}", depth + 2) for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [enc(v, f"{path}.{i}", depth + 1) for i, v in enumerate(obj)]
        if isinstance(obj, Mapping):
            if all(isinstance(k, str) and not (k.startswith("__") and k.endswith("__")) for k in obj):
                return {k: enc(v, f"{path}.{k}" if path else k, depth + 1) for k, v in obj.items()}
            return {"__dict__": [[enc(k, f"{path}.<key>", depth + 3), enc(v, f"{path}.{k}", depth + 3)]
                                 for k, v in obj.items()]}
        raise CheckpointError(f"{path or '<root>'}: cannot checkpoint a value of type {type(obj).__name__}")

    tree = enc(dict(state), "", 1)  # the tree is a member of the shard manifest's top object
    return FlatState(tensors, tree, layouts)


def unflatten(tree: Any, tensor: Callable[[int], torch.Tensor]) -> Any:
    """Rebuild plain values from a (possibly hostile) tree; ``tensor(i)`` supplies tensor i."""
    return _decode(tree, lambda tag, i: tensor(i).numpy() if tag == "__ndarray__" else tensor(i))


def _decode(tree: Any, leaf: Callable[[str, int], Any]) -> Any:
    """Decode a tree; ``leaf(tag, i)`` stands for the tensor or array with id ``i``."""

    def dec(node: Any, depth: int) -> Any:
        if depth > MAX_JSON_DEPTH:
            raise ManifestError(f"checkpoint tree is nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(node, list):
            return [dec(v, depth + 1) for v in node]
        if not isinstance(node, dict):
            return node
        if len(node) == 1:
            (tag, val), = node.items()
            if tag in _TAGS:
                return _decode_tag(tag, val, lambda v: dec(v, depth + 1), leaf)
        return {k: dec(v, depth + 1) for k, v in node.items()}

    return dec(tree, 0)


def _decode_tag(tag: str, val: Any, dec: Callable[[Any], Any], leaf: Callable[[str, int], Any]) -> Any:
    try:
        if tag in ("__tensor__", "__dtensor__", "__ndarray__"):
            if not isinstance(val, int) or isinstance(val, bool) or val < 0:
                raise ValueError(f"tensor id {val!r}")
            return leaf(tag, val)
        if tag == "__tuple__":
            return tuple(dec(v) for v in val)
        if tag == "__bytes__":
            return base64.b64decode(val, validate=True)
        if tag == "__dict__":
            return {_hashable(dec(k)): dec(v) for k, v in val}
        if tag == "__dtype__":
            return DTYPES[val]
        if tag == "__device__":
            return torch.device(val)
        if tag == "__size__":
            return torch.Size(int(v) for v in val)
        if tag == "__npscalar__":
            dtype = np.dtype(val[0])
            if dtype.kind not in _NP_KINDS:
                raise ValueError(f"numpy dtype {dtype}")
            value = complex(*val[1]) if dtype.kind == "c" else val[1]
            return np.array(value, dtype=dtype)[()]
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
        raise ManifestError(f"bad {tag} value in checkpoint tree: {e}") from None
    raise AssertionError(tag)


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        raise ValueError("dict key decodes to a list")
    return key


def tensor_targets(state: Mapping[str, Any], tree: Any, *, any_kind: bool = False) -> dict[int, torch.Tensor]:
    """Existing tensors in ``state`` (module parameters, optimizer moments, DTensor
    shards) that the tensor ids of ``tree`` correspond to.

    Reading straight into them avoids a second copy and the page faults of fresh
    memory; load_state_dict then sees the same storage and its copy is a no-op.
    """
    targets: dict[int, torch.Tensor] = {}

    def walk(target: Any, node: Any, depth: int) -> None:
        if depth > MAX_JSON_DEPTH:
            raise ManifestError(f"checkpoint tree is nested deeper than {MAX_JSON_DEPTH} levels")
        if is_stateful(target):
            walk(target.state_dict(), node, depth + 1)
        elif isinstance(target, torch.Tensor) and isinstance(node, dict) and len(node) == 1:
            (tag, ref), = node.items()
            kinds = ("__tensor__", "__dtensor__") if any_kind else ("__dtensor__" if isinstance(target, DTensor)
                                                                    else "__tensor__",)
            if tag in kinds and isinstance(ref, int):
                targets[ref] = target.detach()
        elif isinstance(target, Mapping) and isinstance(node, dict):
            if set(node) == {"__dict__"} and isinstance(node["__dict__"], list):
                pairs = {}
                for kv in node["__dict__"]:
                    try:
                        pairs[_hashable(unflatten(kv[0], _no_tensor))] = kv[1]
                    except (ManifestError, ValueError, TypeError, IndexError):
                        continue
                node = pairs
            for k, sub in node.items():
                if k in target:
                    walk(target[k], sub, depth + 1)
        elif isinstance(target, (list, tuple)):
            items = node.get("__tuple__") if isinstance(node, dict) else node
            if isinstance(items, list):
                for t, n in zip(target, items):
                    walk(t, n, depth + 1)

    walk(state, tree, 0)
    return targets


def _no_tensor(i: int) -> torch.Tensor:
    raise ValueError("tensor used as a dict key")


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

    saved = _decode(tree, leaf)
    if not isinstance(saved, dict):
        raise ManifestError("the checkpoint's top level is not a dict")
    _raise_mismatches(state, saved)


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
        with torch.no_grad():
            target.copy_(value)
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
                            + "\n  ".join(found[:_SHOWN]) + more)


def _mismatches(target: Any, value: Any, path: str, found: list[str], strict: bool, depth: int) -> None:
    """Append to ``found`` where ``value`` (from the checkpoint) cannot be loaded into
    ``target``. ``strict``: ``target`` is the user's own container, whose keys must all
    be in the checkpoint; inside a stateful object's state_dict only what that object's
    load_state_dict would refuse counts."""
    if depth > MAX_JSON_DEPTH:
        return  # the saved side is no deeper than this (decoding bounds it): nothing left to compare
    mine = _layout(target)
    if mine is not None:
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
            elif strict:
                found.append(f"{_join(path, k)}: in the state but not in the checkpoint")
    elif isinstance(target, Mapping) and isinstance(value, Mapping):
        for k, sub in target.items():
            if k in value:
                _mismatches(sub, value[k], _join(path, k), found, strict, depth + 1)
    elif isinstance(target, (list, tuple)) and isinstance(value, (list, tuple)) and len(target) == len(value):
        for i, (t, v) in enumerate(zip(target, value)):
            _mismatches(t, v, _join(path, i), found, strict, depth + 1)


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
        return ("DTensor" if isinstance(x, DTensor) else "tensor", tuple(local.shape),
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


def tree_holds(tree: Any, tag: str) -> bool:
    """Whether a saved tree holds a value tagged ``tag`` (e.g. ``__dtensor__``), without recursion."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if len(node) == 1 and tag in node:
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False

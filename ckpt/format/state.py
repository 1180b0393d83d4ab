"""Flattening a training state into tensors + a JSON tree, and decoding it back (loading
it into the live objects: ``state_load.py``).

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
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

from ..errors import CheckpointError
from .layout import Layout, layout_of
from .manifest import DTYPE_NAMES, DTYPES, MAX_JSON_DEPTH, ManifestError


def is_dtensor(obj: Any) -> bool:
    """Whether ``obj`` is a DTensor (FSDP2, tensor parallel: each rank keeps its local shard).
    Its module is not imported for the question: it costs half of ``import torch`` again (about
    1 s in every rank), and no object is a DTensor before something (FSDP2, the user) imported it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(obj, getattr(module, "DTensor", ()))

_TAGS = ("__tensor__", "__dtensor__", "__ndarray__", "__tuple__", "__bytes__", "__dict__", "__dtype__",
         "__device__", "__size__", "__npscalar__", "__complex__")
_NP_KINDS = set("biufc")
_PLAIN = frozenset({int, float, str, bool, type(None)})  # exactly these types (not numpy's float64) stay as they are
_DEEPEST_TAG = 3  # {"__npscalar__": ["<c16", [re, im]]}: a value's encoding opens at most 3 levels


@dataclass
class FlatState:
    tensors: list[tuple[str, torch.Tensor]]  # (path in the tree, tensor); index == id
    tree: Any
    layouts: dict[int, Layout] = field(default_factory=dict)  # a DTensor's id -> where its local shard lies
    keys: list[tuple] = field(default_factory=list)  # each tensor's ``tensor_key``, read once here
    # the key of each tensor saved as itself, by its ``id()``: unique while this FlatState holds it, so a question
    # about the same objects in the same save (``overlap.step_written``) reads no tensor again
    by_id: dict[int, tuple] = field(default_factory=dict)
    # the previous save's FlatState when this one holds the very same tensors, paths, keys and layouts (its
    # lists, shared): what a save derives from them alone stays (``save/flat_cache.py``); None: not known
    same_as: FlatState | None = None


@dataclass
class Piece:
    """A top-level value's share of a ``FlatState``, as ``flatten`` made it at tensor index ``start``:
    spliced in unchanged by a later ``flatten`` whose ``reuse`` proved the value unchanged
    (``save/flat_cache.py``). ``closed``: no tensor of it was a duplicate of one before it."""

    start: int
    tree: Any
    tensors: list[tuple[str, torch.Tensor]]
    keys: list[tuple]
    seen: dict[tuple, int]
    by_id: dict[int, tuple]
    layouts: dict[int, Layout]
    closed: bool


# ``flatten``'s ``reuse(key, value)``: a Piece to splice in, True to walk the value and record its Piece, False to walk
Reuse = Callable[[str, Any], "Piece | bool"]


def plain_keys(keys: Iterable[Any]) -> bool:
    """Whether a mapping with these keys is encoded as a plain JSON object: strings, none shaped
    like an encoding tag (``__tensor__``); otherwise its items are kept as pairs (``__dict__``)."""
    return all(isinstance(k, str) and not (k.startswith("__") and k.endswith("__")) for k in keys)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The bytes this rank holds: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def tensor_key(t: torch.Tensor) -> tuple:
    """Which memory a tensor views, and how: (device, data pointer, dtype, shape, strides)."""
    return t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def flatten(state: Mapping[str, Any], reuse: Reuse | None = None, pieces: dict[str, Piece] | None = None) -> FlatState:
    """Split ``state`` into tensors and a JSON tree; raises on types it cannot keep safely.
    ``reuse``: a top-level value's Piece (``Reuse``) to take instead of walking it where it
    would start at the same tensor index and duplicates none before it (the same result);
    the walked values it asks for are recorded in ``pieces``."""
    tensors: list[tuple[str, torch.Tensor]] = []
    keys: list[tuple] = []  # a save's layout is keyed on them (``save/layout_cache.py``), deferred copies too
    layouts: dict[int, Layout] = {}
    seen: dict[tuple, int] = {}  # tied weights (same memory, same view, same conj/neg bits) are stored once
    by_id: dict[int, tuple] = {}
    below = [0, False]  # the index the value being recorded starts at; whether one of its tensors duplicated one before

    def enc(obj: Any, path: str, depth: int) -> Any:
        """``depth``: the JSON nesting ``obj``'s encoding sits at in the shard manifest."""
        if depth + _DEEPEST_TAG > MAX_JSON_DEPTH:
            raise CheckpointError(f"{path}: the state is nested too deeply to checkpoint "
                                  f"(readers accept {MAX_JSON_DEPTH} levels of JSON)")
        kind = type(obj)
        if kind in _PLAIN:  # most of an optimizer's state_dict, first: ten type tests each were half its cost
            return obj
        # then the other exact types of a state_dict, each without the tests that cannot hold for it (neither a
        # plain tensor nor a Parameter is a DTensor; a plain dict or list holds no state_dict)
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            return tensor(obj, path)
        if kind is dict:
            return mapping(obj, path, depth)
        if kind is list:
            return sequence(obj, path, depth)
        if is_dtensor(obj):
            layout, local = layout_of(obj, path), obj.to_local()
            if tuple(local.shape) != layout.local_shape:  # outside a sub-mesh: nothing, in the tensor's dims
                local = local.new_empty(layout.local_shape)
            index = enc(local, path, depth)["__tensor__"]
            layouts[index] = layout
            return {"__dtensor__": index}
        if isinstance(obj, torch.Tensor):
            return tensor(obj, path)
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind not in _NP_KINDS:
                raise CheckpointError(f"{path}: numpy arrays of dtype {obj.dtype} are not supported")
            # ascontiguousarray turns a 0-d array into shape (1,); keep the shape
            tensors.append((path, torch.from_numpy(np.ascontiguousarray(obj).reshape(obj.shape))))
            keys.append(tensor_key(tensors[-1][1]))
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
        if isinstance(obj, complex):  # JSON has no complex numbers (DCP keeps them: so do we)
            return {"__complex__": [obj.real, obj.imag]}
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
            return sequence(obj, path, depth)
        if isinstance(obj, Mapping):
            return mapping(obj, path, depth)
        raise CheckpointError(f"{path or '<root>'}: cannot checkpoint a value of type {type(obj).__name__}")

    def tensor(obj: torch.Tensor, path: str) -> dict:
        if obj.layout != torch.strided or obj.is_quantized or obj.is_meta:
            raise CheckpointError(f"{path}: cannot checkpoint a {obj.layout} / quantized / meta tensor")
        if obj.dtype not in DTYPE_NAMES:
            raise CheckpointError(f"{path}: unsupported dtype {obj.dtype}")
        # a conj() or neg view shares the memory but not the values: its bit is part of the key
        conj, neg, where = obj.is_conj(), obj.is_neg(), tensor_key(obj)
        key = (*where, conj, neg)
        if obj.numel() and key in seen:
            if seen[key] < below[0]:
                below[1] = True
            return {"__tensor__": seen[key]}
        # detached only where it matters (a state_dict's tensors already are): a detach is most of a tensor's cost
        saved = obj.detach().resolve_conj().resolve_neg() if obj.requires_grad or conj or neg else obj
        tensors.append((path, saved))
        keys.append(tensor_key(saved) if conj or neg else where)  # a resolved view is a copy elsewhere
        if saved is obj:
            by_id[id(obj)] = where
        seen[key] = len(tensors) - 1
        return {"__tensor__": len(tensors) - 1}

    # A plain value is kept as it is without a call (and without its path) where the depth check
    # it would pass is passed by every child; deeper, each child is encoded, and the first raises.
    def sequence(obj: list, path: str, depth: int) -> list:
        if depth + 1 + _DEEPEST_TAG <= MAX_JSON_DEPTH:
            return [v if type(v) in _PLAIN else enc(v, f"{path}.{i}", depth + 1) for i, v in enumerate(obj)]
        return [enc(v, f"{path}.{i}", depth + 1) for i, v in enumerate(obj)]

    def mapping(obj: Mapping, path: str, depth: int) -> dict:
        if not plain_keys(obj):
            return {"__dict__": [[enc(k, f"{path}.<key>", depth + 3), enc(v, f"{path}.{k}", depth + 3)]
                                 for k, v in obj.items()]}
        if depth + 1 + _DEEPEST_TAG <= MAX_JSON_DEPTH:
            return {k: v if type(v) in _PLAIN else enc(v, f"{path}.{k}" if path else k, depth + 1)
                    for k, v in obj.items()}
        return {k: enc(v, f"{path}.{k}" if path else k, depth + 1) for k, v in obj.items()}

    def top(state: dict) -> dict:
        """``mapping(state, "", 1)``, taking the Pieces ``reuse`` gives where they hold."""
        out = {}
        for k, v in state.items():
            piece = reuse(k, v)
            if type(piece) is Piece and piece.start == len(tensors) and seen.keys().isdisjoint(piece.seen.keys()):
                tensors.extend(piece.tensors)
                keys.extend(piece.keys)
                seen.update(piece.seen)
                by_id.update(piece.by_id)
                layouts.update(piece.layouts)
                out[k] = piece.tree
                continue
            start = len(tensors)
            below[:] = [start, False]
            out[k] = v if type(v) in _PLAIN else enc(v, k, 2)
            if piece is True and pieces is not None:
                part = tensors[start:]
                pieces[k] = Piece(start, out[k], part, keys[start:], {t: i for t, i in seen.items() if i >= start},
                                  {id(t): by_id[id(t)] for _, t in part if id(t) in by_id},
                                  {i: lay for i, lay in layouts.items() if i >= start}, not below[1])
        return out

    top_level = dict(state)  # the tree is a member of the shard manifest's top object
    if reuse is not None and 2 + _DEEPEST_TAG <= MAX_JSON_DEPTH and plain_keys(top_level):
        tree = top(top_level)
    else:
        tree = enc(top_level, "", 1)
    return FlatState(tensors, tree, layouts, keys, by_id)


def unflatten(tree: Any, tensor: Callable[[int], torch.Tensor]) -> Any:
    """Rebuild plain values from a (possibly hostile) tree; ``tensor(i)`` supplies tensor i."""
    return decode_tree(tree, lambda tag, i: tensor(i).numpy() if tag == "__ndarray__" else tensor(i))


def decode_tree(tree: Any, leaf: Callable[[str, int], Any]) -> Any:
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
        if tag == "__complex__":
            re, im = val
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (re, im)):
                raise ValueError(f"complex parts {val!r}")
            return complex(re, im)
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
            kinds = ("__tensor__", "__dtensor__") if any_kind else ("__dtensor__" if is_dtensor(target)
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

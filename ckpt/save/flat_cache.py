"""Flattening a state whose structure has not changed since the last save, without walking it.

``flatten`` of a module calls ``state_dict()`` (0.2 ms for ten Linear layers) and reads every
tensor's key; of an optimizer, it walks every parameter's state. Saving every step, the
answer is the same each time but for what a step changes without changing the structure:
the tensors' bytes (copied at every save all the same) and plain values (learning rates and
other ``param_groups`` values, the data position, RNG states). So each top-level module and
optimizer of the state keeps the share of the last save's ``FlatState`` it produced (a
``format.state.Piece``), taken again while a proof holds that ``state_dict()`` would give
the same tree and the same tensors:

- a module: each submodule (in ``state_dict``'s order) the same object, of the same type, with
  no state-dict hooks, the same ``_parameters``, ``_buffers`` and ``_modules`` (names and
  objects) and non-persistent buffer names; its class keeps ``nn.Module``'s ``state_dict``,
  ``_save_to_state_dict`` and ``get_extra_state`` (checked when the piece is made);
- an optimizer: of a type keeping ``Optimizer.state_dict``, no state-dict hooks, the same
  groups (their keys and parameters), the same ``state`` dict holding the same per-parameter
  dicts (keys and tensor objects); every value of its groups is read again at each save (a
  plain value, or a tuple or list of them; anything else walks it);
- the tensors of both (parameters, buffers, optimizer state): the same storage and view (data
  pointer, dtype, shape, strides), so ``param.data = ...`` or a resized buffer walks it again.

Anything else at the top level (a sampler, ``RNGState``, a scheduler, tensors) is walked at
every save, as are modules with a DTensor, complex or subclassed tensor and optimizers with a
plain value in their per-parameter state. Any difference walks the value and makes its piece
anew: what is saved is the same either way (``tests/test_ckpt_layout_cache.py``).
"""
from __future__ import annotations

import collections
import itertools
import operator
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..format.state import _PLAIN, FlatState, Piece, flatten, plain_keys

_TENSOR = (torch.Tensor, nn.Parameter)
_ptr, _stride = torch.Tensor.data_ptr, torch.Tensor.stride
_GENERATION = itertools.count()  # each proof's own number: a value proven twice by one proof has not changed between
# what a module's state_dict() reads of it, read by one C-level call a module: its dicts, then its sets of names
_MODULE_DICTS = operator.attrgetter("_parameters", "_buffers", "_modules")
_MODULE_REST = operator.attrgetter("_non_persistent_buffers_set", "_state_dict_hooks", "_state_dict_pre_hooks")
_chain = itertools.chain.from_iterable


def _geometry(tensors: list[torch.Tensor]) -> tuple:
    """What would change a tensor's key or bytes' place without changing the object: its storage and view."""
    return (list(map(_ptr, tensors)), list(map(_stride, tensors)), [t.shape for t in tensors],
            [t.dtype for t in tensors])


def _modules_of(module: nn.Module) -> list[nn.Module]:
    """``module`` and its submodules in ``state_dict``'s order (one reached twice is listed twice, as it walks it)."""
    out = [module]
    for child in module._modules.values():
        if child is not None:
            out += _modules_of(child)
    return out


def _module_sig(modules: list[nn.Module]) -> list:
    """What ``state_dict()`` of ``modules[0]`` depends on (but its tensors' storage), as ``==``-comparable values,
    where ``modules`` is ``_modules_of`` it as last proven: each one's type, its parameters', buffers' and
    children's names and objects, its non-persistent names and hooks. Equal to a proof made while ``modules`` are
    held (their ids stay theirs), it shows ``modules`` is still ``_modules_of`` the same module (each child is
    the held one) and its state_dict the same tree of the same tensors. Read by C-level calls, not a loop a module."""
    dicts = list(_chain(map(_MODULE_DICTS, modules)))
    rest = list(_chain(map(_MODULE_REST, modules)))
    return [*map(type, modules), *map(len, dicts), *map(len, rest), *_chain(dicts), *_chain(rest),
            *map(id, _chain(map(dict.values, dicts)))]


def _module_tensors(modules: list[nn.Module]) -> list[torch.Tensor]:
    return [t for m in modules for d in (m._parameters, m._buffers) for t in d.values() if t is not None]


def _module_ok(modules: list[nn.Module], tensors: list[torch.Tensor]) -> bool:
    """Whether ``state_dict()`` of ``modules[0]`` is ``nn.Module``'s over plain real tensors, with no hook to
    change what it gives from one call to the next (else: walked each save)."""
    base = nn.Module
    for m in modules:
        kind = type(m)
        if (kind.state_dict is not base.state_dict or kind._save_to_state_dict is not base._save_to_state_dict
                or kind.get_extra_state is not base.get_extra_state or m._state_dict_hooks or m._state_dict_pre_hooks
                or any(n in vars(m) for n in ("state_dict", "_save_to_state_dict", "get_extra_state"))
                or not all(type(d) in (dict, collections.OrderedDict) for d in _MODULE_DICTS(m))):  # no own values()
            return False
    return all(type(t) in _TENSOR and not t.is_complex() for t in tensors)


def _optimizer_sig(opt: torch.optim.Optimizer) -> list:
    """What ``opt.state_dict()`` depends on but its groups' values and its tensors' storage: its groups (objects,
    keys, parameters) and state (the parameters it is kept for, their dicts, keys and tensors), by C-level calls."""
    groups, state = opt.param_groups, opt.state
    params = [g["params"] for g in groups]
    per = list(state.values())
    return [id(opt), type(opt), id(state), len(opt._optimizer_state_dict_pre_hooks),
            len(opt._optimizer_state_dict_post_hooks), len(groups), *map(id, groups), *map(len, groups),
            *_chain(groups), *map(len, params), *map(id, _chain(params)), len(state), *map(id, state),
            *map(id, per), *map(len, per), *_chain(per), *map(id, _chain(map(dict.values, per)))]


def _optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [*_chain(g["params"] for g in opt.param_groups), *_chain(s.values() for s in opt.state.values())]


def _plain(value: Any) -> Any:
    """``flatten``'s encoding of a plain value, a tuple or a list of them; ``_Walk`` for anything else."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if (kind is tuple or kind is list) and all(type(v) in _PLAIN for v in value):
        return {"__tuple__": list(value)} if kind is tuple else list(value)
    raise _Walk


class _Walk(Exception):
    """A group value ``_plain`` cannot encode: the optimizer is walked."""


class _Held:
    """One top-level value's piece and the proof it holds; without a piece, a value refused while its
    structure holds (a module or optimizer of a kind this cache cannot prove: walked at every save)."""

    def __init__(self, value: Any, piece: Piece | None, sig: list | None, tensors: list[torch.Tensor],
                 modules: list[nn.Module] | None = None) -> None:
        # held, so that their ids stay theirs: the tensors, and a module's submodules as last proven
        self.value, self.piece, self.sig, self.tensors, self.modules = value, piece, sig, tensors, modules
        self.geometry = _geometry(tensors)
        self.generation = next(_GENERATION)

    def holds(self) -> bool:
        """Whether the value's structure and tensors' storage are those this was made for (no ``sig``: always).
        The same structure holds the very tensors this holds (their ids are in it), so their geometry is read
        from them."""
        if self.sig is None:
            return True
        try:
            sig = _module_sig(self.modules) if self.modules is not None else _optimizer_sig(self.value)
        except (TypeError, KeyError, AttributeError):  # a dict become something else: walked (and raised there)
            return False
        return sig == self.sig and _geometry(self.tensors) == self.geometry

    def proven(self) -> Piece | None:
        """The piece with this save's plain values, if it holds."""
        if self.piece is None or not self.holds():
            return None
        if self.modules is not None:
            return self.piece
        try:
            groups = [{**{k: _plain(v) for k, v in g.items() if k != "params"}, "params": cached["params"]}
                      for g, cached in zip(self.value.param_groups, self.piece.tree["param_groups"])]
        except _Walk:
            return None
        p = self.piece
        return Piece(p.start, {"state": p.tree["state"], "param_groups": groups}, p.tensors, p.keys, p.seen, p.by_id,
                     p.layouts, p.closed)


def _eligible(value: Any, piece: Piece) -> _Held:
    """The proof for a module or optimizer just walked into ``piece``; without the piece where this cache
    cannot prove it unchanged."""
    if isinstance(value, nn.Module):
        modules = _modules_of(value)
        if not all(isinstance(d, dict) for m in modules for d in _MODULE_DICTS(m)):
            return _Held(value, None, None, [])  # walked while it is this module
        tensors = _module_tensors(modules)
        ok = piece.closed and not piece.layouts and _module_ok(modules, tensors)
        return _Held(value, piece if ok else None, _module_sig(modules), tensors, modules)
    base = torch.optim.Optimizer
    params = {id(p) for g in getattr(value, "param_groups", ()) for p in g["params"]}
    if (type(value).state_dict is not base.state_dict or "state_dict" in vars(value)
            or not all(type(g) is dict for g in value.param_groups)
            or not all(id(p) in params and type(s) is dict and all(type(v) is torch.Tensor for v in s.values())
                       for p, s in value.state.items())):
        # not Optimizer's state_dict (a wrapper), or plain values in its state (LBFGS' counts): walked while it is this
        return _Held(value, None, None, [])
    tensors = _optimizer_tensors(value)
    held = _Held(value, piece, _optimizer_sig(value), tensors)
    keys_ok = all(plain_keys(g) for g in value.param_groups)
    if not (piece.closed and not piece.layouts and keys_ok and not value._optimizer_state_dict_pre_hooks
            and not value._optimizer_state_dict_post_hooks
            and all(type(t) in _TENSOR and not t.is_complex() for t in tensors)):
        held.piece = None
    elif (again := held.proven()) is None or again.tree != piece.tree:  # the groups as flatten encodes them
        held.piece = None
    return held


class FlatCache:
    """``flatten``, taking each top-level module's and optimizer's piece of the last save while it is
    proven unchanged. ``built`` and ``reused`` count the pieces made and taken (for tests)."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}
        self._last: FlatState | None = None
        # the modules and optimizers whose pieces this save took: id -> their proof's generation
        self.proven: dict[int, int] = {}
        self._defer: tuple[FlatState | None, tuple, list[bool]] = (None, (), [])
        self.built = self.reused = 0

    def flatten(self, state: Mapping[str, Any]) -> FlatState:
        held, taken, walked = self._held, [], {}

        def reuse(key: str, value: Any) -> Piece | bool:
            h = held.get(key)
            if h is not None and h.value is value:
                if h.piece is None:  # refused: walked, and recorded again only once it changed
                    if h.holds():
                        taken.append(key)
                        return False
                elif (piece := h.proven()) is not None:
                    taken.append(key)
                    return piece
            return isinstance(value, (nn.Module, torch.optim.Optimizer))

        flat = flatten(state, reuse, walked)
        kept = {k: held[k] for k in taken}
        self.proven = {id(h.value): h.generation for h in kept.values() if h.piece is not None}
        self.reused += len(self.proven)
        for key, piece in walked.items():
            kept[key] = _eligible(state[key], piece)
            self.built += 1
        last, self._held, self._last = self._last, kept, flat
        if (last is not None and not walked and len(flat.tensors) == len(last.tensors)
                and all(map(operator.is_, flat.tensors, last.tensors)) and flat.layouts == last.layouts):
            # the same tensors under the same paths: share the last one's lists (their keys are the same)
            flat.tensors, flat.keys, flat.by_id, flat.same_as = last.tensors, last.keys, last.by_id, last
            last.same_as = None
        return flat

    def deferrable(self, flat: FlatState, optimizers: list[torch.optim.Optimizer],
                   compute: Callable[[], list[bool]]) -> list[bool]:
        """``compute()`` (which of ``flat``'s tensors only an optimizer step writes: ``overlap.deferrable``), or
        the last save's answer where ``flat`` holds its very tensors and each optimizer is the same, proven
        unchanged by the same proof (its parameters and state: the same objects, storage and views)."""
        key = tuple((id(o), self.proven.get(id(o))) for o in optimizers)
        last, last_key, later = self._defer
        if flat.same_as is None or flat.same_as is not last or key != last_key or any(g is None for _, g in key):
            later = compute()
        self._defer = (flat, key, later)
        return later

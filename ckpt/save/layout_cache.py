"""A save's layout, reused while the state keeps its structure. Saving every step
flattens the same state every step; where each tensor goes in the slot (its manifest
entry: path, dtype, shape, offset, size and a DTensor's layout) depends on nothing else
than the flattened tensors' paths, dtypes, shapes and DTensor layouts, so a save whose
flattened state has the same ones takes the last save's entries (the very list, which
the memory slot keys its views into the slot on: ``ShmSlot.views``).

What can change from one step to the next is read anew at every save: the tree of
plain values (learning rates, positions, RNG states), the tensors themselves (their
bytes, their storage), which tensors an optimizer step writes (``overlap.deferrable``).
A key added or removed, a tensor of another dtype or shape, a DTensor placed otherwise
changes the key, and the layout is planned again: what is saved is the same either way.

``ParamsCache`` does the same for what a save derives from the state's parameters (their
names in the manifest, the soundness scope): both read only which modules and optimizers
the state holds at its top level and their parameters, so they are kept while those are
the same objects under the same names.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING, Any, Callable, Mapping, TypeVar

from ..tiers.memory.copier import plan_layout

if TYPE_CHECKING:
    from ..format.manifest import TensorEntry
    from ..format.state import FlatState

T = TypeVar("T")


class LayoutCache:
    """The last layout planned and its key; ``built`` and ``reused`` count saves (for tests and metrics)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._plan: tuple[list[TensorEntry], int] = ([], 0)
        self._flat: FlatState | None = None  # the last planned (``FlatState.same_as``: one with its very tensors)
        self.built = self.reused = 0

    def plan(self, flat: FlatState) -> tuple[list[TensorEntry], int]:
        """The entries (never to be changed in place) and data bytes of ``flat``'s tensors."""
        last, self._flat = self._flat, flat
        if flat.same_as is not None and flat.same_as is last:
            self.reused += 1
            return self._plan
        key = (tuple(path for path, _ in flat.tensors), tuple((k[2], k[3]) for k in flat.keys),  # dtypes, shapes
               tuple(sorted(flat.layouts.items())))
        if key == self._key:
            self.reused += 1
            return self._plan
        entries, nbytes = plan_layout(flat.tensors)
        if flat.layouts:
            entries = [dataclasses.replace(e, layout=flat.layouts[e.id]) if e.id in flat.layouts else e
                       for e in entries]
        self._key, self._plan = key, (entries, nbytes)
        self.built += 1
        return self._plan


class ParamsCache:
    """What ``compute`` derived from the last state's parameters, while its key holds: for each
    top-level module its type and the names and objects of ``named_parameters`` (duplicates
    kept, in order), for each top-level optimizer its type and each group's parameters (and
    ``param_names``). Objects are compared by ``id()`` and held by weak references: an id is
    another object's only once the first is gone, and a dead reference plans anew."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._alive: list[weakref.ref] = []
        self._value: Any = None
        self.built = self.reused = 0

    def of(self, state: Mapping[str, Any], compute: Callable[[], T], proven: Mapping[int, int] | None = None) -> T:
        """``proven``: the modules and optimizers a ``FlatCache`` proved unchanged in this save, by ``id()``: each
        keyed on its proof (the same while it holds its named parameters, or its groups' parameters), not read."""
        import torch

        key: list[tuple] = []
        held: list[Any] = []
        proven = proven or {}
        for name, value in state.items():
            if id(value) in proven:
                names = (tuple(tuple(g["param_names"]) if "param_names" in g else None for g in value.param_groups)
                         if isinstance(value, torch.optim.Optimizer) else None)
                key.append((name, "proven", id(value), proven[id(value)], names))
                held.append(value)
            elif isinstance(value, torch.nn.Module):
                named = list(value.named_parameters(remove_duplicate=False))
                key.append((name, type(value), id(value), tuple(n for n, _ in named), tuple(id(p) for _, p in named)))
                held += [value, *(p for _, p in named)]
            elif isinstance(value, torch.optim.Optimizer):
                groups = value.param_groups
                key.append((name, type(value), id(value), tuple(tuple(map(id, g["params"])) for g in groups),
                            tuple(tuple(g["param_names"]) if "param_names" in g else None for g in groups)))
                held += [value, *(p for g in groups for p in g["params"])]
        if tuple(key) == self._key and all(ref() is not None for ref in self._alive):
            self.reused += 1
            return self._value
        self._value = compute()
        self._key, self._alive = tuple(key), [weakref.ref(obj) for obj in held]
        self.built += 1
        return self._value

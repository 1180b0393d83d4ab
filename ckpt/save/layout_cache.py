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
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..tiers.memory.copier import plan_layout

if TYPE_CHECKING:
    from ..format.manifest import TensorEntry
    from ..format.state import FlatState


class LayoutCache:
    """The last layout planned and its key; ``built`` and ``reused`` count saves (for tests and metrics)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._plan: tuple[list[TensorEntry], int] = ([], 0)
        self.built = self.reused = 0

    def plan(self, flat: FlatState) -> tuple[list[TensorEntry], int]:
        """The entries (never to be changed in place) and data bytes of ``flat``'s tensors."""
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

"""Overlapped snapshots (``CheckpointManager(overlap=True)``): ``save()`` copies at once
what the next forward and backward may write (buffers such as BatchNorm's running
statistics, RNG states, the data position, plain values) and leaves the parameters and
optimizer state, which only ``optimizer.step()`` writes, to a copy that runs during the
next step's forward and backward. Every optimizer found in the state gets a step
pre-hook that waits for that copy, so no step writes what is still being copied.

The snapshot is sealed as soon as the training thread sees its copy complete: at the end
of the next forward of a module in the state (a forward hook; the copy is not waited for
there), else at that pre-hook. Sealing at the end of the forward rather than of the step
starts the checksums and peer replicas about two thirds of a step sooner, which is what
lets a lost node's replica of the last step arrive before the next fault. The seal is
never done on the copy thread: between ops, the training thread is in no in-place write.

Each deferred tensor's version counter is recorded at ``save()`` and compared when the
copy is waited for: an in-place torch op meanwhile (anything but ``optimizer.step()``)
refuses the seal (``SnapshotChanged``) instead of keeping a torn snapshot. Writes through
an alias the counter does not see (a numpy view, ``torch.from_numpy``, ``.data``, DLPack)
escape it; ``verify`` (``CheckpointManager(overlap_verify=True)``) catches those too, by
comparing the staged bytes with the live tensors at the seal (a second read of every
deferred byte).
"""
from __future__ import annotations

import operator
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import torch

from ..errors import SnapshotChanged
from ..format.state import local_tensor, tensor_key

if TYPE_CHECKING:
    from ..format.manifest import ShardManifest
    from ..format.state import FlatState
    from ..tiers.base import CheckpointId
    from ..tiers.memory.copier import PendingCopy
    from ..tiers.memory.slots import ShmSlot
    from .drain import SaveHandle

_WRAPPED = ("optimizer", "_optimizer")  # Accelerate's AcceleratedOptimizer, Lightning's LightningOptimizer
_version, _tensor = operator.attrgetter("_version"), operator.itemgetter(1)


def versions(watched: list[tuple[str, torch.Tensor]]) -> list[int]:
    """Each (path, tensor)'s version counter, read by C-level calls (a Python loop's first touch of each
    tensor after a step cost a save more than the reads)."""
    return list(map(_version, map(_tensor, watched)))


def optimizers_in(state: Mapping[str, Any]) -> list[torch.optim.Optimizer]:
    """The optimizers of a state (top level, in lists, tuples and dicts), unwrapped."""
    return found_in(state)[0]


def found_in(state: Mapping[str, Any]) -> tuple[list[torch.optim.Optimizer], list[torch.nn.Module]]:
    """The optimizers (unwrapped) and the modules of a state (top level, in lists, tuples and dicts), in one
    walk: a save needs both, and each walk's first touch of the state after a step was most of its cost."""
    optimizers: list = []
    modules: list = []

    def visit(obj: Any, depth: int, optimizer: bool, module: bool) -> None:
        """``optimizer``, ``module``: still looking for that kind here (not found on the way down)."""
        if optimizer:
            opt = obj
            for _ in range(3):  # a wrapper of a wrapper at most (some subclass Optimizer without its hooks)
                inner = _inner(opt, _attr)
                if inner is None:
                    break
                opt = inner
            if isinstance(opt, torch.optim.Optimizer):
                optimizer = False
                if all(o is not opt for o in optimizers):
                    optimizers.append(opt)
        if module and isinstance(obj, torch.nn.Module):
            module = False
            if all(m is not obj for m in modules):
                modules.append(obj)
        if not (optimizer or module) or depth >= 3:
            return
        if isinstance(obj, Mapping):
            for v in obj.values():
                visit(v, depth + 1, optimizer, module)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                visit(v, depth + 1, optimizer, module)

    visit(state, 0, True, True)
    return optimizers, modules


def _inner(obj: Any, get: Callable[[Any, str], Any]) -> torch.optim.Optimizer | None:
    """The optimizer ``obj`` wraps (its first attribute of ``_WRAPPED`` holding one, read by ``get``), or None."""
    return next((v for a in _WRAPPED if isinstance(v := get(obj, a), torch.optim.Optimizer)), None)


def _attr(obj: Any, name: str) -> Any:
    return getattr(obj, name, None)


def _own(obj: Any, name: str) -> Any:
    return getattr(obj, "__dict__", _NONE).get(name)


_NONE: dict = {}
_INERT = (int, float, bool, str, bytes, type(None))


def _plain_attrs(kind: type) -> bool:
    """Whether ``getattr(x, a)`` of a ``kind`` for ``a`` in ``_WRAPPED`` is what ``x.__dict__`` holds: no class
    attribute, slot or property of that name, and ``object``'s lookup (or ``nn.Module``'s ``__getattr__``,
    which finds only parameters, buffers and submodules); a plain value's type (no attributes of its own)."""
    return kind in _INERT or (kind.__getattribute__ is object.__getattribute__
                              and getattr(kind, "__getattr__", None) in (None, torch.nn.Module.__getattr__)
                              and not any(hasattr(kind, a) for a in _WRAPPED))


def _chain(value: Any) -> tuple[list, list[type]] | None:
    """``value``'s links as ``found_in`` unwraps it (itself, then each optimizer it wraps) and their types, where
    every link's attributes are plain and it is no container (``found_in`` walks into those); else None."""
    if isinstance(value, (Mapping, list, tuple)):
        return None
    links = [value]
    while len(links) < 4 and (inner := _inner(links[-1], _attr)) is not None:
        links.append(inner)
    kinds = list(map(type, links))
    return (links, kinds) if all(map(_plain_attrs, kinds)) else None


def _chain_holds(chain: tuple[list, list[type]]) -> bool:
    """Whether each link is still of its type and still wraps the next (the last: nothing, unless at the depth
    ``found_in`` stops at), read from the links' own dicts."""
    links, kinds = chain
    if not all(map(operator.is_, map(type, links), kinds)):
        return False
    return all(_inner(x, _own) is (links[i + 1] if i + 1 < len(links) else None) for i, x in enumerate(links[:3]))


def _kept(value: Any, entry: tuple) -> bool:
    """Whether a top-level value's last answer (``FoundCache``) still stands: the same object, its chain holding."""
    return value is entry[0] and entry[1] is not None and _chain_holds(entry[1])


class FoundCache:
    """``found_in``, each top-level value's part of it kept while the value is the very object of the last call,
    no container, of a type whose wrapped-optimizer attributes are plain, and wrapping the same optimizers (a value
    replaced, an optimizer swapped inside a wrapper: walked anew; a list or dict: walked at every call). Saving
    every step, the walk's first touch of each value after a step was most of its cost."""

    def __init__(self) -> None:
        self._last: list[tuple[Any, tuple | None, tuple[list, list]]] = []  # (value, its chain, its found_in)
        self._found: tuple[list, list] = ([], [])

    def of(self, state: Mapping[str, Any]) -> tuple[list[torch.optim.Optimizer], list[torch.nn.Module]]:
        """``found_in(state)`` (the lists may be the cache's: not to be changed)."""
        values, last = list(state.values()), self._last
        if len(values) == len(last) and all(map(_kept, values, last)):
            return self._found
        if len(values) != len(last):
            last = [(None, None, None)] * len(values)
        # each value as found_in walks it (the depth below a top-level value), merged in order, each found once
        self._last = [e if _kept(v, e) else (v, _chain(v), found_in({"": v})) for v, e in zip(values, last)]
        optimizers: list = []
        modules: list = []
        for _, _, (opts, mods) in self._last:
            optimizers += [o for o in opts if all(x is not o for x in optimizers)]
            modules += [m for m in mods if all(x is not m for x in modules)]
        self._found = (optimizers, modules)
        return self._found


def step_written(optimizers: Iterable[torch.optim.Optimizer], known: Mapping[int, tuple] | None = None) -> set[tuple]:
    """What ``optimizer.step()`` writes: the parameters and the optimizer state (a
    DTensor's local shard, as ``flatten`` saves it). ``known``: keys already read, by
    ``id()`` of live tensors (``FlatState.by_id``: the optimizer state it flattened)."""
    known = known or {}

    def key(t: torch.Tensor) -> tuple:
        return known.get(id(t)) or tensor_key(local_tensor(t))

    keys = set()
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                keys.add(key(p))
                keys.update(key(v) for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor))
    return keys


def deferrable(flat: FlatState, written: set[tuple]) -> list[bool]:
    """For each tensor, whether its copy may wait until the next ``optimizer.step()``:
    only what that step alone writes, and whose in-place writes are counted."""
    return [key in written and _versioned(t) for key, (_, t) in zip(flat.keys, flat.tensors)]


def _versioned(t: torch.Tensor) -> bool:
    """Whether in-place writes to ``t`` are counted (inference tensors count none)."""
    try:
        return t._version >= 0
    except RuntimeError:
        return False


@dataclass
class StagedSnapshot:
    """A snapshot whose copy runs behind the trainer: sealed by ``finish()`` once the
    copy is complete and nothing it read has been written since ``save()``."""

    ckpt_id: CheckpointId
    slot: ShmSlot
    manifest: ShardManifest
    copy: PendingCopy
    watched: list[tuple[str, torch.Tensor]]  # (path, tensor) of each deferred copy (a save's list: kept, not changed)
    versions: list[int]  # each watched tensor's version at save
    drain: tuple[SaveHandle, bool, bool] | None = None  # (handle, upload, urgent): queued once sealed
    verify: bool = False  # compare the staged bytes with the live tensors at the seal
    encoded: Future[bytes] | None = None  # the manifest's bytes, made on the copy thread (``sealed_bytes``)

    def sealed_bytes(self) -> bytes:
        """The seal's bytes: made on the copy thread, or here if that thread has not started them
        (an urgent save seals before returning; raised here as ``to_bytes`` would raise them)."""
        if self.encoded is None or self.encoded.cancel():
            return self.manifest.to_bytes()
        return self.encoded.result()

    def copied(self) -> bool:
        """Whether the copy has ended (without waiting for it)."""
        return self.copy.done()

    def finish(self) -> None:
        """Wait for the copy; raise ``SnapshotChanged`` naming the tensors written meanwhile."""
        self.copy.wait()
        changed = []
        if versions(self.watched) != self.versions:
            changed = [path for (path, t), version in zip(self.watched, self.versions) if t._version != version]
        if not changed and self.verify:
            changed = self._torn()
        if changed:
            shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
            raise SnapshotChanged(
                f"the snapshot of step {self.ckpt_id.step} was not sealed: {shown} changed in place while it was being "
                "copied (overlap=True). Only optimizer.step() may write parameters and optimizer state before the "
                "copy is waited for (it waits by itself); call mgr.wait_staged() before any other in-place write, "
                "or use overlap=False")

    def _torn(self) -> list[str]:
        """The watched tensors whose staged bytes differ from the live ones (a write the version
        counter did not see: through numpy, ``from_numpy``, ``.data``, DLPack)."""
        entries = {e.path: e for e in self.manifest.tensors}
        torn = []
        for path, t in self.watched:
            e = entries[path]
            staged = self.slot.buffer[e.offset : e.offset + e.nbytes]
            live = local_tensor(t).detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            if not torch.equal(staged, live):
                torn.append(path)
        return torn


class StepHooks:
    """A step pre-hook on each optimizer of the saved state, calling ``wait`` (the manager's
    ``wait_staged``), and a forward hook on each module of it, calling ``seal_if_copied``;
    registered once per object, removed at ``close()``.

    A step given a closure (LBFGS, Lightning's automatic optimization) runs the forward and
    backward inside ``step()``, after the pre-hook: the hook hands the step a closure that
    runs the user's first, then waits, so the copy still overlaps them and no update is
    applied before the wait (an optimizer updates only after its closure returned)."""

    def __init__(self, wait: Callable[[], None], seal_if_copied: Callable[[], None]) -> None:
        self._wait, self._seal_if_copied = wait, seal_if_copied
        self._hooks: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    def watch(self, optimizers: Iterable[torch.optim.Optimizer], modules: Iterable[torch.nn.Module]) -> None:
        for opt in optimizers:
            if opt not in self._hooks:
                self._hooks[opt] = opt.register_step_pre_hook(self._before_step)
        for module in modules:
            if module not in self._hooks:
                self._hooks[module] = module.register_forward_hook(self._after_forward)

    def _after_forward(self, _module: torch.nn.Module, _args: tuple, _output: Any) -> None:
        if not torch.compiler.is_compiling():  # a compiled forward: traced as a constant, no graph break
            self._seal_if_copied()

    def _before_step(self, _opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """``args`` are the step's own, the optimizer first: ``(opt, closure)`` when positional."""
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if not callable(closure):
            self._wait()
            return None

        def then_wait() -> Any:
            loss = closure()
            self._wait()  # after the first call it returns at once (LBFGS calls its closure again)
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": then_wait}
        return (args[0], then_wait, *args[2:]), kwargs

    def close(self) -> None:
        for handle in list(self._hooks.values()):
            handle.remove()
        self._hooks.clear()

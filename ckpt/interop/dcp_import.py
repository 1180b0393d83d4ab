"""Reading a ``torch.distributed.checkpoint`` directory (torchtitan, FSDP2, a plain
``dcp.save``) into one unsharded state: every tensor whole, assembled from all ranks'
chunks by DCP's own load planner, and the plain values; ``ckpt import`` then writes it
as one of our checkpoints (``offline_write.py``).

Trust. A DCP directory is pickles: its ``.metadata`` file is one, and so is every item
that is not a tensor (DCP's "bytes" items: an optimizer's hyperparameters, an epoch
counter, anything else). Loading a pickle with Python's own unpickler runs whatever
code it names, so this module never does:

* ``.metadata`` is read by an unpickler that constructs only DCP's metadata classes
  (and ``torch.Size``, dtypes, layouts, memory formats, paths); a file naming anything
  else is refused, with the name. torch has no safe loader for it: its ``weights_only``
  unpickler does not read pickle protocol 4, which DCP writes.
* Each bytes item is a ``torch.save`` blob. The globals its pickle names are listed
  without running it (``torch.serialization.get_unsafe_globals_in_checkpoint``); an
  item naming anything outside torch's ``weights_only`` allowlist is refused, with the
  item's name and the globals, before any tensor is read; the others are decoded by
  ``torch.load(weights_only=True)`` and must be plain values our format keeps.
* Tensors are read by DCP itself with ``torch.load(weights_only=True)``.

What remains is what any file format carries: a hostile directory can still make the
import use much memory or time. Import only directories you chose.
"""
from __future__ import annotations

import io
import math
import os
import pickle
import re
import stat
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from ..errors import CheckpointError
from ..format.manifest import MAX_JSON_DEPTH

METADATA_FILE = ".metadata"
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "ChunkStorageMetadata",
                                              "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}
_DATA_FILE = re.compile(r"(?!\.\.?$)[A-Za-z0-9_.-]+")  # a plain name inside the directory


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata and nothing else: every global it may name is listed."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()) or (module == "torch" and _is_torch_constant(name)):
            return super().find_class(module, name)
        raise CheckpointError(f"DCP metadata names {module}.{name}, which is not part of DCP's metadata; refusing "
                              "to load it (a .metadata file from an untrusted source can run code when unpickled)")


def _is_torch_constant(name: str) -> bool:
    return isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))


def read_metadata(directory: str | Path) -> Metadata:
    """DCP's ``.metadata`` of ``directory``, read without running any code it names."""
    path = Path(directory) / METADATA_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory} is not a torch.distributed.checkpoint directory (no {METADATA_FILE})")
    with open(path, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f).load()
        except CheckpointError:
            raise
        except Exception as e:  # a truncated or garbled pickle raises anything from the unpickler
            raise CheckpointError(f"{path}: unreadable DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{path}: not DCP metadata (a {type(metadata).__name__})")
    if not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{path}: DCP metadata without storage data")
    _check_storage(Path(directory), metadata.storage_data)
    _check_tensors(path, metadata.state_dict_metadata, metadata.storage_data)
    return metadata


def _check_storage(directory: Path, storage: dict) -> None:
    """Every item's bytes lie inside a regular file of ``directory`` (plain names only, as
    text: a crafted path object can show one name and lead elsewhere; no symlinks)."""
    names = [getattr(info, "relative_path", None) for info in storage.values()]
    bad = sorted({repr(n) for n in names if type(n) is not str or not _DATA_FILE.fullmatch(n)})
    if bad:
        raise CheckpointError(f"{directory}: DCP metadata naming files outside the directory ({', '.join(bad[:5])})")
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        name = info.relative_path
        if name not in sizes:
            try:
                st = os.lstat(directory / name)
            except FileNotFoundError:
                raise CheckpointError(f"{directory}: DCP metadata names {name}, which is missing") from None
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{directory}/{name} is not a regular file (a symlink?); refusing to follow it")
            sizes[name] = st.st_size
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0 \
                or offset + length > sizes[name]:
            fqn = getattr(index, "fqn", index)
            raise CheckpointError(f"{directory}: DCP item {fqn!r}: bytes {offset!r}+{length!r} of {name} are not in "
                                  f"the file ({sizes[name]} bytes)")


def _check_tensors(path: Path, items: dict, storage: dict) -> None:
    """Tensor items have a dtype and a size of non-negative integers, and no more elements
    than their stored chunks hold (what allocating them takes: a crafted size is refused
    before any memory is asked for)."""
    for fqn, md in items.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        if not (isinstance(md.size, tuple) and all(type(d) is int and d >= 0 for d in md.size)
                and isinstance(getattr(md.properties, "dtype", None), torch.dtype)):
            raise CheckpointError(f"{path}: DCP item {fqn!r}: tensor size {md.size!r} is not a list of non-negative "
                                  "integers, or its dtype is not a torch dtype")
        stored = 0
        for chunk in md.chunks if isinstance(md.chunks, list) else ():
            info = storage.get(MetadataIndex(fqn, getattr(chunk, "offsets", None)))
            sizes = getattr(chunk, "sizes", None)
            if info is None or not isinstance(sizes, tuple) or not all(type(d) is int and d >= 0 for d in sizes):
                raise CheckpointError(f"{path}: DCP item {fqn!r}: a chunk with no stored bytes or a bad size")
            if getattr(info, "transform_descriptors", None):  # compressed: its length is no bound
                stored = None
            elif stored is not None:
                stored += min(math.prod(sizes), info.length // md.properties.dtype.itemsize)
        if stored is not None and stored < math.prod(md.size):
            raise CheckpointError(f"{path}: DCP item {fqn!r} declares a tensor of {math.prod(md.size)} elements "
                                  f"({list(md.size)}), more than its stored bytes hold ({stored}); the metadata is "
                                  "damaged or crafted")


class _Reader(FileSystemReader):
    """DCP's file reader, with the metadata read as above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self.path)
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# What a pickled numpy array names (an RNG state's, as ``ckpt export`` writes it): numpy's
# own reconstruction of an array from its dtype and bytes. An array of objects would name
# the objects' classes too (refused); our format keeps numeric arrays only (``flatten``).
_NUMPY_ARRAY: dict[str, Callable[[], Any]] = {
    "numpy.ndarray": lambda: __import__("numpy").ndarray,
    "numpy.dtype": lambda: __import__("numpy").dtype,
    "numpy._core.multiarray._reconstruct": lambda: __import__("numpy")._core.multiarray._reconstruct,
    "numpy.core.multiarray._reconstruct": lambda: __import__("numpy")._core.multiarray._reconstruct,
}


def _numeric_dtypes() -> list[type]:
    """numpy's dtype classes of numbers and bools (what an array's pickle builds its dtype from)."""
    import numpy as np

    return [type(np.dtype(c)) for c in "?bBhHiIlLqQefdgFDG"]


class _Planner(DefaultLoadPlanner):
    """DCP's planner into a flat state (fqn -> value); bytes items decoded safely."""

    def __init__(self, progress: Callable[[int], None] | None) -> None:
        super().__init__(flatten_state_dict=False)
        self.progress = progress
        self.values: dict[str, Any] = {}
        self.refused: dict[str, str] = {}

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        raw = value.read()
        try:
            unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(raw)))
            if unsafe - set(_NUMPY_ARRAY):
                self.refused[fqn] = "a pickled object of " + ", ".join(sorted(unsafe))
            else:
                with torch.serialization.safe_globals([_NUMPY_ARRAY[name]() for name in unsafe]
                                                      + (_numeric_dtypes() if unsafe else [])):
                    self.values[fqn] = torch.load(io.BytesIO(raw), weights_only=True)
        except Exception as e:  # not a torch.save blob, or weights_only refused what it builds
            first = (str(e).splitlines() or [""])[0]
            self.refused[fqn] = f"not decodable without unpickling ({type(e).__name__}: {first})"

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        if self.progress is not None:
            self.progress(tensor.numel() * tensor.element_size())


def tensor_bytes(metadata: Metadata) -> int:
    """The unsharded state's tensor bytes (what an import reads and writes)."""
    return sum(md.size.numel() * md.properties.dtype.itemsize for md in metadata.state_dict_metadata.values()
               if isinstance(md, TensorStorageMetadata))


def read_dcp(directory: str | Path, metadata: Metadata | None = None, *,
             progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """The DCP checkpoint in ``directory`` as one nested, unsharded state (CPU tensors and
    plain values), nested as it was saved (DCP's planner data). Plain values are read and
    checked first: a refused item fails the import before any tensor is read."""
    metadata = metadata or read_metadata(directory)
    items = metadata.state_dict_metadata
    kinds = {type(md).__name__ for md in items.values() if not isinstance(md, (TensorStorageMetadata,
                                                                                BytesStorageMetadata))}
    if kinds:
        raise CheckpointError(f"{directory}: DCP items of kind {', '.join(sorted(kinds))} cannot be imported")
    paths = _paths(metadata)
    plain = _load(directory, {fqn: None for fqn, md in items.items() if isinstance(md, BytesStorageMetadata)}, None)
    if plain.refused:
        lines = [f"{fqn}: {why}" for fqn, why in sorted(plain.refused.items())]
        raise CheckpointError(f"{directory}: {len(lines)} item(s) are pickled objects, which ckpt-guard never "
                              "unpickles (tensors and plain values only); save them as tensors or plain values, "
                              "or leave them out:\n  " + "\n  ".join(lines))
    tensors = {fqn: torch.empty(md.size, dtype=md.properties.dtype) for fqn, md in items.items()
               if isinstance(md, TensorStorageMetadata)}
    _load(directory, tensors, progress)
    state: dict[str, Any] = {}
    try:
        for fqn, value in [*plain.values.items(), *tensors.items()]:
            set_element(state, paths[fqn], value)
    except (TypeError, KeyError, IndexError, AttributeError) as e:  # two items claim one place
        raise CheckpointError(f"{directory}: DCP planner data nests items inconsistently ({e})") from None
    return _optimizer_ids(state)


def _paths(metadata: Metadata) -> dict[str, tuple]:
    """Where each item sat in the saved state (DCP's planner data; its name otherwise),
    checked first: a list index beyond the number of items is not a real one."""
    saved = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else {}
    items = metadata.state_dict_metadata
    out = {}
    for fqn in items:
        path = saved.get(fqn)
        path = tuple(path) if isinstance(path, (tuple, list)) and path else (fqn,)
        if len(path) > MAX_JSON_DEPTH // 2 \
                or not all(isinstance(p, str) or (type(p) is int and 0 <= p < len(items)) for p in path):
            raise CheckpointError(f"DCP planner data: {fqn!r} is placed at {_short(path)}, not a path in a state "
                                  f"(at most {MAX_JSON_DEPTH // 2} deep)")
        out[fqn] = path
    return out


def _short(path: tuple) -> str:
    return repr(path) if len(path) <= 8 else f"{path[:4]!r}… ({len(path)} parts)"


def _load(directory: str | Path, flat: dict[str, Any], progress: Callable[[int], None] | None) -> _Planner:
    planner = _Planner(progress)
    if flat:
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(flat, storage_reader=_Reader(str(directory)), planner=planner, no_dist=True)
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as e:  # DCP wraps what its reader raises (in a BaseException)
            raise CheckpointError(f"{directory}: reading the DCP checkpoint failed: {e}") from None
    return planner


def _optimizer_ids(node: Any) -> Any:
    """Undo what DCP loses of a torch optimizer's state dict, so ``load_state_dict`` takes
    it: DCP names every dict key as a string (``state`` keyed 0, 1, ... comes back keyed
    "0", "1": integers again where the sibling ``param_groups`` list them), and stores no
    empty dict (the ``state`` of an optimizer that has not stepped is gone: back as {})."""
    if isinstance(node, list):
        return [_optimizer_ids(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _optimizer_ids(v) for k, v in node.items()}
    groups = node.get("param_groups")
    if isinstance(groups, list) and groups and all(isinstance(g, dict) and "params" in g for g in groups):
        ids = {p for g in groups for p in g["params"] if type(p) is int}
        node["state"] = {int(k) if isinstance(k, str) and k.isdigit() and int(k) in ids else k: v
                         for k, v in node.get("state", {}).items()}
    return node

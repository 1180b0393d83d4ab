"""The versioned manifest: what a checkpoint holds and how to check it.

Two levels, so that ranks write independently and one party commits:

* ``ShardManifest`` (``rank-NNNNN.json``): one rank's tensors (dtype, shape,
  offset and size in the rank's data file, CRC32C per chunk) and the JSON tree of
  plain values that refers to them.
* ``Manifest`` (``manifest.json``): the commit. Step, generation, world size and,
  per shard, the shard manifest's name and CRC. Written last: a checkpoint without
  it does not exist.

Manifests are untrusted input: every name, dtype, offset and size is checked before
any byte is read, and an unknown major format version is refused.

Limits, so that a hostile manifest costs bounded time and memory (``bounded_json``
checks size, depth and items on the raw bytes, before ``json.loads`` builds anything):

* ``MAX_MANIFEST_BYTES`` (128 MiB) per manifest file;
* ``MAX_JSON_DEPTH`` (128) levels of nesting; deeper input is refused instead of
  exhausting the stack of the JSON parser or of the tree decoder;
* ``MAX_JSON_ITEMS`` (2**23, 8.4 M) array elements plus object members in one
  document: about a GB of Python objects at most, even for distinct values;
* ``MAX_TENSORS_PER_SHARD`` (2**19, 524 k) tensors per shard manifest;
* ``MAX_WORLD_SIZE`` (2**18, 262 k) shards per commit, whose own limits are tighter
  since listing reads every commit: ``MAX_COMMIT_BYTES`` (48 MiB, ~115 bytes a
  shard) and ``MAX_COMMIT_ITEMS`` (2**21, 6 items a shard);
* ``checksum.MIN_CHUNK_BYTES`` (64 KiB) as the smallest checksum chunk, so
  ``chunk_bytes: 1`` cannot turn a small checkpoint into millions of checksums
  (a tensor smaller than a chunk still has one checksum).

A 1-trillion-parameter model fits with room to spare: stored unfused (Kimi K2: 61
layers x 384 experts, about 72 k parameters; with AdamW's two moments and step about
290 k tensors), FSDP gives every rank a local shard of each tensor, so one shard
manifest holds about 290 k entries (~250 bytes each plus its share of the tree:
about 72 MB, 3.8 M items, depth under 10), at the default 16 MiB chunks; about
6 s to parse on one slow core, every limit at least 1.7x away.
"""
from __future__ import annotations

import functools
import json
import math
import re
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, ManifestError
from .bounded_json import check_extent, loads_bounded
from .checksum import ALGORITHM, MIN_CHUNK_BYTES, crc32c_of
from .entry_columns import read_entries
from .health import check_health
from .layout import Layout

if TYPE_CHECKING:
    import torch

FORMAT_NAME = "ckpt-guard"
# 1.1: a commit may list a subset of the shards (per-node commits).
# 1.2: a DTensor's entry records its layout (global shape, mesh, placements, where its local
#      shard lies: ``layout.py``), and a shard lists its replicated keys and its optimizers'
#      parameter names (``optim_names.py``): what restoring at another world size needs.
#      1.1 manifests with DTensors restore at their own world size only.
#      A layout may also carry ``mesh_start`` (the mesh's first rank when its ranks run in order:
#      where the other shards lie, ``restore/narrow.py``); optional, ignored by readers without it.
FORMAT_VERSION = "1.2"
MANIFEST_FILE = "manifest.json"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
MAX_MANIFEST_BYTES = 128 << 20
MAX_JSON_DEPTH = 128
MAX_JSON_ITEMS = 1 << 23
MAX_TENSORS_PER_SHARD = 1 << 19
MAX_WORLD_SIZE = 1 << 18
MAX_COMMIT_BYTES = 48 << 20
MAX_COMMIT_ITEMS = 1 << 21

# Only these dtypes are ever materialised; a manifest naming anything else is refused.
# Item sizes are written out so that reading a manifest (``ckpt ls``/``verify``) needs
# no torch; ``DTYPES``/``DTYPE_NAMES`` map to torch dtypes and import torch on first use.
ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex64": 8, "complex128": 16,
    "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
}


@functools.cache
def _torch_dtypes() -> dict[str, "torch.dtype"]:
    import torch

    return {name: getattr(torch, name) for name in ITEMSIZE if hasattr(torch, name)}


def __getattr__(name: str) -> Any:
    if name == "DTYPES":
        return _torch_dtypes()
    if name == "DTYPE_NAMES":
        return {v: k for k, v in _torch_dtypes().items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def shard_data_file(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


def shard_manifest_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def check_name(name: Any) -> str:
    """A file name from a manifest: one plain path component, nothing else."""
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or ".." in name:
        raise ManifestError(f"refusing file name {name!r} from manifest (must be a plain file name)")
    return name


def _check_version(doc: dict) -> None:
    version = doc.get("format_version")
    if not isinstance(version, str) or not re.match(r"^\d+\.\d+$", version):
        raise ManifestError(f"manifest has no valid format_version (got {version!r})")
    if version.split(".")[0] != FORMAT_VERSION.split(".")[0]:
        raise ManifestError(
            f"manifest format {version} is not readable by this ckpt-guard "
            f"(reads {FORMAT_VERSION.split('.')[0]}.x); upgrade ckpt-guard"
        )


def _int(doc: dict, key: str, lo: int = 0) -> int:
    value = doc.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ManifestError(f"manifest field {key!r} must be an integer >= {lo}, got {value!r}")
    return value


def _world_size(doc: dict, what: str) -> int:
    world = _int(doc, "world_size", 1)
    if world > MAX_WORLD_SIZE:
        raise ManifestError(f"{what}: world size {world} is over the limit of {MAX_WORLD_SIZE}")
    return world


_SELF_CRC = re.compile(rb'([,{])"self_crc32c":(\d+)([,}])')


def _crc_without_self(data: bytes) -> int | None:
    """CRC32C of a commit's text without its ``self_crc32c`` member: as the writer computed
    it over ``dumps`` of the rest, without serialising the parsed document again (slow
    for a large one). Canonical key order puts that member before ``shards``, so the
    first match is the top-level one; a text that is not canonical fails the check."""
    m = _SELF_CRC.search(data)
    if m is None:
        return None
    if m[1] == b",":  # ...,"self_crc32c":N}: drop the comma and the member
        text = data[:m.start()] + data[m.end() - 1:]
    elif m[3] == b",":  # {"self_crc32c":N,...: drop the member and its comma
        text = data[:m.start() + 1] + data[m.end():]
    else:  # {"self_crc32c":N}
        text = data[:m.start() + 1] + data[m.end() - 1:]
    return crc32c_of(text)


def dumps(doc: dict) -> bytes:
    """Canonical JSON (sorted keys) so CRCs of re-serialised manifests are stable."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def loads(data: bytes, what: str, max_bytes: int = MAX_MANIFEST_BYTES, max_items: int = MAX_JSON_ITEMS) -> dict:
    """A manifest document: bounded JSON (see the module's limits) that must be an object."""
    doc = loads_bounded(data, what, MAX_JSON_DEPTH, max_bytes, max_items)
    if not isinstance(doc, dict):
        raise ManifestError(f"{what} is not a JSON object")
    return doc


@dataclass(frozen=True)
class TensorEntry:
    """One tensor in a shard's data file."""

    id: int
    path: str  # where it sat in the state tree, for humans and `ckpt ls`
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    checksums: tuple[int, ...] | None = None  # CRC32C per chunk; None until computed
    layout: Layout | None = None  # a DTensor's: where this local shard lies in the global tensor

    @property
    def torch_dtype(self) -> torch.dtype:
        return _torch_dtypes()[self.dtype]

    def with_checksums(self, checksums: list[int]) -> "TensorEntry":
        return replace(self, checksums=tuple(checksums))

    def to_json(self) -> dict:
        # built by hand: ``dataclasses.asdict`` deep-copies every field and was most of a seal's
        # cost on the trainer thread (a manifest is serialised at every save)
        d = {"id": self.id, "path": self.path, "dtype": self.dtype, "shape": list(self.shape),
             "offset": self.offset, "nbytes": self.nbytes,
             "checksums": list(self.checksums) if self.checksums is not None else None}
        if self.layout is not None:
            d["layout"] = self.layout.to_json()
        return d

    @classmethod
    def from_json(cls, d: Any, data_bytes: int, chunk_bytes: int) -> "TensorEntry":
        if not isinstance(d, dict):
            raise ManifestError("tensor entry is not an object")
        dtype = d.get("dtype")
        if dtype not in ITEMSIZE:
            raise ManifestError(f"tensor {d.get('path')!r}: unknown dtype {dtype!r}")
        shape = d.get("shape")
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                  for s in shape):
            raise ManifestError(f"tensor {d.get('path')!r}: bad shape {shape!r}")
        offset, nbytes = _int(d, "offset"), _int(d, "nbytes")
        if nbytes != math.prod(shape) * ITEMSIZE[dtype]:
            raise ManifestError(f"tensor {d.get('path')!r}: {nbytes} bytes does not match shape {shape} of {dtype}")
        if offset + nbytes > data_bytes:
            raise ManifestError(f"tensor {d.get('path')!r}: bytes {offset}..{offset + nbytes} "
                                f"lie past the data's end ({data_bytes})")
        sums = d.get("checksums")
        if sums is not None:
            want = max(1, math.ceil(nbytes / chunk_bytes))
            if not isinstance(sums, list) or len(sums) != want or not all(isinstance(c, int) for c in sums):
                raise ManifestError(f"tensor {d.get('path')!r}: expected {want} chunk checksums")
            sums = tuple(sums)
        path = d.get("path")
        if not isinstance(path, str):
            raise ManifestError("tensor entry has no path")
        layout = d.get("layout")
        if layout is not None:
            layout = Layout.from_json(layout, tuple(shape), f"tensor {path!r}")
        return cls(_int(d, "id"), path, dtype, tuple(shape), offset, nbytes, sums, layout)


@dataclass
class ShardManifest:
    """One rank's part of a checkpoint: its tensors and its plain-value tree."""

    rank: int
    step: int
    generation: int
    data_bytes: int
    tensors: list[TensorEntry]
    tree: Any
    chunk_bytes: int
    world_size: int = 1
    checksum: str = ALGORITHM
    format_version: str = FORMAT_VERSION
    replicated: tuple[str, ...] = ()  # top-level keys identical on every rank (``replicated=``)
    param_names: dict[str, list[str]] = field(default_factory=dict)  # optimizer key -> its parameters' names

    @property
    def data_file(self) -> str:
        return shard_data_file(self.rank)

    @property
    def has_checksums(self) -> bool:
        return all(t.checksums is not None for t in self.tensors)

    def to_bytes(self) -> bytes:
        """The manifest as written; refuses one that readers would refuse (too large)."""
        if len(self.tensors) > MAX_TENSORS_PER_SHARD:
            raise CheckpointError(f"rank {self.rank}: {len(self.tensors)} tensors; a shard holds at most "
                                  f"{MAX_TENSORS_PER_SHARD}")
        if self.chunk_bytes < MIN_CHUNK_BYTES:
            raise CheckpointError(f"rank {self.rank}: chunk_bytes {self.chunk_bytes} is under {MIN_CHUNK_BYTES}")
        raw = dumps({
            "format_version": self.format_version, "rank": self.rank, "step": self.step,
            "generation": self.generation, "world_size": self.world_size, "data_file": self.data_file,
            "data_bytes": self.data_bytes,
            "chunk_bytes": self.chunk_bytes, "checksum": self.checksum,
            "tensors": [t.to_json() for t in self.tensors], "tree": self.tree,
            "replicated": list(self.replicated), "param_names": self.param_names,
        })
        try:
            check_extent(raw, f"rank {self.rank}'s shard manifest", MAX_JSON_DEPTH, MAX_MANIFEST_BYTES, MAX_JSON_ITEMS)
        except ManifestError as e:  # the state holds too many (or too deeply nested) plain values
            raise CheckpointError(f"{e}, which readers refuse") from None
        return raw

    @classmethod
    def from_bytes(cls, data: bytes, what: str = "shard manifest", *,
                   require_checksums: bool = False) -> "ShardManifest":
        """Parse and check a shard manifest. ``require_checksums``: for a durable copy
        (disk, object store), where a manifest without checksums is damaged, not
        "unverified": only a memory slot may be sealed before its checksums exist."""
        doc = loads(data, what)
        _check_version(doc)
        if doc.get("checksum") != ALGORITHM:
            raise ManifestError(f"{what}: unsupported checksum {doc.get('checksum')!r}")
        rank, data_bytes, chunk = _int(doc, "rank"), _int(doc, "data_bytes"), _int(doc, "chunk_bytes", MIN_CHUNK_BYTES)
        world = _world_size(doc, what)
        if rank >= world:
            raise ManifestError(f"{what}: rank {rank} outside world size {world}")
        if doc.get("data_file") != shard_data_file(rank):
            raise ManifestError(f"{what}: data file {doc.get('data_file')!r} does not belong to rank {rank}")
        raw = doc.get("tensors")
        if not isinstance(raw, list):
            raise ManifestError(f"{what}: 'tensors' is not a list")
        if len(raw) > MAX_TENSORS_PER_SHARD:
            raise ManifestError(f"{what}: {len(raw)} tensors is over the limit of {MAX_TENSORS_PER_SHARD} per shard")
        tensors = read_entries(raw, data_bytes, chunk, ITEMSIZE, TensorEntry)  # every entry's checks at once
        if tensors is None:  # one entry at a time, naming the one at fault
            tensors = [TensorEntry.from_json(t, data_bytes, chunk) for t in raw]
            if sorted(t.id for t in tensors) != list(range(len(tensors))):
                raise ManifestError(f"{what}: tensor ids are not 0..{len(tensors) - 1}")
        replicated, names = doc.get("replicated", []), doc.get("param_names", {})
        if not isinstance(replicated, list) or not all(isinstance(k, str) for k in replicated):
            raise ManifestError(f"{what}: 'replicated' is not a list of keys")
        if not isinstance(names, dict) or not all(isinstance(v, list) and all(isinstance(n, str) for n in v)
                                                  for v in names.values()):
            raise ManifestError(f"{what}: 'param_names' is not a map of name lists")
        man = cls(rank, _int(doc, "step"), _int(doc, "generation"), data_bytes, sorted(tensors, key=lambda t: t.id),
                  doc.get("tree"), chunk, world, format_version=doc["format_version"], replicated=tuple(replicated),
                  param_names=names)
        if require_checksums and not man.has_checksums:
            raise ManifestError(f"{what}: no checksums recorded (a durable copy must have them)")
        return man


@dataclass(frozen=True)
class ShardRef:
    rank: int
    manifest_crc32c: int
    data_bytes: int

    @property
    def manifest_file(self) -> str:
        return shard_manifest_file(self.rank)

    @property
    def data_file(self) -> str:
        return shard_data_file(self.rank)


@dataclass
class Manifest:
    """The commit record of one checkpoint in one volume of a tier: the shards held there
    (all ranks' on one machine or a shared store; one node's on its local disk).
    It exists only once every rank's shard is durable in the tier (``commit.py``)."""

    step: int
    generation: int
    world_size: int
    shards: list[ShardRef]
    created: float = field(default_factory=time.time)
    format_version: str = FORMAT_VERSION
    health: dict | None = None  # the replicas' verdict on this step (``format/health.py``)

    @property
    def total_bytes(self) -> int:
        return sum(s.data_bytes for s in self.shards)

    def to_bytes(self) -> bytes:
        body = {
            "format": FORMAT_NAME, "format_version": self.format_version, "step": self.step,
            "generation": self.generation, "world_size": self.world_size, "created": self.created,
            "shards": [{"rank": s.rank, "manifest": s.manifest_file, "manifest_crc32c": s.manifest_crc32c,
                        "data": s.data_file, "data_bytes": s.data_bytes} for s in self.shards],
        }
        if self.health is not None:
            body["health"] = self.health
        body["self_crc32c"] = crc32c_of(dumps(body))
        return dumps(body)

    @classmethod
    def from_bytes(cls, data: bytes, what: str = MANIFEST_FILE) -> "Manifest":
        data = bytes(data)
        doc = loads(data, what, MAX_COMMIT_BYTES, MAX_COMMIT_ITEMS)
        if doc.get("format") != FORMAT_NAME:
            raise ManifestError(f"{what} is not a {FORMAT_NAME} manifest")
        _check_version(doc)
        if doc.pop("self_crc32c", None) != _crc_without_self(data):
            raise ManifestError(f"{what}: checksum mismatch (the manifest itself is damaged)")
        world = _world_size(doc, what)
        raw = doc.get("shards")
        if not isinstance(raw, list) or not 1 <= len(raw) <= world:
            raise ManifestError(f"{what}: expected 1 to {world} shards")
        shards = []
        for s in raw:
            if not isinstance(s, dict):
                raise ManifestError(f"{what}: shard entry is not an object")
            ref = ShardRef(_int(s, "rank"), _int(s, "manifest_crc32c"), _int(s, "data_bytes"))
            if s.get("manifest") != ref.manifest_file or s.get("data") != ref.data_file:
                check_name(s.get("manifest")), check_name(s.get("data"))  # a hostile name is refused as one
                raise ManifestError(f"{what}: shard file names do not match rank {ref.rank}")
            shards.append(ref)
        ranks = [s.rank for s in shards]
        if len(set(ranks)) != len(ranks) or max(ranks) >= world:
            raise ManifestError(f"{what}: shard ranks must be distinct and below the world size {world}")
        created = doc.get("created")
        if not isinstance(created, (int, float)):
            raise ManifestError(f"{what}: bad 'created'")
        return cls(_int(doc, "step"), _int(doc, "generation"), world,
                   sorted(shards, key=lambda s: s.rank), float(created), doc["format_version"],
                   check_health(doc.get("health"), what))

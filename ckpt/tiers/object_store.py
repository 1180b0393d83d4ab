"""Object-store tier: the copy that survives losing the node (S3 via s3fs, or any fsspec URL).

Same layout as the disk tier, under a URL prefix: ``<prefix>/<step-….gN>/rank-NNNNN.bin``,
``rank-NNNNN.json`` and ``manifest.json``, the commit, written last. Until that
object exists the checkpoint is invisible; once it exists nothing under the
checkpoint's prefix is ever written again. Downloads are parallel ranged reads
(``ranged.RangedReader``), each piece verified against the manifest's chunk CRCs
by ``tensor_io``.
"""
from __future__ import annotations

import logging
import posixpath
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ..errors import CheckpointError, DamagedCheckpoint, ManifestError
from ..format.checksum import crc32c_of
from ..format.manifest import MANIFEST_FILE, Manifest, ShardRef, shard_manifest_file
from ..format.verify import run_parallel
from .base import CheckpointId, CheckpointInfo, DurableTier, ShardReader, check_shard, committed_info, parse_commit
from .ranged import RangedReader
from .retry import RetryPolicy
from .uploads import open_store, uploader_for

log = logging.getLogger(__name__)

DEFAULT_PART_BYTES = 32 << 20
DEFAULT_CONCURRENCY = 8


class ObjectStoreTier(DurableTier):
    """Checkpoints under an fsspec URL.

    ``part_size`` and ``concurrency``: the size of upload parts and download ranges, and
    how many are in flight (memory: about ``part_size * concurrency`` per direction).
    An upload request not finished after ``request_timeout_s`` is abandoned and retried;
    ``retry`` bounds how long an outage is ridden out before the write fails and its
    multipart upload is aborted.
    """

    name = "object"

    def __init__(self, url: str, storage_options: dict | None = None, *, part_size: int = DEFAULT_PART_BYTES,
                 concurrency: int = DEFAULT_CONCURRENCY, request_timeout_s: float = 300.0,
                 retry: RetryPolicy | None = None) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.url, self.part_size, self.concurrency = url, part_size, concurrency
        self.retry = retry or RetryPolicy()
        self.fs, root = open_store(url, storage_options, concurrency)
        self.root = root.rstrip("/")
        # separate pools: a copy from one object store to another never waits on itself
        self._up_pool = ThreadPoolExecutor(concurrency, thread_name_prefix="ckpt-upload")
        self._down_pool = ThreadPoolExecutor(concurrency, thread_name_prefix="ckpt-download")
        self._uploader = uploader_for(self.fs, part_size, self.retry, self._up_pool, request_timeout_s)

    @property
    def location(self) -> str:
        return self.url

    @property
    def volume(self) -> str:
        """The prefix itself: every rank writing here shares it (one committer)."""
        return self.url_of(self.root)

    def url_of(self, path: str) -> str:
        return self.fs.unstrip_protocol(path)

    def _key(self, ckpt_id: CheckpointId, file: str = "") -> str:
        return posixpath.join(self.root, ckpt_id.name, file) if file else posixpath.join(self.root, ckpt_id.name)

    # -- reading ------------------------------------------------------------------

    def list(self) -> list[CheckpointInfo]:
        self.fs.invalidate_cache(self.root)
        # the checkpoints' folders (one delimited listing: O(checkpoints) requests, not a walk of
        # every shard's objects), then each one's commit record, missing where none is committed
        folders = self._missing_as_none(lambda: self.fs.ls(self.root, detail=False), self.root) or []
        ids = {posixpath.join(f, MANIFEST_FILE): CheckpointId.parse(posixpath.basename(f.rstrip("/")))
               for f in folders}
        ids = {p: i for p, i in ids.items() if i is not None}
        if not ids:
            return []
        raws = self.retry.call(lambda: self.fs.cat(sorted(ids), on_error="return"), f"read manifests under {self.url}")
        out = []
        for path, cid in ids.items():
            raw = raws.get(path)
            if isinstance(raw, FileNotFoundError):
                continue  # deleted since the listing: retention at work
            if isinstance(raw, Exception):  # a hiccup is not damage
                raw = self.retry.call(lambda p=path: self.fs.cat_file(p), f"read {self.url_of(path)}")
            try:
                if not isinstance(raw, bytes):
                    raise ManifestError(f"{self.url_of(path)}: unreadable ({raw!r})")
                out.append(committed_info(cid, self.name, parse_commit(raw, cid, self.url_of(path))))
            except ManifestError as e:
                out.append(CheckpointInfo(cid, self.name, 0.0, 0, 0, error=str(e)))
        return sorted(out, key=lambda i: i.id)

    def read_manifest(self, ckpt_id: CheckpointId) -> Manifest:
        path = self._key(ckpt_id, MANIFEST_FILE)
        raw = self.retry.call(lambda: self.fs.cat_file(path), f"read {self.url_of(path)}")
        return parse_commit(raw, ckpt_id, self.url_of(path))

    def open_shard(self, ckpt_id: CheckpointId, ref: ShardRef) -> ShardReader:
        man_path, data_path = self._key(ckpt_id, ref.manifest_file), self._key(ckpt_id, ref.data_file)
        self.fs.invalidate_cache(self._key(ckpt_id))
        raw = self._missing_as_none(lambda: self.fs.cat_file(man_path), man_path)
        info = self._missing_as_none(lambda: self.fs.info(data_path), data_path)
        where = self.url_of(data_path)
        man = check_shard(ckpt_id, ref, raw, None if info is None else int(info["size"]),
                          self.url_of(man_path), where, self.name)

        def fetch(offset: int, nbytes: int) -> bytes:
            try:
                return self.retry.call(lambda: self.fs.cat_file(data_path, start=offset, end=offset + nbytes),
                                       f"read {where} bytes {offset}..{offset + nbytes}")
            except FileNotFoundError:
                raise DamagedCheckpoint(ckpt_id.step, where, "disappeared while being read", self.name) from None

        return RangedReader(fetch, man, where, block=self.part_size, depth=self.concurrency, pool=self._down_pool)

    def verify_manifests(self, ckpt_id: CheckpointId, *, threads: int = 8,
                         shards: list[ShardRef] | None = None) -> None:
        """As every tier's, with every object's size from one listing of the checkpoint's folder
        (a request a thousand objects) instead of a HEAD a shard: one ranged GET a shard (a plain
        ``cat_file`` asks for the size first)."""
        shards = self.read_manifest(ckpt_id).shards if shards is None else shards
        folder = self._key(ckpt_id)
        listed = self.retry.call(lambda: self.fs.ls(folder, detail=True, refresh=True), f"list {self.url_of(folder)}")
        sizes = {posixpath.basename(o["name"]): int(o["size"]) for o in listed if o.get("type") != "directory"}

        def one(ref: ShardRef) -> None:
            man_path, data_path = self._key(ckpt_id, ref.manifest_file), self._key(ckpt_id, ref.data_file)
            size = sizes.get(ref.manifest_file)
            raw = (None if size is None else b"" if size == 0 else
                   self._missing_as_none(lambda: self.fs.cat_file(man_path, start=0, end=size), man_path))
            check_shard(ckpt_id, ref, raw, sizes.get(ref.data_file), self.url_of(man_path), self.url_of(data_path),
                        self.name)

        run_parallel(one, shards, threads)

    def _missing_as_none(self, fn, path: str):
        try:
            return self.retry.call(fn, f"read {self.url_of(path)}")
        except FileNotFoundError:
            return None

    def _committed(self, ckpt_id: CheckpointId) -> bool:
        path = self._key(ckpt_id, MANIFEST_FILE)
        self.fs.invalidate_cache(self._key(ckpt_id))
        return self.retry.call(lambda: self.fs.exists(path), f"check {self.url_of(path)}")

    # -- writing ------------------------------------------------------------------

    def write_shard(self, ckpt_id: CheckpointId, source: ShardReader) -> ShardRef:
        man = source.manifest
        if not man.has_checksums:
            raise ValueError("the object-store tier only accepts shards with checksums")
        if self._committed(ckpt_id):
            raise CheckpointError(f"step {ckpt_id} is already committed in {self.url}; refusing to overwrite it")

        buffers = threading.local()  # one per sending thread for this upload: fresh memory faults on every touch

        def read(offset: int, nbytes: int) -> bytearray:
            buf = getattr(buffers, "buf", None)
            if buf is None or len(buf) != nbytes:
                buf = buffers.buf = bytearray(nbytes)
            view = source.view(offset, nbytes)
            if view is not None:
                memoryview(buf)[:] = view
            else:
                source.read_into(offset, memoryview(buf))
            return buf

        self._uploader.put_large(self._key(ckpt_id, man.data_file), man.data_bytes, read)
        raw = man.to_bytes()
        self._uploader.put(self._key(ckpt_id, shard_manifest_file(man.rank)), raw)
        return ShardRef(man.rank, crc32c_of(raw), man.data_bytes)

    def commit(self, ckpt_id: CheckpointId, manifest: Manifest) -> None:
        if self._committed(ckpt_id):
            raise CheckpointError(f"step {ckpt_id} is already committed in {self.url}; refusing to overwrite it")
        self._uploader.put(self._key(ckpt_id, MANIFEST_FILE), manifest.to_bytes())

    def read_marker(self, name: str) -> bytes | None:
        path = posixpath.join(self.root, name)
        return self._missing_as_none(lambda: self.fs.cat_file(path), path)

    def create_marker(self, name: str, data: bytes) -> bool:
        """Check, then write: two jobs starting within one request's time may both write
        (stores without conditional writes cannot do better); the later one wins."""
        path = posixpath.join(self.root, name)
        self.fs.invalidate_cache(self.root)
        if self.retry.call(lambda: self.fs.exists(path), f"check {self.url_of(path)}"):
            return False
        self._uploader.put(path, data)
        return True

    def delete(self, ckpt_id: CheckpointId) -> None:
        man = self._key(ckpt_id, MANIFEST_FILE)
        self.retry.call(lambda: self._rm(man), f"delete {self.url_of(man)}")
        self.retry.call(lambda: self._rm(self._key(ckpt_id), recursive=True),
                        f"delete {self.url_of(self._key(ckpt_id))}")

    def _rm(self, path: str, recursive: bool = False) -> None:
        try:
            self.fs.rm(path, recursive=recursive)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(path)

    def cleanup(self, min_age_s: float = 0.0) -> list[str]:
        """Abort unfinished multipart uploads, then remove checkpoints without a commit and
        stray temporary objects, all idle for ``min_age_s`` (0 at start-up, when nothing of
        ours can be in flight)."""
        removed = self._uploader.sweep(self.root, min_age_s)
        self.fs.invalidate_cache(self.root)
        files = self.retry.call(lambda: self.fs.find(self.root, detail=True), f"list {self.url}")
        by_ckpt: dict[str, list[str]] = {}
        for path in files:
            rel = posixpath.relpath(path, self.root).split("/")
            if len(rel) == 2 and CheckpointId.parse(rel[0]) is not None:
                by_ckpt.setdefault(rel[0], []).append(path)
        for name, paths in by_ckpt.items():
            committed = any(posixpath.basename(p) == MANIFEST_FILE for p in paths)
            doomed = [p for p in paths if not committed or ".tmp-" in posixpath.basename(p)]
            if not doomed or (min_age_s and min(self._age_s(files[p]) for p in doomed) < min_age_s):
                continue
            if committed:
                for p in doomed:
                    self.retry.call(lambda p=p: self._rm(p), f"delete {self.url_of(p)}")
            else:
                self.retry.call(lambda n=name: self._rm(posixpath.join(self.root, n), recursive=True), f"delete {name}")
            removed.extend(self.url_of(p) for p in doomed)
        return removed

    @staticmethod
    def _age_s(info: dict) -> float:
        mtime = info.get("LastModified") or info.get("mtime") or info.get("created")
        if mtime is None:
            return float("inf")
        ts = mtime.timestamp() if hasattr(mtime, "timestamp") else float(mtime)
        return time.time() - ts

    def close(self) -> None:
        self._up_pool.shutdown(wait=True)
        self._down_pool.shutdown(wait=True)

"""Shared-memory slots: where ``save()`` copies the state, and what survives the trainer.

Each rank owns a small pool of slots under ``/dev/shm/ckpt-guard-<uid>-<hash>/rank-N/``.
A slot is a data file (``slot-K.bin``, the shard's data-file layout byte for byte)
and a seal (``slot-K.json``, the shard manifest, written last by rename). Unsealing
comes first when a slot is reused, so a crash mid-copy leaves it invalid, never torn.

Allocation, ``posix_fallocate`` (a full /dev/shm is a clean ENOSPC, never SIGBUS) and
pre-faulting (``MADV_POPULATE_WRITE``) happen once, off the critical path: first
touch of fresh pages costs ~16x the copy itself. The mapping then lives as long as
the pool, so later saves run at memcpy speed. When the state lives on a GPU, the
mapping is also registered as CUDA pinned memory (off the critical path too), so
device copies run by DMA; it is unregistered before it is unmapped.
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import logging
import mmap
import os
import shutil
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Sequence

import torch

from .errors import CheckpointError
from .fsutil import atomic_write
from .manifest import DTYPE_NAMES, ManifestError, ShardManifest, TensorEntry

log = logging.getLogger(__name__)

DEFAULT_SHM_DIR = "/dev/shm"
ALIGN = 64
_MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def namespace_dir(root_key: str, run: str, shm_dir: str = DEFAULT_SHM_DIR) -> Path:
    """Private per-job directory: a hash of the root's real path, the user and the run id."""
    uid = os.getuid()
    digest = hashlib.sha256(f"{root_key}\0{uid}\0{run}".encode()).hexdigest()[:16]
    return Path(shm_dir) / f"ckpt-guard-{uid}-{digest}"


def rank_dir(ns: Path, rank: int) -> Path:
    return ns / f"rank-{rank:05d}"


def namespaces_of_root(root_real: str, shm_dir: str = DEFAULT_SHM_DIR) -> list[Path]:
    """Every namespace of this user whose owner recorded ``root_real`` (any run id)."""
    found = []
    for owner in sorted(Path(shm_dir).glob(f"ckpt-guard-{os.getuid()}-*/rank-*/owner.json")):
        try:
            if json.loads(owner.read_text()).get("root") == root_real and owner.parent.parent not in found:
                found.append(owner.parent.parent)
        except (OSError, ValueError, AttributeError):
            continue
    return found


def plan_layout(tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[TensorEntry], int]:
    """Offsets for each tensor in the shard's data file, aligned for any dtype view."""
    entries, offset = [], 0
    for i, (path, t) in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        entries.append(TensorEntry(i, path, DTYPE_NAMES[t.dtype], tuple(t.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, offset


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise CheckpointError(f"{path} is not a private directory of this user; refusing to use it")


def sweep_orphans(spaces: list[Path], durable: set[tuple[int, int]], *, force: bool = False) -> list[str]:
    """Remove rank directories whose owner is gone (their lock is free), when every
    sealed (generation, step) in them is also in ``durable``, or with ``force``."""
    removed = []
    for ns in spaces:
        for rdir in sorted(ns.glob("rank-*")):
            try:
                fd = os.open(rdir / "lock", os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue  # a live owner
            try:
                sealed = set()
                for meta in rdir.glob("slot-*.json"):
                    try:
                        m = ShardManifest.from_bytes(meta.read_bytes())
                        sealed.add((m.generation, m.step))
                    except (OSError, ManifestError):
                        continue
                if force or sealed <= durable:
                    shutil.rmtree(rdir, ignore_errors=True)
                    removed.append(str(rdir))
            finally:
                os.close(fd)
        if ns.is_dir() and not any(ns.iterdir()):
            ns.rmdir()
    return removed


class ShmSlot:
    """One shared-memory file, mapped once and pre-faulted, reused save after save."""

    def __init__(self, data_path: Path) -> None:
        self.data_path = data_path
        self.meta_path = data_path.with_suffix(".json")
        self.capacity = 0
        self.buffer: torch.Tensor | None = None  # uint8 view of the whole mapping
        self._mmap: mmap.mmap | None = None
        self._pinned = False  # registered with CUDA (cudaHostRegister)
        self._lock = threading.Lock()  # the background preparer and the training thread both map and pin
        self.idle = threading.Event()  # set when no drain is reading this slot
        self.idle.set()
        sealed = self.sealed() if self.meta_path.exists() else None
        self.holds: tuple[int, int] | None = (sealed.generation, sealed.step) if sealed else None  # (gen, step)

    def ensure(self, nbytes: int) -> None:
        """Allocate (or grow to) ``nbytes``, map and pre-fault; keeps existing contents."""
        with self._lock:
            if self.buffer is None or self.capacity < nbytes:
                self._map(nbytes)

    def pin(self) -> None:
        """Register the mapping as CUDA pinned memory, once: device→slot copies then run
        asynchronously at full DMA speed instead of through the driver's staging buffers."""
        with self._lock:
            if self._pinned or self.buffer is None:
                return
            err = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.capacity, 0)
            if int(err) != 0:
                log.warning("cudaHostRegister of %s failed (%s); device copies will be slower", self.data_path, err)
            self._pinned = int(err) == 0

    def _map(self, nbytes: int) -> None:
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.data_path, flags | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            fd = os.open(self.data_path, flags)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise CheckpointError(f"{self.data_path} is not private to this user; refusing to use it")
            size = max(nbytes, st.st_size, 1)
            _check_free(self.data_path.parent, size - st.st_size)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise CheckpointError(f"cannot allocate {size} bytes in {self.data_path.parent}: {e.strerror} "
                                      f"(enlarge /dev/shm or pass memory_dir=)") from e
            self._unmap()
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.buffer = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.capacity = size
        if _libc.madvise(self.buffer.data_ptr(), size, _MADV_POPULATE_WRITE) != 0:
            flat = self.buffer[:: mmap.PAGESIZE]  # older kernels: touch every page, keeping its byte
            flat.copy_(flat.clone())

    def sealed(self) -> ShardManifest | None:
        try:
            return ShardManifest.from_bytes(self.meta_path.read_bytes(), str(self.meta_path))
        except (FileNotFoundError, ManifestError):
            return None

    def unseal(self) -> None:
        self.holds = None
        self.meta_path.unlink(missing_ok=True)

    def seal(self, manifest: ShardManifest) -> None:
        atomic_write(self.meta_path, manifest.to_bytes(), durable=False, mode=0o600)
        self.holds = (manifest.generation, manifest.step)

    def release(self) -> None:
        with self._lock:
            self._unmap()

    def _unmap(self) -> None:
        # a registration must not outlive its mapping: the driver would keep the address
        # range, and the next allocation there fails ("resource already mapped")
        if self._pinned and self.buffer is not None:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self._pinned = False
        self.buffer = None
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None


def _check_free(directory: Path, need: int) -> None:
    if need <= 0:
        return
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise CheckpointError(f"not enough space in {directory}: a checkpoint slot needs {need / 2**20:.0f} MiB more, "
                              f"{free / 2**20:.0f} MiB free (enlarge /dev/shm or pass memory_dir=)")


class SlotPool:
    """A rank's slots, held under an exclusive lock so no sibling or rerun can touch them."""

    def __init__(self, ns: Path, rank: int, *, slots: int = 2, owner: dict | None = None) -> None:
        if slots < 2:
            raise ValueError("at least two slots: a snapshot must never overwrite the last complete one")
        _private_dir(ns)
        self.dir = rank_dir(ns, rank)
        _private_dir(self.dir)
        self.rank = rank
        self._lock_fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise CheckpointError(f"{self.dir} is in use by another live process (same root, run and rank): "
                                  "is the job already running? Each job needs its own checkpoint root") from None
        for tmp in self.dir.glob("*.tmp*"):  # a seal or owner record a killed process was writing
            tmp.unlink(missing_ok=True)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), **(owner or {})}
        atomic_write(self.dir / "owner.json", json.dumps(info).encode(), durable=False, mode=0o600)
        self.slots = [ShmSlot(self.dir / f"slot-{k}.bin") for k in range(slots)]
        self._ready = threading.Event()
        self._prepare_error: BaseException | None = None

    def prepare_async(self, nbytes: int, *, pin: bool = False) -> None:
        """Allocate and pre-fault every slot in the background (and register it with
        CUDA when ``pin``: the state lives on a GPU)."""
        self._ready.clear()

        def run() -> None:
            try:
                for s in self.slots:
                    s.ensure(nbytes)
                    if pin:
                        s.pin()
            except BaseException as e:  # surfaced by the next save
                self._prepare_error = e
            finally:
                self._ready.set()

        threading.Thread(target=run, name="ckpt-prefault", daemon=True).start()

    def wait_prepared(self) -> None:
        self._ready.wait()
        if self._prepare_error is not None:
            err, self._prepare_error = self._prepare_error, None
            raise err

    def target(self) -> ShmSlot:
        """The slot the next snapshot goes to: never the one holding the newest sealed state."""
        newest = max((s for s in self.slots if s.holds), key=lambda s: s.holds, default=None)
        candidates = [s for s in self.slots if s is not newest]
        idle = [s for s in candidates if s.idle.is_set()]
        return (idle or candidates)[0]

    def snapshot(self, slot: ShmSlot, tensors: Sequence[torch.Tensor], manifest: ShardManifest,
                 copier: "TensorCopier") -> None:
        """Copy ``tensors`` into ``slot`` at the manifest's offsets, then seal it."""
        slot.unseal()
        if slot.capacity < manifest.data_bytes:
            log.warning("allocating %.1f MiB of shared memory on the training thread (%s); pass state= or call "
                        "prepare() to do it in the background", manifest.data_bytes / 2**20,
                        "the state grew" if slot.capacity else "slots not prepared")
            slot.ensure(manifest.data_bytes)
        if any(t.is_cuda for t in tensors):
            slot.pin()
        buf = slot.buffer
        assert buf is not None
        pairs = []
        for e, t in zip(manifest.tensors, tensors):
            if e.nbytes:
                pairs.append((buf[e.offset : e.offset + e.nbytes].view(e.torch_dtype).view(e.shape), t))
        copier.copy(pairs)
        slot.seal(manifest)

    def close(self) -> None:
        for s in self.slots:
            s.release()
        os.close(self._lock_fd)


class TensorCopier:
    """Device→shared-memory copy. CPU: torch's multi-threaded copy. CUDA: copies into the
    pinned slot run on a side stream, after the work already queued on the current one."""

    def __init__(self) -> None:
        self._stream = None

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        cuda = [(d, s) for d, s in pairs if s.is_cuda]
        for d, s in pairs:
            if not s.is_cuda:
                d.copy_(s)
        if cuda:
            self._copy_cuda(cuda)

    def _copy_cuda(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for d, s in pairs:
                d.copy_(s, non_blocking=True)
        self._stream.synchronize()

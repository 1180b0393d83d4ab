"""Shared-memory slots: where ``save()`` copies the state, and what survives the trainer.

A slot is a data file (``slot-K.bin``, the shard's data-file layout byte for byte),
a seal (``slot-K.json``, the shard manifest, written last by rename) and an epoch
(``slot-K.epoch``, a nonce). Unsealing comes first when a slot is reused (the seal
goes, the epoch changes), so a crash mid-copy leaves it invalid, never torn, and a
reader of the old bytes learns that they changed.

Allocation, ``posix_fallocate`` (a full /dev/shm is a clean ENOSPC, never SIGBUS) and
pre-faulting (``MADV_POPULATE_WRITE``) happen once, off the critical path: first
touch of fresh pages costs ~16x the copy itself. The mapping then lives as long as
the pool, so later saves run at memcpy speed. When the state lives on a GPU, the
mapping is also registered as CUDA pinned memory (off the critical path too), so
device copies run by DMA; it is unregistered before it is unmapped.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import mmap
import os
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Sequence

import torch

from ...errors import CheckpointError
from ...format.manifest import ManifestError, ShardManifest, TensorEntry
from ..base import CheckpointId
from ..fsutil import atomic_write
from .copier import CopyPlan, PendingCopy, TensorCopier
from .namespace import (
    MAX_SEAL_BYTES,
    OWNER_FILE,
    free_bytes,
    make_private_dir,
    rank_dir,
    read_owner,
    read_private,
    remove_if_unheld,
)
from .owners import committed_ids
from .reader import epoch_path

log = logging.getLogger(__name__)
_SAID_WAITS = threading.Event()  # a save waited for a slot to drain: said once per process

_MADV_POPULATE_WRITE = 23

# The pools' lock fds held by this process. A forked child (a data loader's worker) shares each
# one's lock: were it kept, a rank's lock would outlive the rank while its children live (up to
# the 5 s a loader worker takes to notice), and the spare taking its rank would be refused.
_LOCKS_HELD: set[int] = set()


def _drop_inherited_locks() -> None:
    for fd in _LOCKS_HELD:
        with contextlib.suppress(OSError):
            os.close(fd)  # the child's copy only: the parent's still holds the lock
    _LOCKS_HELD.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)

# A replica pool's slots: its newest, the newest step common to the sender's node, and the one
# being received (ckpt/peers/replicas.py says why); the shared-memory budget counts them too
REPLICA_SLOTS = 3
_LOCK_WAIT_S = 2.0  # a sweeper holds a dead rank's lock only while it removes the directory
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


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
        self._views: tuple[list, torch.Tensor, list] | None = None  # (entries, buffer, their views): ``views``
        # (entries, tensors, deferred, buffer) -> the staged copy's plan (``SlotPool.start_snapshot``)
        self.copy_plan: tuple[tuple, CopyPlan] | None = None
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
            return ShardManifest.from_bytes(read_private(self.meta_path, MAX_SEAL_BYTES), str(self.meta_path))
        except (OSError, ManifestError):
            return None

    def unseal(self) -> None:
        """Before the slot's bytes change: drop the seal, then give the slot a new epoch, so
        a reader still reading the old bytes finds out when it closes."""
        self.holds = None
        self.meta_path.unlink(missing_ok=True)
        atomic_write(epoch_path(self.meta_path), os.urandom(8).hex().encode(), durable=False, mode=0o600)

    def seal(self, manifest: ShardManifest, data: bytes | None = None) -> None:
        """Write the seal: ``data`` is ``manifest.to_bytes()`` when the caller has it already."""
        atomic_write(self.meta_path, manifest.to_bytes() if data is None else data, durable=False, mode=0o600)
        self.holds = (manifest.generation, manifest.step)

    def views(self, entries: list[TensorEntry]) -> list[torch.Tensor | None]:
        """Each entry's place in the mapping, typed and shaped (None: empty). Kept for the same
        list of entries (``save/layout_cache.py`` hands the same one while the layout holds)
        and the same mapping: making 3 views a tensor was a large part of a save's cost."""
        cached = self._views
        if cached is not None and cached[0] is entries and cached[1] is self.buffer:
            return cached[2]
        buf = self.buffer
        views = [buf[e.offset : e.offset + e.nbytes].view(e.torch_dtype).view(e.shape) if e.nbytes else None
                 for e in entries]
        self._views = (entries, buf, views)
        return views

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
        self._views = self.copy_plan = None  # views of the mapping: it closes only once none is left
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None


def _check_free(directory: Path, need: int) -> None:
    if need <= 0:
        return
    free = free_bytes(directory)
    if need > free:
        raise CheckpointError(f"not enough space in {directory}: a checkpoint slot needs {need / 2**20:.0f} MiB more, "
                              f"{free / 2**20:.0f} MiB free (enlarge /dev/shm or pass memory_dir=)")


class SlotPool:
    """A rank's slots, held under an exclusive lock so no sibling or rerun can touch them."""

    def __init__(self, ns: Path, rank: int, *, slots: int = 2, owner: dict | None = None) -> None:
        if slots < 2:
            raise ValueError("at least two slots: a snapshot must never overwrite the last complete one")
        self.dir = rank_dir(ns, rank)
        self.rank = rank
        self._lock_fd = self._take_lock()
        _LOCKS_HELD.add(self._lock_fd)
        for tmp in self.dir.glob("*.tmp*"):  # a seal or owner record a killed process was writing
            tmp.unlink(missing_ok=True)
        self.owner: dict = {}
        self._owner_lock = threading.Lock()
        durable = (read_owner(self.dir) or {}).get("durable")  # a previous owner's commits stay true of its slots
        self.set_owner({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), **(owner or {}),
                        **({"durable": durable} if isinstance(durable, dict) else {})})
        self.slots = [ShmSlot(self.dir / f"slot-{k}.bin") for k in range(slots)]
        self._ready = threading.Event()
        self._prepare_error: BaseException | None = None

    def _take_lock(self) -> int:
        """The rank's lock. A sweeper that holds it for a moment (it is removing a dead job's
        directory: ``owners.remove_holding``) is waited out, and the directory made again."""
        deadline = time.monotonic() + _LOCK_WAIT_S
        while True:
            try:
                make_private_dir(self.dir.parent)
                make_private_dir(self.dir)
                fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except FileNotFoundError:
                continue  # removed between the two steps
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
                continue
            with contextlib.suppress(OSError):
                if os.stat(self.dir / "lock").st_ino == os.fstat(fd).st_ino:
                    return fd
            os.close(fd)  # a sweeper removed it while this waited
        raise CheckpointError(f"{self.dir} is in use by another live process (same root, run and rank): "
                              "is the job already running? Each job needs its own checkpoint root")

    def set_owner(self, owner: dict) -> None:
        """(Re)write ``owner.json``: what the CLI and the sweeps know of these slots."""
        with self._owner_lock:
            self._write_owner(owner)

    def record_durable(self, tier: str, ckpt_id: CheckpointId) -> None:
        """A step committed in a durable tier: recorded in ``owner.json`` (``owners`` says why)."""
        with self._owner_lock:
            rec = dict(self.owner.get("durable") or {})
            if tuple(rec.get(tier, (-1, -1))) >= (ckpt_id.generation, ckpt_id.step):
                return
            rec[tier] = [ckpt_id.generation, ckpt_id.step]
            self._write_owner({**self.owner, "durable": rec})

    def all_durable(self) -> bool:
        """Whether every step these slots hold is committed in a durable tier (so removing them
        loses nothing: a step restored from memory and never saved again may be the only copy)."""
        done = committed_ids(self.owner)
        return all(any(CheckpointId(*s.holds) <= d for d in done) for s in self.slots if s.holds)

    def _write_owner(self, owner: dict) -> None:
        atomic_write(self.dir / OWNER_FILE, json.dumps(owner).encode(), durable=False, mode=0o600)
        self.owner = owner

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

    def reserve(self, step: int, keep: tuple[int, int] | None = None) -> tuple[ShmSlot, float]:
        """The slot the next snapshot goes to, never the one holding the newest sealed
        state nor the one holding ``keep`` (generation, step), marked busy; an idle one
        first, then one already allocated, then the oldest; waits (and says so) while every
        candidate is still draining. Returns the slot and the seconds waited."""
        newest = max((s for s in self.slots if s.holds), key=lambda s: s.holds, default=None)
        candidates = [s for s in self.slots if s is not newest and (keep is None or s.holds != keep)]
        if not candidates:
            raise CheckpointError(f"{self.dir}: {len(self.slots)} slots cannot keep both the newest state and {keep}")
        slot = min(candidates, key=lambda s: (not s.idle.is_set(), s.capacity == 0, s.holds or (-1, -1)))
        waited = 0.0
        if not slot.idle.is_set():
            # once per process: the advice (save less often, or a faster drain) does not change with each
            # save, nor with each pool (an in-process recovery makes a new one)
            log.log(logging.DEBUG if _SAID_WAITS.is_set() else logging.WARNING, "save(%d) waits for the previous "
                    "checkpoint to leave memory (the drain is slower than the save interval; said once)", step)
            _SAID_WAITS.set()
            t0 = time.monotonic()
            slot.idle.wait()
            waited = time.monotonic() - t0
        slot.idle.clear()
        return slot, waited

    def snapshot(self, slot: ShmSlot, tensors: Sequence[torch.Tensor], manifest: ShardManifest,
                 copier: "TensorCopier") -> None:
        """Copy ``tensors`` into ``slot`` at the manifest's offsets, then seal it."""
        copier.copy(self.destinations(slot, tensors, manifest))
        slot.seal(manifest)

    def start_snapshot(self, slot: ShmSlot, tensors: Sequence[torch.Tensor], manifest: ShardManifest,
                       copier: "TensorCopier", later: Sequence[bool]) -> "PendingCopy":
        """Copy the tensors not marked ``later`` now and start copying the others; the
        caller seals the slot once the returned copy is waited for. The pairs are the slot's
        last ones while ``manifest.tensors``, ``tensors`` and ``later`` are the very same lists
        (``save/layout_cache.py``, ``save/flat_cache.py``: neither changes a list it handed out)
        and the mapping is the same one (its size, pinning and views: unchanged)."""
        key = (manifest.tensors, tensors, later, slot.buffer)
        kept = slot.copy_plan
        if kept is not None and all(a is b for a, b in zip(kept[0], key)):
            return copier.run(kept[1], first=slot.unseal)
        pairs = self.destinations(slot, tensors, manifest, unseal=False)
        defer = [d for e, d in zip(manifest.tensors, later) if e.nbytes]
        plan = CopyPlan.of([p for p, d in zip(pairs, defer) if d], [p for p, d in zip(pairs, defer) if not d])
        slot.copy_plan = ((manifest.tensors, tensors, later, slot.buffer), plan)
        return copier.run(plan, first=slot.unseal)  # on the copy thread when it copies every byte

    def destinations(self, slot: ShmSlot, tensors: Sequence[torch.Tensor], manifest: ShardManifest, *,
                     unseal: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Unseal ``slot`` (a crash from then on leaves it invalid, never torn; ``unseal``
        False: the caller does, before a byte of it changes), size it, and pair each
        non-empty tensor with its place in the slot."""
        if unseal:
            slot.unseal()
        if slot.buffer is None or slot.capacity < manifest.data_bytes:
            if manifest.data_bytes:
                log.warning("allocating %.1f MiB of shared memory on the training thread (%s); pass state= or call "
                            "prepare() to do it in the background", manifest.data_bytes / 2**20,
                            "the state grew" if slot.capacity else "slots not prepared")
            slot.ensure(manifest.data_bytes)  # a rank with nothing to store still maps one byte
        if any(t.is_cuda for t in tensors):
            slot.pin()
        return [(v, t) for v, t in zip(slot.views(manifest.tensors), tensors) if v is not None]

    def close(self, remove: bool = False) -> None:
        for s in self.slots:
            s.release()
        if remove:  # still under the lock: no sibling or rerun is using these files
            shutil.rmtree(self.dir, ignore_errors=True)
            remove_if_unheld(self.dir.parent)  # the job's namespace, once its last rank is gone
        _LOCKS_HELD.discard(self._lock_fd)
        os.close(self._lock_fd)

"""Reading a sealed slot: zero-copy views of the mapping, re-checked against the slot's
epoch when done, so a slot overwritten meanwhile (a live job saving again) is reported
as damaged, never returned torn; a re-seal of the same bytes (the drain adding
checksums) is not an overwrite. Checking bytes needs no torch (``ckpt verify`` starts
fast); torch is imported only to copy into tensors."""
from __future__ import annotations

import mmap
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import DamagedCheckpoint
from ...format.manifest import ShardManifest
from ..base import ShardReader
from .namespace import read_private

if TYPE_CHECKING:
    import torch

_EPOCH_BYTES = 64


def epoch_path(meta_path: Path) -> Path:
    return meta_path.with_suffix(".epoch")


def slot_epoch(meta_path: Path) -> bytes:
    """The slot's epoch: a nonce rewritten each time the slot is unsealed for reuse, before
    any of its bytes change (b"": never reused). Taken before the seal is read, the same
    value after reading proves the bytes were not overwritten meanwhile. OSError: not a
    private file of this user."""
    try:
        return read_private(epoch_path(meta_path), _EPOCH_BYTES)
    except FileNotFoundError:
        return b""


class SlotReader(ShardReader):
    def __init__(self, meta_path: Path, data_path: Path, manifest: ShardManifest, buffer: "torch.Tensor | None",
                 *, epoch: bytes | None) -> None:
        """``buffer``: the owner's own mapping (None: map the file read-only). ``epoch``: the
        slot's epoch, taken before ``manifest`` was read (None: do not re-check)."""
        self.manifest, self.location = manifest, str(data_path)
        self._meta_path = meta_path
        self._epoch = epoch
        self._mmap = None
        self._buf = buffer  # a uint8 tensor over the same bytes, made on first use
        if buffer is not None:
            self._view = memoryview(buffer.numpy()) if buffer.numel() else memoryview(b"")
            return
        fd = os.open(data_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise DamagedCheckpoint(manifest.step, str(data_path), "not a private file of this user", "memory")
            if st.st_size < manifest.data_bytes:
                raise DamagedCheckpoint(manifest.step, str(data_path), "shorter than its seal says", "memory")
            if manifest.data_bytes:
                self._mmap = mmap.mmap(fd, manifest.data_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self._view = memoryview(self._mmap) if self._mmap is not None else memoryview(b"")

    def _tensor(self) -> "torch.Tensor":
        if self._buf is None:
            import torch

            with warnings.catch_warnings():  # read-only on purpose: nothing writes through it
                warnings.simplefilter("ignore", UserWarning)
                self._buf = torch.frombuffer(self._mmap, dtype=torch.uint8) if self._mmap is not None else \
                    torch.empty(0, dtype=torch.uint8)
        return self._buf

    def view(self, offset: int, nbytes: int) -> memoryview:
        return self._view[offset : offset + nbytes]

    def tensor(self, offset: int, nbytes: int) -> "torch.Tensor":
        return self._tensor()[offset : offset + nbytes]

    def read_into(self, offset: int, out: memoryview) -> None:
        n = len(out)
        if n:
            import torch

            torch.frombuffer(out, dtype=torch.uint8).copy_(self._tensor()[offset : offset + n])  # releases the GIL

    def close(self) -> None:
        try:
            still = self._epoch is None or slot_epoch(self._meta_path) == self._epoch
        except OSError:
            still = False
        self._view.release()
        self._buf = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # a caller still holds a view; the GC unmaps it later
                pass
            self._mmap = None
        if not still:
            raise DamagedCheckpoint(self.manifest.step, str(self._meta_path), "slot was overwritten while being read",
                                    "memory")

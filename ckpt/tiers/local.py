"""Local-disk tier (NVMe): one directory per checkpoint, written with large
sequential writes from a few threads, fsynced, committed by ``manifest.json``.

Files are opened without following symlinks: a link planted in a checkpoint
directory is damage, never a way to read (or restore) some other file."""
from __future__ import annotations

import os
import shutil
import stat
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import CheckpointError, DamagedCheckpoint, ManifestError
from ..format.checksum import crc32c_of
from ..format.manifest import MANIFEST_FILE, Manifest, ShardManifest, ShardRef
from .base import CheckpointId, CheckpointInfo, DurableTier, ShardReader, check_shard, committed_info, parse_commit
from .fsutil import age_s, atomic_file, atomic_write, fsync_dir, pread_exact

WRITE_PIECE = 16 << 20
VOLUME_FILE = ".ckpt-guard-volume"
_NOFOLLOW = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


def read_nofollow(path: Path) -> bytes:
    """A file's bytes, refusing a symlink (ELOOP) rather than reading where it points."""
    fd = os.open(path, _NOFOLLOW)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


class FileShardReader(ShardReader):
    def __init__(self, path: Path, manifest: ShardManifest) -> None:
        self.location, self.manifest = str(path), manifest
        self._fd = os.open(path, _NOFOLLOW)

    def read_into(self, offset: int, out: memoryview) -> None:
        pread_exact(self._fd, out, offset, self.location)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class LocalDiskTier(DurableTier):
    name = "disk"

    def __init__(self, root: str | os.PathLike, *, threads: int = 4) -> None:
        self.root = Path(root)
        self.threads = threads

    @property
    def location(self) -> str:
        return str(self.root)

    @property
    def volume(self) -> str:
        """A random id kept in the root, created by whichever rank comes first: ranks on one
        node (or on one shared filesystem) read the same id, ranks on other nodes' local
        disks read their own."""
        self.create_marker(VOLUME_FILE, uuid.uuid4().hex.encode())
        return (self.read_marker(VOLUME_FILE) or b"").decode(errors="replace").strip()

    def read_marker(self, name: str) -> bytes | None:
        try:
            return read_nofollow(self.root / name)
        except FileNotFoundError:
            return None

    def create_marker(self, name: str, data: bytes) -> bool:
        """Written under a temporary name and linked into place: exclusive, and never seen half-written."""
        path = self.root / name
        if path.exists():
            return False
        tmp = path.with_name(f"{name}.tmp{os.getpid()}")
        atomic_write(tmp, data)
        try:
            os.link(tmp, path)
            fsync_dir(self.root)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def _dir(self, ckpt_id: CheckpointId) -> Path:
        return self.root / ckpt_id.name

    def list(self) -> list[CheckpointInfo]:
        if not self.root.is_dir():
            return []
        out = []
        for d in self.root.iterdir():
            cid = CheckpointId.parse(d.name)
            if cid is None or not (d / MANIFEST_FILE).exists():
                continue
            try:
                out.append(committed_info(cid, self.name, self.read_manifest(cid)))
            except (ManifestError, OSError) as e:
                out.append(CheckpointInfo(cid, self.name, d.stat().st_mtime, 0, 0, error=str(e)))
        return sorted(out, key=lambda i: i.id)

    def read_manifest(self, ckpt_id: CheckpointId) -> Manifest:
        path = self._dir(ckpt_id) / MANIFEST_FILE
        return parse_commit(read_nofollow(path), ckpt_id, str(path))

    def open_shard(self, ckpt_id: CheckpointId, ref: ShardRef) -> ShardReader:
        d = self._dir(ckpt_id)
        man_path, data_path = d / ref.manifest_file, d / ref.data_file
        try:
            raw = read_nofollow(man_path)
        except FileNotFoundError:
            raw = None
        try:
            st = data_path.lstat()
            size = st.st_size
        except FileNotFoundError:
            st, size = None, None
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise DamagedCheckpoint(ckpt_id.step, str(data_path), "not a regular file (a symlink?)", self.name)
        man = check_shard(ckpt_id, ref, raw, size, str(man_path), str(data_path), self.name)
        return FileShardReader(data_path, man)

    def write_shard(self, ckpt_id: CheckpointId, source: ShardReader) -> ShardRef:
        man = source.manifest
        if not man.has_checksums:
            raise ValueError("the disk tier only accepts shards with checksums")
        d = self._own_dir(ckpt_id)
        data = d / man.data_file
        with atomic_file(data) as fd:
            if man.data_bytes:
                os.posix_fallocate(fd, 0, man.data_bytes)  # ENOSPC now, not halfway
            self._copy(source, fd, man.data_bytes)
        raw = man.to_bytes()
        atomic_write(d / ShardRef(man.rank, 0, 0).manifest_file, raw)
        return ShardRef(man.rank, crc32c_of(raw), man.data_bytes)

    def _copy(self, source: ShardReader, fd: int, size: int) -> None:
        """Each thread writes one contiguous region front to back: sequential I/O."""
        n = max(1, min(self.threads, -(-size // WRITE_PIECE)))
        bounds = [size * i // n for i in range(n + 1)]

        def region(lo: int, hi: int) -> None:
            bounce = None
            for off in range(lo, hi, WRITE_PIECE):
                k = min(WRITE_PIECE, hi - off)
                buf = source.view(off, k)
                if buf is None:
                    bounce = bounce or memoryview(bytearray(WRITE_PIECE))
                    buf = bounce[:k]
                    source.read_into(off, buf)
                while buf:
                    buf = buf[os.pwrite(fd, buf, off + (k - len(buf))):]

        with ThreadPoolExecutor(n) as pool:
            for f in [pool.submit(region, bounds[i], bounds[i + 1]) for i in range(n)]:
                f.result()

    def _own_dir(self, ckpt_id: CheckpointId) -> Path:
        """The checkpoint's directory, created if need be, refused if it is anything but a
        real directory (a symlink there would send the writes elsewhere)."""
        d = self._dir(ckpt_id)
        try:
            d.mkdir(parents=True)
            fsync_dir(self.root)
        except FileExistsError:
            pass
        if not stat.S_ISDIR(os.lstat(d).st_mode):
            raise CheckpointError(f"{d} is a symlink or not a directory; refusing to write a checkpoint through it")
        return d

    def commit(self, ckpt_id: CheckpointId, manifest: Manifest) -> None:
        atomic_write(self._own_dir(ckpt_id) / MANIFEST_FILE, manifest.to_bytes())

    def delete(self, ckpt_id: CheckpointId) -> None:
        d = self._dir(ckpt_id)
        if d.is_symlink():
            return  # not ours: nothing of it was written (see _own_dir)
        if (d / MANIFEST_FILE).exists():
            (d / MANIFEST_FILE).unlink()
            fsync_dir(d)
        shutil.rmtree(d, ignore_errors=True)

    def cleanup(self, min_age_s: float = 0.0) -> list[str]:
        """Remove uncommitted checkpoint directories (and stray temp files) idle for ``min_age_s``."""
        removed: list[str] = []
        if not self.root.is_dir():
            return removed
        for d in self.root.iterdir():
            if CheckpointId.parse(d.name) is None or not d.is_dir():
                continue
            try:
                if age_s(d) < min_age_s:
                    continue
                if not (d / MANIFEST_FILE).exists():
                    shutil.rmtree(d, ignore_errors=True)
                    removed.append(str(d))
                    continue
                for f in d.iterdir():
                    if ".tmp" in f.name:
                        f.unlink(missing_ok=True)
                        removed.append(str(f))
            except FileNotFoundError:
                continue
        return removed

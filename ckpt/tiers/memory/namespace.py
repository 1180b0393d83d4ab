"""Where a job's shared memory lives, and which of it this user may trust.

Each job (disk root or object-store URL, user, run id) owns one namespace directory,
``<shm>/ckpt-guard-<uid>-<hash>/``, with one ``rank-NNNNN/`` directory per rank
holding its slots, a lock held while the rank lives, and ``owner.json`` (pid, host,
root, run) so that the CLI finds a job's slots from its root after a crash.

/dev/shm is writable by every local user, so nothing found there is trusted by
name: a namespace, rank directory or file counts only if it is owned by this user,
private (no group/other bits) and not a symlink. A planted namespace is ignored,
never listed or restored. A job whose predictable name another user took first uses
the first of ``<name>-1`` ... ``<name>-64`` that is (or can be made) its own: every
rank, restart and CLI lookup walks the same list and lands on the same directory.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ...errors import CheckpointError, ManifestError
from ...format.bounded_json import loads_bounded
from ...format.manifest import ShardManifest
from ..base import CheckpointId

DEFAULT_SHM_DIR = "/dev/shm"
OWNER_FILE = "owner.json"
_MAX_OWNER_BYTES = 64 << 10
MAX_SEAL_BYTES = 256 << 20  # a slot's seal: the shard manifest
_NOFOLLOW = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
log = logging.getLogger(__name__)


_ALTERNATIVES = 64


def namespace_dir(root_key: str, run: str, shm_dir: str = DEFAULT_SHM_DIR) -> Path:
    """Private per-job directory: a hash of the root's real path (or URL), the user and the
    run id; when that name is taken by someone else, the first alternative of this user's
    (made here: ranks racing to make it both end up in it)."""
    uid = os.getuid()
    digest = hashlib.sha256(f"{root_key}\0{uid}\0{run}".encode()).hexdigest()[:16]
    ns = Path(shm_dir) / f"ckpt-guard-{uid}-{digest}"
    if not os.path.lexists(ns) or is_trusted(ns, directory=True):
        return ns
    for k in range(1, _ALTERNATIVES + 1):
        alt = ns.with_name(f"{ns.name}-{k}")
        try:
            alt.mkdir(mode=0o700)
            log.warning("%s is not a private directory of this user (someone else made it); using %s", ns, alt)
        except OSError:
            pass  # ours already, or someone else's: told apart below
        if is_trusted(alt, directory=True):
            return alt
    raise CheckpointError(f"{ns} and its {_ALTERNATIVES} alternatives ({ns.name}-N) are taken by someone else; "
                          f"remove them or pass another memory_dir")


def memory_namespace(root: str | os.PathLike, run: str | None, memory_dir: str = DEFAULT_SHM_DIR) -> Path:
    """The shared-memory directory of the job with this disk root and run (the CLI finds it too)."""
    return namespace_dir(os.path.realpath(root), run or "default", memory_dir)


def rank_dir(ns: Path, rank: int) -> Path:
    return ns / f"rank-{rank:05d}"


def is_trusted(path: Path, *, directory: bool, uid: int | None = None) -> bool:
    """Owned by this user (or ``uid``), private, and not a symlink (checked with lstat)."""
    try:
        st = path.lstat()
    except OSError:
        return False
    kind = stat.S_ISDIR if directory else stat.S_ISREG
    return kind(st.st_mode) and st.st_uid == (os.getuid() if uid is None else uid) and not st.st_mode & 0o077


def make_private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not is_trusted(path, directory=True):
        raise CheckpointError(f"{path} is not a private directory of this user; refusing to use it")


def read_private(path: Path, limit: int, uid: int | None = None) -> bytes:
    """A small file of this user's (or ``uid``'s), read without following a symlink; OSError otherwise."""
    fd = os.open(path, _NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != (os.getuid() if uid is None else uid) or st.st_mode & 0o077:
            raise PermissionError(errno.EPERM, "not a private file of this user", str(path))
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", str(path))
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit + 1)
    finally:
        os.close(fd)


def read_owner(rdir: Path, uid: int | None = None) -> dict[str, Any] | None:
    """A rank directory's owner record, or None when it is missing, foreign or malformed."""
    path = rdir / OWNER_FILE
    try:
        doc = loads_bounded(read_private(path, _MAX_OWNER_BYTES, uid), str(path), 4, _MAX_OWNER_BYTES)
    except (OSError, ManifestError):
        return None
    return doc if isinstance(doc, dict) else None


def trusted_namespaces(shm_dir: str = DEFAULT_SHM_DIR) -> list[Path]:
    """Every namespace directory of this user under ``shm_dir`` that passes ``is_trusted``."""
    base = Path(shm_dir)
    if not base.is_dir():
        return []
    return [ns for ns in sorted(base.glob(f"ckpt-guard-{os.getuid()}-*")) if is_trusted(ns, directory=True)]


def rank_dirs(ns: Path, uid: int | None = None) -> list[Path]:
    return [d for d in sorted(ns.glob("rank-*")) if is_trusted(d, directory=True, uid=uid)]


def remove_if_unheld(ns: Path) -> bool:
    """Remove the namespace ``ns`` once no rank directory is left in it: what else it holds (the
    hang detector's beats, the node's restart records) served ranks that are all gone, and alone
    would keep the namespace forever. Returns whether it is gone."""
    with contextlib.suppress(OSError):  # a rank (re)made meanwhile, or removed by a sibling
        if not any(ns.glob("rank-*")):
            shutil.rmtree(ns)
    return not ns.exists()


def slot_file_bytes(ns: Path) -> int:
    """Shared memory the slot files under ``ns`` take (allocated in full when prepared)."""
    if not is_trusted(ns, directory=True):
        return 0
    return sum(p.stat().st_size for d in rank_dirs(ns) for p in d.glob("slot-*.bin") if not p.is_symlink())


def free_bytes(directory: Path) -> int:
    """Space an unprivileged writer can still allocate under ``directory`` (a tmpfs: memory)."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def namespaces_of_root(root_key: str, shm_dir: str = DEFAULT_SHM_DIR) -> list[Path]:
    """Every trusted namespace whose owner recorded ``root_key`` (any run id)."""
    found = []
    for ns in trusted_namespaces(shm_dir):
        if any((o := read_owner(d)) is not None and o.get("root") == root_key for d in rank_dirs(ns)):
            found.append(ns)
    return found


@contextmanager
def owner_gone(rdir: Path) -> Iterator[bool | None]:
    """Whether a rank directory's owner process is gone: True (and its lock is held here
    until the block ends, so nobody takes the slots meanwhile), False for a live owner,
    None when there is no lock file to tell."""
    try:
        fd = os.open(rdir / "lock", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def seals(rdir: Path, uid: int | None = None) -> Iterator[ShardManifest]:
    """The seals in a rank directory that parse (one being replaced, or damaged, is skipped)."""
    for meta in rdir.glob("slot-*.json"):
        try:
            yield ShardManifest.from_bytes(read_private(meta, MAX_SEAL_BYTES, uid), str(meta))
        except (OSError, ManifestError):
            continue


def sweep_orphans(spaces: list[Path], durable: set[tuple[int, int, int]], *, older_than: CheckpointId | None = None,
                  force: bool = False) -> list[str]:
    """Remove rank directories whose owner is gone (their lock is free), when every
    sealed (saved rank, generation, step) in them is also in ``durable`` or older than
    ``older_than`` (a finished job's newest durable step: nothing restores past it), or
    with ``force``. Keyed on the saved rank: a node's own shard of a step on its disk
    never makes another rank's shard of that step (a peer replica) look disposable."""
    removed = []
    for ns in spaces:
        if not is_trusted(ns, directory=True):
            continue
        for rdir in rank_dirs(ns):
            with owner_gone(rdir) as gone:
                if not gone:
                    continue  # a live owner, or no lock to tell
                kept = {(m.rank, m.generation, m.step) for m in seals(rdir)
                        if older_than is None or CheckpointId(m.generation, m.step) >= older_than}
                if force or kept <= durable:
                    shutil.rmtree(rdir, ignore_errors=True)
                    removed.append(str(rdir))
        remove_if_unheld(ns)
    return removed

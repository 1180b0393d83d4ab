"""The job's secret: what separates the job's own processes from anyone else who can reach its
ports (docs/security.md).

Whoever starts the job makes it (``python -m ckpt.inprocess.launch`` on one node, the Slurm batch
script, a per-job Kubernetes Secret) and hands it to every node's launcher, and on to every
worker, through the environment or a file, never on argv (``/proc/PID/cmdline`` is readable by
every user of the host):

- ``CKPT_JOB_SECRET_FILE``: a file holding it (its bytes, a trailing newline stripped), or
- ``CKPT_JOB_SECRET``: the secret itself.

At least 32 bytes of it (e.g. ``head -c 32 /dev/urandom | base64``); the file wins when both are
set. Each use gets a key of its own (HKDF-SHA256, RFC 5869): a key learnt from one use (a peer
replica's transport) opens nothing else (the control plane).
"""
from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

SECRET_ENV = "CKPT_JOB_SECRET"
SECRET_FILE_ENV = "CKPT_JOB_SECRET_FILE"
MIN_BYTES = 32
_SALT = b"ckpt-guard job secret v1"

log = logging.getLogger(__name__)


class SecretError(ValueError):
    """The job's secret is missing where it is required, unreadable or too short."""


def load() -> bytes | None:
    """The job's secret from ``CKPT_JOB_SECRET_FILE`` or ``CKPT_JOB_SECRET``; None when neither
    is set. SecretError (one line) when the one set is unreadable or shorter than 32 bytes."""
    path = os.environ.get(SECRET_FILE_ENV)
    if path:
        try:
            raw = Path(path).read_bytes().rstrip(b"\r\n")
            mode = os.stat(path).st_mode
        except OSError as e:
            raise SecretError(f"{SECRET_FILE_ENV}={path}: cannot read the job secret ({e.strerror})") from None
        if mode & stat.S_IROTH:
            log.warning("%s=%s is readable by every user of this host: chmod 600 it", SECRET_FILE_ENV, path)
        where = f"{SECRET_FILE_ENV}={path}"
    elif os.environ.get(SECRET_ENV):
        raw, where = os.environb[SECRET_ENV.encode()], SECRET_ENV
    else:
        return None
    if len(raw) < MIN_BYTES:
        raise SecretError(f"{where}: the job secret has {len(raw)} bytes, fewer than {MIN_BYTES}")
    return raw


def ensure() -> bytes:
    """The job's secret, made here (32 random bytes, hex) and put in this process's environment
    for its children when none was given: the launcher of a job on one node needs nobody else
    to know it."""
    found = load()
    if found is not None:
        return found
    os.environ[SECRET_ENV] = os.urandom(MIN_BYTES).hex()
    return os.environb[SECRET_ENV.encode()]


def derive(secret: bytes, use: str, length: int = 32) -> bytes:
    """The key of one ``use`` of the job's secret (HKDF-SHA256, a fixed salt, ``use`` as the info)."""
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=_SALT, info=use.encode()).derive(secret)


def fingerprint(key: bytes) -> str:
    """A short name of ``key`` that gives nothing of it away: ranks compare theirs to find one
    started with another job's secret (or none) before they rely on it."""
    return derive(key, "fingerprint", 8).hex()

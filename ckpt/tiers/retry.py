"""Retrying remote operations: exponential backoff with full jitter, bounded by a deadline.

Network stores fail transiently (timeouts, resets, 5xx, throttling) far more often
than they fail for good, so anything not known to be permanent is retried until
the deadline; jitter keeps many parts (or many ranks) from retrying in lockstep.
"""
from __future__ import annotations

import errno
import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from ..errors import CheckpointError

log = logging.getLogger(__name__)
T = TypeVar("T")

# Retrying these cannot help: the request itself is wrong, or the store refuses it.
_PERMANENT = (PermissionError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
              ValueError, TypeError, NotImplementedError, CheckpointError)
# The store lacks the call (s3fs maps S3's NotImplemented to ENOSYS): callers may skip what needs it.
UNSUPPORTED_ERRNO = frozenset({errno.ENOSYS, errno.EOPNOTSUPP})
_PERMANENT_ERRNO = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENAMETOOLONG,
                    *UNSUPPORTED_ERRNO}


def is_transient(exc: BaseException) -> bool:
    """True for errors worth another attempt: anything but a known-permanent refusal."""
    if not isinstance(exc, Exception) or isinstance(exc, _PERMANENT):
        return False
    return not (isinstance(exc, OSError) and exc.errno in _PERMANENT_ERRNO)


@dataclass(frozen=True)
class RetryPolicy:
    """``deadline_s`` bounds the whole operation, so an outage longer than that surfaces as an error."""

    deadline_s: float = 900.0
    base_s: float = 0.2
    cap_s: float = 20.0

    def call(self, fn: Callable[[], T], what: str) -> T:
        """Run ``fn`` until it succeeds, a permanent error occurs, or the deadline passes."""
        start = time.monotonic()
        attempt = 0
        while True:
            try:
                return fn()
            except Exception as e:
                attempt += 1
                elapsed = time.monotonic() - start
                if not is_transient(e) or elapsed >= self.deadline_s:
                    if is_transient(e):
                        log.error("%s: giving up after %d attempts in %.0f s: %s", what, attempt, elapsed, e)
                    raise
                delay = min(self.deadline_s - elapsed, random.uniform(0, min(self.cap_s, self.base_s * 2 ** attempt)))
                log.warning("%s failed (attempt %d, retrying in %.1f s): %s", what, attempt, delay, e)
                time.sleep(max(0.0, delay))

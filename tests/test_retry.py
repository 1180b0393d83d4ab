"""What the object-store tier retries, and what it gives up on at once."""
from __future__ import annotations

import errno

import pytest

from ckpt.tiers.retry import RetryPolicy, is_transient


@pytest.mark.parametrize("exc", [ConnectionResetError(), TimeoutError(), OSError(errno.EIO, "I/O"),
                                 RuntimeError("5xx")])
def test_transient_errors_are_retried(exc: Exception) -> None:
    assert is_transient(exc)


@pytest.mark.parametrize("exc", [PermissionError(), FileNotFoundError(), OSError(errno.ENOSPC, "full"),
                                 OSError(errno.ENOSYS, "A parameter you provided implies functionality that is not "
                                                       "implemented"), NotImplementedError()],
                         ids=["denied", "missing", "full", "store-lacks-the-api", "not-implemented"])
def test_permanent_errors_are_not(exc: Exception) -> None:
    assert not is_transient(exc)


def test_a_store_without_the_api_fails_at_the_first_attempt() -> None:
    calls = []

    def unsupported() -> None:
        calls.append(1)
        raise OSError(errno.ENOSYS, "not implemented")

    with pytest.raises(OSError):
        RetryPolicy(deadline_s=60, base_s=0.01).call(unsupported, "list unfinished uploads")
    assert len(calls) == 1

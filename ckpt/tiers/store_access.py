"""Before the first request to an object store: is its fsspec driver installed, and are
there credentials? Without either, a listing would end in a traceback or in minutes of
retries (``RetryPolicy`` retries what it cannot tell is permanent); here it is one line.
"""
from __future__ import annotations

from ..errors import CheckpointError

# protocol -> (the package fsspec needs, the ckpt-guard extra that installs it)
DRIVERS = {"s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}
# storage_options that name credentials (or none: anon) themselves; botocore's chain is not asked
_S3_OWN_CREDENTIALS = ("anon", "key", "secret", "token", "profile", "session")


def missing_driver(url: str, protocol: str | None, error: ImportError) -> CheckpointError:
    """The one-line error for a URL whose fsspec driver is not installed."""
    package, extra = DRIVERS.get(protocol or "", (None, None))
    if package is None:
        return CheckpointError(f"{url}: {error}")
    return CheckpointError(f"{url}: {protocol}:// needs {package}: pip install 'ckpt-guard[{extra}]'")


def check_s3_credentials(url: str, storage_options: dict) -> None:
    """Fail at once, naming what is missing, when botocore's chain (environment, profile
    files, instance role) finds no credentials: s3fs would otherwise raise at each request."""
    client = storage_options.get("client_kwargs") or {}
    if any(storage_options.get(k) for k in _S3_OWN_CREDENTIALS) or client.get("aws_access_key_id"):
        return
    import botocore.session

    if botocore.session.Session().get_credentials() is None:
        raise CheckpointError(f"{url}: no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                              "(or AWS_PROFILE, ~/.aws/credentials, an instance role), or pass key/secret "
                              "in storage_options")

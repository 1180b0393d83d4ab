"""How bytes reach an object store: the one place that knows about backends.

The object-store tier talks to every fsspec filesystem through ``Uploader``. The
generic one streams an object through ``fs.open``; on S3 (s3fs) large objects go
as multipart uploads whose parts are sent in parallel, retried one by one, and
aborted as a whole when the upload cannot finish, so no half object and no
orphaned upload (which S3 bills for) is left behind.
"""
from __future__ import annotations

import base64
import hashlib
import logging
import os
import posixpath
import uuid
from abc import ABC, abstractmethod
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from datetime import datetime, timezone
from typing import Any, Callable, Iterator

from fsspec import AbstractFileSystem
from fsspec.asyn import sync
from fsspec.core import split_protocol, url_to_fs
from fsspec.exceptions import FSTimeoutError

from .retry import UNSUPPORTED_ERRNO, RetryPolicy
from .store_access import check_s3_credentials, missing_driver

log = logging.getLogger(__name__)

# (offset, nbytes) -> those bytes of the source, in a buffer the calling thread may reuse at its next call
Read = Callable[[int, int], "bytes | bytearray"]
S3_PROTOCOLS = ("s3", "s3a")
S3_MIN_PART = 5 << 20  # S3 refuses smaller parts (except the last)
S3_MAX_PARTS = 10_000


def open_store(url: str, storage_options: dict | None, concurrency: int) -> tuple[AbstractFileSystem, str]:
    """The filesystem and root path behind ``url``. On S3, the tier gets its own client with
    a connection pool as large as the transfers in flight (botocore's default is 10), no
    listing cache, and no s3fs inner retry loop, so ``RetryPolicy`` is the one place
    retries happen.

    botocore hashes every request body (SHA-256 for the signature over plain HTTP, and a
    CRC32) on s3fs's single event-loop thread, which then caps the upload rate. Here each
    body carries a Content-MD5 that the worker sending it computes, in parallel, and S3
    rejects a part whose bytes do not match it; botocore's own hashing is turned off
    unless ``storage_options`` set it.
    """
    opts = dict(storage_options or {})
    protocol = split_protocol(url)[0]
    s3 = protocol in S3_PROTOCOLS
    if s3:
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault("max_pool_connections", max(10, 2 * concurrency))
        config.setdefault("request_checksum_calculation", "when_required")
        config["s3"] = {"payload_signing_enabled": False, **(config.get("s3") or {})}
        opts.update(config_kwargs=config, skip_instance_cache=True, use_listings_cache=False)  # other nodes write too
    try:
        fs, root = url_to_fs(url, **opts)
    except ImportError as e:  # fsspec: "Install s3fs to access S3"
        raise missing_driver(url, protocol, e) from None
    if s3:
        check_s3_credentials(url, opts)
        fs.retries = 1
    return fs, root


def _fsync(f: Any) -> None:
    """Make a local file durable; remote file objects have no descriptor and are durable on close."""
    try:
        fd = f.fileno()
    except (AttributeError, OSError, ValueError):
        return
    f.flush()
    os.fsync(fd)


class Uploader(ABC):
    def __init__(self, fs: AbstractFileSystem, part_size: int, retry: RetryPolicy) -> None:
        self.fs, self.part_size, self.retry = fs, part_size, retry

    @abstractmethod
    def put(self, path: str, data: bytes) -> None:
        """Write a small object atomically: readers see all of it or none."""

    @abstractmethod
    def put_large(self, path: str, size: int, read: Read) -> None:
        """Write ``size`` bytes obtained piecewise from ``read`` (each piece consumed before the
        same thread reads the next); leave nothing behind on failure."""

    def sweep(self, prefix: str, min_age_s: float = 0.0) -> list[str]:
        """Abort unfinished uploads under ``prefix`` older than ``min_age_s``; return what went."""
        return []


class StreamUploader(Uploader):
    """Any fsspec filesystem: one sequential stream per object, retried whole."""

    def _open(self, path: str, **kwargs: Any) -> Any:
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)  # real directories where there are any
        return self.fs.open(path, "wb", **kwargs)

    def put(self, path: str, data: bytes) -> None:
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"

        def attempt() -> None:
            with self._open(tmp) as f:
                f.write(data)
                _fsync(f)
            self.fs.mv(tmp, path)  # a rename where the store has one

        try:
            self.retry.call(attempt, f"write {path}")
        except BaseException:
            _remove_quietly(self.fs, tmp)
            raise

    def put_large(self, path: str, size: int, read: Read) -> None:
        def attempt() -> None:
            with self._open(path, block_size=self.part_size) as f:
                for off in range(0, size, self.part_size):
                    f.write(read(off, min(self.part_size, size - off)))
                _fsync(f)

        try:
            self.retry.call(attempt, f"write {path}")
        except BaseException:
            _remove_quietly(self.fs, path)
            raise


class S3MultipartUploader(Uploader):
    """s3fs: parallel multipart uploads through s3fs's own (async) client and credentials.

    Each request is bounded by ``request_timeout_s``: botocore's read timeout does not fire
    while a body is still being sent, so a store that stops reading would hang a part forever.
    """

    def __init__(self, fs: AbstractFileSystem, part_size: int, retry: RetryPolicy, pool: ThreadPoolExecutor,
                 request_timeout_s: float) -> None:
        super().__init__(fs, part_size, retry)
        self.pool, self.request_timeout_s = pool, request_timeout_s

    def _call(self, method: str, **kwargs: Any) -> dict:
        try:
            return sync(self.fs.loop, self.fs._call_s3, method, timeout=self.request_timeout_s, **kwargs)
        except FSTimeoutError:
            raise TimeoutError(f"{method}: no answer within {self.request_timeout_s:g} s") from None

    def put(self, path: str, data: bytes) -> None:
        bucket, key, _ = self.fs.split_path(path)
        md5 = _content_md5(data)
        self.retry.call(lambda: self._call("put_object", Bucket=bucket, Key=key, Body=data, ContentMD5=md5),
                        f"write {path}")

    def put_large(self, path: str, size: int, read: Read) -> None:
        if size <= self.part_size:
            self.put(path, read(0, size))
            return
        bucket, key, _ = self.fs.split_path(path)
        part_size = max(self.part_size, -(-size // S3_MAX_PARTS))  # very large shards need larger parts
        starts: list[str | None] = []  # one entry per start sent; the upload id where its reply came

        def start() -> str:
            starts.append(None)
            starts[-1] = self._call("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
            return starts[-1]

        try:
            upload = self.retry.call(start, f"start upload of {path}")
            where = dict(Bucket=bucket, Key=key, UploadId=upload)
            try:
                self._send_and_complete(path, size, part_size, read, where)
            except BaseException:
                self._abort(path, where)
                raise
        finally:
            if None in starts:  # a start whose reply was lost may still have begun an upload on the store
                self._abort_strays(path, keep=[u for u in starts if u is not None])

    def _send_and_complete(self, path: str, size: int, part_size: int, read: Read, where: dict) -> None:
        etags = self._send_parts(path, size, part_size, read, where)
        parts = [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(etags)]
        whole = _multipart_etag(etags)

        def complete() -> None:
            try:
                self._call("complete_multipart_upload", MultipartUpload={"Parts": parts}, **where)
            except Exception:
                if self._landed(where["Bucket"], where["Key"], whole):  # an earlier try finished; its reply was lost
                    return
                raise

        self.retry.call(complete, f"complete upload of {path}")

    def _send_parts(self, path: str, size: int, part_size: int, read: Read, where: dict) -> list[str]:
        """Each part is read when a worker takes it, so at most ``pool`` parts sit in memory."""
        def part(number: int, off: int) -> str:
            body = read(off, min(part_size, size - off))
            md5 = _content_md5(body)
            return self.retry.call(lambda: self._call("upload_part", PartNumber=number, Body=body, ContentMD5=md5,
                                                      **where)["ETag"], f"upload part {number} of {path}")

        futures = [self.pool.submit(part, i + 1, off) for i, off in enumerate(range(0, size, part_size))]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in done if f.exception() is not None), None)
        if failed is not None:
            for f in futures:
                f.cancel()
            wait(futures)
            raise failed.exception()  # type: ignore[misc]
        return [f.result() for f in futures]

    def _landed(self, bucket: str, key: str, etag: str) -> bool:
        try:
            head = self._call("head_object", Bucket=bucket, Key=key)
        except Exception:
            return False
        return head.get("ETag", "").strip('"') == etag

    def _abort(self, path: str, where: dict) -> None:
        try:
            RetryPolicy(deadline_s=30).call(lambda: self._call("abort_multipart_upload", **where),
                                            f"abort upload of {path}")
        except Exception as e:  # the start-up sweep will get it
            log.error("could not abort the multipart upload of %s (%s); it is swept at the next start-up", path, e)

    def _abort_strays(self, path: str, keep: list[str]) -> None:
        """Abort this key's unfinished uploads other than ``keep`` (ours, handled by the caller):
        each key has one writer, so any other is a start whose reply was lost (a store that
        answers after ``request_timeout_s``, or one that was down and then serves what it queued)."""
        bucket, key, _ = self.fs.split_path(path)
        try:
            for up in self._unfinished(bucket, key, RetryPolicy(deadline_s=30)):
                if up["Key"] == key and up["UploadId"] not in keep:
                    self._abort(path, dict(Bucket=bucket, Key=key, UploadId=up["UploadId"]))
        except Exception as e:  # the start-up sweep will get them
            log.error("could not list the unfinished uploads of %s (%s); they are swept at the next start-up", path, e)

    def _unfinished(self, bucket: str, key_prefix: str, retry: RetryPolicy) -> Iterator[dict]:
        """The unfinished multipart uploads under ``key_prefix``, page by page."""
        marker: dict = {}
        while True:
            page = retry.call(lambda marker=marker: self._call("list_multipart_uploads", Bucket=bucket,
                                                               Prefix=key_prefix, **marker),
                              f"list unfinished uploads under {bucket}/{key_prefix}")
            yield from page.get("Uploads", [])
            if not page.get("IsTruncated"):
                return
            marker = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    def sweep(self, prefix: str, min_age_s: float = 0.0) -> list[str]:
        bucket, key_prefix, _ = self.fs.split_path(prefix)
        key_prefix = key_prefix.rstrip("/") + "/" if key_prefix else ""
        now = datetime.now(timezone.utc)
        swept: list[str] = []
        try:
            for up in self._unfinished(bucket, key_prefix, self.retry):
                if (now - up["Initiated"]).total_seconds() >= min_age_s:
                    where = dict(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
                    self._abort(f"{bucket}/{up['Key']}", where)
                    swept.append(f"{bucket}/{up['Key']} (unfinished upload {up['UploadId']})")
        except OSError as e:
            if e.errno not in UNSUPPORTED_ERRNO:
                raise
            log.warning("%s cannot list unfinished multipart uploads (%s): orphans of killed uploads are not "
                        "swept; a lifecycle rule that aborts incomplete uploads does it", prefix, e)
        return swept


def _content_md5(body: bytes) -> str:
    return base64.b64encode(hashlib.md5(body, usedforsecurity=False).digest()).decode()


def _multipart_etag(etags: list[str]) -> str:
    """S3's ETag of a completed multipart object: MD5 of the parts' MD5s, dash, part count."""
    digest = hashlib.md5(b"".join(bytes.fromhex(e.strip('"')) for e in etags), usedforsecurity=False)
    return f"{digest.hexdigest()}-{len(etags)}"


def _remove_quietly(fs: AbstractFileSystem, path: str) -> None:
    try:
        fs.rm_file(path)
    except Exception:  # already gone, or the store is down: start-up cleanup removes it
        pass


def uploader_for(fs: AbstractFileSystem, part_size: int, retry: RetryPolicy, pool: ThreadPoolExecutor,
                 request_timeout_s: float) -> Uploader:
    """Multipart on S3 (parts sent by ``pool``); a plain stream everywhere else."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol
    if any(p in S3_PROTOCOLS for p in protocols):
        if part_size < S3_MIN_PART:
            raise ValueError(f"part_size {part_size} is below S3's minimum of {S3_MIN_PART} bytes (5 MiB)")
        return S3MultipartUploader(fs, part_size, retry, pool, request_timeout_s)
    return StreamUploader(fs, part_size, retry)

"""A real S3-compatible server on loopback for the object-store tests: moto's server mode
in a subprocess (so a test can freeze it with SIGSTOP), one per test session, with a
fresh bucket per test. Import the fixtures into a test module; they stop what they start."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from contextlib import contextmanager
from dataclasses import dataclass

from .procs import free_port, stop_process

MOTO_SERVER = [sys.executable, "-m", "moto.server"]  # works wherever moto is importable (a venv, --target)


@dataclass
class S3Server:
    proc: subprocess.Popen
    endpoint: str
    key: str = "testing"
    secret: str = "testing"

    def options(self, **config) -> dict:
        """storage_options for s3fs: short timeouts so a frozen server shows up as errors, and no
        botocore retries below the tier's own (those are what the tests exercise)."""
        return {"endpoint_url": self.endpoint, "key": self.key, "secret": self.secret,
                "client_kwargs": {"region_name": "us-east-1"},
                "config_kwargs": {"connect_timeout": 2, "read_timeout": 10, "retries": {"max_attempts": 1}, **config}}

    def freeze(self) -> None:
        """SIGSTOP the server: connections are accepted by the kernel and then hang, as in a partition."""
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    @contextmanager
    def frozen(self):
        """Frozen for the block (thawed on exit, also when the block thawed it already)."""
        self.freeze()
        try:
            yield
        finally:
            self.thaw()


def _wait_up(endpoint: str, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1)
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"moto_server did not answer on {endpoint}")


@contextmanager
def moto_server(env: dict | None = None):
    """Start ``moto_server`` on a free loopback port; stop it (thawed first) on exit."""
    port = free_port()
    proc = subprocess.Popen([*MOTO_SERVER, "-H", "127.0.0.1", "-p", str(port)],
                            env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        endpoint = f"http://127.0.0.1:{port}"
        _wait_up(endpoint, proc)
        yield S3Server(proc, endpoint)
    finally:
        proc.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        stop_process(proc)


def create_bucket(server: S3Server, name: str | None = None) -> str:
    name = name or f"ckpt-{uuid.uuid4().hex[:12]}"
    import s3fs  # here, not at the top: conftest loads this module where s3fs is absent (the GPU machine)

    s3fs.S3FileSystem(skip_instance_cache=True, **server.options()).call_s3("create_bucket", Bucket=name)
    return name

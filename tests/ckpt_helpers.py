"""Shared helpers for the checkpoint-engine tests (tests/test_ckpt_*.py).

Everything here drives the real engine: real files, real shared memory (in a
private directory under /dev/shm, removed afterwards), real processes killed with
real SIGKILLs. Nothing is mocked.

* ``step_state(step)``: a small multi-tensor training state whose every byte is a
  function of ``step`` (and ``salt``), so a test can recompute what any step held.
* ``assert_same(actual, expected)``: bitwise comparison of (nested) states.
* ``CrashServer``: drives tests/crash_child.py, a pre-imported "zygote" that forks
  one trainer per request and SIGKILLs it on cue (see that file).
* corruption / hostile-manifest helpers, and ``small_tmpfs`` for disk-full tests.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
SAVED_NEWEST = 3  # the ``saved`` fixture (conftest.py) holds steps 1..SAVED_NEWEST

# -- deterministic states ---------------------------------------------------------------


def step_state(step: int, salt: int = 0) -> dict[str, Any]:
    """Several tensors of several dtypes, a numpy array and plain values, all derived
    from ``(step, salt)``: any step's bytes can be recomputed by any process."""
    g = torch.Generator().manual_seed(step * 1_000_003 + salt)
    return {
        "weights": torch.randn(512, 1024, generator=g),  # 2 MiB: snapshot and drain take measurable time
        "bias": torch.randn(4096, generator=g).to(torch.bfloat16),
        "counts": torch.randint(-2**40, 2**40, (3, 1000), generator=g),
        "mask": torch.rand(777, generator=g) > 0.5,
        "moments": torch.randn(300, generator=g, dtype=torch.float64).numpy(),
        "meta": {"step": step, "salt": salt, "tag": f"step-{step}", "pair": (step, 2**65 + step),
                 "blob": bytes([step % 256, salt % 256]) * 7},
    }


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(actual: Any, expected: Any, path: str = "state") -> None:
    """Bitwise equality, recursing through containers; types must match too."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: {type(actual).__name__}, expected a tensor"
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), f"{path}: dtype/shape differ"
        assert raw_bytes(actual) == raw_bytes(expected), f"{path}: tensor bytes differ"
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), f"{path}: {type(actual).__name__}, expected an ndarray"
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), f"{path}: dtype/shape differ"
        assert actual.tobytes() == expected.tobytes(), f"{path}: array bytes differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), \
            f"{path}: keys {set(actual)} != {set(expected)}"
        for k in expected:
            assert_same(actual[k], expected[k], f"{path}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), f"{path}: {actual!r} != {expected!r}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{path}[{i}]")
    elif isinstance(expected, float) and expected != expected:
        assert isinstance(actual, float) and actual != actual, f"{path}: {actual!r}, expected nan"
    else:
        assert type(actual) is type(expected) and actual == expected, f"{path}: {actual!r} != {expected!r}"
        if isinstance(expected, float):
            assert repr(actual) == repr(expected), f"{path}: {actual!r} != {expected!r} (sign of zero?)"


def restored(mgr, step: int | None = None) -> tuple[int | None, dict]:
    """Restore into an empty dict (everything comes back as new values)."""
    state: dict = {}
    return mgr.restore(state, step=step), state


# -- disk layout and damage --------------------------------------------------------------


CKPT_DIR = re.compile(r"^step-\d{12}\.g\d+$")


def ckpt_dir(root: Path, step: int, generation: int = 0) -> Path:
    return Path(root) / f"step-{step:012d}.g{generation}"


def disk_steps(root: Path) -> list[tuple[int, int]]:
    """(generation, step) of every committed directory on disk, oldest first."""
    out = []
    for d in Path(root).iterdir():
        if CKPT_DIR.match(d.name) and (d / "manifest.json").exists():
            step, gen = d.name[5:].split(".g")
            out.append((int(gen), int(step)))
    return sorted(out)


def leftovers(root: Path, memory_dir: str | None = None) -> list[str]:
    """What an interrupted save leaves: step directories without a commit, temp files
    (on disk, and in the shared-memory slots under ``memory_dir``)."""
    out = [str(p) for p in Path(memory_dir).rglob("*.tmp*")] if memory_dir else []
    for d in Path(root).iterdir():
        if CKPT_DIR.match(d.name) and d.is_dir():
            if not (d / "manifest.json").exists():
                out.append(d.name)
            out += [f"{d.name}/{f.name}" for f in d.iterdir() if ".tmp" in f.name]
    return sorted(out)


def eventually(check: Callable[[], Any], timeout: float = 60.0) -> None:
    """Poll ``check`` until true: retention runs in the background after wait() returns
    (wait() means durable, not pruned)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"still not true after {timeout} s: {check.__doc__ or check}"
        time.sleep(0.01)


def flip_byte(path: Path, offset: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def truncate(path: Path, drop: int = 1) -> None:
    os.truncate(path, path.stat().st_size - drop)


def rewrite_json(path: Path, change: Callable[[dict], None]) -> None:
    """Edit a manifest and re-sign it (self-CRC for manifest.json, the commit's CRC for a
    shard manifest): the result is *consistent* hostile input, so the checks under test
    are the semantic ones, not the checksums."""
    from ckpt.format.checksum import crc32c_of
    from ckpt.format.manifest import MANIFEST_FILE, dumps

    doc = json.loads(path.read_bytes())
    if path.name == MANIFEST_FILE:
        doc.pop("self_crc32c", None)
        change(doc)
        doc["self_crc32c"] = crc32c_of(dumps(doc))
        path.write_bytes(dumps(doc))
        return
    change(doc)
    raw = dumps(doc)
    path.write_bytes(raw)
    commit = path.parent / MANIFEST_FILE

    def resign(m: dict) -> None:
        for s in m["shards"]:
            if s["manifest"] == path.name:
                s["manifest_crc32c"] = crc32c_of(raw)
    rewrite_json(commit, resign)


def plant_shard_manifest(path: Path, raw: bytes) -> None:
    """Replace a shard manifest with ``raw`` (hostile bytes json.dumps cannot even make,
    e.g. 100,000-deep) and re-sign the commit's CRC of it, so the checks under test
    are the parser's, not the CRC's."""
    from ckpt.format.checksum import crc32c_of
    from ckpt.format.manifest import MANIFEST_FILE

    path.write_bytes(raw)

    def resign(m: dict) -> None:
        for s in m["shards"]:
            if s["manifest"] == path.name:
                s["manifest_crc32c"] = crc32c_of(raw)
    rewrite_json(path.parent / MANIFEST_FILE, resign)


# -- a filesystem that fills up -----------------------------------------------------------


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """Mount a size-limited tmpfs at ``path`` (needs root / CAP_SYS_ADMIN; skips otherwise),
    unmounted on the way out (lazily if something still holds it)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("a size-limited tmpfs needs root (mount); run the suite as root or in a VM to cover disk-full")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "ckpt-test", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def writes_denied(path: Path) -> Iterator[str]:
    """Make directory ``path`` refuse new entries: chmod 0500 as a normal user; as root
    (which ignores permission bits) the immutable attribute (chattr +i, EPERM)."""
    if os.geteuid() != 0:
        path.chmod(0o500)
        try:
            yield "Permission denied"
        finally:
            path.chmod(0o700)
        return
    r = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"running as root and chattr +i is unavailable here: {r.stderr.strip()}")
    try:
        yield "Operation not permitted"
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


# -- the crash harness ----------------------------------------------------------------------


class CrashServer:
    """Client of ``tests/crash_child.py serve``: one pre-imported zygote process that, per
    ``run()``, forks a fresh trainer process, lets it save in a loop, and SIGKILLs it
    after ``kill_after`` seconds (or the trainer kills itself at an injected fault point).
    Forking from a zygote makes each killed trainer cost milliseconds, not a torch import."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.stderr_path = workdir / "crash_child.stderr"
        self._stderr = open(self.stderr_path, "wb")
        env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        self.proc = subprocess.Popen([PYTHON, str(REPO / "tests" / "crash_child.py"), "serve"], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        self.rounds = 0

    def run(self, **cfg: Any) -> dict:
        """Run one trainer; returns the zygote's report plus ``events`` (the trainer's log:
        ``restored N`` / ``saving N`` / ``saved N`` / ``durable`` / ``fault ...``)."""
        self.rounds += 1
        cfg = {"events": str(self.workdir / f"events-{self.rounds}.log"), "timeout": 30.0, **cfg}
        events = Path(cfg["events"])
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(cfg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"crash_child.py died: {self.stderr_path.read_text()[-3000:]}")
        report = json.loads(line)
        report["events"] = events.read_text().split("\n")[:-1] if events.exists() else []
        if report.get("exit") not in (None, 0):
            raise AssertionError(f"trainer failed (exit {report['exit']}): {self.stderr_path.read_text()[-3000:]}")
        return report

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()


def steps_logged(events: list[str], what: str) -> list[int]:
    """Steps of the trainer's ``saving N`` / ``saved N`` lines."""
    return [int(e.split()[1]) for e in events if e.startswith(what + " ")]

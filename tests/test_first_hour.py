"""The first hour with ``ckpt``: each mistake a newcomer makes ends in one line that says
what to do (``error: …``), at once, never a traceback or minutes of silent retries."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# run ckpt.cli as if a package were not installed: None in sys.modules makes its import fail
_WITHOUT = "import sys; sys.modules.update(dict.fromkeys({mods!r})); sys.argv[0] = 'ckpt'; " \
           "from ckpt.cli import main; main()"


def ckpt(*args: str, without: tuple[str, ...] = (), env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m ckpt.cli ARGS`` in ``env`` (default: this one); the timeout is a hang guard only."""
    full = {**(os.environ if env is None else env), "PYTHONPATH": str(REPO)}
    cmd = ["-c", _WITHOUT.format(mods=list(without)), *args] if without else ["-m", "ckpt.cli", *args]
    return subprocess.run([sys.executable, *cmd], cwd=REPO, env=full, capture_output=True, text=True, timeout=120)


def one_error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


@pytest.mark.parametrize("url, package, extra", [("s3://bucket/run", "s3fs", "s3"),
                                                 ("gs://bucket/run", "gcsfs", "gcs")])
def test_a_store_url_without_its_driver_names_the_extra(url: str, package: str, extra: str) -> None:
    line = one_error_line(ckpt("ls", url, without=("s3fs", "gcsfs")))
    assert package in line and f"ckpt-guard[{extra}]" in line
    r = ckpt("ls", url, "--json", without=("s3fs", "gcsfs"))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    out = json.loads(r.stdout)
    assert f"ckpt-guard[{extra}]" in out["error"] and out["exit_code"] == 1


def test_s3_without_credentials_fails_at_once_naming_them(tmp_path: Path) -> None:
    """No keys in the environment, no profile files, no instance role (IMDS off here: no network)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
               AWS_EC2_METADATA_DISABLED="true", HOME=str(tmp_path))
    line = one_error_line(ckpt("ls", "s3://bucket/run", env=env))  # retried for 15 min before
    assert "no AWS credentials" in line and "AWS_ACCESS_KEY_ID" in line


def test_a_failed_restore_leaves_no_folder_it_made_and_keeps_one_that_was_there(tmp_path: Path) -> None:
    empty_root = tmp_path / "run"
    empty_root.mkdir()
    made = tmp_path / "new" / "restored"
    r = ckpt("restore", str(empty_root), "--to", str(made), "--memory-dir", str(tmp_path / "no-shm"))
    assert "no checkpoint" in one_error_line(r)
    assert not (tmp_path / "new").exists()  # neither DEST nor the parent made for it
    there = tmp_path / "there"
    there.mkdir()
    r = ckpt("restore", str(empty_root), "--to", str(there), "--json", "--memory-dir", str(tmp_path / "no-shm"))
    assert r.returncode == 1 and json.loads(r.stdout)["exit_code"] == 1, r.stdout + r.stderr
    assert there.is_dir()


@pytest.mark.parametrize("module, args, code", [
    ("ckpt.cli", ("ls",), 2),                                   # usage: click's own three lines before
    ("ckpt.cli", ("verify", "/no/such/root"), 2),
    ("predictor.cli", ("eval", "--trace", "/no/such/trace"), 2),
    ("agents.cli", ("simulate", "--nodes", "0", "--out", "/tmp/x"), 2),
])
def test_every_command_reports_an_error_as_one_line_starting_error(module: str, args: tuple, code: int) -> None:
    r = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == code, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--help" in lines[0], r.stderr


def test_predictor_serve_without_tokens_says_so_before_loading_the_server() -> None:
    """Said at once: the tokens are read before the server's imports (the model's libraries took 15 s
    on a busy machine). No timing asserted: the import log shows that they were never loaded."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPT_GUARD_", "PREDICTOR_"))}
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "predictor.cli", "serve", "--port", "1"], cwd=REPO,
                       env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if not line.startswith("import time:")]
    assert len(errors) == 1 and errors[0].startswith("error: no tokens"), errors
    assert "predictor.serve.server" not in r.stderr and "sklearn" not in r.stderr


def test_the_data_docs_hazard_md_runs_on_is_where_it_says() -> None:
    """Its commands run from the repository's root: every data path they name is there (../shared
    beside the repository, as in CI; the page says where to get it elsewhere)."""
    import re

    text = (REPO / "docs" / "hazard.md").read_text()
    paths = set(re.findall(r"(?<![\w/.])(\.\./shared/data/[\w./-]+\w)", text))
    assert paths and not re.search(r"(?<![\w/.])shared/data/", text.replace("../shared/data/", "")), paths
    if not (REPO.parent / "shared" / "data").is_dir():
        pytest.skip("../shared/data is not beside this checkout")
    assert [p for p in paths if not (REPO / p).exists()] == []


def test_ls_shows_what_verify_found_damaged_and_what_it_found_sound(root: Path, shm_dir: str, tmp_path: Path) -> None:
    """The commit's seal does not cover the data: a flipped data byte lists as complete until
    verify reads it; from then on ls says damaged (and checked, for the sound step)."""
    from ckpt import CheckpointManager
    from tests.ckpt_helpers import ckpt_dir, flip_byte, step_state

    with CheckpointManager(root, memory_dir=shm_dir, keep_last=5) as mgr:
        for step in (1, 2):
            mgr.save(step, step_state(step))
        mgr.wait()
    flip_byte(ckpt_dir(root, 1) / "rank-00000.bin", 12345)
    slots = ("--memory-dir", str(tmp_path / "no-slots"))

    def ls() -> dict[int, str]:
        r = ckpt("ls", str(root), *slots, "--json")
        assert r.returncode == 0, r.stderr
        return {row["step"]: row["status"] for row in json.loads(r.stdout)}

    assert ls() == {1: "complete", 2: "complete"}
    assert ckpt("verify", str(root), *slots).returncode == 1
    assert ls() == {1: "damaged", 2: "checked"}
    text = ckpt("ls", str(root), *slots)
    assert "found damaged by ckpt verify" in text.stdout, text.stdout

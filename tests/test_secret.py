"""The job's secret (ckpt.secret): handed over by file or environment, never argv; one key per use."""
from __future__ import annotations

import os

import pytest

from ckpt import secret
from ckpt.coordination import Coordinator
from ckpt.peers.peering import _peer_key


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv(secret.SECRET_ENV, raising=False)
    monkeypatch.delenv(secret.SECRET_FILE_ENV, raising=False)
    return monkeypatch


def test_the_file_wins_over_the_variable_and_short_secrets_are_refused(clean_env, tmp_path):
    f = tmp_path / "secret"
    f.write_bytes(b"f" * 40 + b"\n")
    f.chmod(0o600)
    clean_env.setenv(secret.SECRET_ENV, "e" * 40)
    assert secret.load() == b"e" * 40
    clean_env.setenv(secret.SECRET_FILE_ENV, str(f))
    assert secret.load() == b"f" * 40  # the trailing newline of `echo ... > file` is not part of it
    f.write_bytes(b"short")
    with pytest.raises(secret.SecretError, match="5 bytes, fewer than 32"):
        secret.load()
    clean_env.setenv(secret.SECRET_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(secret.SecretError, match="cannot read the job secret"):
        secret.load()


def test_ensure_makes_one_for_the_children_once(clean_env):
    assert secret.load() is None
    made = secret.ensure()
    assert len(made) >= 32 and os.environ[secret.SECRET_ENV].encode() == made and secret.ensure() == made


def test_each_use_has_its_own_key(clean_env):
    job = b"j" * 32
    a, b = secret.derive(job, "peer replicas"), secret.derive(job, "control plane")
    assert len(a) == len(b) == 32 and a != b and secret.derive(job, "peer replicas") == a
    assert secret.derive(b"k" * 32, "peer replicas") != a and secret.fingerprint(a) != secret.fingerprint(b)


def test_the_peer_key_comes_from_the_job_secret_not_over_the_group(clean_env):
    """With a job secret every rank derives the replicas' key; nothing secret is gathered."""
    clean_env.setenv(secret.SECRET_ENV, "j" * 32)
    key, everyone = _peer_key(Coordinator(), "n0", "127.0.0.1:1")
    assert key == secret.derive(b"j" * 32, "peer replicas")
    assert everyone == [("n0", "127.0.0.1:1", secret.fingerprint(key), None)]
    clean_env.delenv(secret.SECRET_ENV)
    drawn, everyone = _peer_key(Coordinator(), "n0", "127.0.0.1:1")  # no secret: rank 0 draws one
    assert len(drawn) == 32 and everyone[0][3] == drawn.hex()

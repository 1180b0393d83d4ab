"""Bearer tokens and their roles, read from a file or the environment (never argv).

Roles: `agent` may post telemetry and XIDs; `job` may register jobs and listen to
their stream; `operator` may do everything, including reading risk. Variables share
the project's CKPT_GUARD_ prefix (the agent reads the same CKPT_GUARD_AGENT_TOKEN);
the former PREDICTOR_ names still work, with a deprecation warning.
"""
from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

ROLES = ("agent", "job", "operator")
ENV_FILE = "CKPT_GUARD_TOKENS_FILE"
ENV_TOKENS = {role: f"CKPT_GUARD_{role.upper()}_TOKEN" for role in ROLES}
_FORMER_PREFIX = "PREDICTOR_"


def _env(name: str) -> str | None:
    """$name, else its former PREDICTOR_ spelling (deprecated, warned once per read)."""
    value = os.environ.get(name)
    if value:
        return value
    former = _FORMER_PREFIX + name.removeprefix("CKPT_GUARD_")
    value = os.environ.get(former)
    if value:
        warnings.warn(f"${former} is deprecated: set ${name}", FutureWarning, stacklevel=3)
    return value or None


def _digest(token: str) -> bytes:
    # look-ups go through a hash so their timing says nothing about a token's prefix
    return hashlib.sha256(token.encode()).digest()


class Tokens:
    """token -> role; `role_of` answers None for an unknown token."""

    def __init__(self, pairs: list[tuple[str, str]]):
        self._roles = {}
        for role, token in pairs:
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r} (expected one of {', '.join(ROLES)})")
            if len(token) < 16:
                raise ValueError(f"a {role} token is shorter than 16 characters")
            self._roles[_digest(token)] = role
        if not self._roles:
            raise ValueError("no tokens configured")

    @staticmethod
    def owner_of(authorization: str | None) -> str:
        """Who presented the header, for per-token limits: a digest, never the token."""
        return _digest((authorization or "")[7:].strip()).hex()[:16]

    def role_of(self, authorization: str | None) -> str | None:
        if not authorization or not authorization.startswith("Bearer "):
            return None
        return self._roles.get(_digest(authorization[7:].strip()))


def parse_token_file(text: str) -> list[tuple[str, str]]:
    """Lines of 'ROLE TOKEN'; blank lines and # comments ignored."""
    pairs = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"token file line {n}: expected 'ROLE TOKEN'")
        pairs.append((parts[0], parts[1]))
    return pairs


def load_tokens(path: str | None = None) -> Tokens:
    """From `path`, else $CKPT_GUARD_TOKENS_FILE, else $CKPT_GUARD_{AGENT,JOB,OPERATOR}_TOKEN."""
    path = path or _env(ENV_FILE)
    if path:
        return Tokens(parse_token_file(Path(path).read_text()))
    pairs = [(role, token) for role, var in ENV_TOKENS.items() if (token := _env(var))]
    if not pairs:
        raise ValueError(f"no tokens: pass --tokens FILE or set {ENV_FILE} or {', '.join(ENV_TOKENS.values())}"
                         " (or --no-auth for a loopback test)")
    return Tokens(pairs)

"""The job's store as launchers and workers act on it: every value signed under the job's secret.

torch's TCPStore authenticates no one: whoever reaches its port can ``set``, ``add`` or
``delete`` any key. What the launchers and workers act on (rounds, evictions, exits, relaunch
and done marks, hosts, beats, steps, readiness, places, the lifeline's port) is therefore
written here as a signed value, ``c1 ROUND SEQ MAC PAYLOAD``: an HMAC-SHA256 under the job's
control key (``ckpt.secret``) over a canonical encoding of the key's name, the attempt, the
round the writer acts in, a sequence number (the writer's clock in ns, increasing per key) and
the payload. A value copied to another key, into another attempt, or written back after a newer
one (a replayed beat) fails; so does anything an outsider makes. A failing value is ignored
(the reader keeps the newest good one it saw), counted in ``rejected`` and logged once per key.

The checkpoint commit protocol (``save/commit.py``) signs its announcements and verdicts the
same way when the job has a secret.

What this does not give: availability. An outsider can still delete or overwrite a key (the
job then waits, times out, or relaunches, as for a lost node); isolate the store's network for
that (docs/security.md). torch's ``add`` counters cannot carry a MAC: none is used for a
decision here (beats are signed values with increasing sequence numbers).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import secret

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger(__name__)
_TAG = b"c1"
_MAX_VALUE = 1 << 20  # larger values are nobody's control message


@dataclass(frozen=True)
class Signed:
    """A value that passed its check: the round its writer acted in, its sequence number, the payload."""

    round: int
    seq: int
    payload: bytes


def control_key(job: bytes | None = None) -> bytes:
    """The control plane's key, from the job's secret (``job``, else ``ckpt.secret.load()``);
    RuntimeError when there is none (a worker started by hand, not by the launcher)."""
    job = job if job is not None else secret.load()
    if job is None:
        raise RuntimeError(f"no job secret: start the job with python -m ckpt.inprocess.launch, which hands "
                           f"{secret.SECRET_ENV} to its workers (several nodes: give every node "
                           f"{secret.SECRET_FILE_ENV} or {secret.SECRET_ENV})")
    return secret.derive(job, "control plane")


class Control:
    """Signed reads and writes of one attempt's keys on the job's store (``store``: for torch's
    rendezvous, which needs the raw store)."""

    def __init__(self, store: "dist.Store", key: bytes, attempt: int) -> None:
        self.store, self.attempt, self._key = store, attempt, key
        self._sent: dict[str, int] = {}  # key -> the last sequence number written here
        self._good: dict[str, tuple[bytes, Signed]] = {}  # key -> (raw value, what it said): the newest good one
        self._warned: set[str] = set()
        self._bad: dict[str, bytes] = {}  # key -> the last value that failed (not counted again)
        self.rejected = 0

    def mac(self, *fields: bytes | str | int) -> bytes:
        """HMAC-SHA256 of ``fields`` (length-prefixed, so no two lists encode alike) in this attempt."""
        parts = [b"ckpt-guard control v1", str(self.attempt).encode(),
                 *(f if isinstance(f, bytes) else str(f).encode() for f in fields)]
        return hmac.new(self._key, b"".join(struct.pack("!I", len(p)) + p for p in parts), hashlib.sha256).digest()

    def put(self, key: str, payload: bytes | str, *, round: int = 0) -> None:
        """Write ``payload`` under ``key``, signed, as written in round ``round``."""
        self.store.set(key, self._sealed(key, payload, round))

    def put_many(self, keys: list[str], payloads: list[bytes | str], *, round: int = 0) -> None:
        """``put`` of each key in one ``multi_set`` (one round trip, not one a key)."""
        self.store.multi_set(keys, [self._sealed(k, p, round) for k, p in zip(keys, payloads)])

    def _sealed(self, key: str, payload: bytes | str, round: int) -> bytes:
        data = payload.encode() if isinstance(payload, str) else payload
        seq = max(self._sent.get(key, 0) + 1, time.time_ns())
        self._sent[key] = seq
        mac = self.mac(key, round, seq, data)
        return b"%s %d %d %s %s" % (_TAG, round, seq, mac.hex().encode(), data)

    def signed(self, key: str) -> Signed | None:
        """The newest good value under ``key`` (None: none yet); a forged or replayed one is ignored."""
        if not self.store.check([key]):
            return self._good.get(key, (b"", None))[1]
        return self._open(key, self.store.get(key))

    def get(self, key: str) -> bytes | None:
        """The payload of ``signed(key)``."""
        found = self.signed(key)
        return None if found is None else found.payload

    def has(self, key: str) -> bool:
        return self.signed(key) is not None

    def many(self, keys: list[str]) -> list[bytes | None]:
        """``get`` of each key (see ``many_signed``)."""
        return [None if found is None else found.payload for found in self.many_signed(keys)]

    def many_signed(self, keys: list[str]) -> list[Signed | None]:
        """``signed`` of each key: once all are there, one ``check`` and one ``multi_get`` of
        them all, each value's MAC checked here (a store's ``multi_get`` blocks on a missing
        key, hence the check). While some are missing, those read before are checked together
        and each one never read alone, so that a poll over keys that appear one by one (steps,
        exits) costs a round trip per key still missing, not per key."""
        if not keys:
            return []
        if self.store.check(keys):
            present = keys
        else:
            seen = [k for k in keys if k in self._good]
            present = seen if seen and self.store.check(seen) else [k for k in seen if self.store.check([k])]
            present += [k for k in keys if k not in self._good and self.store.check([k])]
        raw = dict(zip(present, self.store.multi_get(present))) if present else {}
        return [self._open(k, raw[k]) if k in raw else self._good.get(k, (b"", None))[1] for k in keys]

    def opened(self, keys: list[str], values: list[bytes]) -> list[bytes | None]:
        """The payloads of ``values`` read raw from ``keys`` (one ``multi_get`` of the caller's),
        each checked as ``get`` does."""
        return [None if found is None else found.payload for found in map(self._open, keys, values)]

    def _open(self, key: str, raw: bytes) -> Signed | None:
        last = self._good.get(key)
        if last is not None and last[0] == raw:
            return last[1]
        found = self._check(key, raw)
        if found is None or (last is not None and found.seq < last[1].seq):
            if self._bad.get(key) != raw:  # counted once, however often a poll reads it again
                self._bad[key] = raw
                self._reject(key, "fails its check" if found is None else "is older than one already read (a replay)")
            return None if last is None else last[1]
        self._good[key] = (raw, found)
        return found

    def _check(self, key: str, raw: bytes) -> Signed | None:
        parts = raw.split(b" ", 4)
        if len(raw) > _MAX_VALUE or len(parts) != 5 or parts[0] != _TAG:
            return None
        try:
            round_id, seq, mac = int(parts[1]), int(parts[2]), bytes.fromhex(parts[3].decode("ascii"))
        except (ValueError, UnicodeError):
            return None
        if not hmac.compare_digest(mac, self.mac(key, round_id, seq, parts[4])):
            return None
        return Signed(round_id, seq, parts[4])

    def _reject(self, key: str, why: str) -> None:
        self.rejected += 1
        if key not in self._warned:
            self._warned.add(key)
            log.warning("ignored a value of %s that %s (not written by this job; attempt %d): %d rejected so far",
                        key, why, self.attempt, self.rejected)

"""The action log: one JSON line per decision taken about a node (drained, spare asked,
already drained, refused by the cap, dry run, failed), with the prediction behind it.

It is also the hourly cap's memory, so it fails closed: a drain is first written as an
*intent* (fsync'd) and applied only once that line is on disk; an intent whose outcome
line never came counts as applied. Counting, the intent and the outcome happen under an
exclusive ``flock`` of the log, so the webhook and a CLI drain at the same time never
both pass the cap."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from .errors import ActionError

log = logging.getLogger("predictor.actions")


class RecordError(ActionError):
    """The action log cannot be written (disk full, file too large, read-only): nothing is applied."""


@dataclass
class Prediction:
    """Why a node is to be drained: the alert (or operator) that asked, and its evidence."""
    node: str
    source: str                  # "alertmanager:GPUFailurePredicted", "operator", ...
    detail: dict[str, Any] = field(default_factory=dict)   # the alert's labels and annotations

    def reason(self) -> str:
        """The one-line reason the scheduler shows (Slurm's Reason=, the taint's value)."""
        risk, why = self.detail.get("risk"), self.detail.get("reason")
        return (f"ckpt-guard: {self.source}" + (f" risk={risk}" if risk else "") + (f" ({why})" if why else ""))[:200]


@dataclass
class Outcome:
    node: str
    action: str                  # drained | already-drained | capped | failed | refused | dry-run
    applied: bool                # True when the cluster was changed
    steps: list[str]             # what was (or, dry, would be) done, in the scheduler's words
    error: str | None = None
    intent: str | None = None    # the intent line this outcome closes


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise RecordError(f"cannot make the action log's directory {path} durable: {e.strerror or e}") from None


class ActionLog:
    """Appends JSON lines to ``path`` (created 0600), each fsync'd, and logs each at WARNING
    (ERROR when refused or failed), so every action on the cluster leaves a line in both."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RecordError(f"cannot create the action log's directory {self.path.parent}: {e}") from None
        self._fd: int | None = None

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the log's exclusive lock (across processes) for a count-intent-apply-outcome."""
        new = not self.path.exists()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as e:
            raise RecordError(f"cannot open the action log {self.path}: {e.strerror or e}") from None
        try:
            if new:   # the file's name is durable too
                _fsync_dir(self.path.parent)
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._fd = fd
            yield
        finally:
            self._fd = None
            os.close(fd)   # releases the lock

    def _append(self, entry: dict) -> None:
        """One line, written whole and fsync'd, or RecordError (a partial line is cut back)."""
        if self._fd is None:
            with self.locked():
                return self._append(entry)
        data = (json.dumps(entry, sort_keys=True, allow_nan=False) + "\n").encode()
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            if os.write(self._fd, data) != len(data):
                raise OSError(errno.ENOSPC, "short write")
            os.fsync(self._fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, start)
            raise RecordError(f"cannot record in the action log {self.path}: {e.strerror or e}") from None

    def intend(self, prediction: Prediction, steps: list[str]) -> str:
        """Record, durably, that ``prediction.node`` is about to be taken out; its id."""
        intent = uuid.uuid4().hex
        self._append({"t": time.time(), "action": "intent", "intent": intent, "node": prediction.node,
                      "applied": None, "steps": steps, "prediction": asdict(prediction)})
        return intent

    def write(self, outcome: Outcome, prediction: Prediction, dry_run: bool) -> dict:
        entry = {"t": time.time(), **asdict(outcome), "dry_run": dry_run, "prediction": asdict(prediction)}
        self._append(entry)
        level = logging.ERROR if outcome.action in ("capped", "failed", "refused") else logging.WARNING
        log.log(level, "%s %s%s: %s (%s)%s", outcome.action, outcome.node, " [dry run]" if dry_run else "",
                "; ".join(outcome.steps) or "nothing done", prediction.reason(),
                f": {outcome.error}" if outcome.error else "")
        return entry

    def applied_since(self, since: float) -> int:
        """Nodes taken out of service at or after ``since``: applied drains, and intents with
        no outcome (a crash or a failed record between the two: the drain may have happened)."""
        if not self.path.exists():
            return 0
        open_intents: dict[str, float] = {}
        count = 0
        with open(self.path, "rb") as f:
            for line in f:
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue   # a torn line: its write failed, so nothing was applied after it
                if not isinstance(entry, dict):
                    continue
                t = entry.get("t", 0)
                t = t if isinstance(t, (int, float)) else 0
                if entry.get("action") == "intent":
                    open_intents[str(entry.get("intent"))] = t
                    continue
                closed = open_intents.pop(str(entry.get("intent")), None) if entry.get("intent") else None
                applied = entry.get("action") == "drained" and entry.get("applied")
                count += bool(applied) and (closed if closed is not None else t) >= since
        return count + sum(t >= since for t in open_intents.values())

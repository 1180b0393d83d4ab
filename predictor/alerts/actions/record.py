"""The action log: one JSON line per decision taken about a node (drained, spare asked,
already drained, refused by the cap, dry run, failed), with the prediction behind it.
It is also the hourly cap's memory, so a restart does not reset the count."""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("predictor.actions")


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
    action: str                  # drained | already-drained | capped | failed | dry-run
    applied: bool                # True when the cluster was changed
    steps: list[str]             # what was (or, dry, would be) done, in the scheduler's words
    error: str | None = None


class ActionLog:
    """Appends JSON lines to ``path`` (created 0600) and logs each at WARNING (ERROR when
    refused or failed), so every action on the cluster leaves a line in both."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def write(self, outcome: Outcome, prediction: Prediction, dry_run: bool) -> dict:
        entry = {"t": time.time(), **asdict(outcome), "dry_run": dry_run, "prediction": asdict(prediction)}
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            with os.fdopen(fd, "a") as f:
                f.write(json.dumps(entry, sort_keys=True) + "\n")
        level = logging.ERROR if outcome.action in ("capped", "failed") else logging.WARNING
        log.log(level, "%s %s%s: %s (%s)%s", outcome.action, outcome.node, " [dry run]" if dry_run else "",
                "; ".join(outcome.steps) or "nothing done", prediction.reason(),
                f": {outcome.error}" if outcome.error else "")
        return entry

    def applied_since(self, since: float) -> int:
        """Nodes taken out of service (applied drains) logged at or after ``since``."""
        if not self.path.exists():
            return 0
        count = 0
        with self._lock, open(self.path) as f:
            for line in f:
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue   # a torn last line after a crash counts as nothing
                count += entry.get("action") == "drained" and entry.get("applied") and entry.get("t", 0) >= since
        return count

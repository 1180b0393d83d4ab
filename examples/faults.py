"""Fault injection for the integration examples and their tests: ``"6:kill,10:term"``
makes the process SIGKILL itself when training completes step 6 and SIGTERM itself
(a preemption notice) at step 10. Each fault fires once per checkpoint root,
remembered by a marker file there, so a restarted run goes past it."""
from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM}


class Faults:
    def __init__(self, spec: str, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.at = {int(step): SIGNALS[kind] for step, kind in (f.split(":") for f in spec.split(",") if f)}

    def fire(self, step: int) -> None:
        """Call at the end of each step with the number of steps completed."""
        marker = self.root / f"fault-{step}.fired"
        if step in self.at and not marker.exists():
            self.root.mkdir(parents=True, exist_ok=True)
            marker.touch()
            logging.info("fault injector: %s at step %d", self.at[step].name, step)
            os.kill(os.getpid(), self.at[step])

"""Urgent-save requests: raised from any thread or a signal handler, read by the
training loop at step boundaries (where ranks agree on them)."""
from __future__ import annotations

import signal
import threading


class SaveRequests:
    """Urgent-save requests from other threads or signal handlers, read at step boundaries."""

    def __init__(self) -> None:
        self._urgent = threading.Event()
        self.preempted = False

    def request(self) -> None:
        self._urgent.set()

    def take(self) -> bool:
        wanted = self._urgent.is_set()
        self._urgent.clear()
        return wanted

    def on_sigterm(self, signum: int, frame: object) -> None:
        self.preempted = True
        self._urgent.set()

    def catch_sigterm(self) -> None:
        """Turn SIGTERM into an urgent save and an exit (signals reach the main thread only)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.on_sigterm)

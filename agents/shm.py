"""The shared memory checkpoint jobs hold on this node: reported on /metrics, reclaimed on a timer.

ckpt-guard's memory tier keeps each job's slots in ``/dev/shm/ckpt-guard-<uid>-<hash>/``
(they are meant to survive the trainer). Whose they are, whether the owner lives and whether
their newest step is durable elsewhere is read from the slots' owner records
(``ckpt.tiers.memory.owners``: torch-free, the same decisions as the engine's own sweeps);
locks are read from /proc/locks, never taken to look.

Every ``every_s`` the watch removes the namespaces that are reclaimable (owner gone, newest
step durable) on two ticks in a row, so a job relaunching (torchrun, a requeue) gets a
tick's time to take its slots back first. It sees and removes what this process may: any
user's with CAP_DAC_OVERRIDE and CAP_FOWNER (the shipped systemd unit), else its own user's
(docs/agents.md). A dead job's steps held nowhere else are never removed here: past the
grace time they are reported (stale).
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ckpt.tiers.memory.owners import Holding, grace_s, remove_holding, survey

log = logging.getLogger(__name__)
_LABELS = ["namespace", "user", "pid", "run", "root", "owner_alive", "durable", "state"]


def _label(v: object) -> str:
    return "" if v is None else str(v)[:256]


class ShmWatch:
    """Reports (``families``) and reclaims (``tick``, or ``start`` for a timer) checkpoint shared memory."""

    def __init__(self, shm_dir: str = "/dev/shm", every_s: float = 300.0) -> None:
        self.shm_dir, self.every_s = shm_dir, every_s
        self.reclaimed_bytes = 0
        self.reclaimed_namespaces = 0
        self._ready: set[Path] = set()  # reclaimable at the last tick
        self._warned: set[Path] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _survey(self) -> list[Holding]:
        return survey(self.shm_dir)  # every namespace it may read

    def tick(self) -> list[Holding]:
        """One round: remove what was reclaimable at the last tick and still is; returns it."""
        grace, removed = grace_s(), []
        found = self._survey()
        ready = {h.path for h in found if h.state(grace) == "reclaimable"}
        for h in found:
            if h.path in ready and h.path in self._ready:
                try:
                    gone = remove_holding(h)
                except OSError as e:
                    log.warning("cannot reclaim %s: %s", h.path, e)
                    gone = False
                if gone:
                    removed.append(h)
                    self.reclaimed_bytes += h.bytes
                    self.reclaimed_namespaces += 1
                    log.info("reclaimed %s (%.0f MiB): its job is gone and its newest step is durable", h.path,
                             h.bytes / 2**20)
            elif h.state(grace) == "stale" and h.path not in self._warned:
                self._warned.add(h.path)
                log.warning("%s: %.0f MiB held by a job that is gone (user %s, root %s), its newest step durable "
                            "nowhere else, untouched for %.1f h; `ckpt gc --orphans --force` as that user frees it",
                            h.path, h.bytes / 2**20, h.describe(grace)["user"], h.owner().get("root"),
                            h.idle_s / 3600)
        self._ready = ready - {h.path for h in removed}
        return removed

    def start(self) -> None:
        """Tick every ``every_s`` on a background thread (0: never)."""
        if self.every_s <= 0:
            return

        def loop() -> None:
            while not self._stop.wait(self.every_s):
                try:
                    self.tick()
                except Exception as e:  # housekeeping must not end the agent
                    log.warning("shared-memory sweep failed: %s", e)

        self._thread = threading.Thread(target=loop, name="agents-shm", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def families(self) -> list:
        """/metrics: each namespace, the totals held by jobs that are gone, what was reclaimed."""
        grace = grace_s()
        each = GaugeMetricFamily("ckpt_guard_node_shm_bytes", "Shared memory of one checkpoint namespace on this "
                                 "node: its owner, whether the owner lives, whether its newest step is durable "
                                 "elsewhere, and its state (live, reclaimable, grace, stale).", labels=_LABELS)
        dead = stale = count = 0
        for h in self._survey():
            d = h.describe(grace)
            each.add_metric([_label(d["namespace"]), _label(d["user"]), _label(d["pid"]), _label(d["run"]),
                             _label(d["root"]), str(int(d["owner_alive"])), str(int(d["durable_elsewhere"])),
                             d["state"]], d["bytes"])
            if not h.live:
                dead, count = dead + h.bytes, count + 1
                stale += h.bytes if d["state"] == "stale" else 0
        reclaimed = CounterMetricFamily("ckpt_guard_node_shm_reclaimed_bytes",
                                        "Shared memory of jobs that were gone, reclaimed by this agent.")
        reclaimed.add_metric([], self.reclaimed_bytes)
        return [each,
                GaugeMetricFamily("ckpt_guard_node_orphaned_shm_bytes", "Shared memory held by checkpoint jobs that "
                                  "are gone (reclaimed once durable; else after the grace time, stale).", value=dead),
                GaugeMetricFamily("ckpt_guard_node_orphaned_shm_namespaces",
                                  "Checkpoint shared-memory namespaces whose job is gone.", value=count),
                GaugeMetricFamily("ckpt_guard_node_stale_shm_bytes", "Shared memory held by jobs gone for longer than "
                                  f"the grace time ({grace:g} s) whose newest step is durable nowhere else.",
                                  value=stale),
                reclaimed]

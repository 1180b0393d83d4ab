"""Deciding what to do about one predicted failure: nothing when the node is out of service
already (idempotent), the plan alone in a dry run (the default), a refusal and a page
once the hourly cap of nodes taken out is reached (a bad model must not drain half the
cluster), else drain and ask for a spare. Every decision goes to the action log."""
from __future__ import annotations

import json
import logging
import re
import threading
import time
import urllib.request
from typing import Callable, Protocol

from .errors import ActionError, NotOneNode
from .record import ActionLog, Outcome, Prediction, RecordError

log = logging.getLogger("predictor.actions")
# One node, by its own name: a Slurm hostlist ("gpu[001-512]") or a list would drain many.
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
#: Names a scheduler reads as many nodes (Slurm's ``ALL``), refused before any is asked.
RESERVED_NAMES = frozenset({"ALL"})
CAP_ALERT = "CkptGuardDrainCapReached"
RECORD_ALERT = "CkptGuardActionLogUnwritable"


class NodeActions(Protocol):
    """What a scheduler backend offers (slurm.SlurmNodes, kubernetes.KubernetesNodes).
    ``is_out_of_service`` raises NotOneNode unless the name is exactly one real node."""

    def is_out_of_service(self, node: str) -> bool: ...
    def plan(self, node: str, reason: str) -> list[str]: ...
    def drain(self, node: str, reason: str) -> list[str]: ...
    def request_spare(self, node: str, reason: str) -> list[str]: ...


class Responder:
    """Applies ``nodes`` to predictions, one at a time in this process (a lock) and across
    processes (the action log's flock), so two alerts never both pass the cap."""

    def __init__(self, nodes: NodeActions, actions: ActionLog, max_per_hour: int, dry_run: bool = True,
                 page: Callable[[str, Prediction, str], None] | None = None) -> None:
        self.nodes = nodes
        self.actions = actions
        self.max_per_hour = max_per_hour
        self.dry_run = dry_run
        self.page = page
        self._lock = threading.Lock()

    def handle(self, prediction: Prediction) -> dict:
        """Decide, act, log; returns the log entry. The scheduler's refusals are entries;
        RecordError (the log cannot be written: nothing applied, or the drain stands
        counted by its intent) is raised after paging, for the caller to fail loudly."""
        if not NODE_NAME.fullmatch(prediction.node):
            raise ValueError(f"node {prediction.node!r} is not one node's name (letters, digits, . _ -)")
        if prediction.node.upper() in RESERVED_NAMES:
            raise ValueError(f"node {prediction.node!r} is not one node's name: the scheduler reads it as every node")
        try:
            with self._lock, self.actions.locked():
                outcome = self._decide(prediction)
                return self.actions.write(outcome, prediction, self.dry_run)
        except RecordError as e:
            log.error("%s: %s", prediction.node, e)
            self._page(f"the action log cannot be written ({e}): {prediction.node} not drained unless its intent "
                       "was recorded; a person must look", prediction, RECORD_ALERT)
            raise

    def _decide(self, p: Prediction) -> Outcome:
        reason = p.reason()
        try:
            if self.nodes.is_out_of_service(p.node):
                return Outcome(p.node, "already-drained", False, [])
            if self.dry_run:
                return Outcome(p.node, "dry-run", False, self.nodes.plan(p.node, reason))
            taken = self.actions.applied_since(time.time() - 3600)
            if taken >= self.max_per_hour:
                message = (f"{taken} node(s) taken out of service in the last hour, the cap is {self.max_per_hour}: "
                           f"{p.node} left in service; a person must decide")
                self._page(message, p)
                return Outcome(p.node, "capped", False, [], message)
        except NotOneNode as e:
            return Outcome(p.node, "refused", False, [], str(e))
        except ActionError as e:
            return Outcome(p.node, "failed", False, [], str(e))
        intent = self.actions.intend(p, self.nodes.plan(p.node, reason))   # RecordError: nothing applied
        try:
            steps = self.nodes.drain(p.node, reason)
        except ActionError as e:
            return Outcome(p.node, "failed", False, [], str(e), intent)
        try:
            steps += self.nodes.request_spare(p.node, reason)
        except ActionError as e:   # drained all the same: the log says the spare is missing
            return Outcome(p.node, "drained", True, steps, f"no spare: {e}", intent)
        return Outcome(p.node, "drained", True, steps, None, intent)

    def _page(self, message: str, p: Prediction, alertname: str = CAP_ALERT) -> None:
        if self.page is None:
            return
        try:
            self.page(message, p, alertname)
        except Exception as e:  # noqa: BLE001 - a failed page is logged, the refusal stands
            log.error("could not page (%s): %s", alertname, e)


def alertmanager_pager(url: str, timeout_s: float = 10.0) -> Callable[[str, Prediction, str], None]:
    """Pages through Alertmanager's API v2 (CkptGuardDrainCapReached, CkptGuardActionLogUnwritable; severity page)."""
    def page(message: str, p: Prediction, alertname: str = CAP_ALERT) -> None:
        body = [{"labels": {"alertname": alertname, "severity": "page", "node": p.node,
                            "service": "ckpt-guard-actions"},
                 "annotations": {"summary": message, "prediction": p.reason()}}]
        req = urllib.request.Request(url.rstrip("/") + "/api/v2/alerts", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=timeout_s):
            pass
    return page

"""What a restart costs, phase by phase, per kind of failure and per strategy.

A flat figure per restart cannot tell strategies apart on the restart itself, yet that
is where failures differ most: a crashed process is seen at once and restarts in place;
a failed GPU that leaves its rank alive and silent (off the bus, a hung kernel, a stuck
collective) holds every other rank in its next collective until the collective timeout,
unless the job fails fast (issue 19: the hang detector's deadline, or the agent's
critical XID turned into a "node failed" event within a second); a replaced node waits
for a spare, unless the predictor saw it coming: a spare requested at the alarm (by the
job or the operator's hook) has had the alarm's lead to arrive. Each phase below is a
parameter with a default (docs/goodput.md, "Restart phases") and its source
(docs/research/goodput-model.md); the restore
is the strategy's own (``Recovery``).
Phases enter the model as their expectation per kind of failure.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .inprocess import InProcessCosts
    from .model import Lead

# before the restore, which the strategy's tier sets; "inprocess" is (f)'s recovery without a
# relaunch (``inprocess.InProcessCosts``)
PHASES = ("detect", "replace", "relaunch", "inprocess")


@dataclass(frozen=True)
class RestartCosts:
    """The phases of a restart before the restore, in seconds (defaults: docs/goodput.md).

    ``flat_s`` is the what-if of the earlier model: every restart costs that much before
    its restore, whatever the failure and the strategy."""

    gpu_hang_share: float = 0.64  # GPU failures leaving the rank alive and silent
    collective_timeout_s: float = 600.0  # PyTorch's NCCL default: what a hang costs without fail-fast
    hang_deadline_s: float = 30.0  # our hang detector: 5 x a ~6 s step of Llama 3 405B
    xid_share: float = 0.96  # hangs whose fault posts a critical XID the agent sees
    xid_reaction_s: float = 1.04  # agent sample -> every rank exits, p99 (xid_reaction_bench)
    host_detect_s: float = 30.0  # a host gone: the survivors' transport gives up on it
    frozen_detect_s: float = 4.1  # fail-fast: a rank whose beats stopped is declared frozen (recovery table)
    replace_s: float = 120.0  # a spare node from the scheduler, for a node taken out of the job
    relaunch_s: float = 300.0  # process exit, relaunch, rendezvous, process-group init, setup
    spare_on_alarm: bool = True  # with a predictor: a caught failure's spare is requested at its alarm
    flat_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("gpu_hang_share", "xid_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1]")

    def hang_detect_s(self, fail_fast: bool) -> float:
        """How long a silent rank holds the job: the collective timeout, or with fail-fast
        the XID event where the fault posts one and the hang deadline where it does not."""
        if not fail_fast:
            return self.collective_timeout_s
        deadline = min(self.hang_deadline_s, self.collective_timeout_s)
        return self.xid_share * min(self.xid_reaction_s, deadline) + (1 - self.xid_share) * deadline

    def host_gone_s(self, fail_fast: bool) -> float:
        """How long a host down holds the job: until the survivors' transport gives up on it,
        or with fail-fast until the hang detector sees its ranks' beats stop (``frozen_fast``:
        a host down is a frozen rank to it), whichever comes first."""
        return min(self.host_detect_s, self.frozen_detect_s) if fail_fast else self.host_detect_s

    def replace_wait_s(self, caught: float = 0.0, lead: Lead | None = None) -> float:
        """The expected wait for a spare after a node leaves the job. A failure the
        predictor caught (share ``caught``, alarm-to-failure times ``lead``) had its spare
        requested at the alarm, with ``spare_on_alarm``: it waits max(0, replace_s − lead)."""
        if not (self.spare_on_alarm and caught and lead):
            return self.replace_s
        return (1 - caught) * self.replace_s + caught * lead.shortfall(self.replace_s)

    def phases(self, kind: str, fail_fast: bool, caught: float = 0.0, lead: Lead | None = None,
               inprocess: InProcessCosts | None = None) -> dict[str, float]:
        """Expected seconds of each phase in ``PHASES`` for a failure of ``kind``
        (``model.KINDS``): crashes restart in place, GPU failures and hosts down on a spare,
        staged at the alarm for the share ``caught`` (``replace_wait_s``). With ``inprocess``
        ((f)), all but its ``relaunch_share`` of the failures skip the relaunch and the wait
        for a spare (a warm spare's ranks, already in the job, take a lost node's place) and
        recover in-process instead; detection and the restore are the same on both paths."""
        if self.flat_s is not None:
            return {"detect": 0.0, "replace": 0.0, "relaunch": self.flat_s, "inprocess": 0.0}
        detect = {"crash": 0.0, "gpu": self.gpu_hang_share * self.hang_detect_s(fail_fast),
                  "host": self.host_gone_s(fail_fast)}[kind]
        replace = 0.0 if kind == "crash" else self.replace_wait_s(caught, lead)
        if inprocess is None:
            return {"detect": detect, "replace": replace, "relaunch": self.relaunch_s, "inprocess": 0.0}
        share = inprocess.relaunch_share
        return {"detect": detect, "replace": share * replace, "relaunch": share * self.relaunch_s,
                "inprocess": (1 - share) * inprocess.total_s}

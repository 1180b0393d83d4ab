"""Slurm: drain a node (``scontrol update NodeName=... State=DRAIN Reason=...``: running
jobs finish or are requeued, nothing new lands there) and release a held spare job.

A spare is a job the operator keeps held in the queue (``sbatch --hold --job-name=NAME
...``, e.g. a standby allocation the training job can grow into); on a drain the oldest
held one is released (``scontrol release``). Draining needs Slurm operator rights:
SlurmUser, root, or AdminLevel=Operator in the accounting database."""
from __future__ import annotations

import shutil
import subprocess

from .errors import ActionError, NotOneNode

DRAINED_STATES = ("DRAIN", "DRAINED", "DRAINING", "DOWN")
HELD_REASONS = ("JobHeldUser", "JobHeldAdmin")
RIGHTS_HINT = ("draining needs Slurm operator rights: run this as SlurmUser or root on a host with scontrol, or "
               "grant the user AdminLevel=Operator (sacctmgr modify user NAME set adminlevel=Operator)")


class SlurmNodes:
    """Drains nodes and releases spares through Slurm's own commands (scontrol, squeue)."""

    def __init__(self, spare_job: str | None = None, timeout_s: float = 30.0) -> None:
        self.spare_job = spare_job
        self.timeout_s = timeout_s

    def _run(self, *args: str) -> str:
        exe = shutil.which(args[0])
        if exe is None:
            raise ActionError(f"{args[0]} not found: the Slurm client commands must be on PATH")
        try:
            proc = subprocess.run([exe, *args[1:]], capture_output=True, text=True, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            raise ActionError(f"{' '.join(args[:3])} did not answer within {self.timeout_s:.0f} s") from None
        if proc.returncode != 0:
            said = (proc.stderr or proc.stdout).strip()
            # slurmctld answers an update from a user without rights with "Invalid user id"
            # (ESLURM_USER_ID_MISSING, logged there as a security violation), some RPCs "denied"
            hint = f"; {RIGHTS_HINT}" if any(w in said.lower() for w in ("denied", "invalid user id")) else ""
            raise ActionError(f"{' '.join(args[:3])} failed (exit {proc.returncode}): {said}{hint}")
        return proc.stdout

    def node_record(self, node: str) -> dict[str, str]:
        """``scontrol show node -o NODE`` as key=value pairs, when it answers exactly one
        record named NODE; else NotOneNode (unknown, ``ALL``, a nodeset, a hostlist)."""
        try:
            out = self._run("scontrol", "show", "node", "-o", node)
        except ActionError as e:
            if "not found" in str(e).lower():
                raise NotOneNode(f"{node!r} is not a node Slurm knows: {e}") from None
            raise
        records = [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in out.splitlines() if line.strip()]
        if len(records) != 1 or records[0].get("NodeName") != node:
            names = [r.get("NodeName", "?") for r in records]
            raise NotOneNode(f"{node!r} does not name exactly one Slurm node: scontrol answers {len(records)} "
                             f"record(s) ({', '.join(names[:5])}{' ...' if len(names) > 5 else ''})")
        return records[0]

    def is_out_of_service(self, node: str) -> bool:
        """Drained, draining or down already (by anyone, for any reason)."""
        state = self.node_record(node).get("State", "")
        return any(s in state.upper().replace("+", " ").split() for s in DRAINED_STATES)

    def plan(self, node: str, reason: str) -> list[str]:
        steps = [f"scontrol update NodeName={node} State=DRAIN Reason={reason!r}"]
        if self.spare_job:
            steps.append(f"scontrol release <the oldest held job named {self.spare_job}>")
        return steps

    def drain(self, node: str, reason: str) -> list[str]:
        self.node_record(node)   # still exactly one node, just before the update
        self._run("scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}")
        return [f"drained {node} (Reason={reason!r})"]

    def request_spare(self, node: str, reason: str) -> list[str]:
        if not self.spare_job:
            return []
        out = self._run("squeue", "-h", "-t", "PD", "-n", self.spare_job, "-o", "%i %r")
        held = sorted((int(job) for job, reason in (line.split(maxsplit=1) for line in out.splitlines() if " " in line)
                       if reason.strip() in HELD_REASONS and job.isdigit()))   # job ids grow: oldest first
        if not held:
            raise ActionError(f"no held spare job named {self.spare_job!r} to release for {node}")
        self._run("scontrol", "release", str(held[0]))
        return [f"released spare job {held[0]} ({self.spare_job})"]

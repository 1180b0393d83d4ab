"""The fault campaign's rows (benchmarks/fault_campaign.py): each fault on the campaign's job
(benchmarks/fault_campaign_jobs.py), its row in one schema.

Every row: ``fault``, ``mode`` (in-process: ``ckpt.inprocess`` recovers the survivors in their
processes; relaunch: the job is started again on the same disk root and memory tier),
``detected``, ``detect_steps`` (steps between the fault and the step where it was noticed: 0 is
the step in flight), ``named`` (the culprit rank or node named; null where nothing was
detected or there is no culprit), ``restored_step``, ``steps_lost`` (steps done before the fault
and redone), ``relaunched``, ``equal_to_clean`` (the final weights, every rank, bitwise equal to
the uninterrupted 2-rank run: the one reference, see fault_campaign_jobs), and what else the
row saw.
"""
from __future__ import annotations

import re
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path

from benchmarks.fault_campaign_jobs import (
    DAMAGE_SEEN,
    FAULT_AT,
    REPO,
    SPARE,
    STEPS,
    Job,
    launch,
    names_rank,
    restored_steps,
    sdc_lines,
    step_times,
)


@dataclass
class Campaign:
    """Where the jobs run, and the reference every row is compared with (run once)."""

    workdir: Path
    shm: Path  # a directory under /dev/shm: each job's memory tier below it
    lmr_path: str | None  # lm-resiliency's site dir for the SDC rows' side-by-side columns
    _clean: set[str] | None = None
    clean_step_s: float | None = None

    def job(self, name: str, launcher: list[str], child: list[str], **kw) -> Job:
        env = {"PYTHONPATH": f"{REPO}:{kw.pop('pythonpath')}"} if "pythonpath" in kw else None
        return launch(self.workdir, name, launcher, ["--steps", str(STEPS), *child], memory_dir=self.shm / name,
                      env=env, **kw)

    def clean(self) -> set[str]:
        """The uninterrupted 2-rank run's final digest."""
        if self._clean is None:
            job = self.job("clean", ["--nproc", "2"], [])
            self._clean = job.digests()
            self.clean_step_s = statistics.median(step_times(job))
        return self._clean


def row(fault: str, mode: str, *, detected: bool, detect_steps: int | None, named: bool | None,
        restored_step: int | None, steps_lost: int | None, relaunched: bool, equal_to_clean: bool | None,
        **extra) -> dict:
    return {"fault": fault, "mode": mode, "detected": detected, "detect_steps": detect_steps, "named": named,
            "restored_step": restored_step, "steps_lost": steps_lost, "relaunched": relaunched,
            "equal_to_clean": equal_to_clean, **extra}


def recovered(fault: str, job: Job, clean: set[str], culprit: str, fault_step: int = FAULT_AT) -> dict:
    """A process fault the in-process job recovered from: its first recovery as rank 0 saw it.
    ``culprit``: a pattern the recovery's cause must hold to count as naming the culprit."""
    survivors = [r for r in job.of("recovery") if r["failed_at_step"] is not None]
    relaunched = job.restarted()
    if not survivors:
        return row(fault, "in-process", detected=False, detect_steps=None, named=None, restored_step=None,
                   steps_lost=None, relaunched=relaunched, equal_to_clean=job.digests() == clean)
    lead = min(survivors, key=lambda r: (r["round"], r["rank"]))
    cause = lead["reason"].split(":")[0]
    return row(fault, "in-process", detected=True, detect_steps=lead["failed_at_step"] - fault_step,
               named=bool(re.search(culprit, cause)), restored_step=lead["restored_step"],
               steps_lost=lead["failed_at_step"] - (lead["restored_step"] or 0), relaunched=relaunched,
               equal_to_clean=job.digests() == clean, recoveries=len({r["round"] for r in job.of("recovery")}),
               reason=lead["reason"], recovery_s=round(lead["phases"].get("total_s", float("nan")), 3))


def process_fault(c: Campaign, fault: str, child: list[str], launcher: list[str] = SPARE,
                  culprit: str = r"\b1\b") -> dict:
    return recovered(fault, c.job(fault, launcher, child), c.clean(), culprit)


def relaunched(c: Campaign, fault: str, damage=None) -> dict:
    """The launcher SIGKILLed at ``FAULT_AT`` (its workers die with it); ``damage(memory_dir,
    disk_root)`` then hurts what it left; the job is started again on the same root and memory."""
    first = c.job(fault, SPARE, [], kill_at=FAULT_AT)
    done = max((e["step"] for e in first.of("step")), default=0)
    survivors = [e["pid"] for e in first.of("start")]
    what = damage(c.shm / fault, c.workdir / fault) if damage else None
    again = c.job(fault, SPARE, [])
    steps = restored_steps(again.log)
    restored = steps[0] if steps else None
    damage_lines = [line for line in again.log.splitlines() if DAMAGE_SEEN.search(line)]
    return row(fault, "relaunch", detected=bool(damage_lines) if damage else True, detect_steps=0 if damage_lines
               else None, named=None, restored_step=restored, steps_lost=None if restored is None else done - restored,
               relaunched=True, equal_to_clean=again.digests() == c.clean(), launcher_exit=first.returncode,
               workers_left=sum(_alive(p) for p in survivors), damaged=what, damage_lines=damage_lines[:3])


def _alive(pid: int) -> bool:
    from tests.procs import running
    return running(pid)


def sdc(c: Campaign, fault: str, kind: str) -> dict:
    """One rank silently wrong once at ``FAULT_AT``: what the checks of this code see (log lines
    of a suspect or non-finite snapshot, a failed canary, or a recovery), the ground truth beside
    it, and, where it runs, lm-resiliency's C3 comparison of the ranks' state after every step."""
    lmr = ["--lmr"] if c.lmr_path else []
    kw = {"pythonpath": c.lmr_path} if c.lmr_path else {}
    job = c.job(fault, SPARE, ["--sdc", kind, "--sdc-worker", "1", "--kill-at", str(FAULT_AT), *lmr], **kw)
    out = sdc_row(fault, job, c.clean())
    return {**out, **lm_resiliency(job, c.clean_step_s)} if c.lmr_path else out


def sdc_row(fault: str, job: Job, clean: set[str]) -> dict:
    """An SDC row from its job: what the checks said (log lines, recoveries) beside the truth."""
    lines, recs = sdc_lines(job.log), [r for r in job.of("recovery") if r["failed_at_step"] is not None]
    steps = restored_steps(job.log)
    seen_at = [int(m.group(1)) for m in (re.search(r"step (\d+)", x) for x in lines) if m]
    detect = (recs[0]["failed_at_step"] if recs else min(seen_at, default=None))
    detected = bool(lines or recs)
    # an unsound verdict gets a round of its own (every rank goes back in process); a relaunch is a fallback
    again = "falling back to a relaunch" in job.log or job.restarted()
    return row(fault, "relaunch" if again else "in-process", detected=detected,
               detect_steps=None if detect is None else detect - FAULT_AT,
               named=names_rank(lines, 1) if detected else None, restored_step=steps[0] if steps else None,
               steps_lost=None if not steps else FAULT_AT + 1 - steps[0], relaunched=again,
               equal_to_clean=job.digests() == clean, replicas_equal_at_end=len(job.digests()) == 1,
               finite_at_end=all(e.get("finite", True) for e in job.of("done")), check_lines=lines[:3])


def lm_resiliency(job: Job, clean_step_s: float | None) -> dict:
    """lm-resiliency 0.2.0's C3 over parameters and optimizer state, every step: whether it saw
    the fault, whom it named, and its cost per step against the clean run's median step."""
    evs = [e for e in job.of("lmr") if e["worker"] == 0]
    after = [e for e in evs if e["step"] > FAULT_AT and any(e[k]["status"] != "agree" for k in ("params", "optim"))]
    first = after[0] if after else None
    per = statistics.median(e["s"] for e in evs) if evs else None
    return {"lmr_detected": first is not None, "lmr_detect_steps": None if first is None else first["step"] - 1
            - FAULT_AT, "lmr_status": None if first is None else {k: first[k]["status"] for k in ("params", "optim")},
            "lmr_bitmap": None if first is None else first["params"]["bitmap"] or first["optim"]["bitmap"],
            "lmr_check_s": per, "lmr_share_of_step": None if per is None or not clean_step_s else per
            / clean_step_s}


def predictor_down(c: Campaign, fault: str) -> dict:
    """The job's predictor listener started with no predictor (nor agent feeding it) behind its
    address: training must go on, saving every step, and say so once."""
    job = c.job(fault, SPARE, ["--listen"])
    said = [line for line in job.log.splitlines() if "unreachable" in line]
    return row(fault, "in-process", detected=bool(said), detect_steps=0 if said else None, named=None,
               restored_step=None, steps_lost=0, relaunched=False, equal_to_clean=job.digests() == c.clean(),
               check_lines=said[:1])


def disk_full(c: Campaign, fault: str, size: str = "6m") -> dict:
    """The job's disk root on a ``size`` tmpfs (room for about two steps): drains fail with
    ENOSPC from the third step on. What the job does is the row (``outcome``)."""
    from tests.ckpt_helpers import small_tmpfs
    try:
        with small_tmpfs(c.workdir / fault, size):
            try:
                job = c.job(fault, SPARE, [], timeout=400)
            except SystemExit as e:
                return row(fault, "in-process", detected=True, detect_steps=None, named=None, restored_step=None,
                           steps_lost=None, relaunched=False, equal_to_clean=None,
                           outcome="the job failed: " + str(e).splitlines()[0][:300],
                           check_lines=[x for x in str(e).splitlines() if "space" in x][:3])
    except BaseException as e:  # small_tmpfs skips (pytest's Skipped) without root or mount
        if type(e).__name__ != "Skipped":
            raise
        return {"fault": fault, "skipped": str(e)}
    said = [line for line in job.log.splitlines() if "No space left" in line]
    steps = restored_steps(job.log)
    return row(fault, "in-process", detected=bool(said), detect_steps=None, named=None,
               restored_step=steps[0] if steps else None, steps_lost=None,
               relaunched=job.restarted(),
               equal_to_clean=job.digests() == c.clean(), outcome="the job finished", check_lines=said[:3])


def canary_fail(c: Campaign, fault: str) -> dict:
    """A canary that fails after an in-process restore: a first job trains ``FAULT_AT`` + 2 steps
    recording its losses; a second, on a copy of its disk root, restores by name the newest step
    whose canary reference was committed (an overlapped snapshot superseded before its drain
    carries none), and in its first step every rank's parameters are not what was saved (once).
    Every rank must go back in its process to the verified step before it and end equal to the
    clean run."""
    from ckpt.tiers.local import LocalDiskTier

    first = c.workdir / f"{fault}-first"
    c.job(first.name, SPARE, ["--steps", str(FAULT_AT + 2), "--canary"])
    refs = [info.health["canary"]["after"] for info in LocalDiskTier(first).list()
            if info.complete and isinstance((info.health or {}).get("canary"), dict)]
    if not refs:
        return {"fault": fault, "skipped": "the first job committed no canary reference (every drain superseded)"}
    shutil.copytree(first, c.workdir / fault)
    job = c.job(fault, SPARE, ["--resume-step", str(max(refs)), "--canary-fault", "once"])
    lines = [line for line in job.log.splitlines() if "CANARY FAILED" in line]
    steps = restored_steps(job.log)  # the step named, then the one gone back to
    back = steps[1] if len(steps) > 1 else None
    again = "falling back to a relaunch" in job.log or job.restarted()
    return row(fault, "relaunch" if again else "in-process", detected=bool(lines), detect_steps=0 if lines else None,
               named=None, restored_step=back, steps_lost=None if back is None else max(refs) - back,
               relaunched=again, equal_to_clean=job.digests() == c.clean(), resumed_at=max(refs),
               check_lines=lines[:2])

"""When to save: the periodic checkpoint interval from measured costs and the failure rate.

A hand-set ``every=50`` is either too often (stalls) or too rare (lost work). The
optimum balances the two:

- Young (1974), "A first order approximation to the optimum checkpoint interval":
  compute ``τ = sqrt(2·C·M)`` between saves, C the save's blocking cost, M the job's
  mean time between failures.
- Daly (2006), "A higher order estimate of the optimum checkpoint interval for restart
  dumps": ``τ = sqrt(2·C·M)·[1 + ⅓·sqrt(C/2M) + ⅑·(C/2M)] − C`` for C < 2M, else M.
- With a failure predictor: a predicted failure is covered by an urgent save at the
  alarm, so the periodic interval only has to cover the unpredicted rate
  ``(1 − recall)·λ``; every alarm, true or false, costs one urgent save.
- Tightened under risk: every predicted failure strikes while an alarm is open, so
  while the risk is elevated the job's hazard is the unpredicted rate plus the
  predicted rate divided by the share of time some alarm is open (alarms open windows
  of ``window_s``, cut short by the failure when there is one, and overlap as a Poisson
  stream: open ``1 − exp(−(rλ·lead + false_rate·window))`` of the time); the same
  formula then gives a shorter interval.
- Scaled by the job's measured risk: where the predictor states the job's hazard as a
  ratio to its fleet's base rate (``hazard_ratio``, from calibrated node probabilities:
  predictor/model/job_risk.py), the job's hazard now is its own rate times that ratio; the
  excess over the base rate, ``(ratio − 1)·λ``, is added to the unpredicted rate. A
  ratio at or below 1 leaves the periodic interval as it is; there is no threshold.

- From per-GPU hazards: where a fleet model gives each of the job's GPUs a probability
  ``p`` of failing within a horizon H (``predictor hazard score``), each GPU's rate is
  ``−ln(1 − p)/H`` (constant over the horizon) and the job fails when any GPU does, so
  its MTBF is ``1 / Σ rates`` (``mtbf_from_gpu_hazards``).

Only the *blocking* cost C enters the formulas; the time to durability in each tier
does not move the optimum (it adds a constant to the loss per failure) but bounds the
interval from below: a save every T keeps up only if every tier absorbs one save per T.
"""
from __future__ import annotations

import csv
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

log = logging.getLogger(__name__)

FORMULAS = ("young", "daly")


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young (1974): compute seconds between saves, ``sqrt(2·C·M)``."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly (2006): the higher-order optimum; equals Young's to first order."""
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - cost_s


def mtbf_from_gpu_hazards(probabilities: Iterable[float], horizon_s: float) -> float:
    """A job's MTBF from its GPUs' probabilities of failing within ``horizon_s`` (any one stops the job)."""
    rate = 0.0
    for p in probabilities:
        if not 0.0 <= p < 1.0:
            raise ValueError(f"a GPU's probability of failing must be in [0, 1), not {p}")
        rate += -math.log1p(-p) / horizon_s
    return 1.0 / rate if rate > 0 else math.inf


def read_gpu_hazards(path: str, serials: Iterable[str]) -> list[float]:
    """The ``probability`` of each of ``serials`` from a scores CSV (columns SN, probability)."""
    want = set(serials)
    with open(path, newline="") as f:
        found = {row["SN"]: float(row["probability"]) for row in csv.DictReader(f) if row["SN"] in want}
    missing = sorted(want - found.keys())
    if missing:
        raise ValueError(f"{path}: no hazard for GPUs {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return list(found.values())


@dataclass(frozen=True)
class Predictor:
    """What a failure predictor buys a job: ``recall`` is the share of the job's failures
    caught early enough to make an urgent save durable where the restart will read it;
    ``false_alarms_per_day`` counts alarm episodes on the job's nodes that no failure
    follows; ``lead_s`` is the median time from alarm to failure; an alarm keeps the risk
    elevated for ``window_s`` (the scorer's horizon, shared/telemetry/EVAL.md)."""

    recall: float
    false_alarms_per_day: float
    lead_s: float
    window_s: float = 3600.0

    def alarms_per_s(self, failure_rate: float) -> tuple[float, float]:
        """(true, false) alarm rates for a job failing at ``failure_rate`` per second."""
        return self.recall * failure_rate, self.false_alarms_per_day / 86400.0

    def precision(self, failure_rate: float) -> float:
        """Share of alarms that a failure follows, at this job's own rates."""
        true, false = self.alarms_per_s(failure_rate)
        return true / (true + false) if true + false > 0 else 0.0

    def elevated_share(self, failure_rate: float) -> float:
        """Share of the time at least one alarm is open."""
        true, false = self.alarms_per_s(failure_rate)
        return 1.0 - math.exp(-(true * self.lead_s + false * self.window_s))

    def elevated_rate(self, failure_rate: float) -> float:
        """The job's hazard while an alarm is open: unpredicted failures, plus all the
        predicted ones squeezed into the time alarms are open."""
        share = self.elevated_share(failure_rate)
        return (1.0 - self.recall) * failure_rate + (self.recall * failure_rate / share if share else 0.0)


@dataclass
class IntervalPolicy:
    """The periodic interval from the measured blocking cost and the failure rate.

    ``blocking_s``: what a save stalls the training thread (measured; ``saved()`` keeps
    it current); ``mtbf_s``: the job's mean time between failures; ``drain_s``: the
    slowest tier's time from save to durability (the interval's floor); ``predictor``:
    optional, see ``Predictor``. Use ``interval_steps(step_time_s)`` for a step count, or
    ``should_save(now)`` / ``saved(now)`` as ``ckpt.resumable(..., every=policy)`` does.
    """

    blocking_s: float
    mtbf_s: float
    drain_s: float = 0.0
    predictor: Predictor | None = None
    formula: str = "daly"
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    last_save: float | None = field(default=None, repr=False)

    @classmethod
    def from_gpu_hazards(cls, blocking_s: float, probabilities: Iterable[float], horizon_s: float,
                         **kwargs) -> "IntervalPolicy":
        """The policy with the job's MTBF from its GPUs' hazards (``mtbf_from_gpu_hazards``)."""
        return cls(blocking_s=blocking_s, mtbf_s=mtbf_from_gpu_hazards(probabilities, horizon_s), **kwargs)

    def __post_init__(self) -> None:
        if self.formula not in FORMULAS:
            raise ValueError(f"formula must be one of {FORMULAS}, not {self.formula!r}")
        if self.blocking_s < 0 or self.mtbf_s <= 0:
            raise ValueError("blocking_s must be >= 0 and mtbf_s > 0")
        self._logged: tuple[float, float] | None = None

    @property
    def failure_rate(self) -> float:
        return 1.0 / self.mtbf_s

    def _optimum(self, rate: float) -> float:
        fn = daly_interval if self.formula == "daly" else young_interval
        floor = max(0.0, self.drain_s - self.blocking_s)  # start to start ≥ the slowest tier's drain
        return max(fn(self.blocking_s, 1.0 / rate), floor) if rate > 0 else math.inf

    @property
    def interval_s(self) -> float:
        """Compute seconds between periodic saves."""
        rate = self.failure_rate * (1.0 - self.predictor.recall if self.predictor else 1.0)
        return self._optimum(rate)

    @property
    def risk_interval_s(self) -> float:
        """Compute seconds between saves while a node's risk is elevated (never longer)."""
        if self.predictor is None:
            return self.interval_s
        return min(self.interval_s, self._optimum(self.predictor.elevated_rate(self.failure_rate)))

    def interval_at(self, hazard_ratio: float | None = None, elevated: bool = False) -> float:
        """Compute seconds between saves now: scaled by the job's hazard ratio when the predictor
        states one, else the binary ``elevated`` choice (never longer than the periodic interval)."""
        if hazard_ratio is None:
            return self.risk_interval_s if elevated else self.interval_s
        unpredicted = 1.0 - self.predictor.recall if self.predictor else 1.0
        rate = self.failure_rate * (unpredicted + max(0.0, hazard_ratio - 1.0))
        return min(self.interval_s, self._optimum(rate))

    def explain(self) -> dict:
        """The inputs, the formula and the result, for logs and ``--json``."""
        rate = self.failure_rate
        out = {"formula": "Daly 2006: sqrt(2CM)(1 + sqrt(C/2M)/3 + C/18M) - C" if self.formula == "daly"
               else "Young 1974: sqrt(2CM)",
               "blocking_s": self.blocking_s, "mtbf_s": self.mtbf_s, "drain_floor_s": self.drain_s,
               "interval_s": self.interval_s}
        if self.predictor:
            p = self.predictor
            out.update(recall=p.recall, false_alarms_per_day=p.false_alarms_per_day, lead_s=p.lead_s,
                       periodic_covers_mtbf_s=self.mtbf_s / max(1.0 - p.recall, 1e-12),
                       precision=p.precision(rate), elevated_share=p.elevated_share(rate),
                       elevated_mtbf_s=1.0 / p.elevated_rate(rate),
                       risk_interval_s=self.risk_interval_s)
        return out

    def _log_why(self) -> None:
        now = (self.interval_s, self.risk_interval_s)
        if self._logged and all(abs(a - b) <= 0.1 * b for a, b in zip(now, self._logged)):
            return
        self._logged = now
        why = self.explain()
        log.info("checkpoint interval %.0f s (%.0f s under risk): %s", now[0], now[1],
                 ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in why.items()))

    def interval_steps(self, step_time_s: float, elevated: bool = False, hazard_ratio: float | None = None) -> int:
        """The interval as a whole number of training steps (at least 1)."""
        self._log_why()
        seconds = self.interval_at(hazard_ratio, elevated)
        return max(1, round(seconds / step_time_s)) if math.isfinite(seconds) else 2**62

    def should_save(self, now: float | None = None, elevated: bool = False,
                    hazard_ratio: float | None = None) -> bool:
        """True once the interval's compute time (``interval_at``) has passed since the last save returned."""
        now = self.clock() if now is None else now
        if self.last_save is None:
            self.last_save = now  # the clock starts with training, not at import
            self._log_why()
            return False
        return now - self.last_save >= self.interval_at(hazard_ratio, elevated)

    def saved(self, now: float | None = None, blocking_s: float | None = None) -> None:
        """Note a save that just returned; a measured blocking time updates the cost (EWMA)."""
        self.last_save = self.clock() if now is None else now
        if blocking_s is not None:
            self.blocking_s = 0.7 * self.blocking_s + 0.3 * blocking_s
            self._log_why()

"""Goodput of a long training run under failures: the effective training time ratio
(ETTR, useful compute / wall clock) and where the rest goes.

Three kinds of waste, as fractions of the wall clock (Young 1974; Daly 2006):

- **stalls**: the training thread blocked by saves, C per period T = τ + C, plus one
  urgent save per alarm and the tighter saves while an alarm's risk is open;
- **lost work**: compute since the newest checkpoint the restart can read, on average
  T/2 plus how long after its save's end a checkpoint becomes durable in the copy that
  survives the failure (see ``KINDS``: a crashed process leaves its node's memory, a
  replaced node leaves only copies held elsewhere);
- **restarts**: per failure, its restart's phases (``restart.RestartCosts``: detecting it,
  replacing a node taken out of the job, relaunching) plus reading the checkpoint back.

``analytic`` is the first-order model: without a predictor, with no restart cost and a
checkpoint durable when its save returns, it is exactly Young's waste ``C/T + λ·T/2``.
``monte_carlo`` plays the same run event by event (Poisson failures, seeded), with the
schedule's real phase, failures during restarts and risk windows, to check it.
"""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import asdict, dataclass

from ..policy import IntervalPolicy, Predictor

RISK_WINDOW_S = 3600.0  # an alarm's horizon (shared/telemetry/EVAL.md): risk stays elevated this long
MIN_LEAD_S = 120.0  # a failure counts as caught only with this much lead (EVAL.md)
_N = statistics.NormalDist()

# the kinds of failure, by what the restart still has: a crashed process leaves its node
# (memory, disk) to the restart; a failed GPU takes its node out of the job (the host is
# alive, but the job restarts on a replacement whose memory and disk hold nothing); a host
# down loses the node outright. For the restart the last two read alike.
KINDS = {"crash": "process crash (node fine)", "gpu": "GPU failure (node replaced, host alive)",
         "host": "host down"}


@dataclass(frozen=True)
class Run:
    """A training run: defaults are Llama 3 405B's (Dubey et al. 2024, §3.3.4): 16,384
    GPUs, 54 days, 419 unexpected interruptions; shares are documented in docs/goodput.md
    (the rest of the failures, after host down and GPU, are process crashes)."""

    gpus: int = 16384
    days: float = 54.0
    failures: int = 419
    host_down_share: float = 0.21
    gpu_failure_share: float = 0.64
    precursor_share: float = 0.58
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        if self.host_down_share + self.gpu_failure_share > 1.0 + 1e-9:
            raise ValueError("host-down and GPU-failure shares add up to more than 1")

    @property
    def shares(self) -> dict[str, float]:
        """Share of the failures per kind (``KINDS``)."""
        crash = max(0.0, 1.0 - self.host_down_share - self.gpu_failure_share)
        return {"crash": crash, "gpu": self.gpu_failure_share, "host": self.host_down_share}

    @property
    def wall_s(self) -> float:
        return self.days * 86400.0

    @property
    def failure_rate(self) -> float:
        return self.failures / self.wall_s

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)


@dataclass(frozen=True)
class Recovery:
    """How a restart recovers from one kind of failure: it ``reads`` a copy that is durable
    ``lag_s`` after a save's start, in ``restore_s``, after the failure was detected, its
    node replaced where it left the job, and the job relaunched or, under (f), recovered
    in-process (``restart.PHASES``; each the expectation over the two paths)."""

    lag_s: float
    restore_s: float
    reads: str = ""
    detect_s: float = 0.0
    replace_s: float = 0.0
    relaunch_s: float = 0.0
    inprocess_s: float = 0.0

    @property
    def restart_s(self) -> float:
        """Failure to training again: every phase and the restore."""
        return self.detect_s + self.replace_s + self.relaunch_s + self.inprocess_s + self.restore_s


@dataclass(frozen=True)
class Lead:
    """Alarm-to-failure times of caught failures: log-normal through the median and the
    10th percentile, within [MIN_LEAD_S, RISK_WINDOW_S] as the scorer defines a catch."""

    median_s: float
    p10_s: float

    @property
    def _mu_sigma(self) -> tuple[float, float]:
        return math.log(self.median_s), math.log(self.median_s / self.p10_s) / -_N.inv_cdf(0.1)

    def _cdf(self, x: float) -> float:
        mu, sigma = self._mu_sigma
        return _N.cdf((math.log(x) - mu) / sigma)

    def _lo(self, lag_s: float) -> float:
        return min(max(lag_s, MIN_LEAD_S), RISK_WINDOW_S)

    def covered(self, lag_s: float) -> float:
        """Share of caught failures whose lead is at least ``lag_s``."""
        total = self._cdf(RISK_WINDOW_S) - self._cdf(MIN_LEAD_S)
        return (self._cdf(RISK_WINDOW_S) - self._cdf(self._lo(lag_s))) / total

    def mean_below(self, lag_s: float, hi: float) -> tuple[float, float]:
        """(P, E[lead; lead < hi]) over covered failures (lead ≥ lag_s), normalised to them."""
        mu, sigma = self._mu_sigma
        lo, hi = self._lo(lag_s), min(max(hi, self._lo(lag_s)), RISK_WINDOW_S)
        z = self._cdf(RISK_WINDOW_S) - self._cdf(lo)
        shifted = lambda x: _N.cdf((math.log(x) - mu - sigma**2) / sigma)  # noqa: E731 (partial moment)
        return (self._cdf(hi) - self._cdf(lo)) / z, math.exp(mu + sigma**2 / 2) * (shifted(hi) - shifted(lo)) / z

    def shortfall(self, wait_s: float) -> float:
        """E[max(0, wait_s − lead)] over caught failures: what is left of a wait started at
        the alarm when the failure comes."""
        below, lead_below = self.mean_below(0.0, wait_s)
        return below * wait_s - lead_below

    def sample(self, rng: random.Random, lag_s: float) -> float:
        lo, hi = self._cdf(self._lo(lag_s)), self._cdf(RISK_WINDOW_S)
        mu, sigma = self._mu_sigma
        return math.exp(mu + sigma * _N.inv_cdf(lo + (hi - lo) * rng.random()))


@dataclass(frozen=True)
class Skill:
    """A predictor as ``predictor eval --json`` scores it (node level); no ``lead`` when
    it caught nothing to measure one on."""

    recall_of_predictable: float
    false_alarms_per_1000_node_days: float
    lead: Lead | None


@dataclass(frozen=True)
class Strategy:
    """A checkpointing strategy: its save's blocking cost, how each kind of failure
    (``KINDS``) is recovered, optionally a predictor, and whether the job fails fast on a
    hung rank or a dead GPU (issue 19; it shortens the recoveries' detection). ``floor_s``:
    saves start at least this far apart (one step and its snapshot, under (f))."""

    name: str
    label: str
    blocking_s: float
    crash: Recovery
    gpu: Recovery
    host: Recovery
    skill: Skill | None = None
    fail_fast: bool = False
    floor_s: float = 0.0

    def recovery(self, kind: str) -> Recovery:
        return getattr(self, kind)

    def classes(self, run: Run) -> list[tuple[float, Recovery, float]]:
        """(share of failures, recovery, share of them predicted in time) per kind of failure."""
        return [(share, self.recovery(k), self._predicted(run, self.recovery(k))) for k, share in run.shares.items()]

    def caught(self, run: Run) -> float:
        """Share of failures the predictor raises an alarm for (lead of at least MIN_LEAD_S)."""
        if self.skill is None or self.skill.lead is None:
            return 0.0
        return run.precursor_share * self.skill.recall_of_predictable

    def _predicted(self, run: Run, rec: Recovery) -> float:
        """Caught, with lead enough to make the urgent save durable where the restart reads."""
        caught = self.caught(run)
        return caught * self.skill.lead.covered(rec.lag_s) if caught else 0.0

    def policy(self, run: Run, formula: str = "daly") -> IntervalPolicy:
        """This strategy's own optimum interval, as the training loop would use it."""
        predictor = None
        if self.skill:
            recall = sum(share * q for share, _, q in self.classes(run))
            lead_s = self.skill.lead.median_s if self.skill.lead else 0.0  # no lead: no caught failure
            predictor = Predictor(recall, self.skill.false_alarms_per_1000_node_days * run.nodes / 1000.0, lead_s)
        drain = max(self.floor_s, *(self.recovery(k).lag_s for k in KINDS))
        return IntervalPolicy(self.blocking_s, 1.0 / run.failure_rate, drain, predictor, formula)


@dataclass
class Outcome:
    """Fractions of the wall clock; ETTR = 1 − stall − lost − restart."""

    strategy: str
    label: str
    ettr: float
    stall: float
    lost: float
    restart: float
    interval_s: float
    risk_interval_s: float
    blocking_s: float
    mode: str

    @property
    def waste(self) -> float:
        return self.stall + self.lost + self.restart

    def to_dict(self) -> dict:
        return asdict(self) | {"waste": self.waste}


def analytic(run: Run, s: Strategy, formula: str = "daly") -> Outcome:
    """The first-order expected waste of ``s`` over ``run`` (see the module docstring)."""
    lam, c = run.failure_rate, s.blocking_s
    pol = s.policy(run, formula)
    period, risk_period = pol.interval_s + c, pol.risk_interval_s + c
    classes = s.classes(run)
    restart = sum(lam * share * rec.restart_s for share, rec, _ in classes)
    running = 1.0 - restart
    true_rate, false_rate = pol.predictor.alarms_per_s(lam) if pol.predictor else (0.0, 0.0)
    lost_per_failure, risk_time = 0.0, false_rate * RISK_WINDOW_S
    for share, rec, q in classes:
        if not q:
            continue
        p_short, lead_short = s.skill.lead.mean_below(rec.lag_s, risk_period)
        _, lead_mean = s.skill.lead.mean_below(rec.lag_s, math.inf)
        # lead shorter than the risk period: only the urgent save, taken at the alarm, is there
        late = (1 - p_short) * (risk_period / 2 + rec.lag_s - c)
        lost_per_failure += share * q * (lead_short - p_short * c + late)
        risk_time += lam * share * q * lead_mean
    at_risk = 1.0 - math.exp(-running * risk_time)  # windows overlap: time covered by at least one
    mean_period = (1 - at_risk) * period + at_risk * risk_period
    lost_per_failure += sum(share * (1 - q) * (mean_period / 2 + rec.lag_s - c)
                            for share, rec, q in classes if q < 1)
    # an urgent save takes the place of a periodic one that was half a period away on average
    stall = running * ((1 - at_risk) * c / period + at_risk * c / risk_period + (true_rate + false_rate) * c / 2)
    lost = running * lam * lost_per_failure
    return Outcome(s.name, s.label, 1.0 - stall - lost - restart, stall, lost, restart,
                   pol.interval_s, pol.risk_interval_s, c, "analytic")


@dataclass
class _Schedule:
    """Periodic saves after ``anchor``: compute τ, save (blocking C), compute τ, ...;
    ``done0`` is the compute kept at ``anchor``. An urgent save at time t is this
    schedule anchored at t − τ (its first save starts at t)."""

    anchor: float
    tau: float
    cost: float
    done0: float

    def split(self, t: float) -> tuple[float, float]:
        """(compute, stall) seconds from the anchor to t."""
        period = self.tau + self.cost
        n = math.floor((t - self.anchor) / period)
        r = t - self.anchor - n * period
        return n * self.tau + min(r, self.tau), n * self.cost + max(0.0, r - self.tau)

    def done(self, t: float) -> float:
        return self.done0 + self.split(t)[0]

    def saves_before(self, t: float, count: int | None = None) -> list[tuple[float, float]]:
        """(compute kept, start time) of the newest ``count`` saves started before t."""
        last = math.floor((t - self.anchor - self.tau) / (self.tau + self.cost))
        first = 0 if count is None else max(0, last - count + 1)
        return [(self.done0 + (j + 1) * self.tau, self.anchor + self.tau + j * (self.tau + self.cost))
                for j in range(first, last + 1)]


def _events(run: Run, s: Strategy, rng: random.Random, false_rate: float) -> list[tuple[float, int, Recovery | None]]:
    """Failures (kind 1, with their recovery), their alarms and false alarms (kind 0), in time order."""
    classes, out, t = s.classes(run), [], 0.0
    while (t := t + rng.expovariate(run.failure_rate)) < run.wall_s:
        _, rec, q = rng.choices(classes, weights=[c[0] for c in classes])[0]
        out.append((t, 1, rec))
        if q and rng.random() < q:
            out.append((t - s.skill.lead.sample(rng, rec.lag_s), 0, None))
    t = 0.0
    while false_rate and (t := t + rng.expovariate(false_rate)) < run.wall_s:
        out.append((t, 0, None))
    return sorted(e for e in out if e[0] > 0)


def _play(run: Run, s: Strategy, rng: random.Random) -> tuple[float, float, float, float]:
    """One run, event by event: (compute kept, stalls, lost, restarts) in seconds."""
    pol = s.policy(run)
    tau, risk_tau, c = min(pol.interval_s, run.wall_s), pol.risk_interval_s, s.blocking_s  # inf: no periodic saves
    false_rate = pol.predictor.alarms_per_s(run.failure_rate)[1] if pol.predictor else 0.0
    sched, since, kept = _Schedule(0.0, tau, c, 0.0), 0.0, [(0.0, -math.inf)]
    stall = lost = restart = 0.0
    down_from, up_at, risk_until = None, 0.0, math.inf

    def settle(t: float) -> float:
        """Count the stalls up to t, keep the newest saves; the compute done at t."""
        nonlocal stall, since
        stall += sched.split(t)[1] - sched.split(since)[1]
        kept.extend(sched.saves_before(t, 2))
        since = t
        return sched.done(t)

    def switch(t: float, new_tau: float, urgent: bool) -> None:
        """From t on: an urgent save now, then every ``new_tau``; or every ``new_tau``
        counted from the end of the last save (an interval change, as the loop does it)."""
        nonlocal sched
        done = settle(t)
        if urgent:
            sched = _Schedule(t - new_tau, new_tau, c, done - new_tau)
        else:
            last = sched.saves_before(t, 1)
            done, start = last[0] if last else (sched.done0, sched.anchor - c)
            sched = _Schedule(start + c, new_tau, c, done)

    for t, kind, rec in _events(run, s, rng, false_rate) + [(run.wall_s, -1, None)]:
        if down_from is not None and up_at <= t:  # the restart finished: resume, risk cleared
            restart += up_at - down_from
            sched, since, down_from, risk_until = _Schedule(up_at, tau, c, kept[0][0]), up_at, None, math.inf
        if down_from is None and risk_until <= t:
            switch(risk_until, tau, urgent=False)
            risk_until = math.inf
        if kind == 1:
            if down_from is None:
                done = settle(t)
                best = max(d for d, start in kept if start + rec.lag_s <= t)
                lost += done - best
                kept[:] = [(best, -math.inf)]
                down_from = t
            up_at = t + rec.restart_s
        elif kind == 0 and down_from is None:
            switch(t, risk_tau, urgent=True)
            risk_until = t + RISK_WINDOW_S
    if down_from is not None:
        restart += run.wall_s - down_from
        return kept[0][0], stall, lost, restart
    return settle(run.wall_s), stall, lost, restart


def monte_carlo(run: Run, s: Strategy, runs: int = 20, seed: int = 0) -> Outcome:
    """The mean over ``runs`` seeded plays of ``run`` (Poisson failures at its rate)."""
    rng = random.Random(seed)
    plays = [_play(run, s, rng) for _ in range(runs)]
    _, stall, lost, restart = (statistics.fmean(p[i] for p in plays) / run.wall_s for i in range(4))
    pol = s.policy(run)
    return Outcome(s.name, s.label, 1.0 - stall - lost - restart, stall, lost, restart,
                   pol.interval_s, pol.risk_interval_s, s.blocking_s, f"monte-carlo ({runs} runs, seed {seed})")

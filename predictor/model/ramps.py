"""Dating a counter's precursor ramp from its own events (the ramp rule's input).

A precursor's event rate grows like exp(RAMP_GROWTH * progress) over its duration D, so
the events seen so far date the ramp: their mean age against the time since the first
one gives the progress, hence D and the time left. Per GPU and counter this needs four
numbers (first and last event time, events, their summed age), never a list of events.

The rule's cut and the model's ramp features were fitted on counters read every
RAMP_REFERENCE_INTERVAL_S (most of the training data, and the shared sample), where a read's
events are dated at the read. A counter read more often is folded into its ramp at that
cadence: its reads add up until a reference interval has passed since the last fold, and
the ramp is read as of that fold. Dated at every 30 s read instead, the same events gave a
ramp that ended 2-3 min later than at 60 s, which cost lead on a warm 30 s fleet
(docs/research/predictor-experiments.md, "Fleet shift on the hidden generator"). The burst cap is a rate per
second of each read's interval (6 events a read at 60 s), so a burst split over two 30 s
reads counts no more than at 60 s. At the reference cadence or a coarser one every read is
a fold, exactly as before.
"""
from __future__ import annotations

import numpy as np

#: Measured on the shared sample (per failure, from its events and labelled duration):
#: median 4.0 (HBM), 4.3 (PCIe), 4.7 (NVLink); 3.5-4.4 on the long ramps, where the
#: estimate is tight.
RAMP_GROWTH = 4.0
RAMP_GAP_S = 3600.0                          # an hour without events ends a counter's ramp
RAMP_REFERENCE_INTERVAL_S = 60.0             # the cadence a ramp is folded at (above)
RAMP_BURST_RATE = 0.1                        # a read counts at most RATE per second of its interval
RAMP_BURST_FACTOR = 8.0                      # + FACTOR x the events the last 10 min's rate predicts
#                                              (6 + 8x at 60 s): a one-off burst is no ramp
RAMP_NONE_MIN = 1e4                          # "time left" when nothing is ramping (minutes)
#: The upper bound dates a ramp once its events span this long (3 folds after the first, within
#: jitter): the first fold holds part of an interval, and a few folds' counts cannot tell a
#: ramp from a step up in rate (Ramps.left).
RAMP_BOUND_SPAN_S = 2.5 * RAMP_REFERENCE_INTERVAL_S


def _ramp_x_table() -> tuple[np.ndarray, np.ndarray]:
    """x = growth x elapsed against q = mean event age / elapsed, for a rate ∝ exp(growth * age):
    q(x) = 1/x - 1/(e^x - 1) falls from 1/2 (flat) towards 0 (steep)."""
    x = np.geomspace(1e-4, 200.0, 4000)
    return -(1 / x - 1 / np.expm1(x)), x          # negated: increasing, for np.interp


_RAMP_NEG_Q, _RAMP_X = _ramp_x_table()


def ramp_left_min(elapsed_s: np.ndarray, mean_age_s: np.ndarray) -> np.ndarray:
    """Minutes left on an exponential ramp whose events since `elapsed_s` ago have that mean age.

    The ramp's duration is RAMP_GROWTH / growth and `elapsed_s` of it has passed; a flat or
    falling rate (mean age >= half the elapsed time) has no end in sight (RAMP_NONE_MIN)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(elapsed_s > 0, mean_age_s / elapsed_s, 0.5)
        x = np.interp(-np.minimum(q, 0.5), _RAMP_NEG_Q, _RAMP_X)
        left = elapsed_s * (RAMP_GROWTH / x - 1.0) / 60.0
    return np.clip(np.nan_to_num(left, nan=RAMP_NONE_MIN), 0.0, RAMP_NONE_MIN)


class Ramps:
    """Per GPU slot and counter: the current ramp's first/last event time, events, summed age,
    and the events read since the last fold (and when that and the last read were).

    `reference_s` = 0 folds every read, its events dated at the read at any cadence (as before
    the fold; benchmarks/ramp_cadence.py compares the two)."""

    def __init__(self, counters: int, reference_s: float = RAMP_REFERENCE_INTERVAL_S):
        self.counters = counters
        self.reference_ms = reference_s * 1000.0
        self.first_t = np.empty((0, counters), np.int64)
        self.last_t = np.empty((0, counters), np.int64)
        self.events = np.empty((0, counters))
        self.moment = np.empty((0, counters))       # events' summed age from the first one (s)
        self.fold_t = np.empty((0, counters), np.int64)
        self.read_t = np.empty((0, counters), np.int64)
        self.pending = np.empty((0, counters))      # events read since the last fold

    def grow(self, cap: int) -> None:
        """Room for `cap` slots; new slots have no ramp."""
        def grown(old: np.ndarray, fill) -> np.ndarray:
            new = np.full((cap, self.counters), fill, dtype=old.dtype)
            new[: len(old)] = old
            return new
        self.first_t, self.last_t = grown(self.first_t, -1), grown(self.last_t, -1)
        self.events, self.moment = grown(self.events, 0.0), grown(self.moment, 0.0)
        self.fold_t, self.read_t = grown(self.fold_t, -1), grown(self.read_t, -1)
        self.pending = grown(self.pending, 0.0)

    def reset(self, slots: np.ndarray) -> None:
        for a in (self.first_t, self.last_t, self.fold_t, self.read_t):
            a[slots] = -1
        for a in (self.events, self.moment, self.pending):
            a[slots] = 0.0

    def update(self, s: np.ndarray, t: np.ndarray, ok: np.ndarray, delta: np.ndarray,
               expected: np.ndarray, interval_s: np.ndarray) -> None:
        """Add a read: `delta` events per counter at `t` (where `ok`), `interval_s` after the
        counter's previous read (0 at its first: taken as the reference interval). Of them at
        most RAMP_BURST_RATE per second of the interval (never less than one) plus what
        `expected` (the events the 10 min rate predicts for it) makes plausible count, so a
        one-off burst of replays is no ramp. Once a reference interval has passed since the
        last fold (within half a read), the events read since are folded in, dated at `t`.
        Events after RAMP_GAP_S of silence start a new ramp."""
        tc = t[:, None]
        interval = np.where(interval_s > 0, interval_s, RAMP_REFERENCE_INTERVAL_S)
        cap = np.maximum(RAMP_BURST_RATE * interval, 1.0) + RAMP_BURST_FACTOR * expected
        pending = self.pending[s] + np.where(ok, np.minimum(delta, cap), 0.0)
        fold_t = self.fold_t[s]
        due = ok & ((fold_t < 0) | (tc - fold_t >= self.reference_ms - interval_s * 500.0))
        hit = due & (pending > 0)
        woke = hit & ((self.last_t[s] < 0) | (tc - self.last_t[s] > RAMP_GAP_S * 1000))
        r_first = np.where(woke, tc, self.first_t[s])
        self.first_t[s] = r_first
        self.events[s] = np.where(woke, 0.0, self.events[s]) + np.where(hit, pending, 0.0)
        self.moment[s] = np.where(woke, 0.0, self.moment[s]) + \
            np.where(hit, pending * (tc - r_first) / 1000.0, 0.0)
        self.last_t[s] = np.where(hit, tc, self.last_t[s])
        self.fold_t[s] = np.where(due, tc, fold_t)
        self.read_t[s] = np.where(ok, tc, self.read_t[s])
        self.pending[s] = np.where(due, 0.0, pending)

    def window(self, s: np.ndarray, t: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Counter k's current ramp at times t, as of its last fold while reads wait to be folded:
        live mask, events in it, seconds since its first event (0 where no ramp is live)."""
        n = self.events[s, k]
        fold_t = self.fold_t[s, k]
        now = np.where(self.read_t[s, k] > fold_t, fold_t, t)
        elapsed = (now - self.first_t[s, k]) / 1000.0
        # a ramp is dated once it spans time: events in one sample say nothing of their trend
        live = (self.last_t[s, k] >= 0) & (now - self.last_t[s, k] <= RAMP_GAP_S * 1000) & (n > 0) \
            & (elapsed > 0)
        return live, n, np.where(live, elapsed, 0.0)

    def left(self, s: np.ndarray, t: np.ndarray, k: int, sigmas: tuple[float, ...],
             bound_span_s: float = RAMP_BOUND_SPAN_S) -> tuple[np.ndarray, np.ndarray]:
        """Minutes left on counter k's ramp with its events' mean age at each of `sigmas` standard
        errors above itself ([n, len(sigmas)]; few events date a ramp loosely), and the events in
        it ([n]); RAMP_NONE_MIN and 0 where no ramp is live. Above the estimate itself, a ramp
        whose events span less than `bound_span_s` has no end in sight."""
        live, n, elapsed = self.window(s, t, k)
        n1 = np.maximum(n, 1.0)
        age = elapsed - self.moment[s, k] / n1
        # the mean of n ages spread over [0, elapsed] is uncertain by about elapsed / sqrt(12 n)
        err = elapsed / np.sqrt(12.0 * n1)
        spans = elapsed >= bound_span_s
        left = np.stack([np.where(live & (spans | (z <= 0)), ramp_left_min(elapsed, age + z * err), RAMP_NONE_MIN)
                         for z in sigmas], 1)
        return left, np.where(live, n, 0.0)

    def features(self, s: np.ndarray, t: np.ndarray, k: int) -> np.ndarray:
        """[n, 3]: log minutes left on counter k's ramp, the same at the events' 1-sigma
        upper bound (the ramp rule's input), and log events in it."""
        left, n = self.left(s, t, k, (0.0, 1.0))
        return np.log1p(np.column_stack([left, n]))

"""Dating a counter's ramp does not depend on how often the counter is read, and a ramp a few folds
old is not bounded (predictor/model/ramps.py)."""
import numpy as np
import pytest

from predictor.model.features import COUNTERS, FEATURE_NAMES, METRICS, Chunk, FleetState
from predictor.model.ramps import RAMP_BOUND_SPAN_S, RAMP_BURST_RATE, RAMP_NONE_MIN, RAMP_REFERENCE_INTERVAL_S, Ramps

_DURATION_MIN = 120


def _ramp_events(peak_per_min: float) -> np.ndarray:
    """Event times (min) of a precursor whose rate rises like exp(4 x progress) to its peak at 120 min,
    placed where the expected count crosses k + 1/2 (no noise: only the cadence differs)."""
    m = np.linspace(0, _DURATION_MIN, 120_001)
    cum = np.cumsum(peak_per_min * np.exp(4.0 * (m / _DURATION_MIN - 1.0))) * (m[1] - m[0])
    return np.interp(np.arange(0.5, cum[-1]), cum, m)


def _left_hi_by_minute(events_min: np.ndarray, interval_s: int) -> dict[int, float]:
    """Minutes left (upper bound, the ramp rule's input) on each whole minute, the SBE counter read
    every `interval_s`."""
    state = FleetState()
    slot = state.slots_for(["n0"], np.array([0]))
    sbe = METRICS.index(COUNTERS[0])
    col = FEATURE_NAMES.index("ecc_sbe_vol_total_ramp_left_hi")
    out = {}
    for t_s in range(0, _DURATION_MIN * 60, interval_s):
        values = np.full((1, len(METRICS)), np.nan)
        values[0, sbe] = np.searchsorted(events_min, t_s / 60, side="right")
        left = np.expm1(state.apply(Chunk(slot, np.array([t_s * 1000]), values))[0, col])
        if t_s % 60 == 0:
            out[t_s // 60] = float(left)
    return out


@pytest.mark.parametrize("peak_per_min", [3.0, 10.0])
def test_the_same_events_read_at_60_30_and_10_s_date_the_same_ramp_end(peak_per_min):
    """Dated at its own read, a read's events look younger by half its interval: the same ramp read
    every 60 s ended about 2 min before the one read every 30 s, enough for the rule's cut to catch
    a failure 10-25 min later (docs/research/predictor-experiments.md, "Fleet shift on the hidden
    generator"). Dated as a 60 s read dates them, the 30 s and 10 s ends are within 2 % (or 0.75 min)
    of the 60 s one."""
    events = _ramp_events(peak_per_min)
    by_cadence = {iv: _left_hi_by_minute(events, iv) for iv in (60, 30, 10)}
    near_end = [m for m in range(60, _DURATION_MIN) if by_cadence[60][m] <= 60]
    assert len(near_end) >= 10
    for m in near_end:
        assert by_cadence[30][m] == pytest.approx(by_cadence[60][m], rel=0.02, abs=0.75), m
        assert by_cadence[10][m] == pytest.approx(by_cadence[60][m], rel=0.02, abs=0.75), m


def _read(ramps: Ramps, t_s: float, delta: float, interval_s: float) -> None:
    ramps.update(np.array([0]), np.array([int(t_s * 1000)]), np.ones((1, 1), bool),
                 np.array([[delta]]), np.zeros((1, 1)), np.array([[interval_s]]))


def test_reads_at_the_reference_interval_fold_at_every_read():
    """At 60 s (or coarser) the model's and the rule's inputs are exactly those they were fitted
    on: each read's events dated at the read, at most 6 (+ what the rate predicts)."""
    assert RAMP_REFERENCE_INTERVAL_S == 60.0
    ramps = Ramps(1)
    ramps.grow(1)
    for i, (t_s, delta) in enumerate([(600, 50.0), (660, 2.0), (780, 1.0)]):
        _read(ramps, t_s, delta, 0.0 if i == 0 else t_s - 600 - (60 if i == 2 else 0))
        assert ramps.last_t[0, 0] == t_s * 1000 and ramps.pending[0, 0] == 0.0
    assert ramps.events[0, 0] == RAMP_BURST_RATE * 60 + 2 + 1 == 6 + 2 + 1
    assert ramps.moment[0, 0] == 2 * 60 + 1 * 180


def test_faster_reads_fold_once_a_reference_interval_has_passed():
    """Read every 30 s or 10 s, the events add up and are folded every 60 s (within half a read of
    jitter), each read's burst capped at its share of the 6 a 60 s read may count; until the
    next fold the ramp is read as of the last one."""
    for interval in (30.0, 10.0, 29.7):
        ramps = Ramps(1)
        ramps.grow(1)
        _read(ramps, 600, 0.0, 0.0)
        folds = []
        for i in range(1, int(180 / interval) + 1):
            t_s = 600 + i * interval
            _read(ramps, t_s, 50.0, interval)
            if ramps.pending[0, 0] == 0.0:
                folds.append(t_s - 600)
        assert [round(f) for f in folds] == ([59, 119, 178] if interval == 29.7 else [60, 120, 180])
        per_read = max(RAMP_BURST_RATE * interval, 1.0)
        assert ramps.events[0, 0] == pytest.approx(3 * 60 / round(interval) * per_read)
        t_last = 600 + (int(180 / interval) + 1) * interval     # a read that does not fold
        _read(ramps, t_last, 50.0, interval)
        assert ramps.pending[0, 0] == pytest.approx(per_read)
        _, _, elapsed = ramps.window(np.array([0]), np.array([int(t_last * 1000)]), 0)
        assert elapsed[0] == pytest.approx(folds[-1] - folds[0], abs=0.01)


def test_a_burst_split_over_two_reads_counts_no_more_than_in_one():
    """7 events in one 60 s read count 6; split 3 + 4 over two 30 s reads they count 3 + 3."""
    at_60, at_30 = Ramps(1), Ramps(1)
    for ramps in (at_60, at_30):
        ramps.grow(1)
        _read(ramps, 600, 0.0, 0.0)
    _read(at_60, 660, 7.0, 60.0)
    _read(at_30, 630, 3.0, 30.0)
    _read(at_30, 660, 4.0, 30.0)
    assert at_60.events[0, 0] == at_30.events[0, 0] == 6.0


def test_a_ramp_a_few_folds_old_has_no_upper_bound():
    """The start of a 133 min NVLink precursor on the shifted sample: 1, 3 and 6 events in its first
    three folds date its end within 2 min (a false alarm 131 min early). Until the events span
    RAMP_BOUND_SPAN_S the upper bound is open; the estimate itself is unchanged."""
    ramps = Ramps(1)
    ramps.grow(1)
    _read(ramps, 600, 0.0, 0.0)
    sigmas = (0.0, 1.0)
    for i, delta in enumerate([1.0, 3.0, 6.0, 4.0], start=1):
        t_s = 600 + 60 * i
        _read(ramps, t_s, delta, 60.0)
        left, n = ramps.left(np.array([0]), np.array([t_s * 1000]), 0, sigmas)
        if i == 3:
            assert n[0] == 10 and left[0, 0] < 1 and left[0, 1] == RAMP_NONE_MIN
            always, _ = ramps.left(np.array([0]), np.array([t_s * 1000]), 0, sigmas, bound_span_s=0.0)
            assert always[0, 0] == left[0, 0] and always[0, 1] < 2     # bounded at once: the rule's cut
    assert 120 < RAMP_BOUND_SPAN_S <= 180
    assert left[0, 1] < RAMP_NONE_MIN          # three intervals after the first fold: bounded

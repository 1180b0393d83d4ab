"""ckpt.policy: the checkpoint interval from measured costs (Young 1974, Daly 2006), the
predictor refinement, tightening under risk, and ``resumable(every=policy)``."""
from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import CheckpointManager
from ckpt.policy import IntervalPolicy, Predictor, daly_interval, young_interval


def daly_exact_wall(tau: float, cost: float, mtbf: float, restart: float = 0.0) -> float:
    """Daly (2006): expected wall time per second of work, exponential failures."""
    return mtbf * math.exp(restart / mtbf) * (math.exp((tau + cost) / mtbf) - 1.0) / tau


def test_young_is_sqrt_2CM() -> None:
    assert young_interval(50.0, 3600.0) == pytest.approx(600.0)


@pytest.mark.parametrize("ratio", [1e-4, 1e-3, 1e-2, 0.05, 0.2, 0.5])
def test_daly_minimises_the_exact_expected_wall_time(ratio: float) -> None:
    mtbf = 10_000.0
    cost = ratio * mtbf
    grid = [cost * 0.05 * k for k in range(1, 4000)]
    best = min(grid, key=lambda t: daly_exact_wall(t, cost, mtbf))
    tau = daly_interval(cost, mtbf)
    # Daly's estimate sits within 1% of the exact optimum's cost, Young's drifts with C/M
    assert daly_exact_wall(tau, cost, mtbf) <= daly_exact_wall(best, cost, mtbf) * 1.001
    if ratio <= 1e-3:
        assert tau == pytest.approx(young_interval(cost, mtbf), rel=0.05)


def test_daly_when_the_save_outlasts_the_mtbf() -> None:
    assert daly_interval(300.0, 100.0) == 100.0


def test_predictor_leaves_only_the_unpredicted_rate() -> None:
    plain = IntervalPolicy(blocking_s=10.0, mtbf_s=3600.0)
    pred = IntervalPolicy(blocking_s=10.0, mtbf_s=3600.0, predictor=Predictor(0.75, 0.0, 600.0))
    assert pred.interval_s == pytest.approx(daly_interval(10.0, 4 * 3600.0))
    assert pred.interval_s > plain.interval_s
    assert plain.risk_interval_s == plain.interval_s


def test_tightened_under_risk() -> None:
    p = Predictor(recall=0.5, false_alarms_per_day=2.0, lead_s=900.0)
    pol = IntervalPolicy(blocking_s=5.0, mtbf_s=6 * 3600.0, predictor=p)
    rate = 1 / pol.mtbf_s
    assert p.precision(rate) == pytest.approx(0.5 * rate / (0.5 * rate + 2 / 86400))
    open_share = 1 - math.exp(-(0.5 * rate * 900.0 + 2 / 86400 * 3600.0))
    assert p.elevated_share(rate) == pytest.approx(open_share)
    assert pol.risk_interval_s == pytest.approx(daly_interval(5.0, 1 / (0.5 * rate + 0.5 * rate / open_share)))
    assert pol.risk_interval_s < pol.interval_s / 2
    # without false alarms, a predicted failure comes about one lead after its alarm
    sharp = Predictor(recall=0.5, false_alarms_per_day=0.0, lead_s=900.0)
    assert sharp.elevated_rate(1e-6) == pytest.approx(1 / 900.0, rel=0.01)


def test_drain_time_is_a_floor() -> None:
    pol = IntervalPolicy(blocking_s=1.0, mtbf_s=100.0, drain_s=60.0)
    assert pol.interval_s == pytest.approx(59.0)  # one save per 60 s start to start, no faster
    assert pol.explain()["drain_floor_s"] == 60.0


def test_explains_why(caplog: pytest.LogCaptureFixture) -> None:
    pol = IntervalPolicy(blocking_s=2.0, mtbf_s=7200.0, predictor=Predictor(0.4, 10.0, 1200.0))
    with caplog.at_level(logging.INFO, logger="ckpt.policy"):
        steps = pol.interval_steps(step_time_s=1.5)
    why = pol.explain()
    assert steps == round(why["interval_s"] / 1.5)
    assert {"formula", "blocking_s", "mtbf_s", "recall", "precision", "risk_interval_s"} <= set(why)
    assert "Daly 2006" in caplog.text and "mtbf_s=7200" in caplog.text
    assert pol.interval_steps(1.5, elevated=True) <= steps


def test_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        IntervalPolicy(blocking_s=1.0, mtbf_s=0.0)
    with pytest.raises(ValueError):
        IntervalPolicy(blocking_s=1.0, mtbf_s=10.0, formula="guess")


def test_clock_and_measured_cost() -> None:
    pol = IntervalPolicy(blocking_s=1.0, mtbf_s=50.0, formula="young")  # τ = 10 s
    assert not pol.should_save(now=100.0)  # the clock starts here
    assert not pol.should_save(now=109.0)
    assert pol.should_save(now=110.0)
    pol.saved(now=111.0, blocking_s=0.0)
    assert pol.blocking_s == pytest.approx(0.7)  # measured cost folded in
    assert pol.interval_s == pytest.approx(math.sqrt(2 * 0.7 * 50.0))
    assert not pol.should_save(now=111.0 + pol.interval_s - 0.01)
    assert pol.should_save(now=111.0 + pol.interval_s + 0.01)


def test_resumable_saves_on_the_policy(root: Path, shm_dir: str) -> None:
    now = [0.0]
    pol = IntervalPolicy(blocking_s=1.0, mtbf_s=50.0, formula="young", clock=lambda: now[0])  # τ = 10 s, then less
    state = {"w": torch.zeros(8), "n": 0}
    with CheckpointManager(root, memory_dir=shm_dir, keep_last=20) as mgr:
        for _step in ckpt.resumable(mgr, state, total=12, every=pol, preemption=False):
            state["w"] += 1
            now[0] += 3.0  # each step takes 3 s of the policy's clock
        steps = [row["step"] for row in mgr.list()]
    # the clock starts after step 1 (t=3); due at t=15 (step 5, τ=10), then τ≈8.4: t=24 (step 8),
    # then τ≈7: step 11; and the end: 12
    assert steps == [5, 8, 11, 12]
    assert pol.blocking_s < 1.0


def test_mtbf_from_gpu_hazards_adds_the_gpus_rates(tmp_path: Path) -> None:
    from ckpt.policy import mtbf_from_gpu_hazards, read_gpu_hazards
    day = 86400.0
    # 1 - exp(-1) within 180 days is a rate of 1/180 per day; two such GPUs fail twice as often
    p = 1.0 - math.exp(-1.0)
    assert mtbf_from_gpu_hazards([p, p], 180 * day) == pytest.approx(90 * day)
    assert mtbf_from_gpu_hazards([0.0], day) == math.inf
    with pytest.raises(ValueError):
        mtbf_from_gpu_hazards([1.0], day)
    scores = tmp_path / "scores.csv"
    scores.write_text("SN,probability,location\na,0.5,x\nb,0.1,y\nc,0.2,z\n")
    assert sorted(read_gpu_hazards(str(scores), ["a", "c"])) == [0.2, 0.5]
    with pytest.raises(ValueError, match="no hazard for GPUs"):
        read_gpu_hazards(str(scores), ["a", "missing"])
    policy = IntervalPolicy.from_gpu_hazards(10.0, read_gpu_hazards(str(scores), ["a", "b"]), 180 * day)
    riskier = IntervalPolicy.from_gpu_hazards(10.0, [0.5, 0.5], 180 * day)
    assert riskier.interval_s < policy.interval_s

"""Sound state, not only sound bytes (invariant 16, docs/sound-state.md): the verdict on
every rank's replica report, the statuses a listing derives from the verdicts, and, with
torchrun (gloo, 2-3 DDP ranks), a rank that goes wrong after its optimizer step caught at
the next save, named, and gone back from."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ckpt.format.health import classify, newest_verified
from ckpt.save.soundness import verdict
from ckpt.tiers.base import CheckpointId


def _rep(digest: int | None, nonfinite: tuple[str, ...] = (), group: int = 0) -> dict:
    return {"digest": digest, "group": group, "nonfinite": list(nonfinite), "node": "n", "gpu": "cpu"}


def test_verdict_names_the_minority_or_both() -> None:
    assert verdict({0: _rep(1), 1: _rep(1), 2: _rep(1)})["state"] == "ok"
    three = verdict({0: _rep(1), 1: _rep(2), 2: _rep(1)})
    assert three["state"] == "suspect" and [c["rank"] for c in three["culprits"]] == [1]
    two = verdict({0: _rep(1), 1: _rep(2)})
    assert [c["rank"] for c in two["culprits"]] == [0, 1]
    # an HSDP-like job: two shard groups, each agreeing within itself
    hsdp = {0: _rep(1, group=7), 1: _rep(2, group=8), 2: _rep(1, group=7), 3: _rep(2, group=8)}
    assert verdict(hsdp)["state"] == "ok"
    nan = verdict({0: _rep(1), 1: _rep(1, ("model.w",))})
    assert nan["state"] == "unhealthy" and [c["rank"] for c in nan["culprits"]] == [1] and "model.w" in nan["reason"]
    assert verdict({0: None, 1: _rep(None)})["state"] == "ok"  # nothing compared: finite only
    assert verdict({0: None, 1: None})["state"] == "unchecked"


def test_statuses_go_back_before_the_first_unsound_step() -> None:
    ok, bad = {"state": "ok"}, {"state": "suspect"}
    health = {CheckpointId(0, s): h for s, h in [(1, ok), (2, ok), (3, ok), (4, bad), (5, ok), (6, None)]}
    status = classify(health)
    assert [status[CheckpointId(0, s)] for s in range(1, 7)] == ["verified", "ok", "ok", "suspect", "tainted",
                                                                  "tainted"]
    assert newest_verified(status) == CheckpointId(0, 1)
    status = classify({**health, CheckpointId(1, 7): ok})  # a new generation starts clean
    assert status[CheckpointId(1, 7)] == "ok"


@pytest.mark.parametrize("mode, nproc, culprit, state", [("flip", 3, 1, "suspect"), ("nan", 2, 0, "unhealthy")])
def test_a_rank_gone_wrong_is_caught_named_and_gone_back_from(tmp_path: Path, shm_dir: str, mode: str, nproc: int,
                                                              culprit: int, state: str) -> None:
    from tests.integration_helpers import torchrun

    bad = 4
    log = torchrun(Path(__file__).with_name("sound_child.py"), str(tmp_path / "root"), shm_dir, mode, str(culprit),
                   str(bad), "7", nproc=nproc)
    # ranks print on one stdout: two lines can run together, so decode each object where it starts
    outs = [json.JSONDecoder().raw_decode(log, m.end())[0] for m in re.finditer(r"SOUND (?=\{)", log)]
    assert sorted(o["rank"] for o in outs) == list(range(nproc)), log[-3000:]
    for o in outs:
        assert o["raised_at"] == bad + 1, o  # the save after the bad step refuses to go on
        assert o["health"]["state"] == state
        assert [c["rank"] for c in o["health"]["culprits"]] == [culprit]
        assert o["restored"] == bad - 1  # the newest step whose replicas agreed
        assert o["named_restore"] == bad  # naming the step restores it all the same
        assert o["listing"][f"0.{bad}"] == state and o["listing"]["0.1"] == "verified"
    assert len(re.findall(rf"is {state.upper()}", log)) >= 1, log[-3000:]
    from ckpt.recovery.quarantine import read, record_path

    strikes = read(record_path(tmp_path / "root", "sound"))
    assert strikes and all("step-4" in [s["restart"] for s in ss] for ss in strikes.values()), strikes


def _train(mgr, model, opt, steps: range, torch) -> list[float]:
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        loss = model(torch.randn(8, 16, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mgr.record(loss.item()))
        mgr.save(step + 1, {"model": model, "opt": opt})
        mgr.wait()
    return losses


def test_canary_passes_bitwise_fails_loudly_and_never_loops(tmp_path: Path, shm_dir: str) -> None:
    """Same process, deterministic: the first step after a restore reproduces the recorded
    loss bitwise; with the learning rate changed behind its back it fails once (the next
    restore skips that step), then a second failure stops the job."""
    import torch

    from ckpt import CheckpointManager
    from ckpt.save.canary import CanaryFailed

    torch.use_deterministic_algorithms(True)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with CheckpointManager(tmp_path, memory_dir=shm_dir, run="canary", keep_last=20) as mgr:
            _train(mgr, model, opt, range(0, 6), torch)
            assert mgr.restore({"model": model, "opt": opt}, step=3) == 3
            assert _train(mgr, model, opt, range(3, 4), torch) == ["passed"]
            assert mgr.restore({"model": model, "opt": opt}) == 4  # newest: no reference yet
            assert _train(mgr, model, opt, range(4, 5), torch) == ["no reference"]
            _train(mgr, model, opt, range(5, 8), torch)
            assert mgr.restore({"model": model, "opt": opt}, step=6) == 6
            with torch.no_grad():
                model[0].weight.add_(1.0)  # the restored state is not what was saved
            with pytest.raises(CanaryFailed, match="CANARY FAILED after restoring step 6") as failed:
                _train(mgr, model, opt, range(6, 7), torch)
            assert not failed.value.stop
            newest = mgr.restore({"model": model, "opt": opt})
            assert newest is not None and newest < 6 or newest is None  # step 6 and later skipped
            with torch.no_grad():
                model[0].weight.add_(1.0)
            with pytest.raises(CanaryFailed, match="stopping the job") as again:
                _train(mgr, model, opt, range(newest, newest + 1), torch)
            assert again.value.stop
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_verdict_after_the_last_save_fails_the_close(tmp_path: Path, shm_dir: str) -> None:
    """The last save's drain finds NaN after ``save()`` returned: no later save is there to raise,
    so ``close()`` does (the fault campaign's two-node SDC rows ended 'done' on wrong state)."""
    import torch

    from ckpt import CheckpointManager
    from ckpt.errors import UnsoundState

    model = torch.nn.Linear(16, 8)
    state = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1)}
    mgr = CheckpointManager(tmp_path, memory_dir=shm_dir, run="end", keep_last=5)
    mgr.save(1, state)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    mgr.save(2, state)
    with pytest.raises(UnsoundState, match="step 2 .* is unhealthy") as raised:
        mgr.close()
    assert raised.value.health["state"] == "unhealthy"
    with CheckpointManager(tmp_path, memory_dir=shm_dir, run="end") as again:
        assert again.restore(state) == 1  # the newest sound step


def test_a_reference_from_another_world_size_is_no_reference(tmp_path: Path) -> None:
    """After an in-process shrink each rank's loss is over another share of the batch: the
    recorded one is not comparable, so it is "no reference", not a failed canary."""
    from ckpt.save.canary import Canary, CanaryFailed

    canary = Canary(0, 2, tmp_path / "canary-run.json", lambda failed: [failed])
    canary.restored(CheckpointId(0, 3), {"after": 3, "loss": 1.0, "world": 3, "threads": 1, "deterministic": False})
    assert canary.record(2.0) == "no reference" and not (tmp_path / "canary-run.json").exists()
    canary.restored(CheckpointId(0, 3), {"after": 3, "loss": 1.0, "world": 2, "threads": 1, "deterministic": False})
    with pytest.raises(CanaryFailed, match="CANARY FAILED after restoring step 3"):
        canary.record(2.0)


def test_the_finite_check_sees_nan_and_inf_in_every_checked_dtype(tmp_path: Path, shm_dir: str) -> None:
    """float64/32 through a sum of squares (``isfinite`` when it overflows), float16 through
    ``isfinite``, bfloat16 through its exponent bits: each non-finite parameter is named, and
    large finite values (near each dtype's max, whose squares overflow) are not."""
    import torch

    from ckpt import CheckpointManager
    from ckpt.errors import UnsoundState

    mods = {name: torch.nn.Linear(64, 64).to(dtype) for name, dtype in
            [("f64", torch.float64), ("f32", torch.float32), ("f16", torch.float16), ("bf16", torch.bfloat16),
             ("bf16_big", torch.bfloat16), ("f32_big", torch.float32), ("f64_big", torch.float64),
             ("f32_big_inf", torch.float32)]}
    with torch.no_grad():
        mods["f64"].weight[5, 7] = float("nan")
        mods["f16"].weight[63, 63] = float("-inf")
        mods["bf16"].weight[0, 1] = float("inf")
        mods["bf16_big"].weight.fill_(3.0e38)
        mods["f32_big"].weight.fill_(3.0e38)
        mods["f64_big"].weight.fill_(1.0e308)
        mods["f32_big_inf"].weight.fill_(3.0e38)
        mods["f32_big_inf"].weight[9, 9] = float("-inf")
    mgr = CheckpointManager(tmp_path, memory_dir=shm_dir, run="dtypes", keep_last=2)
    mgr.save(1, dict(mods))
    with pytest.raises(UnsoundState) as raised:
        mgr.close()
    reason = raised.value.health["reason"]
    assert all(f"{name}.weight" in reason for name in ("f64", "f16", "bf16", "f32_big_inf")), reason
    assert not any(f"{name}." in reason for name in ("f32", "bf16_big", "f32_big", "f64_big")), reason


def test_the_cost_clock_times_each_check_and_puts_the_functions_back(tmp_path: Path, shm_dir: str) -> None:
    """``benchmarks/sound_cost.py``: the checks' thread CPU per step, by check and thread (the
    finite check on the checksum threads, the digest on the drain's, the canary on the
    trainer's), and nothing left wrapped after it."""
    import torch

    from benchmarks.sound_cost import clocked
    from ckpt import CheckpointManager
    from ckpt.save import canary, soundness

    before = (soundness.Inspection.visit, soundness.Inspection.report, canary.Canary.record)
    model = torch.nn.Linear(16, 8)
    state = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1)}
    with CheckpointManager(tmp_path, memory_dir=shm_dir, run="cost", keep_last=2) as mgr, clocked() as clock:
        for step in range(1, 4):
            mgr.record(float(step))
            mgr.save(step, state)
        mgr.wait()
    spent = clock.per_step(3)
    checks = {name.split(" ")[0] for name in spent["by_check_ms"]}
    assert {"finite", "report", "record", "scope_of"} <= checks, spent
    assert spent["trainer_thread_ms"] <= spent["checks_ms"]
    assert (soundness.Inspection.visit, soundness.Inspection.report, canary.Canary.record) == before

"""Overlapped snapshots (``CheckpointManager(overlap=True)``, docs/overlap.md): a real
training loop saving every step, while the copy of step k runs during step k+1's
forward and backward, restores every saved step bitwise; a write the wait does not
cover is refused, never sealed torn; the lower tiers skip superseded snapshots."""
from __future__ import annotations

import copy
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ckpt
from ckpt import CheckpointManager
from ckpt.errors import SnapshotChanged
from ckpt.save.overlap import FoundCache, StepHooks, found_in, optimizers_in
from tests.ckpt_helpers import assert_same
from tests.procs import wait_for

MICRO_BATCHES = 2  # gradient accumulation


def build(seed: int = 0) -> dict[str, Any]:
    """BatchNorm (buffers the forward writes), two optimizers (foreach AdamW, SGD with
    momentum), two schedulers, an AMP grad scaler, RNG and data position."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 4))
    body = [p for m in list(model)[:4] for p in m.parameters()]
    opt_a = torch.optim.AdamW(body, lr=1e-2, foreach=True)
    opt_b = torch.optim.SGD(model[5].parameters(), lr=0.1, momentum=0.9)
    return {"model": model, "opt_a": opt_a, "opt_b": opt_b,
            "sched_a": torch.optim.lr_scheduler.StepLR(opt_a, 3, 0.5),
            "sched_b": torch.optim.lr_scheduler.ExponentialLR(opt_b, 0.9),
            "scaler": torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2),
            "rng": torch.get_rng_state(), "data": {"position": 0}}


def train_step(state: dict[str, Any]) -> None:
    model, scaler = state["model"], state["scaler"]
    for _ in range(MICRO_BATCHES):
        x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y) / MICRO_BATCHES
        scaler.scale(loss).backward()
        state["data"]["position"] += 1
    for opt in (state["opt_a"], state["opt_b"]):
        scaler.step(opt)  # calls opt.step(): the pre-hook waits for the copy
    scaler.update()
    for name in ("opt_a", "opt_b", "sched_a", "sched_b"):
        getattr(state[name], "zero_grad" if name.startswith("opt") else "step")()
    state["rng"] = torch.get_rng_state()


def expected_of(state: dict[str, Any]) -> dict[str, Any]:
    """What a restore of this moment must give back, deep-copied."""
    return copy.deepcopy({k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in state.items()})


def assert_restores(mgr: CheckpointManager, step: int, expected: dict[str, Any]) -> None:
    probe = build(seed=step + 100)  # other values everywhere: only the restore can make them equal
    assert mgr.restore(probe, step=step) == step
    assert_same(expected_of(probe), expected, f"step {step}")


def test_saving_every_step_while_the_next_step_runs_restores_each_step_bitwise(root: Path, shm_dir: str) -> None:
    state = build()
    expected = {}
    with CheckpointManager(root, memory_dir=shm_dir, keep_last=100, overlap=True, state=state) as mgr:
        for step in range(1, 13):
            train_step(state)
            expected[step] = expected_of(state)
            handle = mgr.save(step, state)
            assert not mgr.memory.holds(step), "the parameters' copy should still be under way, unsealed"
            assert handle.step == step
        mgr.wait()
        saved = sorted({i["step"] for i in mgr.list()})
        assert saved[-1] == 12 and len(saved) >= 3
        for step in saved:
            assert_restores(mgr, step, expected[step])


def test_without_the_step_wait_the_snapshot_is_refused_not_torn(root: Path, shm_dir: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above fails if the hooks are removed: optimizer.step() then writes the
    parameters during their copy, and the version check refuses the seal."""
    monkeypatch.setattr(StepHooks, "watch", lambda self, optimizers, modules: None)
    state = build()
    with CheckpointManager(root, memory_dir=shm_dir, overlap=True, state=state) as mgr:
        train_step(state)
        mgr.save(1, state)
        train_step(state)  # no wait: optimizer.step() writes what is being copied
        with pytest.raises(SnapshotChanged, match=r"step 1 was not sealed: .*model\.0\.weight"):
            mgr.save(2, state)
        assert [i["step"] for i in mgr.list()] == []  # nothing torn was sealed
        mgr.wait_staged()
        expected = expected_of(state)
        mgr.save(2, state)  # saving goes on after the refusal
        mgr.wait()
        assert_restores(mgr, 2, expected)


def test_an_in_place_write_before_the_wait_is_refused_and_the_last_snapshot_stays(root: Path, shm_dir: str) -> None:
    state = build()
    with CheckpointManager(root, memory_dir=shm_dir, overlap=True, state=state) as mgr:
        train_step(state)
        expected = expected_of(state)
        mgr.save(1, state)
        train_step(state)
        mgr.save(2, state)
        with torch.no_grad():
            state["model"][5].bias.add_(1.0)  # not through optimizer.step(): the copy is not waited for
        with pytest.raises(SnapshotChanged, match=r"model\.5\.bias changed in place"):
            mgr.wait_staged()
        mgr.wait()
        assert sorted({i["step"] for i in mgr.list()}) == [1]
        assert_restores(mgr, 1, expected)


@pytest.mark.parametrize("verify", [False, True])
def test_a_write_through_numpy_escapes_the_counter_and_only_overlap_verify_refuses_it(root: Path, shm_dir: str,
                                                                                      verify: bool) -> None:
    """A write through a numpy view of a saved parameter, after its copy and before the wait,
    bumps no version counter: sealed torn without ``overlap_verify`` (the documented gap),
    refused with it (the staged bytes differ from the live ones), the last snapshot kept."""
    state = build()
    with CheckpointManager(root, memory_dir=shm_dir, overlap=True, overlap_verify=verify, state=state) as mgr:
        train_step(state)
        expected = expected_of(state)
        mgr.save(1, state)
        train_step(state)
        mgr.save(2, state)
        assert wait_for(lambda: mgr._saves._staged.copied(), timeout=60)
        state["model"][5].bias.detach().numpy()[:] += 1.0  # no torch op: the counter stays
        if not verify:
            mgr.wait_staged()  # sealed: had the write landed during the copy, step 2 would be torn unseen
            mgr.wait()
            assert sorted({i["step"] for i in mgr.list()}) == [1, 2]
            return
        with pytest.raises(SnapshotChanged, match=r"model\.5\.bias changed in place"):
            mgr.wait_staged()
        mgr.wait()
        assert sorted({i["step"] for i in mgr.list()}) == [1]
        assert_restores(mgr, 1, expected)


def test_buffers_rng_and_plain_values_are_copied_before_save_returns(root: Path, shm_dir: str) -> None:
    """What the next forward writes (BatchNorm statistics, num_batches_tracked) cannot wait
    for the optimizer: it is in the slot when save() returns."""
    state = build()
    with CheckpointManager(root, memory_dir=shm_dir, overlap=True, state=state) as mgr:
        train_step(state)
        expected = expected_of(state)
        mgr.save(1, state)
        state["model"](torch.randn(64, 16))  # a forward in train mode: running stats change
        state["data"]["position"] = -1
        mgr.wait()
        assert_restores(mgr, 1, expected)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adam(ps, fused=True),
    lambda ps: torch.optim.Adam(ps, foreach=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
], ids=["fused", "foreach", "for-loop"])
def test_the_step_pre_hook_waits_for_every_optimizer_implementation(root: Path, shm_dir: str, make) -> None:
    model = nn.Linear(64, 64)
    opt = make(model.parameters())
    state = {"model": model, "optim": opt}
    with CheckpointManager(root, memory_dir=shm_dir, overlap=True) as mgr:
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
        mgr.save(1, state)
        assert not mgr.memory.holds(1)  # being copied: not sealed yet
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
        assert mgr.memory.holds(1)  # sealed by the pre-hook, before the step wrote anything
        mgr.wait()
        assert [i["step"] for i in mgr.list()] == [1]


def test_the_pre_hook_fires_through_accelerate_and_lightning_wrappers(root: Path, shm_dir: str) -> None:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.optimizer import AcceleratedOptimizer

    accelerate.Accelerator(cpu=True)
    model = nn.Linear(32, 32)
    wrapped = AcceleratedOptimizer(torch.optim.AdamW(model.parameters()), device_placement=False)
    state = {"model": model, "optimizer": wrapped}
    with CheckpointManager(root, memory_dir=shm_dir, overlap=True) as mgr:
        model(torch.randn(4, 32)).sum().backward()
        wrapped.step()
        mgr.save(1, state)
        model(torch.randn(4, 32)).sum().backward()
        wrapped.step()
        assert mgr.memory.holds(1)
        mgr.wait()
    lightning = pytest.importorskip("lightning.pytorch.core.optimizer")
    raw = torch.optim.SGD(model.parameters())
    # Lightning's strategy calls the inner optimizer's step(): its hook is the one that fires
    assert optimizers_in({"optimizers": [lightning.LightningOptimizer(raw)]}) == [raw]


def test_one_walk_finds_the_optimizers_and_modules_of_a_state() -> None:
    """``found_in``: the optimizers (through wrappers, a module's own ``optimizer`` too) and the modules, each once,
    in the order met, in containers to the third level and not below."""

    class Wrapper:
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

    model, deep = nn.Linear(2, 2), nn.Linear(2, 2)
    holder = nn.Linear(2, 2)
    raw, own, buried = (torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1) for _ in range(3))
    holder.optimizer = own  # a module holding an optimizer: both found
    state = {"m": model, "h": holder, "opts": [Wrapper(raw), {"again": (model, raw)}], "deep": [[[deep, buried]]]}
    assert found_in(state) == ([own, raw], [model, holder])
    assert optimizers_in(state) == [own, raw]
    state["deep"] = [[deep, buried]]
    assert found_in(state) == ([own, raw, buried], [model, holder, deep])


def test_found_cache_answers_as_found_in_through_every_change_and_keeps_it_only_while_nothing_changed() -> None:
    """``FoundCache``: the last answer while the top-level values are the same objects wrapping the same
    optimizers; a value replaced, an inner optimizer swapped (one or two wrappers deep), an optimizer given to a
    module, a list changed in place, a wrapper whose attributes are computed: the walk's answer, each time."""

    class Wrapper:
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

    class Computed:  # its optimizer is whatever ``pick`` names at each read: never kept
        def __init__(self, *opts: torch.optim.Optimizer) -> None:
            self.opts, self.pick = opts, 0

        def __getattr__(self, name: str) -> Any:
            if name == "optimizer":
                return self.opts[self.pick]
            raise AttributeError(name)

    def sgd() -> torch.optim.Optimizer:
        return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)

    model, raw, other, third, middle = nn.Linear(2, 2), sgd(), sgd(), sgd(), sgd()
    middle.optimizer = third  # an optimizer wrapping another (``found_in`` unwraps through optimizers only)
    outer = Wrapper(middle)
    state: dict[str, Any] = {"m": model, "w": Wrapper(raw), "o": outer, "step": 3, "lr": 0.1, "name": "x"}
    cache = FoundCache()
    first = cache.of(state)
    assert first == found_in(state) == ([raw, third], [model])
    assert cache.of(dict(state)) is first  # the same objects (a new dict of them): kept
    assert cache.of({**state, "data": {"position": 0}}) == first  # a dict: walked, the others' parts kept
    assert cache.of({"again": model, **state}) == ([raw, third], [model])  # found once, in the order met

    def same() -> tuple[list, list]:
        got = cache.of(state)
        assert got == found_in(state)
        return got

    state["w"].optimizer = other  # the inner optimizer swapped
    assert same() == ([other, third], [model])
    middle.optimizer = raw  # two wrappers deep
    assert same() == ([other, raw], [model])
    state["m"] = nn.Linear(2, 2)  # a value replaced by another object
    assert same()[1] == [state["m"]]
    state["m"].optimizer = third  # a module given an optimizer
    assert same()[0] == [third, other, raw]
    state["m"].__class__ = nn.ReLU  # the same object, another type
    assert same()[1] == [state["m"]]
    state["late"] = [model]  # a list: walked at every call
    assert same()[1][-1] is model
    state["late"].append(sgd())
    assert same()[0][-1] is state["late"][-1]
    state["late"].append(raw)  # found before: not again
    assert same()[0][-1] is state["late"][-2]
    computed = Computed(raw, other)
    state = {"c": computed}
    assert same() == ([raw], [])
    computed.pick = 1
    assert same() == ([other], [])


def test_superseded_snapshots_are_skipped_and_their_handles_follow_the_newer_step(
        root: Path, shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk is held while steps 2..5 are saved: it then writes 1, 4 and 5 only (4 was
    queued when 5 was sealed at flush), and waiting for step 2 means waiting for 4."""
    from ckpt.tiers.local import LocalDiskTier

    gate = threading.Event()
    write = LocalDiskTier.write_shard
    monkeypatch.setattr(LocalDiskTier, "write_shard", lambda self, *a, **k: (gate.wait(60), write(self, *a, **k))[1])
    state = build()
    with CheckpointManager(root, memory_dir=shm_dir, keep_last=100, overlap=True, state=state) as mgr:
        handles = {}
        for step in range(1, 6):
            train_step(state)
            handles[step] = mgr.save(step, state)
        assert len(mgr.memory.pool.slots) == 3
        assert handles[2].superseded_by == 3 and handles[3].superseded_by == 4
        assert not handles[2].done
        gate.set()
        mgr.wait(step=2)
        assert handles[4].durable_s and not handles[2].durable_s
        mgr.wait()
        assert sorted({i["step"] for i in mgr.list() if "disk" in i["tiers"]}) == [1, 4, 5]


def test_a_drain_interval_keeps_the_lower_tiers_to_the_newest_snapshot_that_often(root: Path,
                                                                                    shm_dir: str) -> None:
    """``drain_interval_s``: after step 1's drain, the steps saved within the interval are
    superseded in memory; ``wait()`` and ``close()`` end the pause instead of sleeping it out."""
    state = build()
    with CheckpointManager(root, memory_dir=shm_dir, keep_last=100, overlap=True, drain_interval_s=3600,
                           state=state) as mgr:
        handles = {}
        for step in range(1, 7):
            train_step(state)
            handles[step] = mgr.save(step, state)
            if step == 2:  # step 1's drain has run, and its start begins the interval (a busy machine may
                handles[1].wait()  # start it only after step 2 is queued: step 1 is skipped, then step 2 drained)
        expected = expected_of(state)
        mgr.wait()
        assert [handles[s].superseded_by for s in (2, 3, 4)] == [3, 4, 5]
        assert sorted({i["step"] for i in mgr.list() if "disk" in i["tiers"]}) == [1, 5, 6]
        assert_restores(mgr, 6, expected)
        train_step(state)
        mgr.save(7, state)  # paced again: close() must not wait out the hour
    with pytest.raises(ValueError, match="needs overlap=True"):
        CheckpointManager(root, memory_dir=shm_dir, drain_interval_s=1.0)


def test_the_loop_helper_saves_every_step_with_overlap(root: Path, shm_dir: str) -> None:
    state = build()
    with CheckpointManager(root, memory_dir=shm_dir, overlap=True, state=state) as mgr:
        for _ in ckpt.resumable(mgr, state, total=6, every=1, preemption=False):
            train_step(state)
        expected = expected_of(state)
        assert max(i["step"] for i in mgr.list()) == 6
        assert_restores(mgr, 6, expected)


def test_two_ranks_skip_the_same_superseded_steps(tmp_path: Path, shm_dir: str) -> None:
    """gloo, 2 ranks, rank 1's disk slow: the skipped steps agree, the rest commit and restore."""
    from tests.integration_helpers import torchrun

    log = torchrun(Path(__file__).with_name("overlap_child.py"), str(tmp_path / "root"), shm_dir, "12")
    oks = set(re.findall(r"rank (\d) overlap ok", log))  # the ranks' lines may interleave on one line
    assert oks == {"0", "1"}, log[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_saves_every_step_on_a_side_stream_and_restores_bitwise_from_pinned_slots(root: Path,
                                                                                      shm_dir: str) -> None:
    """The CUDA path: buffers copied before the next forward (the current stream waits on
    the device), parameters and fused AdamW state on the side stream during it, the pre-hook
    waiting on the copy's event; restores from the pinned slots copy asynchronously."""
    def make() -> dict[str, Any]:
        model = nn.Sequential(nn.Linear(256, 1024), nn.BatchNorm1d(1024), nn.ReLU(), nn.Linear(1024, 256)).cuda()
        return {"model": model, "opt": torch.optim.AdamW(model.parameters(), fused=True)}

    def train(state: dict[str, Any]) -> None:
        state["model"](torch.randn(512, 256, device="cuda")).square().mean().backward()
        state["opt"].step()
        state["opt"].zero_grad()

    torch.manual_seed(0)
    state = make()
    train(state)
    expected = {}
    with CheckpointManager(root, memory_dir=shm_dir, keep_last=100, overlap=True, state=state) as mgr:
        for step in range(1, 9):
            train(state)
            expected[step] = expected_of(state)
            mgr.save(step, state)
        mgr.wait()
        assert all(s._pinned for s in mgr.memory.pool.slots if s.buffer is not None)
        for step in sorted({i["step"] for i in mgr.list()}):
            probe = make()
            assert mgr.restore(probe, step=step) == step
            assert next(probe["model"].parameters()).is_cuda
            assert_same(expected_of(probe), expected[step], f"step {step}")


def test_a_state_without_optimizers_is_sealed_when_save_returns(root: Path, shm_dir: str) -> None:
    """Nothing is deferred (no optimizer step would seal it): the default stays safe."""
    state = {"w": torch.randn(1000), "step": 1}
    with CheckpointManager(root, memory_dir=shm_dir, overlap=True) as mgr:
        mgr.save(1, state)
        assert mgr.memory.holds(1)
        state["w"].zero_()
        mgr.wait()
        back = {"w": torch.empty(1000)}
        assert mgr.restore(back) == 1 and not torch.equal(back["w"], state["w"])


def test_saving_every_step_to_an_object_store_alone_uploads_the_newest(tmp_path: Path, shm_dir: str) -> None:
    """No disk tier: 4 slots, uploads straight from memory and never skipped; flush()
    leaves the newest step in the store."""
    url = f"file://{tmp_path}/bucket/run"
    state = build()
    with CheckpointManager(None, object_store=url, memory_dir=shm_dir, overlap=True, object_interval_s=3600,
                           state=state) as mgr:
        assert len(mgr.memory.pool.slots) == 4
        for step in range(1, 7):
            train_step(state)
            mgr.save(step, state)
        expected = expected_of(state)
        mgr.flush()
        mgr.wait()
        stored = sorted({i["step"] for i in mgr.list() if "object" in i["tiers"]})
        assert stored[0] == 1 and stored[-1] == 6
    with CheckpointManager(None, object_store=url, memory_dir=str(tmp_path / "no-slots")) as mgr:
        assert_restores(mgr, 6, expected)


def test_a_snapshot_being_copied_is_invisible_to_other_readers(root: Path, shm_dir: str) -> None:
    """What another process (``ckpt ls``, a restarted trainer) sees mid-copy: the previous
    sealed step, never the one being copied (its slot is unsealed until the wait)."""
    from ckpt.tiers.memory import MemoryTier, memory_namespace

    state = build()
    with CheckpointManager(root, memory_dir=shm_dir, overlap=True, state=state) as mgr:
        train_step(state)
        mgr.save(1, state)
        train_step(state)  # seals step 1
        mgr.save(2, state)
        outside = MemoryTier(memory_namespace(root, None, shm_dir), 0)
        assert [i.id.step for i in outside.list()] == [1]
        mgr.wait_staged()
        assert [i.id.step for i in outside.list()] == [1, 2]


def test_a_fault_in_the_next_forward_costs_one_step(root: Path, shm_dir: str) -> None:
    """In-process recovery: step k's copy ran during step k+1's forward and backward, which
    failed before optimizer.step(); restore() seals step k and restores it from memory."""
    state = build()
    with CheckpointManager(root, memory_dir=shm_dir, overlap=True, state=state) as mgr:
        for step in (1, 2):
            train_step(state)
            expected = expected_of(state)
            mgr.save(step, state)
        state["scaler"].scale(state["model"](torch.randn(64, 16)).sum()).backward()  # step 3 fails after this
        probe = build(seed=7)
        assert mgr.restore(probe) == 2
        assert_same(expected_of(probe), expected)


def copied(mgr: CheckpointManager) -> None:
    """Wait (a hang guard only) until the staged snapshot's copy has ended, unwaited for."""
    assert wait_for(lambda: mgr._saves._staged.copied(), timeout=120, interval=0.001)


def test_the_snapshot_is_sealed_at_the_end_of_the_next_forward(root: Path, shm_dir: str) -> None:
    """Once its copy has ended, step k is sealed by the next forward of the model (its drain
    starts during the backward), not at optimizer.step(): a fault after that forward costs
    no step, and another reader already sees it."""
    from ckpt.tiers.memory import MemoryTier, memory_namespace

    state = build()
    with CheckpointManager(root, memory_dir=shm_dir, overlap=True, state=state) as mgr:
        train_step(state)
        expected = expected_of(state)
        handle = mgr.save(1, state)
        copied(mgr)
        assert not mgr.memory.holds(1), "a finished copy is sealed by the training thread, not the copy thread"
        loss = state["model"](torch.randn(64, 16)).sum()
        assert mgr.memory.holds(1), "the end of the forward seals a copied snapshot"
        handle.wait()  # its drain is under way before the step: durable on disk with no optimizer.step()
        outside = MemoryTier(memory_namespace(root, None, shm_dir), 0)
        assert [i.id.step for i in outside.list()] == [1]
        loss.backward()  # step 2 fails here, before optimizer.step()
        probe = build(seed=7)
        assert mgr.restore(probe) == 1
        assert_same(expected_of(probe), expected)


def test_a_forward_before_the_copy_ended_leaves_the_seal_to_the_step(root: Path, shm_dir: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward hook never waits for the copy: a copy still running (held here) is sealed
    by the step pre-hook, as before, and restores bitwise."""
    from ckpt.tiers.memory.copier import PendingCopy

    monkeypatch.setattr(PendingCopy, "done", lambda self: False)
    state = build()
    with CheckpointManager(root, memory_dir=shm_dir, overlap=True, state=state) as mgr:
        for step in range(1, 4):
            train_step(state)  # its optimizer.step() seals the step before
            assert step == 1 or mgr.memory.holds(step - 1)
            expected = expected_of(state)
            mgr.save(step, state)
            state["model"](torch.randn(64, 16))
            assert not mgr.memory.holds(step)
        mgr.wait()
        assert_restores(mgr, 3, expected)


def test_an_urgent_save_is_sealed_and_durable_without_a_step(root: Path, shm_dir: str) -> None:
    state = build()
    with CheckpointManager(root, memory_dir=shm_dir, overlap=True, state=state) as mgr:
        train_step(state)
        handle = mgr.save(1, state, urgent=True)
        assert mgr.memory.holds(1)  # a failure is predicted: nothing waits for the next step
        handle.wait("disk", timeout=120)


@pytest.mark.parametrize("how", ["positional", "keyword"])
def test_a_closure_step_waits_after_its_forward_and_backward(how: str) -> None:
    """LBFGS (and Lightning's automatic optimization) run the forward and backward inside
    step(closure): the wait comes after the closure, before any update, so the copy overlaps
    them."""
    model = nn.Linear(8, 1)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=3)
    order: list[str] = []
    hooks = StepHooks(lambda: order.append("wait"), lambda: None)
    hooks.watch([opt], [])
    x, y = torch.randn(16, 8), torch.randn(16, 1)

    def closure() -> torch.Tensor:
        order.append("closure")
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    before = model.weight.detach().clone()
    opt.step(closure) if how == "positional" else opt.step(closure=closure)
    # every call of the closure is followed by the wait (a no-op after the first, in the manager)
    assert len(order) > 2 and order == ["closure", "wait"] * (len(order) // 2), order
    assert not torch.equal(model.weight, before)  # the step still updated
    order.clear()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks.watch([sgd], [])
    sgd.step()  # no closure: the wait comes first, as before
    assert order == ["wait"]
    hooks.close()


def test_saving_every_step_with_a_closure_optimizer_restores_each_step_bitwise(root: Path, shm_dir: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(32, 4)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=4, history_size=3)
    state = {"model": model, "optim": opt}
    x, y = torch.randn(64, 32), torch.randn(64, 4)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    expected = {}
    with CheckpointManager(root, memory_dir=shm_dir, keep_last=100, overlap=True, state=state) as mgr:
        for step in range(1, 7):
            opt.step(closure)
            expected[step] = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
            mgr.save(step, state)
            assert not mgr.memory.holds(step)  # deferred: the next step's closure runs during the copy
        mgr.wait()
        for step in sorted({i["step"] for i in mgr.list()}):
            probe_model = nn.Linear(32, 4)
            probe = {"model": probe_model, "optim": torch.optim.LBFGS(probe_model.parameters(), max_iter=4,
                                                                      history_size=3)}
            assert mgr.restore(probe, step=step) == step
            assert_same({"model": probe_model.state_dict(), "optim": probe["optim"].state_dict()}, expected[step],
                        f"step {step}")

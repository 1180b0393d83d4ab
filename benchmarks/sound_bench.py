"""The cost of sound state (issue 49, docs/sound-state.md) and its false alarms, saving every step.

``--mode overhead``: one process trains an MLP (``--hidden``, ``--layers``, ``--batch``: the step
size the cost is stated for) and saves every step, in paired blocks of ``--block`` steps (ABBA
order), each block ending with ``mgr.wait()`` so the drains' work is inside it: arm A without
the checks (the drain's scope is empty: no finite check, no digest; no canary ``record``), arm
B with them (finite check fused with the drain's CRCs, the digest, ``record``). Reports B/A of
the block time: median, 95 % CI, and the step time; and B/A of the process's CPU time per
block (every thread: the drain's checks run off the training thread), which other load on a
shared machine moves far less than the wall time. Many short blocks resolve a small ratio
better than a few long ones (the CI comes from the pairs' count and spread). It then runs
``--cost-steps`` more steps with the checks' functions clocked (``sound_cost.py``): their thread
CPU per step, by check and thread, beside the process's CPU per step: the deterministic figure.
``--mode cost`` runs only that. One process has one replica: the digest is computed and
announced but compared with none, which is the same work per rank as in a job.

``--mode false-alarms``: ``--steps`` steps saving every step, deterministic, and every
``--restore-every`` steps a restore of the step before the newest (so a reference exists)
followed by the canary check. Counts commits not "ok" and canaries that failed: both must be 0.

    python benchmarks/sound_bench.py --mode overhead [--pairs 10] [--block 20] [--json out.json]
    python benchmarks/sound_bench.py --mode overhead --hidden 1024 --layers 4 --batch 1024 --pairs 40 --block 3
    python benchmarks/sound_bench.py --mode cost --hidden 1024 --layers 4 --batch 1024 [--cost-steps 20]
    python benchmarks/sound_bench.py --mode false-alarms [--steps 10000] [--restore-every 100]
"""
from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import abba, leaves_no_shm, paired_ratio, parser, run_meta, spread, write_json  # noqa: E402
from benchmarks.sound_cost import clocked  # noqa: E402
from ckpt import CheckpointManager  # noqa: E402
from ckpt.save import save_path, soundness  # noqa: E402


def model_of(hidden: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = [torch.nn.Linear(64, hidden), torch.nn.Tanh()]
    for _ in range(layers - 1):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.Tanh()]
    model = torch.nn.Sequential(*mods, torch.nn.Linear(hidden, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, batch: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    loss = model(torch.randn(batch, 64, generator=g)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def overhead(args, shm: str, root: Path) -> list[dict]:
    model, opt = model_of(args.hidden, args.layers)
    state = {"model": model, "opt": opt}
    real_scope = save_path.scope_of
    times: list[list[float]] = [[], []]
    cpu: list[list[float]] = [[], []]  # the process's CPU time, every thread's: what the checks cost the machine
    step = 0
    with CheckpointManager(root, memory_dir=shm, keep_last=2, state=state,
                           replicated=("model",)) as mgr:  # replicated: the model is compared as a replica
        for arms in [(0, 1)] + abba(args.pairs):  # the first pair warms up, then is dropped
            for arm in arms:
                save_path.scope_of = real_scope if arm else (lambda *a, **k: soundness.NOTHING)
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(args.block):
                    step += 1
                    loss = train_step(model, opt, step, args.batch)
                    if arm:
                        mgr.record(loss.item())
                    mgr.save(step, state)
                mgr.wait()
                times[arm].append(time.perf_counter() - t0)
                cpu[arm].append(time.process_time() - c0)
        save_path.scope_of = real_scope
    a, b = times[0][1:], times[1][1:]
    return [{"what": "checks on / off, block time", "state_bytes": state_bytes(model), "block_steps": args.block,
             "batch": args.batch, "step_s_off": spread([x / args.block for x in a]),
             "step_s_on": spread([x / args.block for x in b]), "ratio": paired_ratio(a, b),
             "cpu_ratio": paired_ratio(cpu[0][1:], cpu[1][1:]), "threads": torch.get_num_threads()},
            *cost(args, shm, root)]


def state_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.parameters()) * 3  # params + Adam's two moments


def cost(args, shm: str, root: Path) -> list[dict]:
    """``--cost-steps`` steps saving every step with the checks on and clocked (``sound_cost.py``):
    their thread CPU per step beside the process's CPU per step (both arms' work: training, the
    snapshot copies, the drains)."""
    model, opt = model_of(args.hidden, args.layers)
    state = {"model": model, "opt": opt}
    with CheckpointManager(root / "cost", memory_dir=shm, keep_last=2, state=state, replicated=("model",)) as mgr:
        for step in range(1, 3):  # warm-up: the slots, the layouts, the first drains
            mgr.record(train_step(model, opt, step, args.batch).item())
            mgr.save(step, state)
        mgr.wait()
        with clocked() as clock:
            t0, c0 = time.perf_counter(), time.process_time()
            for step in range(3, 3 + args.cost_steps):
                mgr.record(train_step(model, opt, step, args.batch).item())
                mgr.save(step, state)
            mgr.wait()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    spent = clock.per_step(args.cost_steps)
    process_ms = 1e3 * cpu / args.cost_steps
    return [{"what": "checks' thread CPU per step", "state_bytes": state_bytes(model), "batch": args.batch,
             "steps": args.cost_steps, "step_s": wall / args.cost_steps, "process_cpu_ms_per_step": process_ms,
             **spent, "checks_share_of_process_cpu": spent["checks_ms"] / process_ms,
             "trainer_thread_share_of_step": spent["trainer_thread_ms"] / (1e3 * wall / args.cost_steps)}]


def false_alarms(args, shm: str, root: Path) -> list[dict]:
    torch.use_deterministic_algorithms(True)
    model, opt = model_of(args.hidden, args.layers)
    state = {"model": model, "opt": opt}
    unsound, canaries, restores = 0, {}, 0
    step = trained = 0
    t0 = time.monotonic()
    with CheckpointManager(root, memory_dir=shm, keep_last=3, state=state) as mgr:
        while trained < args.steps:
            step += 1
            trained += 1
            outcome = mgr.record(train_step(model, opt, step, args.batch).item())
            if outcome is not None:
                canaries[outcome] = canaries.get(outcome, 0) + 1
            mgr.save(step, state)
            if trained % args.restore_every == 0:
                mgr.wait()
                unsound += sum(r["health"] in ("suspect", "unhealthy") for r in mgr.list())
                step = mgr.restore(state, step=step - 1)
                restores += 1
            if trained % 1000 == 0:
                print(f"{trained} steps: {restores} restores, canaries {canaries}, unsound {unsound}", flush=True)
    return [{"what": "clean run", "steps": trained, "restores": restores, "canaries": canaries,
             "unsound_listed": unsound, "wall_s": time.monotonic() - t0}]


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--mode", choices=("overhead", "cost", "false-alarms"), default="overhead")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64, help="samples a step (with --hidden, the step size)")
    ap.add_argument("--cost-steps", type=int, default=20, help="steps of the clocked run (--mode overhead, cost)")
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--block", type=int, default=20)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--restore-every", type=int, default=100)
    ap.add_argument("--durable-dir", default=None,
                    help="where the disk tier's folder is made (default: the system's temporary folder); "
                         "a tmpfs such as /dev/shm keeps the disk's writeback noise out of the paired blocks")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch's compute threads (default: torch's own choice, every core); 1 leaves the "
                         "drain a core, as a GPU node's trainer does")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    meta = run_meta(mode=args.mode, hidden=args.hidden, layers=args.layers, batch=args.batch,
                    threads=torch.get_num_threads(), durable_dir=args.durable_dir)
    shm = tempfile.mkdtemp(prefix="ckpt-sound-", dir="/dev/shm")
    root = Path(tempfile.mkdtemp(prefix="ckpt-sound-", dir=args.durable_dir))
    try:
        rows = {"overhead": overhead, "cost": cost, "false-alarms": false_alarms}[args.mode](args, shm, root)
        leaves_no_shm(shm)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    write_json(args.json, meta, rows, echo=True)


if __name__ == "__main__":
    main()

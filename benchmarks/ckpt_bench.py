"""Checkpoint engine benchmark: our save/restore against the physical floors and the
tools users would pick instead, in one run on the same bytes.

    python benchmarks/ckpt_bench.py                 # ~350M-param GPT + AdamW (~4 GB)
    python benchmarks/ckpt_bench.py --config tiny --repeats 3 --json out.json
    python benchmarks/ckpt_bench.py --device cuda   # state on the GPU

Floors: memcpy (copy of the same bytes into warm, pre-faulted memory; with --device
cuda, the device-to-host copy into warm pinned memory, and back for restores), disk write
(sequential write + fsync of the same bytes), disk read (sequential read of the same
bytes after dropping them from the page cache). Every disk restore drops the page
cache for its files first (posix_fadvise DONTNEED), so reads come from the device.
Medians of ``--repeats`` runs; machines are noisy, so read the ratios.
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import (  # noqa: E402
    disk_floor,
    drop_cache,
    leaves_no_shm,
    median_time,
    memcpy_floor,
    parser,
    run_meta,
    sync,
    write_json,
)
from ckpt import CheckpointManager  # noqa: E402
from ckpt.restore.reshard import load_shard  # noqa: E402
from ckpt.restore.state_load import load_into  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402


class Results(dict):
    """Measurements, echoed to stderr as they land (a 4 GB run takes minutes)."""

    def __setitem__(self, key: str, value: object) -> None:
        super().__setitem__(key, value)
        print(f"  {key} = {value:.3f}" if isinstance(value, float) else f"  {key} = {value}",
              file=sys.stderr, flush=True)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build_state(cfg: GPTConfig, device: str) -> tuple[dict, int]:
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()  # materialise exp_avg / exp_avg_sq
    opt.zero_grad(set_to_none=True)
    state = {"model": model, "optim": opt, "step": 1}
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    nbytes -= model.tok.weight.numel() * 4  # tied head weight counted once
    nbytes += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    return state, nbytes


def tensors_of(state: dict) -> list[torch.Tensor]:
    from ckpt.format.state import flatten
    return [t for _, t in flatten(state).tensors]


def main() -> None:
    ap = parser(__doc__, repeats=3)
    ap.add_argument("--config", choices=["medium", "tiny"], default="medium")
    ap.add_argument("--dir", default=None,
                    help="Directory on the disk to measure (default: a temp dir under /var/tmp).")
    ap.add_argument("--device", default="cpu", help="Where the training state lives: cpu or cuda.")
    args = ap.parse_args()
    meta = run_meta()
    torch.set_num_threads(os.cpu_count() or 1)

    base = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir or "/var/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir="/dev/shm"))
    res = Results(config=args.config, repeats=args.repeats, threads=torch.get_num_threads(), device=args.device)
    if args.device != "cpu":
        res["device_name"] = torch.cuda.get_device_name()
    try:
        state, nbytes = build_state(GPTConfig.medium() if args.config == "medium" else GPTConfig.tiny(), args.device)
        tensors = tensors_of(state)
        res["state_bytes"] = nbytes
        print(f"state: {nbytes / 2**30:.2f} GiB in {len(tensors)} tensors on {args.device}", file=sys.stderr)
        res["memcpy_s"], res["memcpy_back_s"], host = memcpy_floor(tensors, args.repeats)
        write_s, read_s = disk_floor(host, base, args.repeats)
        del host
        res["disk_write_s"], res["disk_read_s"] = write_s, read_s
        rss0 = rss_bytes()

        # ours
        mgr = CheckpointManager(base / "ours", keep_last=2, run="bench", memory_dir=str(shm), state=state)
        t0 = time.perf_counter()
        mgr.memory.wait_prepared()
        res["ours_prepare_s"] = time.perf_counter() - t0  # background in real use; shown for honesty
        first = mgr.save(1, state)
        res["ours_first_block_s"] = first.blocking_s
        first.wait()
        blocks, durable = [], []
        for step in range(2, 2 + args.repeats):
            h = mgr.save(step, state)
            blocks.append(h.blocking_s)
            h.wait()
            durable.append(h.durable_s["disk"])
        res["ours_block_s"] = statistics.median(blocks)
        res["ours_durable_disk_s"] = statistics.median(durable)
        res["ours_extra_rss_bytes"] = rss_bytes() - rss0
        res["ours_shm_bytes"] = sum(f.stat().st_size for f in shm.rglob("*.bin"))
        last = max(mgr.disk.list(), key=lambda i: i.id).id

        def restore_from(tier) -> None:
            load_into(state, load_shard(tier, last, state, threads=mgr.restore_threads))
            sync(tensors)
        res["ours_restore_memory_s"] = median_time(lambda: restore_from(mgr.memory), args.repeats)
        mgr.close()
        leaves_no_shm(shm)
        # A restore from disk runs in a fresh process, before any slot exists: give the
        # slots' memory back so the cold read has the page cache the floor had.
        shutil.rmtree(shm, ignore_errors=True)

        def restore_disk() -> None:
            drop_cache(base / "ours")
            restore_from(mgr.disk)
        res["ours_restore_disk_s"] = median_time(restore_disk, args.repeats)
        shutil.rmtree(base / "ours")

        # torch.save / torch.load
        ts = base / "torch.pt"

        def tsave() -> None:
            torch.save({"model": state["model"].state_dict(), "optim": state["optim"].state_dict()}, ts)
            fd = os.open(ts, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        res["torch_save_s"] = median_time(tsave, args.repeats)

        def tload() -> None:
            drop_cache(ts)
            sd = torch.load(ts, weights_only=True, map_location=args.device)
            state["model"].load_state_dict(sd["model"])
            state["optim"].load_state_dict(sd["optim"])
        res["torch_load_s"] = median_time(tload, args.repeats)
        ts.unlink()

        # torch.distributed.checkpoint
        def sd() -> dict:
            return {"model": state["model"].state_dict(), "optim": state["optim"].state_dict()}

        def dsave() -> None:
            shutil.rmtree(base / "dcp", ignore_errors=True)
            dcp.save(sd(), checkpoint_id=base / "dcp")
        res["dcp_save_s"] = median_time(dsave, args.repeats)

        def dload() -> None:
            drop_cache(base / "dcp")
            target = sd()
            dcp.load(target, checkpoint_id=base / "dcp")
            sync(tensors)
        res["dcp_load_s"] = median_time(dload, args.repeats)
        ablock, atotal = [], []
        for _ in range(args.repeats):
            shutil.rmtree(base / "dcp", ignore_errors=True)
            t0 = time.perf_counter()
            fut = dcp.async_save(sd(), checkpoint_id=base / "dcp")
            ablock.append(time.perf_counter() - t0)
            fut.result()
            atotal.append(time.perf_counter() - t0)
        res["dcp_async_block_s"] = statistics.median(ablock)
        res["dcp_async_total_s"] = statistics.median(atotal)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)

    report(res)
    write_json(args.json, meta, **res)


def report(r: dict) -> None:
    gb = r["state_bytes"] / 1e9
    m, mb, w, rd = r["memcpy_s"], r["memcpy_back_s"], r["disk_write_s"], r["disk_read_s"]
    cuda = r.get("device", "cpu") != "cpu"
    rows = [
        ("memcpy floor (device→pinned host)" if cuda else "memcpy floor (warm memory)", m, "1.00x memcpy"),
        ("memcpy floor back (pinned host→device)" if cuda else "memcpy floor back (warm memory)", mb,
         "1.00x memcpy back"),
        ("disk floor: sequential write + fsync", w, "1.00x disk write"),
        ("disk floor: sequential cold read", rd, "1.00x disk read"),
        ("ours: save() blocking, first (slots prepared)", r["ours_first_block_s"],
         f"{r['ours_first_block_s'] / m:.2f}x memcpy"),
        ("ours: save() blocking, later (median)", r["ours_block_s"], f"{r['ours_block_s'] / m:.2f}x memcpy"),
        ("ours: save() → durable on disk", r["ours_durable_disk_s"],
         f"{w / r['ours_durable_disk_s']:.2f}x disk-floor throughput"),
        ("torch.save (+fsync)", r["torch_save_s"], f"{r['torch_save_s'] / m:.1f}x memcpy (all blocking)"),
        ("dcp.save", r["dcp_save_s"], f"{r['dcp_save_s'] / m:.1f}x memcpy (all blocking)"),
        ("dcp.async_save: blocking", r["dcp_async_block_s"], f"{r['dcp_async_block_s'] / m:.1f}x memcpy"),
        ("dcp.async_save: total", r["dcp_async_total_s"], ""),
        ("ours: restore from memory", r["ours_restore_memory_s"],
         f"{r['ours_restore_memory_s'] / mb:.2f}x memcpy back"),
        ("ours: restore from disk (cold)", r["ours_restore_disk_s"], f"{r['ours_restore_disk_s'] / rd:.2f}x disk read"),
        ("torch.load (cold)", r["torch_load_s"], f"{r['torch_load_s'] / rd:.2f}x disk read"),
        ("dcp.load (cold)", r["dcp_load_s"], f"{r['dcp_load_s'] / rd:.2f}x disk read"),
    ]
    print(f"\nstate {gb:.2f} GB on {r.get('device_name', 'cpu')}, {r['threads']} threads, median of {r['repeats']}\n")
    print(f"| {'what':46} | {'seconds':>8} | {'GB/s':>6} | ratio |")
    print(f"|{'-' * 48}|{'-' * 10}|{'-' * 8}|-------|")
    for name, s, ratio in rows:
        print(f"| {name:46} | {s:8.3f} | {gb / s:6.2f} | {ratio} |")
    print(f"\nours: prepare (allocate + pre-fault 2 slots, background) {r['ours_prepare_s']:.2f} s; "
          f"shared memory {r['ours_shm_bytes'] / r['state_bytes']:.2f}x the state; "
          f"extra process RSS {r['ours_extra_rss_bytes'] / r['state_bytes']:.2f}x the state")


if __name__ == "__main__":
    main()

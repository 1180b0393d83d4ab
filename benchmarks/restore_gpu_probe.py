"""Where a restore from memory to a GPU spends its time: the whole verified restore
against its parts, each timed alone on the same slot and the same parameters: the staged
device reads of every piece (copy, check on the device, scatter; pieces under a MiB checked
on the host: ``staged_*``; all on the device: ``*_all_on_device``) at several block sizes,
the device's CRC32C alone (``device_crc``), CRC32C of every piece on the host
(``host_crc_only``), the reads without verification (``read_noverify``), and the bare DMA
from the pinned slot (``dma``), against the floor (pinned host → device of the same bytes,
``cudaMemcpyAsync`` into preallocated tensors). Medians of 3. Not a test: nothing here
asserts a speed.

    PYTHONPATH=. python benchmarks/restore_gpu_probe.py [--config medium|tiny] [--json out.json]

Needs CUDA for the DMA rows and the floor; on a CPU it times the host parts only.
"""
from __future__ import annotations

import cProfile
import pstats
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.ckpt_bench import build_state, tensors_of  # noqa: E402
from benchmarks.harness import leaves_no_shm, median_time, memcpy_floor, parser, run_meta, sync, write_json  # noqa: E402
from ckpt import CheckpointManager  # noqa: E402
from ckpt.format.device_crc import RowCRC  # noqa: E402
from ckpt.format.device_reads import HOST_CHECK_BELOW, DevicePiece, StagedDeviceReads  # noqa: E402
from ckpt.format.read_items import read_items  # noqa: E402
from ckpt.format.state import tensor_targets  # noqa: E402
from ckpt.format.tensor_io import read_tensors  # noqa: E402
from ckpt.format.verify import verify_shard  # noqa: E402
from ckpt.restore.execute import open_shard  # noqa: E402
from ckpt.restore.reshard import load_shard  # noqa: E402
from ckpt.restore.state_load import load_into  # noqa: E402
from examples.gpt import GPTConfig  # noqa: E402


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--config", choices=["medium", "tiny"], default="medium")
    ap.add_argument("--profile", action="store_true", help="also print where one restore spends its Python time")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    state, nbytes = build_state(GPTConfig.medium() if args.config == "medium" else GPTConfig.tiny(), device)
    tensors = tensors_of(state)
    base, shm = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp(dir="/dev/shm"))
    meta = run_meta()
    out: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "state_bytes": nbytes}
    try:
        mgr = CheckpointManager(base / "ckpt", keep_last=2, run="probe", memory_dir=str(shm), state=state)
        mgr.memory.wait_prepared()
        mgr.save(1, state).wait()
        last = max(mgr.memory.list(), key=lambda i: i.id).id
        reader = open_shard(mgr.memory, last, 0)
        items = read_items(reader.manifest)
        targets = tensor_targets(state, reader.manifest.tree)
        out.update(slot_is_pinned=bool(reader.tensor(0, 1).is_pinned()), pieces=len(items),
                   chunk_bytes=reader.manifest.chunk_bytes, targets_on_gpu=sum(t.is_cuda for t in targets.values()))
        threads = 8

        def restore() -> None:
            load_into(state, load_shard(mgr.memory, last, state, threads=threads))
            sync(tensors)

        def noverify() -> None:
            read_tensors(reader, targets, verify=False, threads=threads)
            sync(tensors)

        out["restore_s"] = median_time(restore, 3)
        out["read_noverify_s"] = median_time(noverify, 3)
        out["host_crc_only_s"] = median_time(lambda: verify_shard(reader, threads=threads), 3)
        if device == "cuda":
            pieces = [DevicePiece(reader.tensor(i.tensor.offset + i.lo, i.hi - i.lo),
                                  targets[i.tensor.id].reshape(-1).view(torch.uint8)[i.lo:i.hi],
                                  i.tensor.checksums[i.lo // reader.manifest.chunk_bytes], i)
                      for i in items if i.tensor.id in targets and targets[i.tensor.id].is_cuda]
            out["staged_bytes"] = sum(p.host.numel() for p in pieces if p.host.numel() >= HOST_CHECK_BELOW)
            out["host_checked_pieces"] = sum(0 < p.host.numel() < HOST_CHECK_BELOW for p in pieces)
            for block, depth, below in ((128, 3, HOST_CHECK_BELOW), (128, 4, HOST_CHECK_BELOW),
                                        (256, 3, HOST_CHECK_BELOW), (128, 3, 0)):
                staged = StagedDeviceReads(torch.device("cuda"), block_bytes=block << 20, depth=depth,
                                           host_check_below=below, threads=threads)
                out[f"staged_block{block}M_depth{depth}{'_all_on_device' if not below else ''}_s"] = median_time(
                    lambda staged=staged: staged.run(pieces, lambda p: AssertionError(p.tag)), 3)
            if args.profile:
                profile("restore", restore)
                profile("staged reads", lambda: StagedDeviceReads(torch.device("cuda"), threads=threads).run(
                    pieces, lambda p: AssertionError(p.tag)))
            rows = torch.randint(0, 256, (16, reader.manifest.chunk_bytes), dtype=torch.uint8, device="cuda")
            crc = RowCRC(rows.shape[1], rows.device)

            def device_crc() -> None:
                for _ in range(-(-out["staged_bytes"] // rows.numel())):
                    crc(rows)
                torch.cuda.synchronize()
            device_crc()
            out["device_crc_s"] = median_time(device_crc, 3)

            def dma() -> None:
                stream = torch.cuda.Stream()
                with torch.cuda.stream(stream):
                    for i in items:
                        if i.tensor.id in targets:
                            dst = targets[i.tensor.id].reshape(-1).view(torch.uint8)[i.lo:i.hi]
                            dst.copy_(reader.tensor(i.tensor.offset + i.lo, i.hi - i.lo), non_blocking=True)
                stream.synchronize()
            out["dma_s"], out["floor_back_s"] = median_time(dma, 3), memcpy_floor(tensors, 3)[1]
        reader.close()
        mgr.close()
        leaves_no_shm(shm)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    floor_s = out.get("floor_back_s")
    print(f"state {nbytes / 1e9:.2f} GB on {out['device']}, {out['pieces']} pieces")
    for k, v in out.items():
        if k.endswith("_s"):
            print(f"  {k:28} {v:8.3f} s" + (f"  {v / floor_s:5.2f}x the floor" if floor_s else ""))
    write_json(args.json, meta, **out)


def profile(what: str, fn: Callable[[], None]) -> None:
    """Print the 25 functions that take the most of one run of ``fn`` (cProfile, own time)."""
    prof = cProfile.Profile()
    prof.runcall(fn)
    print(f"== profile: {what}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()

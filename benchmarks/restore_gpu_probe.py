"""Where a restore from memory to a GPU spends its time: the whole verified restore
against its parts, each timed alone on the same slot and the same parameters: CRC32C of
every piece on the host (``crc_only``), the reads without verification
(``read_noverify``), and the bare DMA from the pinned slot (``dma``), against the floor
(pinned host → device of the same bytes, ``cudaMemcpyAsync`` into preallocated tensors),
at 4, 8 and 16 threads. Medians of 3. Not a test: nothing here asserts a speed.

    PYTHONPATH=. python benchmarks/restore_gpu_probe.py [--config medium|tiny] [--json out.json]

Needs CUDA for the DMA rows and the floor; on a CPU it times the host parts only.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.ckpt_bench import build_state, median_time, sync, tensors_of  # noqa: E402
from ckpt import CheckpointManager  # noqa: E402
from ckpt.format.read_items import read_items  # noqa: E402
from ckpt.format.state import tensor_targets  # noqa: E402
from ckpt.format.tensor_io import read_tensors  # noqa: E402
from ckpt.format.verify import verify_shard  # noqa: E402
from ckpt.restore.execute import open_shard, read_shard  # noqa: E402
from ckpt.restore.state_load import load_into  # noqa: E402
from examples.gpt import GPTConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=["medium", "tiny"], default="medium")
    ap.add_argument("--json", default=None, help="also write the results as JSON to this path")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    state, nbytes = build_state(GPTConfig.medium() if args.config == "medium" else GPTConfig.tiny(), device)
    tensors = tensors_of(state)
    base, shm = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp(dir="/dev/shm"))
    out: dict = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                 "state_bytes": nbytes}
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
        for threads in (4, 8, 16):
            def restore(threads: int = threads) -> None:
                load_into(state, read_shard(mgr.memory, last, 0, state=state, threads=threads))
                sync(tensors)

            def noverify(threads: int = threads) -> None:
                read_tensors(reader, targets, verify=False, threads=threads)
                sync(tensors)

            def crc_only(threads: int = threads) -> None:
                verify_shard(reader, threads=threads)
            out[f"restore_threads{threads}_s"] = median_time(restore, 3)
            out[f"read_noverify_threads{threads}_s"] = median_time(noverify, 3)
            out[f"crc_only_threads{threads}_s"] = median_time(crc_only, 3)
        if device == "cuda":
            def dma() -> None:
                stream = torch.cuda.Stream()
                with torch.cuda.stream(stream):
                    for i in items:
                        if i.tensor.id in targets:
                            dst = targets[i.tensor.id].reshape(-1).view(torch.uint8)[i.lo:i.hi]
                            dst.copy_(reader.tensor(i.tensor.offset + i.lo, i.hi - i.lo), non_blocking=True)
                stream.synchronize()
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]

            def floor() -> None:
                for h, t in zip(host, tensors):
                    t.copy_(h, non_blocking=True)
                torch.cuda.synchronize()
            out["dma_s"], out["floor_back_s"] = median_time(dma, 3), median_time(floor, 3)
        reader.close()
        mgr.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    floor_s = out.get("floor_back_s")
    print(f"state {nbytes / 1e9:.2f} GB on {out['device']}, {out['pieces']} pieces")
    for k, v in out.items():
        if k.endswith("_s"):
            print(f"  {k:28} {v:8.3f} s" + (f"  {v / floor_s:5.2f}x the floor" if floor_s else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

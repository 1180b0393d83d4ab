"""CPU milliseconds to open one 70B model's shard manifest (248 KB, 723 DTensors: ``scale_listing``'s,
rank 12,345 of 16,384) as ``ckpt verify --manifests-only`` opens it: its CRC, then
``ShardManifest.from_bytes``; beside it ``json.loads`` of the same bytes (the floor of any check
in Python). Medians and minimums of ``--repeat`` runs, CPU time of this process (a loaded
machine inflates wall time more). Run it with PYTHONPATH at another checkout to compare trees.

    python benchmarks/manifest_parse.py [--repeat 31] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.scale_listing import Shards  # noqa: E402
from ckpt.format.checksum import crc32c_of  # noqa: E402
from ckpt.format.manifest import ShardManifest  # noqa: E402


def cpu_ms(fn, repeat: int) -> dict:
    """Median and minimum CPU milliseconds of ``fn()``."""
    runs = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        runs.append((time.process_time() - t0) * 1000)
    runs.sort()
    return {"median_ms": round(runs[len(runs) // 2], 2), "min_ms": round(runs[0], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=31)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    raw = Shards(16384).raw(12345)
    out = {"manifest_bytes": len(raw), "json_loads": cpu_ms(lambda: json.loads(raw), args.repeat),
           "open": cpu_ms(lambda: (crc32c_of(raw), ShardManifest.from_bytes(raw)), args.repeat)}
    print(json.dumps(out) if args.json else
          f"{len(raw)} bytes: json.loads {out['json_loads']['median_ms']} ms (min {out['json_loads']['min_ms']}), "
          f"CRC + from_bytes {out['open']['median_ms']} ms (min {out['open']['min_ms']})")


if __name__ == "__main__":
    main()

"""What every benchmark repeats, once: timing and paired blocks (timing), the JSON ``meta``
block and results file (meta), the physical floors (floors), the command line (cli), the
engines' interpreter (engines), the worker processes a driver starts (procs) and the check that
a run left no checkpoint shared memory behind (shm).
Only the standard library at import time: drivers run in the engines' venv too."""
from benchmarks.harness.cli import parser
from benchmarks.harness.floors import disk_floor, drop_cache, memcpy_floor, sync
from benchmarks.harness.meta import run_meta, write_json
from benchmarks.harness.shm import leaves_no_shm
from benchmarks.harness.timing import abba, median_of, median_time, paired_ratio, spread, timed

__all__ = ["abba", "disk_floor", "drop_cache", "leaves_no_shm", "median_of", "median_time", "memcpy_floor",
           "paired_ratio", "parser", "run_meta", "spread", "sync", "timed", "write_json"]

"""What the Lightning and Hugging Face examples share: their command line, joining
torchrun's process group, and the fault injector their tests drive."""
from __future__ import annotations

import argparse
import logging
import os
import signal
from pathlib import Path

import torch

from ckpt.distributed import init_process_group

SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM}
RAISE = "raise"  # a crash by an exception (the program's own error, or a peer's failure)


def parse_args(doc: str) -> argparse.Namespace:
    """The examples' options; also sets up logging and one CPU thread (a tiny model)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="checkpoint directory (local-disk tier)")
    ap.add_argument("--steps", type=int, default=18)
    ap.add_argument("--every", type=int, default=4, help="periodic checkpoint interval, optimizer steps")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batches-per-epoch", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--memory-dir", default="/dev/shm")
    ap.add_argument("--faults", default="", help="fault injection for tests, e.g. '6:kill,10:term,12:raise'")
    ap.add_argument("--out", default=None, help="write the final weights digest here (JSON)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s rank{os.environ.get('RANK', '0')} %(name)s %(message)s")
    torch.set_num_threads(1)
    return args


def world_size() -> int:
    """Join torchrun's process group when launched by it (restart-safe, and before the
    Trainer, which then uses this group instead of building one that a restart breaks);
    returns the number of ranks."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        init_process_group()
    return world


class Faults:
    """``"6:kill,10:term,12:raise"``: SIGKILL this process when training completes step 6,
    SIGTERM it (a preemption notice) at step 10, raise a RuntimeError at step 12. Each fault fires once per checkpoint
    root, remembered by a marker file there, so a restarted run goes past it. Under
    torchrun only the last rank faults: the others must follow it."""

    def __init__(self, spec: str, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.at = {int(step): kind for step, kind in (f.split(":") for f in spec.split(",") if f)}
        unknown = set(self.at.values()) - {*SIGNALS, RAISE}
        if unknown:
            raise SystemExit(f"--faults: unknown kind(s) {sorted(unknown)} (one of {', '.join([*SIGNALS, RAISE])})")
        if int(os.environ.get("RANK", "0")) != int(os.environ.get("WORLD_SIZE", "1")) - 1:
            self.at = {}

    def fire(self, step: int) -> None:
        """Call at the end of each step with the number of steps completed."""
        marker = self.root / f"fault-{step}.fired"
        if step in self.at and not marker.exists():
            self.root.mkdir(parents=True, exist_ok=True)
            marker.touch()
            if self.at[step] == RAISE:
                logging.info("fault injector: RuntimeError at step %d", step)
                raise RuntimeError(f"fault injector: an exception at step {step}")
            logging.info("fault injector: %s at step %d", SIGNALS[self.at[step]].name, step)
            os.kill(os.getpid(), SIGNALS[self.at[step]])

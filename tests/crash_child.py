"""A trainer that saves checkpoints in a loop until it is SIGKILLed (crash-consistency tests).

    python tests/crash_child.py serve

runs a *zygote*: it imports torch and ckpt once, then for every JSON request on
stdin forks a fresh trainer process, waits for it, SIGKILLs it when told to, reaps
it, and answers one JSON line on stdout: ``{"pid", "exit", "signal", "killed_by"}``.
Each trainer is a real, separate process (its own locks, threads, mappings) that
dies by a real SIGKILL; forking only saves the 3-4 s of importing torch per kill.

A request (see ``CrashServer.run`` in tests/ckpt_helpers.py):

    root, shm, run      where the trainer's CheckpointManager lives
    events              file the trainer appends its log lines to (O_APPEND, unbuffered):
                        "restored N|None", "saving N", "saved N" (save() returned),
                        "durable" (wait() returned), "fault CALL WHEN DETAIL"
    steps               how many steps to save (default: until killed)
    keep_last, salt, restore (default true: resume from the newest checkpoint like a
                        real trainer), pause (max random sleep between saves), seed
    kill_after          seconds after the fork at which the zygote SIGKILLs the trainer
    kill_on_event       SIGKILL the trainer as soon as this exact line is in its log
    hang_at_end         after the last save and wait(), sleep until killed
    fault               fault injection, see ``install_fault``
    timeout             backstop: SIGKILL and report ``timed_out``

Fault injection (``fault``) is how a test hits an exact moment deterministically:
it wraps one OS call *in this trainer process only* (the engine is not modified and
still does the real work) and, at the ``nth`` call whose file matches ``match``,
SIGKILLs the process (``action: kill``) or parks that thread forever (``hang``):

    call  rename | unlink | fsync | pwrite    the os.* function
          copy                                ckpt.tiers.memory.copier.TensorCopier.copy (the snapshot)
    when  before | after                      around the real call
          half                                pwrite/copy: do half the work, then act
"""
from __future__ import annotations

import itertools
import json
import os
import random
import signal
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckpt import CheckpointManager  # noqa: E402
from ckpt.tiers.memory.copier import TensorCopier  # noqa: E402
from tests.ckpt_helpers import step_state  # noqa: E402


def _describe(arg: object) -> str:
    if isinstance(arg, int) and not isinstance(arg, bool):
        try:
            return os.readlink(f"/proc/self/fd/{arg}")
        except OSError:
            return ""
    if isinstance(arg, (str, os.PathLike)):
        return os.fspath(arg)
    return ""


def install_fault(spec: dict, log) -> None:
    call, match, nth = spec["call"], spec.get("match", ""), int(spec.get("nth", 1))
    when, action = spec.get("when", "before"), spec.get("action", "kill")
    hits = itertools.count(1)

    def act(detail: str) -> None:
        log(f"fault {call} {when} {detail}")
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:
            time.sleep(3600)

    if call == "copy":
        original_copy = TensorCopier.copy

        def copy(self, pairs):
            if next(hits) == nth:
                original_copy(self, pairs[: len(pairs) // 2])
                act(f"{len(pairs) // 2} of {len(pairs)} tensors copied")
            return original_copy(self, pairs)

        TensorCopier.copy = copy
        return

    original = getattr(os, call)

    def wrapper(*args, **kwargs):
        names = " ".join(_describe(a) for a in args[:2])
        if match in names and next(hits) == nth:
            if when == "before":
                act(names)
            if when == "half":
                fd, buf, offset = args
                view = memoryview(buf).cast("B")
                original(fd, view[: len(view) // 2], offset)
                act(f"{names}: {len(view) // 2} of {len(view)} bytes written")
            try:
                return original(*args, **kwargs)
            finally:  # even if the call failed (unlinking a seal that is not there)
                act(names)
        return original(*args, **kwargs)

    setattr(os, call, wrapper)


def trainer(cfg: dict) -> None:
    fd = os.open(cfg["events"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def log(line: str) -> None:
        os.write(fd, (line + "\n").encode())

    if cfg.get("fault"):
        install_fault(cfg["fault"], log)
    rng = random.Random(cfg.get("seed", 0))
    mgr = CheckpointManager(cfg["root"], keep_last=cfg.get("keep_last", 2), memory_dir=cfg["shm"], run=cfg.get("run"))
    restored = mgr.restore({}) if cfg.get("restore", True) else None
    log(f"restored {restored}")
    first = (restored or 0) + 1
    mgr.prepare(step_state(first))
    steps = cfg.get("steps")
    for step in itertools.count(first) if steps is None else range(first, first + steps):
        state = step_state(step, cfg.get("salt", 0))
        log(f"saving {step}")
        mgr.save(step, state)
        log(f"saved {step}")
        if cfg.get("pause"):
            time.sleep(rng.uniform(0, cfg["pause"]))
    mgr.wait()
    log("durable")
    if cfg.get("hang_at_end"):
        while True:
            time.sleep(3600)
    mgr.close()


def _logged(path: str, line: str) -> bool:
    try:
        return line in Path(path).read_text().split("\n")
    except FileNotFoundError:
        return False


def supervise(pid: int, cfg: dict) -> dict:
    """Wait for the trainer; SIGKILL it on cue; always reap it."""
    t0 = time.monotonic()
    kill_at = t0 + cfg["kill_after"] if cfg.get("kill_after") is not None else float("inf")
    give_up = t0 + cfg["timeout"]
    killed_by = None
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        now = time.monotonic()
        cue = now >= kill_at or (cfg.get("kill_on_event") and _logged(cfg["events"], cfg["kill_on_event"]))
        if cue or now >= give_up:
            killed_by = "parent" if cue else "timeout"
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            break
        time.sleep(0.0005)
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    if sig is not None and killed_by is None:
        killed_by = "self"
    return {"pid": pid, "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None, "signal": sig,
            "killed_by": killed_by, "seconds": round(time.monotonic() - t0, 3)}


def serve() -> None:
    for line in sys.stdin:
        cfg = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                trainer(cfg)
            except BaseException:
                traceback.print_exc()
                code = 3
            finally:
                sys.stderr.flush()
                os._exit(code)
        print(json.dumps(supervise(pid, cfg)), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] != ["serve"]:
        sys.exit(__doc__)
    serve()

"""Start a node launcher's workers by forking a template that has imported torch already.

Every worker (a first start, a spare, a replacement, a relaunch) used to be ``python <command>``:
2.5-3.4 s of CPU importing torch before it could join. A template process (``python -m
ckpt.inprocess.preload MODULES``, started with the launcher) imports ``--preload`` once (default
``torch``); each worker is a fork of it that then behaves as ``python <command>`` would:

- it is the launcher's own child (the template forks twice and the launcher, a child subreaper,
  adopts the grandchild), so the launcher waits for it, kills it by pid and reads its exit code
  (``sys.exit(n)``: n, an uncaught exception: 1, a signal: -signum) as before, and the worker's
  parent-death signal (``runner.die_with_launcher``) names the launcher;
- its environment is the launcher's for it (RANK, WORLD_SIZE, MASTER_*, OMP_NUM_THREADS...) before
  any user code runs, torch's thread count follows OMP_NUM_THREADS (OpenMP read it in the template),
  ``random`` and numpy's global generator are reseeded from the OS;
- ``sys.argv``, ``sys.path[0]`` and ``__main__`` are a script's (or ``-m``'s, through runpy),
  stdin/stdout/stderr and signal dispositions the launcher's, no other descriptor of the
  launcher's (its store socket) is open, and it ends through the interpreter's own shutdown
  (threads joined, atexit handlers run, streams flushed).

multiprocessing's forkserver does not fit: its children are ``Process`` objects
(``current_process()`` is not MainProcess, ``parent_process()`` is set), re-run the launcher's
``__main__`` as ``__mp_main__``, skip atexit through ``os._exit``, read stdin from /dev/null and are
the forkserver's children, not the launcher's. A template that cannot start or dies leaves the
launcher on ``subprocess.Popen`` (logged once); ``--no-preload`` or ``CKPT_INPROCESS_NO_PRELOAD=1``
chooses Popen from the start. What differs from a fresh interpreter: the workers of a node share
the template's str hash seed (unless PYTHONHASHSEED is set) and the modules it imported.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib
import io
import json
import logging
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import time
import types
from importlib.machinery import SourceFileLoader

log = logging.getLogger("ckpt.inprocess.preload")
NO_PRELOAD_ENV = "CKPT_INPROCESS_NO_PRELOAD"
# how long after the launcher's start its first workers may wait for the template's imports
# (then they are Popen'd: another node's launcher waits 60 s for this one's first tick)
READY_S = 30.0
_PR_SET_CHILD_SUBREAPER = 36
# as torchrun: one OpenMP thread per worker unless the user says otherwise (several workers share the
# node's cores; the same thread count also makes a run bitwise equal under either)
WORKER_DEFAULTS = {"OMP_NUM_THREADS": "1"}


def add_options(ap: argparse.ArgumentParser) -> None:
    """The launcher's ``--preload MODULES`` and ``--no-preload``."""
    ap.add_argument("--preload", default="torch", help="modules (comma-separated) a template process imports once; "
                    "each worker is a fork of it (docs/inprocess.md), not an interpreter that imports them again")
    ap.add_argument("--no-preload", action="store_true",
                    help=f"start every worker as `python COMMAND` (also: {NO_PRELOAD_ENV}=1)")


def starter(args: argparse.Namespace) -> Starter:
    """The launcher's: its template (if any) starts with the environment its workers share."""
    modules = [] if args.no_preload else [m for m in args.preload.split(",") if m]
    return Starter(modules, {**WORKER_DEFAULTS, **os.environ})


class Forked:
    """The part of ``subprocess.Popen`` a node launcher uses, for a worker forked from the template
    (the launcher's child: it waits for it as Popen would)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.005)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def forkable(command: list[str]) -> bool:
    """Whether a template can run ``command`` as ``python <command>`` would: a script file, or ``-m MODULE``."""
    if command[:1] == ["-m"]:
        return len(command) > 1
    return bool(command) and not command[0].startswith("-") and os.path.isfile(command[0])


class Starter:
    """Starts workers: forked from a template when there is one, else (or once it failed) with Popen."""

    def __init__(self, modules: list[str], env: dict[str, str]) -> None:
        self.sock: socket.socket | None = None
        self.template: subprocess.Popen | None = None
        self.ready, self.ready_by = False, time.monotonic() + READY_S
        if not modules or os.environ.get(NO_PRELOAD_ENV, "") not in ("", "0"):
            return
        try:  # orphans of this process become its children: a worker forked twice is the launcher's
            if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
            ours, theirs = socket.socketpair()
            self.template = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno()), *modules],
                                             env=env, pass_fds=[theirs.fileno()])
            theirs.close()
            self.sock, self.reader = ours, ours.makefile("rb")
        except (OSError, AttributeError) as e:
            log.warning("workers start with Popen: no preload template (%s)", e)

    def __call__(self, command: list[str], env: dict[str, str]) -> subprocess.Popen | Forked:
        """Start ``python <command>`` with ``env``."""
        if self.sock is not None and forkable(command):
            pid = self._fork(command, env)
            if pid is not None:
                return Forked(pid)
        return subprocess.Popen([sys.executable, *command], env=env)

    def _fork(self, command: list[str], env: dict[str, str]) -> int | None:
        assert self.sock is not None
        try:
            if not self.ready:
                if not select.select([self.sock], [], [], max(0.0, self.ready_by - time.monotonic()))[0]:
                    log.info("the preload template is still importing: this worker starts with Popen")
                    return None
                if self.reader.readline() != b"ready\n":
                    return self._fail("its imports failed")
                self.ready = True
                self.sock.settimeout(60.0)
            self.sock.sendall(json.dumps({"argv": command, "env": env, "cwd": os.getcwd()}).encode() + b"\n")
            answer = self.reader.readline()
            return int(json.loads(answer)["pid"]) if answer else self._fail("it ended")
        except (OSError, ValueError, KeyError) as e:
            return self._fail(str(e) or type(e).__name__)

    def _fail(self, why: str) -> None:
        log.warning("the preload template failed (%s): workers start with Popen from now on", why)
        self.close()

    def __enter__(self) -> Starter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the template (it also ends when this process does: its socket closes)."""
        if self.sock is not None:
            self.reader.close()  # the socket closes with its last file
            self.sock.close()
            self.sock = None
        if self.template is not None:
            try:
                self.template.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.template.kill()
                self.template.wait()


def _serve(fd: int, modules: list[str]) -> None:
    """The template: import ``modules``, then fork one worker per request line until the launcher
    closes the socket. Runs on in a worker only into ``_become``, which never returns."""
    for name in modules:
        importlib.import_module(name)
    launcher = os.getppid()
    ctl = socket.socket(fileno=fd)
    lines = ctl.makefile("rb")
    if not _say(ctl, b"ready\n"):
        return
    while True:
        try:
            line = lines.readline()
        except OSError:  # the launcher went (a reset: it never read "ready")
            return
        if not line:
            return
        request = json.loads(line)
        r, w = os.pipe()
        middle = os.fork()
        if middle == 0:
            worker = os.fork()
            if worker == 0:
                os.close(r)
                os.close(w)
                lines.close()
                ctl.close()
                _become(request, launcher)
            os.write(w, str(worker).encode())
            os._exit(0)  # its child, an orphan now, is adopted by the launcher (a child subreaper)
        os.close(w)
        os.waitpid(middle, 0)
        with os.fdopen(r, "rb") as pipe:
            pid = int(pipe.read() or b"0")
        if not _say(ctl, json.dumps({"pid": pid} if pid else {}).encode() + b"\n"):
            return


def _say(ctl: socket.socket, line: bytes) -> bool:
    """Send ``line`` to the launcher; False once it is gone."""
    try:
        ctl.sendall(line)
    except OSError:
        return False
    return True


def _become(request: dict, launcher: int) -> None:
    """Be ``python <argv>`` in ``cwd`` with ``env``; end through the interpreter's own shutdown
    (a SystemExit that leaves ``_serve``)."""
    deadline = time.monotonic() + 10.0
    while os.getppid() != launcher and time.monotonic() < deadline:  # the launcher adopts it
        time.sleep(0.001)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _fresh_state()
    argv = request["argv"]
    main = sys.modules["__main__"] = types.ModuleType("__main__")  # a fresh one, not the template's
    main.__dict__.update(__builtins__=__builtins__, __cached__=None, __annotations__={})
    try:
        if argv[0] == "-m":
            sys.argv, sys.path[0] = ["-m", *argv[2:]], os.getcwd()
            runpy._run_module_as_main(argv[1])  # what `python -m` runs, in sys.modules["__main__"]
        else:
            sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.realpath(argv[0]))
            _run_script(main, argv[0])
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # as the interpreter prints it, without this module's frames
        tb = e.__traceback__.tb_next if e.__traceback__ else None
        tb = tb.tb_next if tb and argv[0] != "-m" else tb
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        raise SystemExit(1) from None
    raise SystemExit(0)


def _fresh_state() -> None:
    """What a fresh interpreter would have read from this environment: torch's thread count
    (OpenMP read OMP_NUM_THREADS when the template loaded it), and numpy's global generator's
    seed (``random`` reseeds itself after a fork)."""
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0 and torch.get_num_threads() != int(threads):
        torch.set_num_threads(int(threads))
    if (np_random := sys.modules.get("numpy.random")) is not None:
        np_random.seed()


def _run_script(main: types.ModuleType, path: str) -> None:
    """Run ``path`` in ``main``, as ``python path`` does (it stays ``__main__`` for the atexit
    handlers and threads that outlive it)."""
    main.__dict__.update(__file__=path, __loader__=SourceFileLoader("__main__", path))
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    exec(code, main.__dict__)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2:])

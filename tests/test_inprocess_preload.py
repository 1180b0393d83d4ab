"""Workers forked from the launcher's preloaded template (ckpt/inprocess/preload.py) behave as
``python <command>``: the same argv, sys.path[0], ``__main__``, environment, signal dispositions,
descriptors and parent as a Popen'd twin, torch's thread count from OMP_NUM_THREADS, atexit handlers
at exit, and Popen's exit codes. A launcher-like driver process holds the template (it makes itself a
child subreaper, which this pytest process must not become)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROBE = """
import atexit, json, os, random, signal, sys, time
report, mode = sys.argv[1], sys.argv[2]
fds = {}
for fd in os.listdir("/proc/self/fd"):
    try:
        fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        pass  # listdir's own descriptor, closed by now
torch = sys.modules.get("torch")
signals = {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals() if isinstance(s, signal.Signals)}
names = sorted(globals())
json.dump({"argv": sys.argv, "globals": names, "path0": sys.path[0], "name": __name__, "file": __file__,
           "main_is_me": sys.modules["__main__"].__dict__ is globals(), "ppid": os.getppid(),
           "env": {k: os.environ.get(k) for k in ("RANK", "OMP_NUM_THREADS", "MASTER_PORT")},
           "fds": fds, "signals": signals, "random": random.random(),
           "threads": torch.get_num_threads() if torch else None}, open(report, "w"))
atexit.register(lambda: open(report + ".atexit", "w").write(__name__))
if mode == "exit7":
    sys.exit(7)
if mode == "raise":
    raise ValueError("boom from the probe")
if mode == "sleep":
    time.sleep(600)
"""

DRIVER = """
import json, os, socket, subprocess, sys, time
from ckpt.inprocess import preload
from ckpt.inprocess.preload import Forked, Starter
preload.READY_S = 600.0  # the first case waits for the template's imports, however busy the machine
store = socket.create_server(("127.0.0.1", 0))  # stands for the launcher's store socket: never inherited
cases, modules = json.loads(sys.argv[1]), sys.argv[2].split(",")
start = Starter(modules, {**os.environ, "OMP_NUM_THREADS": "1"})
out = {"pid": os.getpid()}
for name, cmd, extra in cases:
    env = {**os.environ, **extra}
    if name == "template-killed":
        start.template.kill()
    p = subprocess.Popen([sys.executable, *cmd], env=env) if name == "popen" else start(cmd, env)
    if name == "killed":
        while not os.path.exists(cmd[1]):
            time.sleep(0.05)
        p.kill()
    out[name] = {"forked": isinstance(p, Forked), "code": p.wait(300)}
start.close()
print(json.dumps(out))
"""


def _drive(tmp_path: Path, cases: list, modules: str, extra_env: dict | None = None) -> tuple[dict, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(extra_env or {})}
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(cases), modules], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


def _report(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / f"{name}.json").read_text())


def test_forked_worker_is_python_command(tmp_path: Path) -> None:
    """One template (torch preloaded) starts every case; a Popen'd twin is the reference."""
    (tmp_path / "probe.py").write_text(textwrap.dedent(PROBE))
    (tmp_path / "probemod.py").write_text(textwrap.dedent(PROBE))
    script = str(tmp_path / "probe.py")
    env = {"RANK": "3", "OMP_NUM_THREADS": "3", "MASTER_PORT": "29999"}
    cases = [[name, [script, str(tmp_path / f"{name}.json"), mode], env]
             for name, mode in (("popen", "ok"), ("plain", "ok"), ("exit7", "exit7"), ("raise", "raise"),
                                ("killed", "sleep"))]
    cases.append(["module", ["-m", "probemod", str(tmp_path / "module.json"), "ok"], env])
    out, stderr = _drive(tmp_path, cases, "torch")

    assert {k: (v["forked"], v["code"]) for k, v in out.items() if k != "pid"} == {
        "popen": (False, 0), "plain": (True, 0), "exit7": (True, 7), "raise": (True, 1), "killed": (True, -9),
        "module": (True, 0)}
    twin, forked = _report(tmp_path, "popen"), _report(tmp_path, "plain")
    for key in ("globals", "path0", "name", "file", "main_is_me", "ppid", "env", "fds", "signals"):
        assert forked[key] == twin[key], key
    assert forked["argv"] == [script, str(tmp_path / "plain.json"), "ok"] and twin["argv"][0] == script
    assert forked["ppid"] == out["pid"]  # the launcher's child: it waits for it, kills it, reads its code
    assert not any("socket" in target for target in forked["fds"].values())
    assert forked["threads"] == 3 and twin["threads"] is None  # OMP_NUM_THREADS, read after the fork
    assert forked["random"] != _report(tmp_path, "exit7")["random"]  # reseeded in each worker
    module = _report(tmp_path, "module")
    assert module["argv"][0] == str(tmp_path / "probemod.py") and module["path0"] == str(tmp_path)
    assert module["name"] == "__main__" and module["main_is_me"]
    assert not {"Starter", "_serve", "_become"} & set(module["globals"])  # a fresh __main__, not the template's
    for name in ("popen", "plain", "exit7", "raise", "module"):  # atexit handlers ran, in __main__
        assert (tmp_path / f"{name}.json.atexit").read_text() == "__main__", name
    assert not (tmp_path / "killed.json.atexit").exists()
    # the uncaught exception printed as the interpreter prints it: from the script's own frame
    tail = stderr[stderr.index("Traceback"):]
    assert "ValueError: boom from the probe" in tail and "preload.py" not in tail, stderr[-3000:]
    assert f'File "{script}", line' in tail.splitlines()[1]


def test_template_failure_and_opt_out_fall_back_to_popen(tmp_path: Path) -> None:
    """A template that cannot import, or is killed, or is opted out of: every worker still starts (Popen)."""
    (tmp_path / "probe.py").write_text(textwrap.dedent(PROBE))
    case = [[name, [str(tmp_path / "probe.py"), str(tmp_path / f"{name}.json"), "ok"], {}]
            for name in ("first", "template-killed", "after")]
    out, stderr = _drive(tmp_path, case[:1], "no_such_module_for_the_template")
    assert out["first"] == {"forked": False, "code": 0}
    assert "the preload template failed (its imports failed): workers start with Popen" in stderr

    out, stderr = _drive(tmp_path, case, "json")
    assert "Traceback" not in stderr, stderr[-3000:]
    assert [(out[n]["forked"], out[n]["code"]) for n in ("first", "template-killed", "after")] == [
        (True, 0), (False, 0), (False, 0)]
    assert stderr.count("the preload template failed") == 1, stderr[-3000:]

    out, _ = _drive(tmp_path, case[:1], "json", {"CKPT_INPROCESS_NO_PRELOAD": "1"})
    assert out["first"] == {"forked": False, "code": 0}

    _, stderr = _drive(tmp_path, [], "json")  # a launcher gone before it read "ready": the template ends quietly
    assert "Traceback" not in stderr, stderr[-3000:]

"""Each role installs what it imports: a node agent or a predictor host needs no torch.

Statically (fast): every third-party module that agents/, predictor/ or telemetry/
import is declared in the core dependencies or in that role's extra, and none of them is
torch or the checkpoint engine; what ckpt/ imports is declared in ``[train]`` (its
Lightning and Hugging Face integrations in ``[lightning]`` and ``[hf]``).

For real (marked ``install``, part of ``make test``; about a minute a role, most of it
pip unpacking numpy, pyarrow and scikit-learn, from pip's cache after the first run): a
wheel built once from this tree, installed with one extra into a fresh venv of its own;
there ``import torch`` fails, the role's CLI answers ``-h`` and every module of its
packages imports. Needs a package index (PyPI) or pip's cache. ``-m "not install"``
leaves it out.
"""
import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")     # Python >= 3.11 (pyproject is read, not installed)
ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: import name -> distribution name, for the third-party modules the roles and the engine use
DISTRIBUTIONS = {"numpy": "numpy", "click": "click", "tqdm": "tqdm", "pyarrow": "pyarrow",
                 "prometheus_client": "prometheus-client", "apscheduler": "apscheduler", "pynvml": "nvidia-ml-py",
                 "sklearn": "scikit-learn", "scipy": "scipy", "skops": "skops", "threadpoolctl": "threadpoolctl",
                 "aiohttp": "aiohttp", "ijson": "ijson", "matplotlib": "matplotlib", "cryptography": "cryptography",
                 "torch": "torch", "fsspec": "fsspec", "crc32c": "crc32c", "safetensors": "safetensors",
                 "lightning": "lightning", "transformers": "transformers",
                 "nvidia_resiliency_ext": "nvidia-resiliency-ext", "botocore": "botocore"}
FIRST_PARTY = {"agents", "predictor", "telemetry"}
#: role -> (its packages, its CLI)
ROLES = {"agent": (("agents", "telemetry"), "agents"), "predictor": (("predictor", "telemetry"), "predictor")}
#: the extra a module of the checkpoint engine needs, where it is not [train]
ENGINE_EXTRAS = {"integrations/lightning.py": "lightning", "integrations/huggingface.py": "hf",
                 "integrations/nvrx.py": "nvrx", "goodput/spares.py": "hazard",  # spares: its --plot
                 "tiers/store_access.py": "s3"}  # store_access: botocore's credential chain, s3:// only
#: a role's modules that need more than the role's extra (plots: [hazard])
ROLE_EXTRAS = {"predictor/hazard/paper.py": "hazard"}
#: a role's modules allowed to import the engine's torch-free modules, one code for both: the node
#: agent reads the shared-memory owner records as `ckpt gc --orphans` does, and serves /metrics
#: on the listener the checkpoint manager's metrics use
ENGINE_READERS = {"agents/shm.py": {"ckpt.tiers.memory.owners"}, "agents/exporter.py": {"ckpt.listening"}}


def _imports(*paths: Path) -> set[str]:
    """The third-party top-level modules the files import."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - FIRST_PARTY - {"__future__"}


def _modules(path: Path) -> set[str]:
    """The absolute module names a file imports from."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def _assert_torch_free(modules: list[str]) -> None:
    """Importing ``modules`` (in a fresh interpreter) loads neither torch nor a third-party
    module the base install lacks."""
    code = ("import sys, importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)
            + "print(' '.join(sorted({n.split('.')[0] for n in sys.modules})))")
    loaded = set(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                                cwd=ROOT).stdout.split())
    third = loaded - set(sys.stdlib_module_names) - {"ckpt", "__main__"} - {m for m in loaded if m.startswith("_")}
    assert "torch" not in third, modules
    _assert_declared(third, "agent")


def _declared(extra: str) -> set[str]:
    """What ``pip install ckpt-guard[extra]`` installs by name, ``ckpt-guard[other]`` expanded."""
    names = set()
    for req in PROJECT["project"]["dependencies"] + PROJECT["project"]["optional-dependencies"][extra]:
        name = re.split(r"[<>=\[ ;]", req, maxsplit=1)[0].lower()
        if name == PROJECT["project"]["name"]:
            for other in re.search(r"\[(.*)\]", req).group(1).split(","):
                names |= _declared(other.strip())
        else:
            names.add(name)
    return names


def _assert_declared(imported: set[str], extra: str) -> None:
    unknown = imported - DISTRIBUTIONS.keys()
    assert not unknown, f"add {unknown} to DISTRIBUTIONS and to the [{extra}] extra"
    missing = {DISTRIBUTIONS[m] for m in imported} - _declared(extra)
    assert not missing, f"[{extra}] does not install {missing}"


@pytest.mark.parametrize("extra", ROLES)
def test_a_role_imports_only_what_its_extra_installs(extra: str) -> None:
    paths = [path for package in ROLES[extra][0] for path in (ROOT / package).rglob("*.py")]
    imported = _imports(*(p for p in paths if p.relative_to(ROOT).as_posix() not in ROLE_EXTRAS))
    assert "torch" not in imported, imported
    for path in paths:
        engine = {m for m in _modules(path) if m.split(".")[0] == "ckpt"}
        assert engine <= ENGINE_READERS.get(path.relative_to(ROOT).as_posix(), set()), (path, engine)
    _assert_torch_free(sorted(set().union(*ENGINE_READERS.values())))
    imported.discard("ckpt")
    assert "torch" not in _declared(extra)
    _assert_declared(imported, extra)
    for path in paths:
        if path.relative_to(ROOT).as_posix() in ROLE_EXTRAS:
            _assert_declared(_imports(path), ROLE_EXTRAS[path.relative_to(ROOT).as_posix()])


def test_the_checkpoint_engine_declares_what_it_imports() -> None:
    """[train] installs what ckpt/ imports (safetensors for ``ckpt export`` once was not)."""
    for path in sorted((ROOT / "ckpt").rglob("*.py")):
        extra = ENGINE_EXTRAS.get(path.relative_to(ROOT / "ckpt").as_posix(), "train")
        _assert_declared(_imports(path) - {"ckpt"}, extra)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This tree's wheel, built once, from a copy (a build writes build/ and *.egg-info)."""
    src, out = tmp_path_factory.mktemp("src") / "ckpt-guard", tmp_path_factory.mktemp("wheel")
    src.mkdir()
    for name in ("pyproject.toml", PROJECT["project"]["readme"]):
        shutil.copy(ROOT / name, src / name)
    for pattern in PROJECT["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src))
    return next(out.glob("*.whl"))


@pytest.mark.install
@pytest.mark.parametrize("extra", ROLES)
def test_a_role_installs_into_a_venv_of_its_own_without_torch(extra: str, wheel: Path, tmp_path: Path) -> None:
    packages, cli = ROLES[extra]
    venv = _venv_with(f"{wheel}[{extra}]", tmp_path)
    python = str(venv / "bin" / "python")
    no_torch = _run(python, "-c", "import torch", cwd=tmp_path, check=False)
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr, no_torch.stderr
    assert "Usage:" in _run(str(venv / "bin" / cli), "-h", cwd=tmp_path).stdout
    _run(python, "-c", IMPORT_ALL, *packages, cwd=tmp_path)


@pytest.mark.install
def test_the_base_install_answers_help_and_names_the_extra_a_command_needs(wheel: Path, tmp_path: Path) -> None:
    """`pip install ckpt-guard`: every command answers -h, the ckpt CLI works (its checksums need
    crc32c, not torch), and a role's command says which extra brings its libraries."""
    bin_dir = _venv_with(str(wheel), tmp_path) / "bin"
    for cli in ("ckpt", "agents", "predictor"):
        assert "Usage:" in _run(str(bin_dir / cli), "-h", cwd=tmp_path).stdout, cli
    assert _run(str(bin_dir / "ckpt"), "ls", str(tmp_path), "--json", cwd=tmp_path).stdout.strip() == "[]"
    for cli, extra in (("agents", "agent"), ("predictor", "predictor")):
        args = ("simulate", "--out", str(tmp_path / "trace")) if cli == "agents" else ("eval",)
        proc = _run(str(bin_dir / cli), *args, cwd=tmp_path, check=False)
        assert proc.returncode == 1 and f"pip install 'ckpt-guard[{extra}]'" in proc.stderr, proc.stderr


def _venv_with(spec: str, tmp_path: Path) -> Path:
    """A fresh venv with ``spec`` installed: this pip installs into it (--python), none to bootstrap there."""
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", str(venv))
    _run(sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-compile",
         spec)  # no .pyc for all of scipy: half the CPU time
    return venv


IMPORT_ALL = """
import importlib, pkgutil, sys
for name in sys.argv[1:]:
    package = importlib.import_module(name)
    assert package.__file__.startswith(sys.prefix), f"{name} from {package.__file__}, not the venv"
    for module in pkgutil.walk_packages(package.__path__, name + "."):
        importlib.import_module(module.name)
assert "torch" not in sys.modules
"""


def _run(*cmd: str, cwd: Path = ROOT, check: bool = True) -> subprocess.CompletedProcess:
    """``cmd`` with this test's PYTHONPATH dropped (it would put the tree under test first)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=480)
    assert not check or proc.returncode == 0, f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stderr[-4000:]}"
    return proc

"""Each role installs what it imports: a node agent or a predictor host needs no torch.

What this checks statically (fast, every run): every third-party module that agents/,
predictor/ or telemetry/ import is declared in the core dependencies or in that role's
extra, and none of them is torch or the checkpoint engine. The installs themselves
(`pip install -e '.[agent]'` into a fresh venv, then `agents -h`, `agents simulate`, `agents run
--source sim`; the same for `[predictor]` with `predictor -h`, `predictor eval`) take minutes
of downloads, so they are described in docs/agents.md rather than run here.
"""
import ast
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")     # Python >= 3.11 (pyproject is read, not installed)
ROOT = Path(__file__).resolve().parents[1]
#: import name -> distribution name, for the third-party modules the roles use
DISTRIBUTIONS = {"numpy": "numpy", "click": "click", "tqdm": "tqdm", "pyarrow": "pyarrow",
                 "prometheus_client": "prometheus-client", "apscheduler": "apscheduler", "pynvml": "nvidia-ml-py",
                 "sklearn": "scikit-learn", "skops": "skops", "threadpoolctl": "threadpoolctl", "aiohttp": "aiohttp"}
FIRST_PARTY = {"agents", "predictor", "telemetry"}


def _imports(package: str) -> set[str]:
    names = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - FIRST_PARTY - {"__future__"}


def _declared(extra: str) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + project["optional-dependencies"][extra]
    return {re.split(r"[<>=\[ ;]", r, maxsplit=1)[0].lower() for r in reqs}


@pytest.mark.parametrize("extra,packages", [("agent", ("agents", "telemetry")),
                                            ("predictor", ("predictor", "telemetry"))])
def test_a_role_imports_only_what_its_extra_installs(extra, packages):
    imported = set().union(*map(_imports, packages))
    assert not imported & {"torch", "ckpt"}, imported
    unknown = imported - DISTRIBUTIONS.keys()
    assert not unknown, f"add {unknown} to DISTRIBUTIONS and to the [{extra}] extra"
    declared = _declared(extra)
    assert "torch" not in declared
    missing = {DISTRIBUTIONS[m] for m in imported} - declared
    assert not missing, f"[{extra}] does not install {missing}"

"""ckpt/ is grouped by concern and its imports run one way (docs/architecture.md): a module of
a lower layer never imports one of a higher layer at run time, and no import cycle exists.
Checked on the source (ast), so it costs no torch import."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "ckpt"
# lowest first; a module may import its own layer or a lower one
LAYERS = [
    {"errors", "coordination"},
    {"format"},
    {"tiers"},
    {"restore"},
    {"save"},
    {"peers"},
    {"recovery", "interop"},
    {"manager", "distributed", "dcp_reader", "quarantine", "policy"},
    {"integrations", "inprocess", "cli", "simulate_cli", "goodput", "__init__"},
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}
MAX_TOP_LEVEL_MODULES = 15


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _runtime_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(block.test) for n in ast.walk(block)}
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only or not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        if not base.startswith("ckpt"):
            continue
        for alias in node.names:
            full = f"{base}.{alias.name}"
            found.add(full if full in modules else base)
    return {m for m in found if m in modules and m != name}


def _group(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _runtime_imports(name, path, modules) for name, path in modules.items()}


def test_every_group_has_a_layer(graph):
    assert {_group(m) for m in graph} <= set(RANK), "add the new subpackage to LAYERS (and docs/architecture.md)"


def test_imports_run_one_way(graph):
    back = [f"{a} -> {b}" for a, bs in graph.items() for b in bs if RANK[_group(b)] > RANK[_group(a)]]
    assert not back, "imports up the layers:\n" + "\n".join(sorted(back))


def test_no_import_cycle(graph):
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in graph[m]:
            if state.get(n) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(n):] + [n]) if n in path else n)
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_top_level_stays_small():
    top = [p for p in PKG.glob("*.py")]
    assert len(top) <= MAX_TOP_LEVEL_MODULES, sorted(p.name for p in top)


def test_documented_paths_keep_working():
    from ckpt.dcp_reader import CheckpointReader
    from ckpt.distributed import exit_rank, init_process_group
    from ckpt.quarantine import EXIT_QUARANTINED

    assert callable(init_process_group) and callable(exit_rank) and CheckpointReader and EXIT_QUARANTINED == 88
    out = subprocess.run([sys.executable, "-m", "ckpt.quarantine", "--help"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "python -m ckpt.quarantine" in out.stdout, out.stderr

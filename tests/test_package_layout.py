"""ckpt/ and predictor/ are grouped by concern and their imports run one way (docs/architecture.md):
a module of a lower layer never imports one of a higher layer at run time, and no import cycle exists
(predictor/: not even through an import made for type checking only), nor in benchmarks/. Checked on
the source (ast), so it costs no torch import."""
from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Package:
    name: str
    layers: list[set[str]]          # lowest first; a module may import its own layer or a lower one
    max_top_level_modules: int
    typing_imports_count: bool      # an import under TYPE_CHECKING still closes a cycle

    @property
    def rank(self) -> dict[str, int]:
        return {group: i for i, groups in enumerate(self.layers) for group in groups}


PACKAGES = {p.name: p for p in (
    Package("ckpt", [
        {"errors", "coordination", "secret", "listening", "control"},
        {"format"},
        {"tiers"},
        {"restore"},
        {"save"},
        {"peers"},
        {"recovery", "interop"},
        {"manager", "wiring", "distributed", "dcp_reader", "quarantine", "policy"},
        {"integrations", "inprocess", "cli", "simulate_cli", "goodput", "__init__"},
    ], max_top_level_modules=15, typing_imports_count=False),
    # the data's path: cli -> serve/alerts (hazard beside them) -> model -> ingest
    Package("predictor", [
        {"ingest"},
        {"model"},
        {"serve", "alerts", "hazard"},
        {"cli", "__init__"},
    ], max_top_level_modules=12, typing_imports_count=True),
)}


def _modules(pkg: str) -> dict[str, Path]:
    out = {}
    for p in (ROOT / pkg).rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _imports(name: str, path: Path, modules: dict[str, Path], typing_too: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    typing_only = set() if typing_too else {
        id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
        and "TYPE_CHECKING" in ast.unparse(block.test) for n in ast.walk(block)}
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    root = name.split(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == root)
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        if base.split(".")[0] != root:
            continue
        for alias in node.names:
            full = f"{base}.{alias.name}"
            found.add(full if full in modules else base)
    return {m for m in found if m in modules and m != name}


def _group(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


_graphs: dict[tuple[str, bool], dict[str, set[str]]] = {}


def graph(pkg: str, typing_too: bool = False) -> dict[str, set[str]]:
    if (pkg, typing_too) not in _graphs:
        modules = _modules(pkg)
        _graphs[pkg, typing_too] = {name: _imports(name, path, modules, typing_too) for name, path in modules.items()}
    return _graphs[pkg, typing_too]


@pytest.mark.parametrize("pkg", PACKAGES)
def test_every_group_has_a_layer(pkg):
    groups = {_group(m) for m in graph(pkg)}
    assert groups <= set(PACKAGES[pkg].rank), f"add {sorted(groups - set(PACKAGES[pkg].rank))} to {pkg}'s layers " \
                                              "(and docs/architecture.md)"


@pytest.mark.parametrize("pkg", PACKAGES)
def test_imports_run_one_way(pkg):
    rank = PACKAGES[pkg].rank
    g = graph(pkg, PACKAGES[pkg].typing_imports_count)
    back = [f"{a} -> {b}" for a, bs in g.items() for b in bs if rank[_group(b)] > rank[_group(a)]]
    assert not back, "imports up the layers:\n" + "\n".join(sorted(back))


def _assert_no_cycle(g: dict[str, set[str]]) -> None:
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(g[m]):
            if state.get(n) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(n):] + [n]) if n in path else n)
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_import_cycle(pkg):
    _assert_no_cycle(graph(pkg, PACKAGES[pkg].typing_imports_count))


def test_no_import_cycle_in_benchmarks():
    """benchmarks/ is scripts on one harness, without layers: no cycle, counting imports made
    inside functions or for type checking (a lazy import only hides a cycle)."""
    _assert_no_cycle(graph("benchmarks", typing_too=True))


@pytest.mark.parametrize("pkg", PACKAGES)
def test_top_level_stays_small(pkg):
    top = list((ROOT / pkg).glob("*.py"))
    assert len(top) <= PACKAGES[pkg].max_top_level_modules, sorted(p.name for p in top)


def test_the_checks_see_a_type_only_cycle(tmp_path, monkeypatch):
    """The predictor's rule counts an import under TYPE_CHECKING: a type-only import of the
    server from metrics once closed metrics -> server -> scoring_queue -> metrics."""
    pkg = tmp_path / "demo"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from demo.low.b import B\n")
    (pkg / "low" / "b.py").write_text("from demo.low import a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    modules = _modules("demo")
    with_typing = {n: _imports(n, p, modules, True) for n, p in modules.items()}
    without = {n: _imports(n, p, modules, False) for n, p in modules.items()}
    assert with_typing["demo.low.a"] == {"demo.low.b"} and without["demo.low.a"] == set()


def test_documented_paths_keep_working():
    from ckpt.dcp_reader import CheckpointReader
    from ckpt.distributed import exit_rank, init_process_group
    from ckpt.quarantine import EXIT_QUARANTINED

    assert callable(init_process_group) and callable(exit_rank) and CheckpointReader and EXIT_QUARANTINED == 88
    out = subprocess.run([sys.executable, "-m", "ckpt.quarantine", "--help"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "python -m ckpt.quarantine" in out.stdout, out.stderr


def test_predictor_entry_points_resolve():
    """pyproject's `predictor = "predictor.cli:main"` and `python -m predictor.cli` survive the regroup."""
    from predictor.cli import main

    assert callable(main)
    out = subprocess.run([sys.executable, "-m", "predictor.cli", "--help"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "python -m predictor.cli" in out.stdout, out.stderr


def test_a_rank_that_holds_no_dtensor_does_not_import_its_module():
    """torch.distributed.tensor costs half of ``import torch`` again in every rank (and every torchrun
    rank of the suite): the engine tells a DTensor apart without importing it (``format.state.is_dtensor``)."""
    code = ("import sys, ckpt.manager, ckpt.restore.reshard\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.tensor')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr

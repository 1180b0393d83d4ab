"""The conformance matrix's tables from what a run of it left in pytest's base directory
(``pytest -m conformance_full tests/test_conformance.py --basetemp DIR``): every tensor case
summed over its N -> M pairs, and every model case at every pair, each path's verdict as
``tests/test_conformance.py`` judges it. Markdown on stdout, ``--json`` for the cells.

    python scripts/conformance_table.py DIR [--json OUT]
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

TENSOR_PATHS = ("ckpt", "ckpt-overlaps", "import", "dcp")
MODEL_PATHS = ("ckpt", "import", "export-import", "export", "reader", "dcp")


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _pairs(base: Path, kind: str) -> Iterator[tuple[list[dict], int, int, str, dict, dict]]:
    """Each (cases of its launch, N, M, case id, its save's verdicts, its load's verdicts) that
    the ``kind`` ("" for tensors, "model" for models) of run left under ``base``."""
    spec_prefix, out_prefix, field = ("model-cases-", "models-", 2) if kind else ("cases-", "out-", 1)
    tag = "models-" if kind else ""
    for spec in sorted(base.glob(f"**/{spec_prefix}*.json")):
        cases = json.loads(spec.read_text())
        out = spec.with_name(spec.name.replace(spec_prefix, out_prefix).removesuffix(".json"))
        saves = {int(p.name.split("-")[field]): _read(p) for p in out.glob(f"{tag}save-*-rank0.json")}
        for load in sorted(out.glob(f"{tag}load-*-rank0.json")):
            for key, verdicts in _read(load).items():
                cid, n = key.rsplit("@", 1)
                yield cases, int(n), int(load.name.split("-")[field]), cid, \
                    saves.get(int(n), {}).get(cid, {}), verdicts


def tensor_cells(base: Path) -> list[dict]:
    """One cell per tensor case, saved at N and restored at M: each path's verdict."""
    cells = []
    for _, n, m, cid, saved, verdicts in _pairs(base, ""):
        cell = {"case": cid, "n": n, "m": m}
        for path in TENSOR_PATHS:
            first = path.split("-")[0]
            cell[path] = saved[first] if saved.get(first, "ok") != "ok" else verdicts.get(path, "not run")
        cells.append(cell)
    return cells


def model_cells(base: Path) -> list[dict]:
    """One cell per model case, saved at N and restored at M (``judge_models``' reading)."""
    cells = []
    for specs, n, m, cid, saved, verdicts in _pairs(base, "model"):
        case = next(c for c in specs if c["id"] == cid)
        options = [k for k in ("groups", "reorder", "extras", "stateful") if case.get(k)]
        options += [] if case.get("dcp_saver") == "save" else [f"dcp {case['dcp_saver']}"]
        cell = {"case": cid, "layouts": f"{case['save']} → {case['load']}", "options": ", ".join(options),
                "n": n, "m": m}
        for path in MODEL_PATHS:
            cell[path] = verdicts.get(path) or saved.get(path.split("-")[0], "error: not saved")
        cells.append(cell)
    return sorted(cells, key=lambda c: (c["case"], c["n"], c["m"]))


def _short(verdict: str) -> str:
    if verdict == "ok" or ":" not in verdict:
        return verdict
    kind, rest = verdict.split(":", 1)
    return f"{kind}: {rest.strip()[:60]}"


def tensor_table(cells: list[dict]) -> str:
    """A row per case: its pairs, and per path how many were ok (the rest named once)."""
    by_case: dict[str, list[dict]] = {}
    for c in cells:
        by_case.setdefault(c["case"], []).append(c)
    rows = ["| case | pairs | " + " | ".join(TENSOR_PATHS) + " | not ok |", "|" + " --- |" * (len(TENSOR_PATHS) + 3)]
    for cid, cs in sorted(by_case.items()):
        other = Counter(f"{p} {_short(c[p])}" for c in cs for p in TENSOR_PATHS if c[p] != "ok")
        rows.append(f"| {cid} | {len(cs)} | " + " | ".join(str(sum(c[p] == "ok" for c in cs)) for p in TENSOR_PATHS)
                    + " | " + "; ".join(f"{k} ({v}x)" for k, v in sorted(other.items())) + " |")
    return "\n".join(rows)


def model_table(cells: list[dict]) -> str:
    rows = ["| case | save → load | options | N → M | " + " | ".join(MODEL_PATHS) + " |",
            "|" + " --- |" * (len(MODEL_PATHS) + 4)]
    rows += [f"| {c['case']} | {c['layouts']} | {c['options']} | {c['n']} → {c['m']} | "
             + " | ".join(_short(c[p]) for p in MODEL_PATHS) + " |" for c in cells]
    return "\n".join(rows)


def tally(cells: list[dict], paths: tuple[str, ...]) -> dict[str, Counter]:
    """Per path: ok, wrong (silently different bytes) and error cells."""
    return {p: Counter("ok" if c[p] == "ok" else "wrong" if c[p].startswith("wrong") else "error" for c in cells)
            for p in paths}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    tensors, models = tensor_cells(args.base), model_cells(args.base)
    print(f"tensor cases: {len({c['case'] for c in tensors})}, {len(tensors)} case x N -> M cells; "
          f"{ {p: dict(v) for p, v in tally(tensors, TENSOR_PATHS).items()} }")
    print(f"model cases: {len({c['case'] for c in models})}, {len(models)} cells; "
          f"{ {p: dict(v) for p, v in tally(models, MODEL_PATHS).items()} }\n")
    print(tensor_table(tensors), "\n")
    print(model_table(models))
    if args.json:
        args.json.write_text(json.dumps({"tensors": tensors, "models": models}, indent=1))


if __name__ == "__main__":
    main()

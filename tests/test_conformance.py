"""Conformance (issue 31): what comes back is what was saved, at every world size, with
PyTorch's DCP as the control. Cases (``conformance_cases.py``): ported from PyTorch's own
DCP tests plus generated ones (dtypes including bool, complex, float8, bfloat16; 0-d and
0-size tensors; views; uneven and empty shards; 1-D and 2-D meshes; placement pairs).
Each is saved at N ranks (ckpt-guard and ``dcp.save``; the latter imported as ``ckpt
import`` does) and restored at M, bitwise compared on every rank (``conformance_child.py``).

The rule checked for every case and N -> M: no path ever returns wrong bytes; where DCP
saves and loads a case, ckpt-guard's restore and the restore of its import do too. A case
DCP cannot do either is counted as unsupported by both, not as a pass.

The fast subset runs in ``make test``; the whole matrix (every case, saved at 1, 2 and 4
ranks, restored at 1-4; the model cases at 1, 2 and 4 both ways) is one command:

    python -m pytest -q -s -m conformance_full tests/test_conformance.py
"""
from __future__ import annotations

import json
import os
import sys
import warnings
from collections import Counter
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException

from ckpt.dcp_reader import CheckpointReader
from ckpt.interop.export import model_weights, write_dcp, write_safetensors
from ckpt.restore.reshard import read_whole
from tests.conformance_cases import fast_subset, generated, model_cases, model_fast_subset, ported
from tests.conformance_child import compare, expected
from tests.integration_helpers import torchrun

CHILD = Path(__file__).with_name("conformance_child.py")
MODELS_CHILD = Path(__file__).with_name("conformance_models_child.py")
# The whole matrix: ``pytest -m conformance_full tests/test_conformance.py`` (or CKPT_CONFORMANCE=full)
FULL = os.environ.get("CKPT_CONFORMANCE") == "full" or any("conformance_full" in a for a in sys.argv)
SAVE_WORLDS, LOAD_WORLDS = ((1, 2, 4), (1, 2, 3, 4)) if FULL else ((4,), (4, 1))
BATCH = 15 if FULL else 40  # cases per launch: each inside torchrun's 400 s hang guard on a busy machine


def cases() -> list[dict]:
    everything = ported() + generated(60)
    return everything if FULL else fast_subset(everything)


def judge(save: dict, loads: dict[int, dict], by_id: dict[str, dict]) -> tuple[list[str], Counter]:
    """Failures (silent wrong bytes anywhere; an error where DCP succeeded) and a tally."""
    failures, tally = [], Counter()
    for world, results in loads.items():
        for key, verdicts in results.items():
            cid, saved_at = key.rsplit("@", 1)
            saved = save[int(saved_at)][cid]
            where = f"{cid} {saved_at}->{world} ({by_id[cid]['upstream']})"
            for path, verdict in verdicts.items():
                if verdict.startswith("wrong"):
                    failures.append(f"{where} {path}: {verdict}")
            if "ckpt-overlaps" in verdicts and (verdicts["ckpt-overlaps"] == "ok") != (verdicts.get("ckpt") == "ok"):
                failures.append(f"{where}: the plans differ: own shard {verdicts.get('ckpt')}, overlaps "
                                f"{verdicts['ckpt-overlaps']}")
            dcp_ok = saved["dcp"] == "ok" and verdicts.get("dcp") == "ok"
            ours = saved["ckpt"] if saved["ckpt"] != "ok" else verdicts.get("ckpt", "error: not restored")
            if dcp_ok:
                for path, verdict in (("ckpt", ours), ("import", saved.get("import", "ok") if saved.get(
                        "import", "ok") != "ok" else verdicts.get("import", "error: not restored"))):
                    if verdict != "ok":
                        failures.append(f"{where} {path} (DCP does it): {verdict}")
                tally["passed" if ours == "ok" else "failed"] += 1
            else:
                tally["unsupported by both" if ours != "ok" else "beyond DCP"] += 1
    return failures, tally


@pytest.mark.conformance_full
@pytest.mark.timeout(4 * 3600 if FULL else 600)  # the whole matrix is some 40 torchrun launches
def test_conformance(tmp_path: Path, shm_dir: str) -> None:
    todo = cases()
    by_id = {c["id"]: c for c in todo}
    save: dict[int, dict] = {n: {} for n in SAVE_WORLDS}
    loads: dict[int, dict] = {m: {} for m in LOAD_WORLDS}
    for b in range(0, len(todo), BATCH):  # a launch stays well inside torchrun's hang guard
        spec, out = tmp_path / f"cases-{b}.json", tmp_path / f"out-{b}"
        spec.write_text(json.dumps(todo[b:b + BATCH]))
        out.mkdir()
        for n in SAVE_WORLDS:
            torchrun(CHILD, "save", str(spec), str(out), f"{shm_dir}/s{n}", nproc=n)
            save[n].update(json.loads((out / f"save-{n}-rank0.json").read_text()))
        for m in LOAD_WORLDS:
            torchrun(CHILD, "load", str(spec), str(out), f"{shm_dir}/l{m}", *map(str, SAVE_WORLDS), nproc=m)
            loads[m].update(json.loads((out / f"load-{m}-rank0.json").read_text()))
    failures, tally = judge(save, loads, by_id)
    exported, export_tally = judge_exports(todo, save, tmp_path, tmp_path / "exports")
    print(f"conformance: {len(todo)} cases, {sum(tally.values())} case x world-size pairs: {dict(tally)}; "
          f"exports and readers: {dict(export_tally)}")
    failures += exported
    assert not failures, "\n".join(failures[:40])
    assert tally["passed"] > 0
    exported_by_the_cli(tmp_path / f"out-{[c['id'] for c in todo].index('fsdp-to-tp') // BATCH * BATCH}", tmp_path)


MODEL_WORLDS = ((1, 2, 4), (1, 2, 4)) if FULL else ((2,), (2, 1))  # saved at, restored at (N = M included)
MODEL_PATHS = ("ckpt", "import", "export-import", "export", "reader")


# cases per launch: inside torchrun's 400 s hang guard on a busy 2-core machine; the fast subset
# (4 cases) in one launch per world size, not two (each launch starts its ranks: seconds of CPU each)
MODEL_BATCH = 3 if FULL else 4


def run_models(todo: list[dict], work: Path, shm_dir: str,
               worlds: tuple[tuple[int, ...], tuple[int, ...]] = MODEL_WORLDS) -> tuple[list[str], Counter]:
    """The model-and-optimizer cases saved at each N, restored at each M, a few cases per
    launch: every path bitwise by parameter name; an error where DCP (the control) succeeds fails."""
    saves, loads = worlds
    failures, tally = [], Counter()
    for b in range(0, len(todo), MODEL_BATCH):
        spec, out = work / f"model-cases-{b}.json", work / f"models-{b}"
        spec.write_text(json.dumps(todo[b:b + MODEL_BATCH]))
        out.mkdir()
        more, counted = judge_models(spec, out, shm_dir, saves, loads)
        failures, tally = failures + more, tally + counted
    return failures, tally


def judge_models(spec: Path, out: Path, shm_dir: str, saves: tuple[int, ...],
                 loads: tuple[int, ...]) -> tuple[list[str], Counter]:
    saved = {}
    for n in saves:
        torchrun(MODELS_CHILD, "save", str(spec), str(out), f"{shm_dir}/ms{n}", nproc=n)
        saved[n] = json.loads((out / f"models-save-{n}-rank0.json").read_text())
    failures, tally = [], Counter()
    for m in loads:
        torchrun(MODELS_CHILD, "load", str(spec), str(out), f"{shm_dir}/ml{m}", *map(str, saves), nproc=m)
        for key, verdicts in json.loads((out / f"models-load-{m}-rank0.json").read_text()).items():
            cid, n = key.rsplit("@", 1)
            dcp_ok = saved[int(n)][cid].get("dcp") == "ok" and verdicts.get("dcp") == "ok"
            for path in MODEL_PATHS:
                verdict = verdicts.get(path) or saved[int(n)][cid].get(path.split("-")[0], "error: not saved")
                if verdict.startswith("wrong") or (dcp_ok and verdict != "ok"):
                    failures.append(f"{cid} {n}->{m} {path}: {verdict}")
                what = "ok" if verdict == "ok" else "wrong" if verdict.startswith("wrong") else "error"
                tally[f"{path}: {what}"] += 1
            tally["dcp: " + ("ok" if dcp_ok else "error")] += 1
    return failures, tally


@pytest.mark.conformance_full
@pytest.mark.timeout(4 * 3600 if FULL else 1200)
def test_models_and_optimizers_restore_by_name_at_every_pair_of_world_sizes(tmp_path: Path, shm_dir: str) -> None:
    """Issue 47: FSDP2, HSDP, FSDP2+TP, DDP (``module.``), permuted meshes, several param
    groups, parameters listed in another order, Stateful get/set_state_dict, a scheduler, a
    grad scaler, a view target; through our restore, the import of ``dcp.save`` /
    ``async_save`` / a save with planner options, export -> import, and export read by DCP."""
    everything = model_cases()
    failures, tally = run_models(everything if FULL else model_fast_subset(everything), tmp_path, shm_dir)
    print(f"model conformance: {dict(sorted(tally.items()))}")
    assert not failures, "\n".join(failures[:40])


def exported_by_the_cli(saved: Path, work: Path) -> None:
    """``ckpt export --format dcp`` of FSDP2-style shards (an [8, 4] tensor, Shard(0) over 4
    ranks): DCP's metadata gives the global size, not saved rank 0's [2, 4] (issue 31, 3)."""
    from torch.distributed.checkpoint import FileSystemReader

    from tests.test_ckpt_cli import ckpt

    root = saved / "fsdp-to-tp" / f"ckpt-{max(SAVE_WORLDS)}"
    r = ckpt("export", root, "--format", "dcp", "--to", work / "cli-dcp", "--json")
    assert r.returncode == 0, r.stderr
    assert tuple(FileSystemReader(str(work / "cli-dcp")).read_metadata().state_dict_metadata["t"].size) == (8, 4)


def judge_exports(todo: list[dict], save: dict, saved: Path, work: Path) -> tuple[list[str], Counter]:
    """In this process, for each saved case: ``ckpt export --format dcp`` read back by
    ``dcp.load``, ``--format safetensors`` read back by safetensors, and ``dcp.load`` through
    ``CheckpointReader``, each bitwise against the saved tensors; DCP's own directory read
    by ``dcp.load`` in one process is the control."""
    failures, tally = [], Counter()
    for i, case in enumerate(todo):
        out = saved / f"out-{i - i % BATCH}"
        for n, results in save.items():
            if results[case["id"]]["ckpt"] != "ok":
                continue
            root, where = out / case["id"] / f"ckpt-{n}", f"{case['id']} saved at {n} ({case['upstream']})"
            control = read_back(case, partial(load_dcp, out / case["id"] / f"dcp-{n}"))
            for path, fn in (("export dcp", partial(export_dcp, root, work / f"{case['id']}-{n}")),
                             ("export safetensors", partial(export_safetensors, root, work / f"{case['id']}-{n}-st")),
                             ("CheckpointReader", partial(read_ours, root, work / "no-slots"))):
                verdict = read_back(case, fn)
                beyond_format = "safetensors has no" in verdict  # complex128: the format's limit, said so
                if verdict.startswith("wrong") or (control == "ok" and verdict != "ok" and not beyond_format):
                    failures.append(f"{where} {path}: {verdict}")
                what = "ok" if verdict == "ok" else "not in the format" if beyond_format else "unsupported by both"
                tally[f"{path}: {what}"] += 1
    return failures, tally


def read_back(case: dict, load) -> str:
    """Load into plain zeros with ``load(state)``; compare bitwise with the saved tensors."""
    state = {k: torch.zeros_like(v.resolve_conj().resolve_neg()) for k, v in expected(case).items()}
    try:
        with warnings.catch_warnings():  # DCP: "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            load(state)
    except (Exception, CheckpointException) as e:
        return f"error: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
    return compare(case, state)


def load_dcp(folder: Path, state: dict) -> None:
    dcp.load(state, checkpoint_id=str(folder))


def read_ours(root: Path, no_slots: Path, state: dict) -> None:
    no_slots.mkdir(exist_ok=True)
    dcp.load(state, storage_reader=CheckpointReader(str(root), memory_dir=str(no_slots)))


def export_dcp(root: Path, dest: Path, state: dict) -> None:
    """``ckpt export --format dcp`` (its functions), then ``dcp.load``."""
    write_dcp(read_whole(str(root))[1], dest)
    load_dcp(dest, state)


def export_safetensors(root: Path, dest: Path, state: dict) -> None:
    """``ckpt export --format safetensors`` of a state whose tensors sit at the top level."""
    (path,) = write_safetensors(model_weights(read_whole(str(root))[1]), dest)
    state.update(load_file(str(path)))


def test_a_target_that_cannot_be_written_in_place_is_refused(tmp_path: Path, shm_dir: str) -> None:
    """An expanded (stride-0) target has fewer memory locations than elements: restoring into
    it would write several values to one place. Refused naming the tensor, nothing loaded."""
    from ckpt import CheckpointManager
    from ckpt.errors import StateMismatch

    with CheckpointManager(tmp_path, memory_dir=shm_dir) as mgr:
        mgr.save(1, {"t": torch.arange(12.0).reshape(3, 4), "u": torch.ones(2)}).wait()
        target = {"t": torch.zeros(1, 4).expand(3, 4), "u": torch.zeros(2)}
        with pytest.raises(StateMismatch, match=r"t: .*cannot be written in place"):
            mgr.restore(target)
        assert target["u"].eq(0).all()


def test_int_keys_of_a_nested_dict_come_back_from_an_import(tmp_path: Path, shm_dir: str) -> None:
    """Ported from test_nested_dict.py::TestFlattening (a state of dicts nested in dicts and
    lists): DCP names every dict key as a string, and ``dcp.load`` matches them to the
    target's; restoring an import into the same state matches them alike (issue 31, 9)."""
    from ckpt import CheckpointManager
    from ckpt.interop.dcp_import import read_dcp
    from ckpt.interop.offline_write import import_target, write_state
    from ckpt.tiers.local import LocalDiskTier

    def state(fill: float) -> dict:
        return {"nested": {0: torch.full((2,), fill), 1: {"a": torch.full((3,), fill), 7: [torch.full((1,), fill)]}},
                "names": {"0": torch.full((1,), fill)}, "epoch": int(fill)}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process": it is
        dcp.save(state(5.0), checkpoint_id=str(tmp_path / "dcp"))
    (tmp_path / "ours").mkdir()
    tier = LocalDiskTier(tmp_path / "ours")
    write_state(tier, import_target(tier, 1, run="imp"), read_dcp(tmp_path / "dcp"), run="imp")
    target = state(0.0)
    with CheckpointManager(tmp_path / "ours", memory_dir=shm_dir, run="imp") as mgr:
        assert mgr.restore(target) == 1
    assert set(target["nested"]) == {0, 1} and set(target["nested"][1]) == {"a", 7} and set(target["names"]) == {"0"}
    want = state(5.0)
    assert torch.equal(target["nested"][1][7][0], want["nested"][1][7][0])
    assert all(torch.equal(target["nested"][k], want["nested"][k]) for k in (0,))
    assert torch.equal(target["nested"][1]["a"], want["nested"][1]["a"]) and target["epoch"] == 5

"""`predictor label` (issue 20.3): failure labels from the telemetry itself, an operator's CSV
merged in, and `predictor train` on the result."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from predictor.model import labels, training
from telemetry import schema as S
from tests.predictor_fixtures import run_cli

T0 = 1_780_000_000_000
TICK = 60_000


def _samples(rows: list[tuple[str, int, int, str]]) -> pa.Table:
    return pa.table({"timestamp": pa.array([T0 + k * TICK for _, _, k, _ in rows], S.TIMESTAMP),
                     "node": [n for n, _, _, _ in rows], "gpu": pa.array([g for _, g, _, _ in rows], pa.int16()),
                     "uuid": [u for _, _, _, u in rows]})


def _xids(events: list[tuple[str, int, int, int]]) -> pa.Table:
    return pa.table({"timestamp": pa.array([T0 + k * TICK for _, _, k, _ in events], S.TIMESTAMP),
                     "node": [n for n, _, _, _ in events], "gpu": pa.array([g for _, g, _, _ in events], pa.int16()),
                     "xid": pa.array([x for _, _, _, x in events], pa.int32())}, schema=S.XID_SCHEMA)


@pytest.fixture
def fleet() -> tuple[pa.Table, pa.Table]:
    """n1: GPU 1 vanishes after tick 20 and is back at 80, where its XID 79 shows only then (a
    last-value gauge read once it is back); GPU 2 logs XID 79 twice at 30-31 and stops; GPU 0 is
    swapped (new UUID) at tick 40 without a gap. n2: the whole node is silent over ticks 10-40
    (a reboot) and logs application XIDs. Nothing else happens."""
    rows = []
    for k in range(120):
        for gpu in range(3):
            if (gpu == 1 and 20 < k < 80) or (gpu == 2 and k > 30):
                continue
            rows.append(("n1", gpu, k, f"GPU-n1-{gpu}" + ("-new" if gpu == 0 and k >= 40 else "")))
        if not 10 <= k <= 40:
            rows += [("n2", gpu, k, f"GPU-n2-{gpu}") for gpu in range(3)]
    xids = [("n1", 2, 30, 79), ("n1", 2, 31, 79), ("n1", 1, 80, 79), ("n2", 0, 5, 13), ("n2", 1, 50, 43)]
    return _samples(rows), _xids(xids)


def test_critical_xids_vanished_and_replaced_gpus_each_make_one_label(fleet) -> None:
    out = labels.derive(*fleet)
    assert out.schema.names[:len(S.FAILURE_SCHEMA)] == S.FAILURE_SCHEMA.names
    got = [(r["node"], r["gpu"], int(r["timestamp"].timestamp() * 1000), r["source"], r["xid"])
           for r in out.to_pylist()]
    assert got == [("n1", 1, T0 + 21 * TICK, "vanished", 79),     # its node's first tick without it
                   ("n1", 2, T0 + 30 * TICK, "xid", 79),          # XID, repeat and vanish: one incident
                   ("n1", 0, T0 + 40 * TICK, "replaced", 0)]
    assert all(math.isnan(p) for p in out.column("precursor_s").to_pylist())  # unknown, not 0 ("none")


def test_operator_csv_confirms_removes_and_adds(fleet, tmp_path: Path) -> None:
    iso = "2026-05-28T20:26:40Z"  # = T0 + 0 ticks
    csv = tmp_path / "record.csv"
    csv.write_text("node,gpu,time,cause\n"
                   f"n1,2,{(T0 + 32 * TICK) / 1000},hbm\n"       # a ticket two minutes after the XID
                   f"n1,0,{(T0 + 40 * TICK) / 1000},maintenance\n"  # the swap was planned
                   f"n2,1,{iso},thermal\n")                       # a failure the telemetry missed
    out, counts = labels.merge(labels.derive(*fleet), labels.read_operator_csv(csv))
    assert counts == {"confirmed": 1, "removed": 1, "added": 1, "ignored": 0}
    got = {(r["node"], r["gpu"]): (r["mode"], r["source"], int(r["timestamp"].timestamp() * 1000))
           for r in out.to_pylist()}
    assert got == {("n1", 1): ("unknown", "vanished", T0 + 21 * TICK),  # 79 says nothing of the mode
                   ("n1", 2): ("hbm", "xid+operator", T0 + 30 * TICK),
                   ("n2", 1): ("thermal", "operator", T0)}


@pytest.mark.parametrize("text,message", [
    ("node,gpu,when\nn1,0,1\n", "header lacks time, cause"),
    ("node,gpu,time,cause\nn1,x,1,hbm\n,0,1,hbm\nn1,0,yesterday,hbm\n",
     "line 2: invalid literal for int() with base 10: 'x'; line 3: node is empty; "
     "line 4: time 'yesterday' is neither ISO 8601 nor epoch seconds"),
])
def test_a_bad_operator_csv_names_every_bad_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(labels.LabelError, match=message.replace("(", r"\(").replace(")", r"\)")):
        labels.read_operator_csv(path)


def test_label_cli_matches_the_simulator_and_training_reads_it(small_trace: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("node,gpu,time,cause\nnode0001,0,soon,hbm\n")
    res = run_cli("predictor.cli", "label", "--trace", str(small_trace), "--out", str(tmp_path / "x"),
                  "--merge", str(bad), check=False)
    assert res.returncode == 1 and "line 2: time 'soon'" in res.stderr
    assert not (tmp_path / "x" / "failures.parquet").exists()

    out = tmp_path / "derived"
    res = run_cli("predictor.cli", "label", "--trace", str(small_trace), "--out", str(out),
                  "--against", str(small_trace / "failures.parquet"), "--json")
    summary = json.loads(res.stdout)
    truth = pq.read_table(small_trace / "failures.parquet").num_rows
    # every simulated failure ends in a critical XID, and the simulator logs no other
    assert summary["against"]["recall"] == summary["against"]["precision"] == 1.0
    assert summary["failures"] == truth and summary["against"]["offset_s_median"] == 0.0
    res = run_cli("predictor.cli", "label", "--trace", str(small_trace), "--out", str(out), check=False)
    assert res.returncode == 1 and "exists" in res.stderr

    # what train reads from them: unknown precursors give positives (a NaN would give none)
    train_rows, val_rows = training.collect(out)
    assert train_rows.y.sum() > 0 and val_rows.y.sum() > 0

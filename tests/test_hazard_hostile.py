"""predictor hazard against crafted files (issue 48, finding 8): each ends in one clear
line, never a MemoryError, RecursionError, raw ``_csv.Error`` or a silent "0 GPUs scored".
Model files are made by hand here (a Cox model needs no fit to be scored)."""
from __future__ import annotations

import csv
import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import skops.io as sio
from click.testing import CliRunner

from predictor.cli import main
from predictor.hazard import store
from predictor.hazard.features import FEATURE_NAMES
from predictor.hazard.history import HistoryError, read_history
from predictor.hazard.models import LINEAR_TERMS, CoxModel, Standardizer
from tests.test_hazard import make_history

K = len(LINEAR_TERMS)


def cox_payload(**override) -> dict:
    """What store.save writes for a small Cox model, with ``override`` put over it."""
    return {"format_version": store.FORMAT_VERSION, "feature_names": list(FEATURE_NAMES), "kind": "cox",
            "horizon_days": 180.0, "info_json": "{}", "coef": np.full(K, 0.1), "center": np.zeros(K),
            "scale": np.ones(K), "base_days": np.array([30.0, 90.0, 180.0]),
            "base_cumhaz": np.array([0.01, 0.02, 0.04]), **override}


def dump(tmp_path: Path, payload: dict, name: str = "m.skops") -> Path:
    path = tmp_path / name
    sio.dump(payload, str(path))
    return path


def _cli(*args: str):
    return CliRunner().invoke(main, ["hazard", *args])


@pytest.fixture(scope="module")
def history_csv(tmp_path_factory) -> Path:
    return make_history(tmp_path_factory.mktemp("hazard-hostile") / "history.csv", gpus=60)


def test_a_hand_made_model_loads_and_scores(tmp_path):
    hm = store.load(dump(tmp_path, cox_payload()))
    assert isinstance(hm.model, CoxModel) and hm.model.coef.shape == (K,)
    store.save(store.HazardModel(CoxModel(np.zeros(K), Standardizer(np.zeros(K), np.ones(K)), np.array([1.0]),
                                          np.array([0.1])), 30.0, {"a": [1]}), tmp_path / "again.skops")
    assert store.load(tmp_path / "again.skops").info == {"a": [1]}


def test_a_declared_8_tib_array_is_refused_before_allocating(tmp_path):
    """The coef array's .npy header rewritten to declare 2**40 float64 (8 TiB): MemoryError before."""
    good = dump(tmp_path, cox_payload(coef=np.full(K, 0.25)))
    bad = tmp_path / "huge.skops"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith(".npy") and np.load(io.BytesIO(data)).tolist() == [0.25] * K:
                header = io.BytesIO()
                np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False,
                                                              "shape": (1 << 40,)})
                data = header.getvalue() + data[-8 * K:]
            dst.writestr(info, data)
    with pytest.raises(ValueError, match=r"declares shape \(1099511627776,\) of float64"):
        store.load(bad)
    res = _cli("score", "--model", str(bad), "--history", str(make_history(tmp_path / "h.csv", gpus=20)),
               "--out", str(tmp_path / "s.csv"))
    assert res.exit_code == 1 and "cannot load model" in res.output and "Traceback" not in res.output, res.output


def test_a_deep_info_json_is_refused(tmp_path):
    """200,000 nested lists in info_json: RecursionError before."""
    path = dump(tmp_path, cox_payload(info_json="[" * 200_000 + "]" * 200_000))
    with pytest.raises(ValueError, match="info_json is nested deeper than 32 levels"):
        store.load(path)


@pytest.mark.parametrize("name, value, message", [
    ("coef", np.zeros(5), f"coef must be {K} floats"),
    ("scale", np.ones((K, 2)), f"scale must be {K} floats"),
    ("base_cumhaz", np.zeros(2), "base_cumhaz must be 3 floats"),
    ("horizon_days", float("nan"), "is not a positive number of days"),
    ("coef", "abc", f"coef must be {K} floats"),
])
def test_arrays_of_the_wrong_shape_are_refused(tmp_path, name, value, message):
    """A short coefficient vector: a ValueError from numpy's matmul at scoring time before."""
    with pytest.raises(ValueError, match=message):
        store.load(dump(tmp_path, cox_payload(**{name: value})))


def test_a_field_over_the_csv_limit_is_one_error(tmp_path, history_csv):
    bad = tmp_path / "long.csv"
    lines = history_csv.read_text().splitlines()
    lines[3] = '"' + "x" * 200_000 + '",' + lines[3]
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(HistoryError, match=r"line \d+: field larger than field limit"):
        read_history(bad)


def test_a_bom_and_upper_case_booleans_are_read(tmp_path, history_csv):
    """A spreadsheet's UTF-8 BOM ("missing columns ['SN']" before) and TRUE/FALSE as the public Titan files write."""
    text = history_csv.read_text().replace(",True,", ",TRUE,").replace(",False,", ",FALSE,")
    assert ",TRUE," in text and ",FALSE," in text
    odd = tmp_path / "titan.csv"
    odd.write_bytes(b"\xef\xbb\xbf" + text.encode())
    got, want = read_history(odd), read_history(history_csv)
    assert (got.stay_out == want.stay_out).all() and got.stay_out.any() and (got.serials == want.serials).all()


def test_score_at_a_time_outside_the_history_fails(tmp_path, history_csv):
    """--at 2100-01-01 exited 0 with "0 GPUs scored" before."""
    model = dump(tmp_path, cox_payload())
    for at in ("2100-01-01", "1990-01-01"):
        res = _cli("score", "--model", str(model), "--history", str(history_csv), "--at", at,
                   "--out", str(tmp_path / "s.csv"), "--json")
        assert res.exit_code == 2 and "is outside the history (2013-" in res.output, res.output
    res = _cli("score", "--model", str(model), "--history", str(history_csv), "--at", "2017-06-01",
               "--out", str(tmp_path / "s.csv"), "--json")
    assert res.exit_code == 0 and json.loads(res.output)["gpus"] > 0, res.output
    assert len(list(csv.DictReader(open(tmp_path / "s.csv")))) == json.loads(res.output)["gpus"]

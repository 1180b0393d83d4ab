"""The failure model file (predictor/model/model_io.py) against crafted files (issue 48): each ends
in one clear line from ``model_io.load`` and ``predictor score``, never a MemoryError,
RecursionError, a raw skops exception or a failure at the first score. Crafted from the shipped
model, so each differs from a good file in one thing."""
from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import skops.io as sio
from click.testing import CliRunner

from predictor.cli import main
from predictor.model import model_io
from predictor.model.features import FEATURE_NAMES

N = len(FEATURE_NAMES)


@pytest.fixture(scope="module")
def payload() -> dict:
    """What the shipped model file holds."""
    path = Path(model_io.__file__).with_name(model_io.DEFAULT_MODEL)
    return sio.load(str(path), trusted=model_io.TRUSTED_TYPES)


def dump(tmp_path: Path, payload: dict, **override) -> Path:
    path = tmp_path / "m.skops"
    sio.dump({**payload, **override}, str(path))
    return path


def rewrite(src: Path, dst: Path, change) -> Path:
    """``dst``: ``src`` with each member's bytes passed through ``change(name, data)``."""
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dst, "w") as out:
        for info in z.infolist():
            out.writestr(info, change(info.filename, z.read(info)))
    return dst


def refused(path: Path, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        model_io.load(path)
    res = CliRunner().invoke(main, ["score", "--model", str(path), "--out", str(path.with_suffix(".parquet"))])
    assert res.exit_code == 1 and "cannot load model" in res.output, res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1, res.output


def test_the_shipped_model_still_loads(tmp_path, payload):
    m = model_io.load(dump(tmp_path, payload))
    assert m.feature_center.shape == (N,) and 0 < m.sensitive <= m.strict <= 1


def test_a_declared_8_tib_array_is_refused_before_allocating(tmp_path, payload):
    """feature_center's .npy header rewritten to declare 2**40 float64 (8 TiB): MemoryError before."""
    good = dump(tmp_path, payload, feature_center=np.full(N, 0.25))

    def huge(name: str, data: bytes) -> bytes:
        if name.endswith(".npy") and len(data) > 8 * N and np.load(io.BytesIO(data)).tolist() == [0.25] * N:
            header = io.BytesIO()
            np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": (1 << 40,)})
            return header.getvalue() + data[-8 * N:]
        return data

    refused(rewrite(good, tmp_path / "huge.skops", huge), r"declares shape \(1099511627776,\) of float64")


def test_a_deep_info_json_is_refused(tmp_path, payload):
    """200,000 nested lists in info_json: RecursionError before."""
    refused(dump(tmp_path, payload, info_json="[" * 200_000 + "]" * 200_000), "info_json is nested deeper than 32")


def test_a_damaged_schema_is_one_line(tmp_path, payload):
    """A schema node without its class: a raw KeyError from skops' type check before."""
    def damage(name: str, data: bytes) -> bytes:
        if name != "schema.json":
            return data
        schema = json.loads(data)
        del schema["content"]["estimator"]["__class__"]
        return json.dumps(schema).encode()

    refused(rewrite(dump(tmp_path, payload), tmp_path / "damaged.skops", damage), "not a readable model")


class Planted:
    """A type no model file has: loading it could run its code."""


def test_a_foreign_type_is_refused_in_one_line(tmp_path, payload):
    refused(dump(tmp_path, payload, estimator=Planted()), "refusing to load model with unexpected types")


@pytest.mark.parametrize("override, match", [
    ({"feature_center": np.zeros(3)}, f"feature_center must be {N} finite floats"),
    ({"feature_scale": np.full(N, np.nan)}, f"feature_scale must be {N} finite floats"),
    ({"sensitive": float("nan")}, "are not probabilities"),
    ({"estimator": None}, "not a calibrated classifier"),
])
def test_fields_of_the_wrong_shape_are_refused(tmp_path, payload, override, match):
    """A short feature_center: a raw numpy broadcasting ValueError at the first score before."""
    refused(dump(tmp_path, payload, **override), match)

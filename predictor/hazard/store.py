"""A hazard model file: skops, loaded against a fixed type list (as predictor/model/model_io.py does), never pickle.

Linear models are stored as plain arrays; the boosted one as scikit-learn's own objects,
whose types are listed in ``TRUSTED_TYPES``; anything else in a file makes ``load`` refuse it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import skops.io as sio

from predictor.hazard.features import FEATURE_NAMES
from predictor.hazard.models import LINEAR_TERMS, BoostedModel, CoxModel, Standardizer, WeibullAFT
from predictor.ingest.untrusted_files import load_skops, loads_json
from predictor.model.model_io import BOOSTER_TYPES

FORMAT_VERSION = 1
MAX_FILE_BYTES = 256 << 20        # a boosted model is a few MB
MAX_UNPACKED_BYTES = 1 << 30
TRUSTED_TYPES = ["sklearn.ensemble._hist_gradient_boosting.gradient_boosting.HistGradientBoostingClassifier",
                 *BOOSTER_TYPES]


@dataclass
class HazardModel:
    """A fitted model, its horizon, and what it was trained on (``info``)."""

    model: BoostedModel | CoxModel | WeibullAFT
    horizon_days: float
    info: dict = field(default_factory=dict)

    def probability(self, x: np.ndarray, horizon_days: float | None = None) -> np.ndarray:
        return self.model.probability(x, self.horizon_days if horizon_days is None else horizon_days)


def _linear_payload(m: CoxModel | WeibullAFT) -> dict:
    out = {"coef": m.coef, "center": m.std.center, "scale": m.std.scale}
    if isinstance(m, CoxModel):
        out.update(base_days=m.base_days, base_cumhaz=m.base_cumhaz)
    return out


def save(hm: HazardModel, path: str | Path) -> None:
    m = hm.model
    payload = {"format_version": FORMAT_VERSION, "feature_names": list(FEATURE_NAMES), "kind": m.kind,
               "horizon_days": float(hm.horizon_days), "info_json": json.dumps(hm.info)}
    if isinstance(m, BoostedModel):
        payload["estimator"] = m.estimator
    else:
        payload.update(_linear_payload(m))
    sio.dump(payload, str(path))


def load(path: str | Path) -> HazardModel:
    """Load a model file, refusing unknown types, versions or features, declared sizes the
    file does not hold, deep JSON and arrays of the wrong shape: one ValueError, never a
    MemoryError or RecursionError."""
    p = load_skops(path, "hazard model", TRUSTED_TYPES, MAX_FILE_BYTES, MAX_UNPACKED_BYTES)
    if not isinstance(p, dict) or p.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: not a hazard model of format {FORMAT_VERSION}")
    if list(p.get("feature_names", [])) != list(FEATURE_NAMES):
        raise ValueError(f"{path}: model was trained on other features than this predictor computes")
    kind, horizon = p.get("kind"), p.get("horizon_days")
    if not isinstance(horizon, (int, float)) or not math.isfinite(horizon) or horizon <= 0:
        raise ValueError(f"{path}: horizon_days {horizon!r} is not a positive number of days")
    if not isinstance(p.get("info_json"), str):
        raise ValueError(f"{path}: info_json is not a string")
    info = loads_json(p["info_json"], f"{path}: info_json")
    if kind == "boosted":
        model = BoostedModel(p.get("estimator"), float(horizon))
        if getattr(model.estimator, "n_features_in_", None) != len(FEATURE_NAMES):
            raise ValueError(f"{path}: the booster does not take the {len(FEATURE_NAMES)} features")
    elif kind in ("cox", "weibull"):
        model = _linear(p, kind, str(path))
    else:
        raise ValueError(f"{path}: unknown model kind {kind!r}")
    return HazardModel(model, float(horizon), info if isinstance(info, dict) else {})


def _linear(p: dict, kind: str, path: str) -> CoxModel | WeibullAFT:
    """A linear model's arrays, each checked against the shape the design gives it."""
    k = len(LINEAR_TERMS)
    shapes = {"coef": k if kind == "cox" else k + 2, "center": k, "scale": k}
    if kind == "cox":
        n = np.shape(p.get("base_days"))[:1] or (0,)
        shapes.update(base_days=n[0], base_cumhaz=n[0])
    arrays = {}
    for name, length in shapes.items():
        a = p.get(name)
        if not isinstance(a, np.ndarray) or a.dtype.kind != "f" or a.shape != (length,):
            said = f"shape {a.shape} of {a.dtype}" if isinstance(a, np.ndarray) else type(a).__name__
            raise ValueError(f"{path}: {name} must be {length} floats ({kind} model), the file has {said}")
        arrays[name] = a
    std = Standardizer(arrays["center"], arrays["scale"])
    if kind == "cox":
        return CoxModel(arrays["coef"], std, arrays["base_days"], arrays["base_cumhaz"])
    return WeibullAFT(arrays["coef"], std)

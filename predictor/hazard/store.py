"""A hazard model file: skops, loaded against a fixed type list (as predictor/model/model_io.py does), never pickle.

Linear models are stored as plain arrays; the boosted one as scikit-learn's own objects,
whose types are listed in ``TRUSTED_TYPES``; anything else in a file makes ``load`` refuse it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import skops.io as sio

from predictor.hazard.features import FEATURE_NAMES
from predictor.hazard.models import BoostedModel, CoxModel, Standardizer, WeibullAFT
from predictor.model.model_io import BOOSTER_TYPES

FORMAT_VERSION = 1
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
    """Load a model file, refusing unknown types, versions or features."""
    data = Path(path).read_bytes()
    untrusted = [t for t in sio.get_untrusted_types(data=data) if t not in TRUSTED_TYPES]
    if untrusted:
        raise ValueError(f"{path}: refusing to load model with unexpected types {untrusted}")
    p = sio.loads(data, trusted=TRUSTED_TYPES)
    if not isinstance(p, dict) or p.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: not a hazard model of format {FORMAT_VERSION}")
    if list(p["feature_names"]) != list(FEATURE_NAMES):
        raise ValueError(f"{path}: model was trained on other features than this predictor computes")
    kind, horizon = p["kind"], float(p["horizon_days"])
    if kind == "boosted":
        model = BoostedModel(p["estimator"], horizon)
    elif kind == "cox":
        model = CoxModel(np.asarray(p["coef"]), Standardizer(np.asarray(p["center"]), np.asarray(p["scale"])),
                         np.asarray(p["base_days"]), np.asarray(p["base_cumhaz"]))
    elif kind == "weibull":
        model = WeibullAFT(np.asarray(p["coef"]), Standardizer(np.asarray(p["center"]), np.asarray(p["scale"])))
    else:
        raise ValueError(f"{path}: unknown model kind {kind!r}")
    return HazardModel(model, horizon, json.loads(p["info_json"]))

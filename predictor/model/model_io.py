"""The failure model: calibrated gradient boosting plus its two thresholds, saved with skops.

A model file is data, not code: it is written with skops and loaded against a fixed
allow-list of scikit-learn types, so a tampered file is refused instead of executed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np
import skops.io as sio
from sklearn.calibration import CalibratedClassifierCV
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.frozen import FrozenEstimator

from predictor.model.features import FEATURE_NAMES

FORMAT_VERSION = 1
DEFAULT_MODEL = "default.skops"
#: The types a fitted HistGradientBoosting model is made of (the hazard model's store uses them too).
BOOSTER_TYPES = [
    "sklearn.ensemble._hist_gradient_boosting.binning._BinMapper",
    "sklearn.ensemble._hist_gradient_boosting.predictor.TreePredictor",
    "sklearn._loss.loss.HalfBinomialLoss",
    "sklearn._loss.link.LogitLink",
    "sklearn._loss.link.Interval",
    "sklearn._loss._loss.CyHalfBinomialLoss",
    "numpy.dtype",
]
#: Types a model file may contain; anything else makes `load` refuse the file.
TRUSTED_TYPES = [
    "sklearn.calibration._CalibratedClassifier",
    "sklearn.calibration._SigmoidCalibration",
    "sklearn.frozen._frozen.FrozenEstimator",
    *BOOSTER_TYPES,
]


@dataclass
class Model:
    """A fitted classifier and everything needed to turn its output into alarms."""

    estimator: CalibratedClassifierCV
    sensitive: float                     # risk at which a job checkpoints now
    strict: float                        # risk at which an operator is paged
    feature_center: np.ndarray           # healthy median per feature, for reasons
    feature_scale: np.ndarray            # healthy spread per feature, for reasons
    info: dict = field(default_factory=dict)

    def predict(self, features: np.ndarray) -> np.ndarray:
        """Calibrated probability of a failure on this GPU within the horizon."""
        if len(features) == 0:
            return np.empty(0)
        return self.estimator.predict_proba(features)[:, 1]

    def reasons(self, features: np.ndarray, top: int = 2) -> list[str]:
        """The features that stand out most from a healthy GPU, as short text."""
        z = (features - self.feature_center) / self.feature_scale
        out = []
        for row, zr in zip(features, z):
            idx = np.argsort(-np.abs(zr))[:top]
            out.append(", ".join(f"{FEATURE_NAMES[i]}={row[i]:+.3g}" for i in idx))
        return out

    def save(self, path: str | Path) -> None:
        payload = {
            "format_version": FORMAT_VERSION,
            "feature_names": list(FEATURE_NAMES),
            "estimator": self.estimator,
            "sensitive": float(self.sensitive),
            "strict": float(self.strict),
            "feature_center": self.feature_center,
            "feature_scale": self.feature_scale,
            "info_json": json.dumps(self.info),
        }
        sio.dump(payload, str(path))


def fit_estimator(x_train: np.ndarray, y_train: np.ndarray, x_cal: np.ndarray, y_cal: np.ndarray,
                  seed: int = 0) -> CalibratedClassifierCV:
    """Gradient boosting on the training nodes, Platt-calibrated on held-out ones.

    Sigmoid rather than isotonic calibration keeps the ranking strictly monotone,
    which the threshold search on alarm episodes relies on."""
    booster = HistGradientBoostingClassifier(
        max_iter=150, learning_rate=0.1, max_leaf_nodes=31, min_samples_leaf=80,
        l2_regularization=1.0, class_weight="balanced", early_stopping=True,
        validation_fraction=0.15, n_iter_no_change=20, random_state=seed)
    booster.fit(x_train, y_train)
    cal = CalibratedClassifierCV(FrozenEstimator(booster), method="sigmoid")
    cal.fit(x_cal, y_cal)
    return cal


def load(path: str | Path | None = None) -> Model:
    """Load a model file (None: the packaged default), refusing unknown types or versions."""
    if path is None:
        path = resources.files("predictor.model") / DEFAULT_MODEL
    data = Path(str(path)).read_bytes()
    untrusted = [t for t in sio.get_untrusted_types(data=data) if t not in TRUSTED_TYPES]
    if untrusted:
        raise ValueError(f"{path}: refusing to load model with unexpected types {untrusted}")
    payload = sio.loads(data, trusted=TRUSTED_TYPES)
    if payload.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: model format {payload.get('format_version')} is not {FORMAT_VERSION}")
    if list(payload["feature_names"]) != list(FEATURE_NAMES):
        raise ValueError(f"{path}: model was trained on other features than this predictor computes")
    return Model(estimator=payload["estimator"], sensitive=payload["sensitive"], strict=payload["strict"],
                 feature_center=np.asarray(payload["feature_center"]),
                 feature_scale=np.asarray(payload["feature_scale"]),
                 info=json.loads(payload["info_json"]))

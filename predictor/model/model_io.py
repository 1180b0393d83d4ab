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

from predictor.ingest.untrusted_files import load_skops, loads_json
from predictor.model.features import FEATURE_NAMES

FORMAT_VERSION = 1
DEFAULT_MODEL = "default.skops"
MAX_FILE_BYTES = 256 << 20  # the shipped model is 2.3 MB
MAX_UNPACKED_BYTES = 1 << 30
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
    """Load a model file (None: the packaged default), refusing unknown types or versions,
    declared sizes the file does not hold, deep JSON and fields of the wrong shape: one
    ValueError, never a MemoryError, RecursionError or a failure at the first score."""
    if path is None:
        path = resources.files("predictor.model") / DEFAULT_MODEL
    p = load_skops(str(path), "model", TRUSTED_TYPES, MAX_FILE_BYTES, MAX_UNPACKED_BYTES)
    if not isinstance(p, dict) or p.get("format_version") != FORMAT_VERSION:
        version = p.get("format_version") if isinstance(p, dict) else None
        raise ValueError(f"{path}: model format {version!r} is not {FORMAT_VERSION}")
    if list(p.get("feature_names", [])) != list(FEATURE_NAMES):
        raise ValueError(f"{path}: model was trained on other features than this predictor computes")
    estimator = p.get("estimator")
    if not isinstance(estimator, CalibratedClassifierCV) or \
            getattr(estimator, "n_features_in_", None) != len(FEATURE_NAMES):
        raise ValueError(f"{path}: the estimator is not a calibrated classifier of the "
                         f"{len(FEATURE_NAMES)} features")
    thresholds = [p.get("sensitive"), p.get("strict")]
    if not all(isinstance(t, float) and 0.0 <= t <= 1.0 for t in thresholds):
        raise ValueError(f"{path}: thresholds {thresholds!r} are not probabilities")
    center, scale = (np.asarray(p.get(k)) for k in ("feature_center", "feature_scale"))
    for name, a in (("feature_center", center), ("feature_scale", scale)):
        if a.shape != (len(FEATURE_NAMES),) or a.dtype.kind != "f" or not np.isfinite(a).all():
            raise ValueError(f"{path}: {name} must be {len(FEATURE_NAMES)} finite floats, not {a.dtype} {a.shape}")
    if not isinstance(p.get("info_json"), str):
        raise ValueError(f"{path}: info_json is not a string")
    info = loads_json(p["info_json"], f"{path}: info_json")
    return Model(estimator=estimator, sensitive=p["sensitive"], strict=p["strict"], feature_center=center,
                 feature_scale=scale, info=info if isinstance(info, dict) else {})

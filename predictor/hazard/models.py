"""Three models of the time to a GPU's next DBE or OTB, each giving P(event within H days).

- ``CoxModel``: proportional hazards, Breslow partial likelihood and baseline, ridge-penalised.
- ``WeibullAFT``: log T = mu + x.b + sigma.W with W standard minimum extreme value.
- ``BoostedModel``: scikit-learn's histogram gradient boosting on landmark windows: the label
  is "an event within the horizon", which is the operator's question, with no shape assumed.

Cox and Weibull are written here against scipy (a few dozen lines each): lifelines 0.30 pins
pandas < 3 and brings matplotlib, autograd and formulaic to a predictor host; scikit-survival
0.28 pins scikit-learn to 1.9.x and brings ecos, osqp, numexpr and pandas.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize
from sklearn.ensemble import HistGradientBoostingClassifier

from predictor.hazard.features import FEATURE_NAMES

_IDX = {n: i for i, n in enumerate(FEATURE_NAMES)}
#: Columns of the linear models' design: counts and durations on a log scale, cage and node one-hot.
LINEAR_TERMS = ("log_age", "cage1", "cage2", "node1", "node2", "node3", "slot", "row", "col",
                "log_past_events", "had_event", "log_stays", "log_days_in_slot",
                "lot_failed_share", "lot_recent_share", "slot_other_failures")


def linear_design(x: np.ndarray) -> np.ndarray:
    """The linear models' covariates from the feature matrix."""
    c = lambda name: x[:, _IDX[name]]  # noqa: E731
    return np.column_stack([
        np.log1p(c("age_days")), c("cage") == 1, c("cage") == 2, c("node") == 1, c("node") == 2, c("node") == 3,
        c("slot"), c("row"), c("col"), np.log1p(c("past_events")), c("past_events") > 0,
        np.log1p(c("stays")), np.log1p(c("days_in_slot")),
        c("lot_failed_share"), c("lot_recent_share"), c("slot_other_failures"),
    ]).astype(float)


@dataclass
class Standardizer:
    center: np.ndarray
    scale: np.ndarray

    @classmethod
    def fit(cls, z: np.ndarray) -> "Standardizer":
        s = z.std(axis=0)
        return cls(z.mean(axis=0), np.where(s > 0, s, 1.0))

    def __call__(self, z: np.ndarray) -> np.ndarray:
        return (z - self.center) / self.scale


def _breslow(times: np.ndarray, event: np.ndarray, lp: np.ndarray):
    """Risk-set sums at each row's time (ties share the full risk set), times in descending order."""
    order = np.argsort(-times, kind="stable")
    t = times[order]
    last_of_tie = np.r_[np.flatnonzero(t[1:] != t[:-1]), len(t) - 1]
    group_end = np.repeat(last_of_tie, np.diff(np.r_[-1, last_of_tie]))
    return order, group_end


def fit_cox(design: np.ndarray, days: np.ndarray, event: np.ndarray, ridge: float = 1.0):
    """(coefficients per standardised column, the standardiser, baseline times, Breslow cumulative hazard)."""
    std = Standardizer.fit(design)
    z = std(design)
    order, group_end = _breslow(days, event, np.zeros(len(days)))
    zo, do = z[order], event[order].astype(float)
    n_ev = do.sum()

    def loss(b):
        lp = zo @ b
        w = np.exp(lp - lp.max())
        s = np.cumsum(w)[group_end]
        sx = np.cumsum(w[:, None] * zo, axis=0)[group_end]
        ll = (do * (lp - lp.max() - np.log(s))).sum()
        grad = (do[:, None] * (zo - sx / s[:, None])).sum(axis=0)
        return (-ll + 0.5 * ridge * b @ b) / n_ev, (-grad + ridge * b) / n_ev

    res = minimize(loss, np.zeros(z.shape[1]), jac=True, method="L-BFGS-B")
    coef = res.x
    # Breslow baseline: dH0(t) = d(t) / sum over the risk set of exp(lp)
    w = np.exp(zo @ coef)
    s = np.cumsum(w)[group_end]
    t_desc = days[order]
    ev_t, inv = np.unique(t_desc[do > 0], return_inverse=True)
    d = np.bincount(inv, minlength=len(ev_t))
    s_at = np.zeros(len(ev_t))
    s_at[inv] = s[do > 0]
    return coef, std, ev_t, np.cumsum(d / s_at)


@dataclass
class CoxModel:
    kind = "cox"
    coef: np.ndarray
    std: Standardizer
    base_days: np.ndarray     # event times (days from the landmark)
    base_cumhaz: np.ndarray   # Breslow cumulative baseline hazard at them

    @classmethod
    def fit(cls, x: np.ndarray, days: np.ndarray, event: np.ndarray, ridge: float = 1.0) -> "CoxModel":
        return cls(*fit_cox(linear_design(x), days, event, ridge))

    def log_hazard_ratio(self, x: np.ndarray) -> np.ndarray:
        return self.std(linear_design(x)) @ self.coef

    def probability(self, x: np.ndarray, horizon_days: float) -> np.ndarray:
        i = np.searchsorted(self.base_days, horizon_days, side="right")
        h0 = self.base_cumhaz[i - 1] if i > 0 else 0.0
        return 1.0 - np.exp(-h0 * np.exp(self.log_hazard_ratio(x)))

    def hazard_ratios(self) -> dict[str, float]:
        """exp(coefficient) per one unit of each term (not per standard deviation)."""
        return {n: float(np.exp(c / s)) for n, c, s in zip(LINEAR_TERMS, self.coef, self.std.scale)}


@dataclass
class WeibullAFT:
    kind = "weibull"
    coef: np.ndarray          # [mu, b..., log sigma]
    std: Standardizer

    @classmethod
    def fit(cls, x: np.ndarray, days: np.ndarray, event: np.ndarray, ridge: float = 1.0) -> "WeibullAFT":
        std = Standardizer.fit(linear_design(x))
        z = std(linear_design(x))
        logt = np.log(np.maximum(days, 1.0 / 24))
        d = event.astype(float)
        n_ev = max(d.sum(), 1.0)
        k = z.shape[1]

        def loss(p):
            mu, b, log_s = p[0], p[1:k + 1], p[k + 1]
            s = np.exp(log_s)
            zz = (logt - mu - z @ b) / s
            ez = np.exp(np.minimum(zz, 50))
            ll = (d * (zz - log_s) - ez).sum()
            dz = d - ez
            g_mu = (dz * -1 / s).sum()
            g_b = (dz[:, None] * (-z / s)).sum(axis=0)
            g_ls = (dz * -zz).sum() - d.sum()
            grad = np.r_[g_mu, g_b, g_ls]
            pen = np.r_[0.0, b, 0.0]
            return (-ll + 0.5 * ridge * pen @ pen) / n_ev, (-grad + ridge * pen) / n_ev

        p0 = np.r_[logt.mean() + 2.0, np.zeros(k), 0.0]
        res = minimize(loss, p0, jac=True, method="L-BFGS-B")
        return cls(res.x, std)

    def probability(self, x: np.ndarray, horizon_days: float) -> np.ndarray:
        k = len(self.coef) - 2
        mu, b, s = self.coef[0], self.coef[1:k + 1], np.exp(self.coef[k + 1])
        zz = (np.log(horizon_days) - mu - self.std(linear_design(x)) @ b) / s
        return 1.0 - np.exp(-np.exp(np.minimum(zz, 50)))


@dataclass
class BoostedModel:
    kind = "boosted"
    estimator: HistGradientBoostingClassifier
    horizon_days: float

    @classmethod
    def fit(cls, x: np.ndarray, y: np.ndarray, horizon_days: float, seed: int = 0) -> "BoostedModel":
        est = HistGradientBoostingClassifier(
            max_iter=300, learning_rate=0.05, max_leaf_nodes=15, min_samples_leaf=200, l2_regularization=1.0,
            categorical_features=None, early_stopping=True, validation_fraction=0.15, n_iter_no_change=30,
            random_state=seed)
        est.fit(x, y)
        return cls(est, horizon_days)

    def probability(self, x: np.ndarray, horizon_days: float) -> np.ndarray:
        """P(event within the trained horizon), rescaled to another at a constant hazard."""
        if len(x) == 0:
            return np.empty(0)
        p = self.estimator.predict_proba(x)[:, 1]
        if horizon_days == self.horizon_days:
            return p
        return 1.0 - (1.0 - p) ** (horizon_days / self.horizon_days)


def handmade_score(x: np.ndarray) -> np.ndarray:
    """The issue's simple baseline: the lot's failure share, past events, the cage (a ranking, not a probability)."""
    return 10 * x[:, _IDX["lot_failed_share"]] + (x[:, _IDX["past_events"]] > 0) + 0.1 * x[:, _IDX["cage"]]

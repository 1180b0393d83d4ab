"""The ops drain list: the GPUs and blades most likely to fail, with why and how sure.

A blade (``c{col}-{row}c{cage}s{slot}``, all its nodes) is drained as a unit; its figure is the
probability that any of its GPUs fails within the horizon, ``1 - prod(1 - p)``.
"""
from __future__ import annotations

import numpy as np

from predictor.hazard.scoring import Scores


def blade_of(location: str) -> str:
    """The unit drained together: a Titan blade (``c0-0c1s2`` of ``c0-0c1s2n3``), or a trace's host."""
    return location.split("/gpu")[0] if "/gpu" in location else location.rsplit("n", 1)[0]


def drain_list(s: Scores, top: int = 20) -> dict:
    """{"gpus": [...], "blades": [...]} with the top ``top`` of each, most likely first."""
    order = s.order()[:top]
    base = float(s.probability.mean()) if len(s.probability) else 0.0
    gpus = [{"SN": str(s.serial[i]), "location": str(s.location[i]), "probability": round(float(s.probability[i]), 4),
             "times_fleet_mean": round(float(s.probability[i]) / base, 1) if base else None,
             "reasons": s.reasons[i]} for i in order]
    blades: dict[str, list[int]] = {}
    for i, loc in enumerate(s.location):
        blades.setdefault(blade_of(str(loc)), []).append(i)
    any_fail = {b: 1.0 - float(np.prod(1.0 - s.probability[idx])) for b, idx in blades.items()}
    top_blades = sorted(any_fail, key=lambda b: -any_fail[b])[:top]
    return {"fleet_gpus": len(s.probability), "fleet_mean_probability": round(base, 5), "gpus": gpus,
            "blades": [{"blade": b, "probability_any": round(any_fail[b], 4),
                        "worst": str(s.serial[max(blades[b], key=lambda i: s.probability[i])])} for b in top_blades]}

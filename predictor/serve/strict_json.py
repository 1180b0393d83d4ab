"""The service's JSON: RFC 8259 only, so no bare NaN or Infinity reaches a client (a strict
parser, JavaScript's JSON.parse among them, refuses the whole answer)."""
from __future__ import annotations

import json
import math


def strict_dumps(data: object) -> str:
    """JSON, never with bare NaN or Infinity (not JSON: a client's parser refuses them): a
    value that is not finite (a job hazard when a node's probability is 1) goes out as null."""
    try:
        return json.dumps(data, allow_nan=False)
    except ValueError:
        return json.dumps(finite(data), allow_nan=False)


def finite(x: object) -> object:
    """``x`` with every float that is not finite replaced by None."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x

"""Timing and its statistics. On a shared machine contention only ever adds time, so a figure
is a median over repeats (or the minimum, said so), and a comparison of two arms is made of
adjacent blocks, A B B A ..., whose per-pair ratios carry a confidence interval."""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall, CPU of this process) seconds of ``fn()``."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def samples(fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall seconds of ``repeats`` calls of ``fn()``."""
    return [timed(fn)[0] for _ in range(repeats)]


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of ``repeats`` calls of ``fn()``."""
    return statistics.median(samples(fn, repeats))


def spread(xs: list[float]) -> dict[str, float]:
    """Median, min, max and count: the figure and how far the noise moved it."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def median_of(runs: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Each key's median over the runs that measured it (None where none did)."""
    return {k: statistics.median(known) if (known := [r[k] for r in runs if r.get(k) is not None]) else None
            for k in runs[0]}


def abba(pairs: int) -> list[tuple[int, int]]:
    """The arms' order in ``pairs`` adjacent pairs, A B, B A, A B ...: a drift in the machine's
    load over the run falls on both arms alike."""
    return [(0, 1) if i % 2 == 0 else (1, 0) for i in range(pairs)]


def median_ci(xs: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median (order statistics of the sign test): no
    assumption of normal noise, which a shared machine's is not. The full range when too few."""
    s, n = sorted(xs), len(xs)
    k = 0  # [s[k], s[n-1-k]] holds the median with probability 1 - 2 P(Binomial(n, 1/2) <= k)
    while 2 * (k + 1) < n and sum(math.comb(n, i) for i in range(k + 2)) / 2 ** n <= (1 - confidence) / 2:
        k += 1
    return s[k], s[n - 1 - k]


def paired_ratio(a: list[float], b: list[float], confidence: float = 0.95) -> dict[str, float]:
    """B/A per adjacent pair: median, min, max, n and the median's confidence interval
    (``ci_low``, ``ci_high``). An interval that holds 1.0 is no measured difference."""
    ratios = [y / x for x, y in zip(a, b)]
    low, high = median_ci(ratios, confidence)
    return {**spread(ratios), "ci_low": low, "ci_high": high, "confidence": confidence}

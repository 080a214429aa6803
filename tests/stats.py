"""A two-sample test for the sampling tests: are two bags of sampled tokens one distribution?"""

from __future__ import annotations

import math
from collections import Counter


def chi_square(a: Counter, b: Counter) -> tuple[float, int]:
    """Two-sample chi-square statistic over the tokens both saw at least 10 times in all (the rest
    pooled), and its degrees of freedom."""
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    na, nb = sum(a.values()), sum(b.values())
    bins = [(a[k], b[k]) for k in keys]
    rest = (na - sum(x for x, _ in bins), nb - sum(y for _, y in bins))
    if sum(rest) >= 10:
        bins.append(rest)
    stat = 0.0
    for x, y in bins:
        ex, ey = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
        stat += (x - ex) ** 2 / ex + (y - ey) ** 2 / ey
    return stat, len(bins) - 1


def same_distribution(a: Counter, b: Counter) -> tuple[bool, float, int]:
    """Not rejected at p < 1e-4 (the chi-square's normal approximation: df + 3.72 sqrt(2 df))."""
    stat, df = chi_square(a, b)
    return stat < df + 3.72 * math.sqrt(2 * df), stat, df

"""Pairs of runs under a band: which (query, key) pairs of queries [qa, qa+n) x keys [ka, ka+m)
satisfy lo <= i - j <= hi -- none, all or some (:func:`band_relation`) and how many
(:func:`band_pairs`). Every mask kind's classification and work reduce to these
(:mod:`.base`)."""

from __future__ import annotations

INF = float("inf")

__all__ = ["INF", "band_relation", "band_pairs"]


# -- pairs of runs --------------------------------------------------------------------------------
def band_relation(qa: int, n: int, ka: int, m: int, lo: float, hi: float) -> str:
    """Which pairs of queries [qa, qa+n) x keys [ka, ka+m) (one document) the band
    lo <= i - j <= hi keeps: "none", "all" or "some" (decided from the corners)."""
    dmin, dmax = qa - (ka + m - 1), qa + n - 1 - ka
    if dmax < lo or dmin > hi or lo > hi:
        return "none"
    if dmin >= lo and dmax <= hi:
        return "all"
    return "some"


def band_pairs(qa: int, n: int, ka: int, m: int, lo: float, hi: float) -> int:
    """How many (i, j) with i in [qa, qa+n), j in [ka, ka+m) have lo <= i - j <= hi.

    Closed form: query x sees keys [A(x), B(x)] with A = max(ka, x - hi), B = min(ka + m - 1,
    x - lo); the count B - A + 1 (clamped at 0) is linear with slope -1, 0 or 1 between the
    points where A or B switch sides, so each part is an arithmetic series."""
    if n <= 0 or m <= 0:
        return 0
    big = 4 * (n + m + abs(qa - ka)) + 4  # a band edge beyond this never binds
    lo_i = -big if lo == -INF else max(-big, min(big, int(lo)))
    hi_i = big if hi == INF else max(-big, min(big, int(hi)))

    def f(x: int) -> int:
        return min(ka + m - 1, x - lo_i) - max(ka, x - hi_i) + 1

    cuts = sorted({qa, qa + n} | {c for c in (ka + hi_i, ka + m - 1 + lo_i) if qa < c < qa + n})
    total = 0
    for x0, x1 in zip(cuts, cuts[1:]):
        f0, last = f(x0), x1 - 1
        slope = f(last) - f0 if last > x0 else 0
        slope = (slope > 0) - (slope < 0)
        if slope == 0:
            total += (x1 - x0) * max(0, f0)
            continue
        if slope > 0:  # positive from x0 + max(0, 1 - f0) on
            a = x0 + max(0, 1 - f0)
            b = last
        else:  # positive up to x0 + f0 - 1
            a = x0
            b = min(last, x0 + f0 - 1)
        if a <= b:
            total += (f(a) + f(b)) * (b - a + 1) // 2
    return total



"""Attention work of packed documents: the allowed (query, key) pairs of a span of a document
(:func:`document_work`), and of a layout's runs of global positions (:func:`max_work`) -- what
the balanced layout (:mod:`.balance`) balances and the planner's compute floor counts.

Worked example: documents [0, 8) and [8, 16) under a causal mask; Megatron's zigzag over two ranks
(:func:`zigzag_runs`) gives rank 0 positions 0-3 and 12-15 -- 1 + 2 + 3 + 4 = 10 pairs in the first
document and 5 + 6 + 7 + 8 = 26 in the second -- and rank 1 positions 4-11 (26 + 10): ``max_work``
is 36.
"""

from __future__ import annotations

import bisect

from .sel import merge_runs

__all__ = ["document_work", "max_work", "zigzag_runs"]


def _sum_min(n: int, c: int | None) -> int:
    """sum_{t=0}^{n-1} min(t, c) (c None: unlimited)."""
    if n <= 0:
        return 0
    if c is None or n <= c + 1:
        return n * (n - 1) // 2
    return c * (c + 1) // 2 + (n - c - 1) * c


def document_work(a: int, b: int, length: int, causal: bool = True, window=(None, None)) -> int:
    """Allowed keys of the queries at positions [a, b) of a document of ``length`` tokens:
    query t sees min(t, left) keys before it, itself, and (non-causal) min(length-1-t, right)
    after it. E.g. document_work(0, 4, 4) == 10 (1 + 2 + 3 + 4)."""
    left, right = window
    before = _sum_min(b, left) - _sum_min(a, left)
    after = 0 if causal else _sum_min(length - a, right) - _sum_min(length - b, right)
    return (b - a) + before + after


def zigzag_runs(S: int, units: int) -> list[tuple[tuple[int, int], ...]]:
    """Megatron's zigzag of ``S`` tokens over ``units`` ranks (or Ulysses groups): unit u holds
    halves u and 2 units - 1 - u of the sequence's 2 units, as (global start, length) runs."""
    h = S // (2 * units)
    return [tuple(merge_runs([(u * h, h), ((2 * units - 1 - u) * h, h)])) for u in range(units)]


def max_work(units, bounds, causal: bool = True, window=(None, None)) -> int:
    """The largest work of ``units`` (each a sequence of (global start, length) runs) over the
    documents ``bounds`` ((start, end), ... covering the sequence in order)."""
    starts = [a for a, _ in bounds]

    def work(s: int, n: int) -> int:
        total, p = 0, s
        while p < s + n:  # the run cut at document boundaries
            a, b = bounds[bisect.bisect_right(starts, p) - 1]
            e = min(b, s + n)
            total += document_work(p - a, e - a, b - a, causal, window)
            p = e
        return total

    return max(sum(work(s, n) for s, n in runs) for runs in units)

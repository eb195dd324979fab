"""The greedy fill behind the balanced layout (:mod:`.balance`): portions of documents into bins of
exactly ``capacity`` tokens each, with balanced work (:func:`fill_bins`).

A :class:`Portion` is runs of one document that go to one bin together; its work is the (query,
key) pairs the mask allows to its query tokens (``mask.span_work``), its *density* the work per
token. Algorithm (one pass, O(portions log portions)): portions above ``portion_work`` x the mean
work per bin (or above a bin's tokens) are cut into *zigzag portions* (portion i = the halves i and
2k-1-i of 2k, so every portion has the same work) and put in a pool ordered by density. Bins are
filled one after another, each to exactly ``capacity`` tokens and a work target of (work left) /
(bins left): first the densest portions whole while the rest of the bin can still be filled below
the target with the lightest portions, then one cut of the next densest portion to reach the
target, then the tokens are filled with the portions closest to the density still needed, the last
one cut to fit. A cut portion goes back to the pool (the next bin usually takes the rest), so at
most a few portions per bin are cut. Last, tokens are swapped between the busiest and the idlest
bin (the same number each way, the denser ones to the idler bin) while that narrows the gap.

Worked example (2 bins of 8 tokens, causal, documents [0, 12) and [12, 16): work 78 and 10, mean
44 a bin). The first document is above the mean, so it is cut into 2 zigzag portions, its
quarters 0 and 3, 1 and 2: [0, 3) + [9, 12) and [3, 6) + [6, 9), work 39 each (density 6.5); the
second stays whole (density 2.5). Bin 0 (target 44) takes one zigzag portion whole (39, and its 2
tokens left can be filled with 5 more); cutting the other one would overshoot (39 + 6.5 + 2.5 >
44), so the 2 tokens come from the portion closest to the density still needed, 5 / 2: the short
document, cut to its first 2 tokens (work 3). Bin 1 takes the rest::

    bin 0: [0, 3) + [9, 12) + [12, 14)    work 39 + 3 = 42
    bin 1: [3, 9) + [14, 16)              work 39 + 7 = 46

and the even-out stops: swapping even one token would move 5 pairs across a gap of 4
(``tests/plan/test_balance.py`` pins it).
"""

from __future__ import annotations

import bisect
import math
from collections import deque

from .layout import split_evenly
from .sel import merge_runs

__all__ = ["Portion", "fill_bins", "portion_runs"]


class Portion:
    """Runs (document-relative [a, b)) of one document that go to one rank together."""

    __slots__ = ("doc", "start", "length", "runs", "tokens", "work", "density")

    def __init__(self, doc: int, start: int, length: int, runs, mask):
        self.doc, self.start, self.length, self.runs = doc, start, length, runs
        tokens = work = 0
        for a, b in runs:  # a loop, not two sums (a layout makes thousands of portions)
            tokens += b - a
            work += mask.span_work(a, b, length)
        self.tokens, self.work = tokens, work
        self.density = work / tokens  # work per token, read at every step of a fill

    def cut(self, x: int, mask) -> tuple["Portion", "Portion"]:
        """The first ``x`` tokens, taken from every run in proportion (a zigzag portion keeps its
        density), and the rest."""
        sizes = [b - a for a, b in self.runs]
        take = [s * x // self.tokens for s in sizes]
        left = x - sum(take)
        for i, s in enumerate(sizes):
            more = min(left, s - take[i])
            take[i] += more
            left -= more
        first = [(a, a + t) for (a, b), t in zip(self.runs, take) if t]
        rest = [(a + t, b) for (a, b), t in zip(self.runs, take) if a + t < b]
        return (Portion(self.doc, self.start, self.length, first, mask),
                Portion(self.doc, self.start, self.length, rest, mask))


def _take(runs, lo: int, hi: int) -> list[tuple[int, int]]:
    """The runs covering tokens [lo, hi) of the concatenation of ``runs``."""
    out, pos = [], 0
    for a, b in runs:
        x, y = max(lo, pos), min(hi, pos + b - a)
        if x < y:
            out.append((a + x - pos, a + y - pos))
        pos += b - a
    return out


def _zigzag(p: Portion, k: int, mask) -> list[Portion]:
    """``p`` as k zigzag portions: its tokens (in position order) cut into 2k equal parts, portion i
    = parts i and 2k-1-i -- a causal document's light front paired with its dense back, so the
    portions have (nearly) the same work. A whole document gives its halves i and 2k-1-i."""
    runs = sorted(p.runs)
    h = split_evenly(p.tokens, 2 * k)
    return [Portion(p.doc, p.start, p.length, _take(runs, h[i], h[i + 1]) + _take(runs, h[2 * k - 1 - i], h[2 * k - i]),
                   mask) for i in range(k)]


class _Pool:
    """Portions by density: the densest, the lightest, the one closest to a density."""

    def __init__(self, portions):
        self.by: dict[float, deque] = {}
        for p in sorted(portions, key=lambda p: (p.density, p.doc, p.runs[0][0])):
            self.by.setdefault(p.density, deque()).append(p)
        self.keys = sorted(self.by)

    def __len__(self) -> int:
        return len(self.keys)

    def take(self, i: int) -> Portion:
        k = self.keys[i]
        q = self.by[k]
        p = q.popleft()
        if not q:
            del self.by[k]
            self.keys.pop(i)
        return p

    def peek(self, i: int) -> Portion:
        return self.by[self.keys[i]][0]

    def closest(self, density: float) -> int:
        i = bisect.bisect_left(self.keys, density)
        if i == len(self.keys) or (i > 0 and density - self.keys[i - 1] <= self.keys[i] - density):
            i -= 1
        return i

    def put(self, p: Portion) -> None:
        q = self.by.get(p.density)
        if q is None:
            q = self.by[p.density] = deque()
            bisect.insort(self.keys, p.density)
        q.appendleft(p)

    def lightest_fill(self, tokens: int) -> float:
        """Work of the lightest portions holding ``tokens`` tokens (the least any fill can add)."""
        w = 0.0
        for k in self.keys:
            for p in self.by[k]:
                if p.tokens >= tokens:
                    return w + tokens * p.density
                w += p.work
                tokens -= p.tokens
        return w


def _split_heavy(portions, work_cap: float, token_cap: int, mask) -> list[Portion]:
    """Every portion above ``work_cap`` work or ``token_cap`` tokens as zigzag portions below both."""
    out = []
    for p in portions:
        k = min(max(1, math.ceil(p.work / work_cap), math.ceil(p.tokens / token_cap)), max(1, p.tokens // 2))
        out += [p] if k == 1 else _zigzag(p, k, mask)
    return out


def _fill(pool: _Pool, tokens: int, target: float, mask) -> list[Portion]:
    """One bin: exactly ``tokens`` tokens with work close to ``target`` (see the module docstring)."""
    got: list[Portion] = []
    t = w = 0

    def take(p: Portion) -> None:
        nonlocal t, w
        got.append(p)
        t += p.tokens
        w += p.work

    while len(pool) > 1:  # the densest portions whole, while the rest can still be filled below the target
        p = pool.peek(len(pool) - 1)
        if p.tokens > tokens - t:
            break
        pool.take(len(pool) - 1)
        if w + p.work + pool.lightest_fill(tokens - t - p.tokens) > target:
            pool.put(p)
            break
        take(p)
    if len(pool) > 1 and t < tokens:  # one cut of the densest portion: as much as keeps the rest fillable
        p = pool.take(len(pool) - 1)
        lo, hi = 0, min(tokens - t, p.tokens - 1)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if w + mid * p.density + pool.lightest_fill(tokens - t - mid) <= target:
                lo = mid
            else:
                hi = mid - 1
        if lo > 0:
            first, rest = p.cut(lo, mask)
            pool.put(rest)
            take(first)
        else:
            pool.put(p)
    while t < tokens:  # the tokens, with the portions closest to the density still needed
        p = pool.take(pool.closest((target - w) / (tokens - t)))
        if p.tokens > tokens - t:
            first, rest = p.cut(tokens - t, mask)
            pool.put(rest)
            p = first
        take(p)
    return got


def _even_out(bins: list[list[Portion]], mask, tolerance: float = 0.01) -> None:
    """Swap tokens between the busiest and the idlest bin -- the same number each way, the denser
    ones to the idler bin -- until they are within ``tolerance`` of the mean (the greedy fill's
    last bins take what is left)."""
    works = [sum(p.work for p in b) for b in bins]
    mean = sum(works) / len(works)
    for _ in range(4 * len(bins)):
        h = max(range(len(bins)), key=works.__getitem__)
        lo = min(range(len(bins)), key=works.__getitem__)
        gap = works[h] - works[lo]
        if gap <= 2 * tolerance * mean:
            return
        ph = max(bins[h], key=lambda p: p.density)
        pl = min(bins[lo], key=lambda p: p.density)
        if ph.density <= pl.density:
            return
        m = min(round(gap / 2 / (ph.density - pl.density)), ph.tokens, pl.tokens)
        if m < 1:
            return
        moved_h, kept_h = ph.cut(m, mask) if m < ph.tokens else (ph, None)
        moved_l, kept_l = pl.cut(m, mask) if m < pl.tokens else (pl, None)
        bins[h].remove(ph)
        bins[lo].remove(pl)
        bins[h] += [x for x in (kept_h, moved_l) if x is not None]
        bins[lo] += [x for x in (kept_l, moved_h) if x is not None]
        works[h], works[lo] = sum(p.work for p in bins[h]), sum(p.work for p in bins[lo])


def portion_runs(portions) -> tuple[tuple[int, int], ...]:
    """(global start, length) of the portions' tokens, sorted and joined."""
    return tuple(merge_runs((s, e - s) for s, e in sorted((p.start + a, p.start + b) for p in portions
                                                          for a, b in p.runs)))


def fill_bins(portions, bins: int, capacity: int, mask, portion_work: float) -> list[list[Portion]]:
    """``portions`` into ``bins`` bins of exactly ``capacity`` tokens each, work balanced: heavy
    portions cut into zigzag portions, the greedy fill, the even-out (the module docstring)."""
    total = sum(p.work for p in portions)
    pool = _Pool(_split_heavy(portions, max(1.0, portion_work * total / bins), capacity, mask))
    filled, left = [], total
    for b in range(bins):
        got = _fill(pool, capacity, left / (bins - b), mask)
        left -= sum(p.work for p in got)
        filled.append(got)
    _even_out(filled, mask)
    return filled

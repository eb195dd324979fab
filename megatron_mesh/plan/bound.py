"""Lower bounds on the bytes the busiest rank sends, per sample of packed documents (causal, no
window), against which a layout's plans are measured (the planner's "x bound" column).

**Query-owner bound** (every allowed pair computed on the rank that holds its query: ring, TASP,
Mesh on document plans, the inner plans of the hybrids). Take a document of L tokens that no
rank can hold whole -- more than T = S / P tokens, or more causal pairs, L(L+1)/2, than the work
budget B (``budget`` x the mean per-rank work) -- and the rank r holding its last row L-1. Let m
be one more than the largest row any *other* rank holds (m >= 1: the document is split). Then:

* every token r holds below m is read by that other rank's row m-1: r sends its K/V at least once
  (``kv`` bytes a token);
* r's last row reads every token below m: for each one r does not hold, r computes a dK/dV
  partial that only it can send (``dkv`` bytes a token, fp32) -- relays or chained reductions
  move it further, they do not remove r's send;
* r holds every row from m on: at most T tokens, so m >= L - T, and the rows' work
  L(L+1)/2 - m(m+1)/2, plus at least a(a+1)/2 for the a rows it holds below m, is at most B.

So r sends at least ``kv`` x a + ``dkv`` x (m - a); the bound is that minimised over every
feasible (m, a), maximised over the documents. With ``kv`` = ``dkv`` = b (fp32 inputs) it is
b x m_min, m_min = max(L - T, the least m with m(m+1)/2 >= L(L+1)/2 - B) ~ b max(sqrt(L^2 - 2B),
L - T) (:attr:`QueryOwnerBound.simple`: that form with b = min(kv, dkv), valid for any dtype);
with 16-bit inputs the dK/dV partials are twice the K/V, and r holding early tokens of the
document (a > 0) can trade one for the other only as far as T and B let it.

Worked example (P = 2, T = 4, a document of 7 tokens and one of 1, b = kv = dkv a token): the
work is 28 + 1 = 29 pairs, B = 1.05 x 14.5 = 15.2. The first document does not fit (7 > T); its
last-row holder r holds rows m..6, of 28 - m(m+1)/2 <= 15.2 pairs, only for m >= 5: r sends at
least 5b. A layout that sends exactly that on both ranks: r = rank 0 holds tokens 0, 5, 6 and the
short document (work 1 + 6 + 7 + 1 = 15), rank 1 holds 1-4 (work 14); rank 0 sends token 0's K/V
and the dK/dV partials of tokens 1-4, rank 1 the K/V of 1-4 and the partial of token 0
(``tests/plan/test_bound.py`` checks the bound against every layout of such problems).

**Any placement** (a block may be computed on any rank: ``BalancedLayout.owners``, 2-D tiles). A
rank c that computes A pairs of rows and columns it does not hold must send the partial results
of those rows (output and dQ: ``q_side`` bytes a token) and columns (dK/dV: ``kv_side``), and A
pairs need |R| x |C| >= A: by the arithmetic-geometric mean, ``q_side`` |R| + ``kv_side`` |C| >=
2 sqrt(q_side kv_side A) (:func:`tile_bound`). With its own T tokens c can cover more pairs for
free: pairs whose two tokens c holds need nothing, so A' pairs of which each touches a token c
does not hold need (|R| + T)(|C| + T) >= A' + T^2 (:func:`rank_bound`). Per sample, a document
longer than T has at least w - sum of n(n+1)/2 over the (at most T-token) parts its holders keep
pairs whose tokens lie on two ranks; spread over the P ranks, the busiest computes at least 1/P
of them (:attr:`PlacementBound.bytes`). It is far below the query-owner bound -- the room that
choosing a block's rank could win, not a target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .accounting import buffer_bytes
from .shape import AttentionShape

__all__ = ["QueryOwnerBound", "PlacementBound", "query_owner_bound", "placement_bound", "tile_bound", "rank_bound",
           "BUDGET"]

# the work budget the bounds assume: each rank at most this x the mean per-rank work (the balanced
# layout's target, docs/performance.md)
BUDGET = 1.05


def _pairs(n: int) -> int:
    return n * (n + 1) // 2


def _lengths(cu_seqlens) -> list[int]:
    cu = [int(c) for c in cu_seqlens]
    if len(cu) < 2 or cu[0] != 0 or any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must be strictly increasing from 0, got {list(cu_seqlens)!r}")
    return [b - a for a, b in zip(cu, cu[1:])]


def _check(world_size: int, budget: float) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not isinstance(budget, (int, float)) or isinstance(budget, bool) or not 1 <= budget < math.inf:
        raise ValueError(f"budget must be a number >= 1 (the busiest rank's work over the mean), got {budget!r}")


@dataclass(frozen=True)
class QueryOwnerBound:
    """The query-owner bound of one sample: ``bytes`` (the lemma with ``kv`` and ``dkv`` apart),
    ``simple`` (b x max(sqrt(L^2 - 2B), L - T), b = min(kv, dkv)), the ``document`` (index) that
    sets it, and that document's least ``m``; all 0 / None when every document can sit whole."""

    bytes: float
    simple: float
    document: int | None
    m: int


def _least_m(L: int, T: int, B: float) -> int:
    """The least m (1 <= m < L) with m >= L - T and the rows m..L-1 within B."""
    need = _pairs(L) - B
    m = 0 if need <= 0 else math.ceil((math.sqrt(1 + 8 * need) - 1) / 2)
    while m > 0 and _pairs(m - 1) >= need:  # the float root may overshoot by one
        m -= 1
    while _pairs(m) < need:
        m += 1
    return max(m, L - T, 1)


def _rows_below(L: int, T: int, B: float, m: int) -> int | None:
    """The most rows the last-row holder can hold below m (None: m infeasible): at most m - 1 (row
    m - 1 is another rank's), T - (L - m) tokens, and a(a+1)/2 of the work left."""
    left = B - (_pairs(L) - _pairs(m))
    if left < 0 or L - m > T:
        return None
    a = int((math.sqrt(1 + 8 * left) - 1) / 2)
    while _pairs(a) > left:
        a -= 1
    while _pairs(a + 1) <= left:
        a += 1
    return max(0, min(m - 1, T - (L - m), a))


def _cost(L: int, T: int, B: float, kv: int, dkv: int, m: int) -> float:
    a = _rows_below(L, T, B, m)
    if a is None:
        return math.inf
    a = a if kv < dkv else 0  # holding a row below m trades a dK/dV partial for a K/V send
    return kv * a + dkv * (m - a)


def _document_bound(L: int, T: int, B: float, kv: int, dkv: int, scan: bool = False) -> float:
    """min over feasible (m, a) of kv a + dkv (m - a), for one document that cannot sit whole.
    Where K/V is cheaper than dK/dV, the cost falls while the work left bounds a (a grows by about
    m / a per step of m) and rises by kv per step once a token cap does: the least m and the m where
    the work stops binding are the candidates (``scan``: every m, which the tests compare)."""
    lo = _least_m(L, T, B)
    if lo >= L:  # its last row alone is over B: no query-owner layout keeps the budget
        return math.inf
    if scan:
        return min(_cost(L, T, B, kv, dkv, m) for m in range(lo, L))
    cand = {lo}
    if kv < dkv:
        def work_binds(m: int) -> bool:
            a = _rows_below(L, T, B, m)
            return a is not None and a < min(m - 1, T - (L - m))

        a_lo, a_hi = lo, L - 1  # the last m at which the work still binds
        if work_binds(a_lo):
            while a_lo < a_hi:
                mid = (a_lo + a_hi + 1) // 2
                if work_binds(mid):
                    a_lo = mid
                else:
                    a_hi = mid - 1
            cand |= {a_lo, min(a_lo + 1, L - 1)}
            # inside, a ~ sqrt(m^2 + c): convex in m where c < 0 (the document alone is over B), so
            # the cost is too, with its least value where dkv = (dkv - kv) m / a
            c = 2 * B - L * (L + 1)
            rho = (dkv - kv) / dkv
            if c < 0:
                m0 = min(max(round(math.sqrt(-c / (1 - rho * rho))), lo), a_lo)
                cand |= set(range(max(lo, m0 - 64), min(a_lo, m0 + 64) + 1))  # a is an integer: look around
    return min(_cost(L, T, B, kv, dkv, m) for m in cand)


def query_owner_bound(cu_seqlens, world_size: int, shape: AttentionShape, budget: float = BUDGET) -> QueryOwnerBound:
    """The query-owner bound (module docstring) of the documents ``cu_seqlens`` over ``world_size``
    ranks of ``shape.seq_local`` tokens each, K/V and dK/dV bytes per token from ``shape``, work
    at most ``budget`` x the mean per rank. Causal attention without a window."""
    _check(world_size, budget)
    lengths = _lengths(cu_seqlens)
    T = shape.seq_local
    if sum(lengths) != T * world_size:
        raise ValueError(f"the documents cover {sum(lengths)} tokens, {world_size} ranks of {T} hold "
                         f"{T * world_size}")
    kv, dkv = buffer_bytes("kv", 1, shape), buffer_bytes("dkv", 1, shape)
    B = budget * sum(_pairs(n) for n in lengths) / world_size
    best = QueryOwnerBound(0, 0.0, None, 0)
    for d, L in enumerate(lengths):
        if L <= T and _pairs(L) <= B:
            continue
        m = _least_m(L, T, B)
        got = _document_bound(L, T, B, kv, dkv)
        simple = min(kv, dkv) * max(math.sqrt(max(0.0, L * L - 2 * B)), L - T)
        if got > best.bytes or (got == best.bytes and simple > best.simple):
            best = QueryOwnerBound(got, simple, d, m)
    return best


def tile_bound(pairs: float, q_side: float, kv_side: float) -> float:
    """Bytes a rank sends to compute ``pairs`` pairs of rows and columns it holds none of:
    2 sqrt(q_side kv_side pairs) (|R| |C| >= pairs and the arithmetic-geometric mean)."""
    return 2.0 * math.sqrt(q_side * kv_side * max(0.0, pairs))


def rank_bound(pairs: float, own: int, q_side: float, kv_side: float) -> float:
    """Bytes a rank holding ``own`` tokens sends to compute ``pairs`` pairs each of which touches a
    token it does not hold: the least q_side x + kv_side y with (x + own)(y + own) >= pairs + own^2
    (x remote rows, y remote columns; :func:`tile_bound` at own = 0)."""
    need = max(0.0, pairs) + own * own
    if need <= own * own:
        return 0.0
    side = math.sqrt(need * kv_side / q_side)  # x + own at the unconstrained optimum
    if side >= own and need / side >= own:
        return 2.0 * math.sqrt(q_side * kv_side * need) - (q_side + kv_side) * own
    # one side stays at zero: the cheaper of all rows or all columns
    return min(q_side, kv_side) * (need / own - own)


@dataclass(frozen=True)
class PlacementBound:
    """The any-placement bound of one sample: ``bytes`` the busiest rank sends at least, from
    ``pairs`` pairs whose tokens lie on two ranks (at least) spread over the ranks."""

    bytes: float
    pairs: int


def placement_bound(cu_seqlens, world_size: int, shape: AttentionShape) -> PlacementBound:
    """The any-placement bound (module docstring): a document longer than T = ``shape.seq_local``
    keeps at most n(n+1)/2 pairs on each rank holding n <= T of its tokens; the rest cross ranks,
    and the rank computing the most of them (at least 1/P of all) sends :func:`rank_bound` of
    them (Q side: output and dQ partials; K/V side: dK/dV partials)."""
    _check(world_size, BUDGET)
    lengths = _lengths(cu_seqlens)
    T = shape.seq_local
    crossing = 0
    for L in lengths:
        if L > T:
            whole, rest = divmod(L, T)
            crossing += _pairs(L) - whole * _pairs(T) - _pairs(rest)
    q_side = buffer_bytes("o", 1, shape) + buffer_bytes("dq", 1, shape)
    kv_side = buffer_bytes("dkv", 1, shape)
    return PlacementBound(rank_bound(crossing / world_size, T, q_side, kv_side), crossing)

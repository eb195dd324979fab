"""The lower bounds on the busiest rank's bytes (plan/bound.py) against brute force: every layout
of small problems (query owner), every layout and every rank for each pair (any placement), the
per-rank rectangle forms against every choice of rows and columns, and the plans themselves."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from megatron_mesh.plan import AttentionShape, Mask, balanced_layout, plan_bytes, resolve
from megatron_mesh.plan.bound import (_document_bound, placement_bound, query_owner_bound, rank_bound, tile_bound)
from megatron_mesh.plan.accounting import buffer_bytes


def _layouts(S: int, P: int, T: int):
    """Every assignment of S tokens to P ranks of T tokens each (the rank of each token)."""
    def rec(x, counts, cur):
        if x == S:
            yield tuple(cur)
            return
        for r in range(P):
            if counts[r] < T:
                counts[r] += 1
                cur.append(r)
                yield from rec(x + 1, counts, cur)
                cur.pop()
                counts[r] -= 1
    yield from rec(0, [0] * P, [])


def _query_owner_sends(cu, owner, P, kv, dkv):
    """Per rank (bytes sent, causal pairs of its rows) when every pair is computed by its query's
    owner and every piece goes straight to each rank that reads it."""
    sends, work = [0] * P, [0] * P
    for a, b in zip(cu, cu[1:]):
        last = {}
        for y in range(a, b):
            work[owner[y]] += y - a + 1
            last[owner[y]] = y
        for x in range(a, b):
            readers = [g for g, y in last.items() if g != owner[x] and y > x]
            sends[owner[x]] += kv * len(readers)  # its K/V to each rank with a later row
            for g in readers:
                sends[g] += dkv  # and each of them returns its dK/dV partial
    return sends, work


def _brute_query_owner(cu, P, kv, dkv, budget=1.05):
    S = cu[-1]
    W = sum((b - a) * (b - a + 1) // 2 for a, b in zip(cu, cu[1:]))
    best = None
    for owner in _layouts(S, P, S // P):
        sends, work = _query_owner_sends(cu, owner, P, kv, dkv)
        if max(work) <= budget * W / P and (best is None or max(sends) < best):
            best = max(sends)
    return best


def _shape(T, itemsize):
    return AttentionShape(T, 1, 1, 1, 1, itemsize)  # kv = 2 x itemsize a token, dkv = 8


def test_worked_example_of_the_module_docstring():
    shape = _shape(4, 4)
    b = query_owner_bound([0, 7, 8], 2, shape)
    kv = buffer_bytes("kv", 1, shape)
    assert (b.bytes, b.document, b.m) == (5 * kv, 0, 5)
    owner = (0, 1, 1, 1, 1, 0, 0, 0)  # the docstring's layout reaches it on both ranks
    assert _query_owner_sends([0, 7, 8], owner, 2, kv, buffer_bytes("dkv", 1, shape)) == ([5 * kv] * 2, [15, 14])


CASES = [([0, 6, 8], 2), ([0, 7, 8], 2), ([0, 5, 8], 2), ([0, 6, 7, 8], 2), ([0, 10, 12], 2), ([0, 9, 12], 3),
         ([0, 8, 10, 12], 3), ([0, 3, 10, 12], 2), ([0, 12], 3)]


@pytest.mark.parametrize("cu, P", CASES)
def test_query_owner_bound_is_below_every_layout(cu, P):
    """No layout of these small problems within the work budget sends less than the bound, with
    K/V as large as dK/dV (fp32) or half of it (bf16); on some the best layout meets it."""
    met = 0
    for itemsize in (4, 2):
        shape = _shape(cu[-1] // P, itemsize)
        kv, dkv = buffer_bytes("kv", 1, shape), buffer_bytes("dkv", 1, shape)
        bound = query_owner_bound(cu, P, shape)
        best = _brute_query_owner(cu, P, kv, dkv)
        assert best is not None and bound.bytes <= best, (itemsize, bound, best)
        assert bound.simple <= bound.bytes + 1e-9
        met += bound.bytes == best
    if cu in ([0, 7, 8], [0, 10, 12]):
        assert met >= 1


def test_query_owner_bound_is_zero_when_every_document_fits():
    assert query_owner_bound([0, 2, 4, 6, 8], 2, _shape(4, 2)).bytes == 0
    assert _brute_query_owner([0, 2, 4, 6, 8], 2, 4, 8) == 0


def test_candidates_find_the_least_cost_of_every_m():
    """The bound evaluates a few candidate m per document; a scan of every m gives the same."""
    rng = random.Random(7)
    for _ in range(1500):
        T, L = rng.randint(1, 300), rng.randint(2, 1500)
        B = rng.uniform(1, L * L)
        if L <= T and L * (L + 1) / 2 <= B:
            continue
        kv, dkv = rng.choice((1, 2, 4)), rng.choice((1, 2, 4, 8))
        assert _document_bound(L, T, B, kv, dkv) == _document_bound(L, T, B, kv, dkv, scan=True), (L, T, B, kv, dkv)


@pytest.mark.parametrize("world, seq, mean", [(4, 4096, 512), (8, 8192, 1024)])
def test_the_plans_send_at_least_the_bound(world, seq, mean):
    """Every plain mode's plan on the balanced layout of sampled documents (bf16, GQA): its busiest
    rank sends at least the query-owner bound."""
    rng = random.Random(world)
    shape = AttentionShape(seq // world, 1, 4, 2, 8, 2)
    for _ in range(3):
        cu = [0]
        while cu[-1] < seq:
            cu.append(min(seq, cu[-1] + max(1, round(rng.lognormvariate(math.log(mean) - 0.5, 1.0)))))
        bound = query_owner_bound(cu, world, shape).bytes
        layout = balanced_layout(cu, world)
        for mode in ("ring", "tasp"):
            plan = resolve(mode, world, shape).build(shape, Mask(True), layout)
            assert max(b.sent for b in plan_bytes(plan, shape)) >= bound


def test_tile_and_rank_bounds_are_below_every_rectangle():
    """A rank computing the causal pairs of rows R and columns C (of one document), holding the
    tokens O, sends q_side for each row and kv_side for each column it does not hold; the
    rectangle forms are below that for every R, C and O of a 6-token document."""
    L, q_side, kv_side = 6, 3.0, 1.0
    tokens = range(L)
    subsets = [frozenset(c) for n in range(L + 1) for c in itertools.combinations(tokens, n)]
    for own in subsets:
        for rows in subsets:
            for cols in subsets:
                pairs = sum(1 for i in rows | own for j in cols | own if j <= i and not (i in own and j in own))
                sent = q_side * len(rows - own) + kv_side * len(cols - own)
                assert rank_bound(pairs, len(own), q_side, kv_side) <= sent + 1e-9
                if not own:
                    assert tile_bound(pairs, q_side, kv_side) <= sent + 1e-9
    assert rank_bound(10, 3, 2.0, 1.0) <= rank_bound(10, 2, 2.0, 1.0)  # more own tokens: never more bytes


def test_placement_bound_is_below_every_placement():
    """P = 2 ranks of 2 tokens, one document of 3 tokens and one of 1: every layout and every
    choice of the rank that computes each pair (the holders send Q or K/V to it, it sends the
    partial results back): the busiest rank sends at least the any-placement bound."""
    cu, P, T = [0, 3, 4], 2, 2
    shape = AttentionShape(T, 1, 1, 1, 1, 2)
    q, kv = buffer_bytes("q", 1, shape), buffer_bytes("kv", 1, shape)
    q_side = buffer_bytes("o", 1, shape) + buffer_bytes("dq", 1, shape)
    kv_side = buffer_bytes("dkv", 1, shape)
    pairs = [(i, j) for a, b in zip(cu, cu[1:]) for i in range(a, b) for j in range(a, i + 1)]
    best = None
    for owner in _layouts(4, P, T):
        for where in itertools.product(range(P), repeat=len(pairs)):
            sent = [0.0] * P
            moved = set()
            for (i, j), c in zip(pairs, where):
                for token, side in ((i, "q"), (j, "kv")):
                    if owner[token] != c and (token, side, c) not in moved:
                        moved.add((token, side, c))
                        sent[owner[token]] += q if side == "q" else kv
                        sent[c] += q_side if side == "q" else kv_side
            best = max(sent) if best is None else min(best, max(sent))
    got = placement_bound(cu, P, shape)
    assert got.pairs == 6 - 3 - 1  # 6 pairs, at most 3 and 1 kept on the two holders
    assert got.bytes <= best


def test_bad_inputs_are_named():
    shape = _shape(4, 2)
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        query_owner_bound([0, 8], 0, shape)
    with pytest.raises(ValueError, match="budget must be a number >= 1"):
        query_owner_bound([0, 8], 2, shape, budget=0.5)
    with pytest.raises(ValueError, match="strictly increasing"):
        query_owner_bound([0, 4, 4, 8], 2, shape)
    with pytest.raises(ValueError, match="cover 6 tokens"):
        query_owner_bound([0, 6], 2, shape)

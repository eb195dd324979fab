"""The mask, defined once, and the layouts it is applied to: Mask rules and errors, the closed
forms against brute force, block classification against token-by-token truth, zigzag / THD /
span-u layouts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

import numpy as np

from megatron_mesh.plan import (Mask, SpanLayout, ThdLayout, ZigzagLayout, classify_block, head_slice, layout_from_text,
                                positions, slot_segments)
from megatron_mesh.plan.mask import band_pairs, band_relation


# -- the rule ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(causal="False"), r"causal must be True or False, got 'False'"),
    (dict(window=(-1, 0)), r"window left must be an int >= 0 or None \(unlimited\), got -1"),
    (dict(window=(4, 2)), r"window right 2 > 0 with causal attention"),
    (dict(window=(1.5, 0)), r"window left must be an int >= 0 or None \(unlimited\), got 1.5"),
    (dict(window=5), r"window must be \(left, right\)"),
    (dict(documents=((0, 4), (3, 8))), r"documents must be sorted, non-empty, disjoint"),
])
def test_bad_masks_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Mask(**kwargs)


@pytest.mark.parametrize("cu, match", [
    ([0, 4, 3, 8], r"cu_seqlens must be strictly increasing from 0 to the global sequence length 8, got \[0, 4, 3, 8\]"),
    ([0, 4], "to the global sequence length 8"),
    ([1, 8], "strictly increasing from 0"),
])
def test_bad_cu_seqlens_name_the_value(cu, match):
    with pytest.raises(ValueError, match=match):
        Mask.from_cu_seqlens(cu, 8)


def test_worked_example_of_the_mask_docstring():
    m = Mask.from_cu_seqlens([0, 6, 16], 16, causal=True, window=(3, None))
    assert m.key_intervals(13, 16) == ((10, 14),) and m.key_intervals(3, 16) == ((0, 4),)
    layout = ZigzagLayout(4, 16)
    runs = lambda r: tuple((a, n) for _, a, n in layout.runs(r))  # noqa: E731
    c = classify_block(m, runs(1), (runs(0),))
    assert (c.kind, c.rows, c.cols, c.pairs) == ("full", ((0, 2),), (((0, 2),),), 4)


def test_normalized_drops_what_cannot_bite():
    assert Mask.from_cu_seqlens([0, 16], 16).is_dense
    assert Mask(True, (15, 0)).normalized(16).is_dense
    assert not Mask(True, (14, 0)).normalized(16).is_dense
    assert Mask.from_text(Mask.from_cu_seqlens([0, 3, 16], 16, False, (2, 5)).text()) == \
        Mask.from_cu_seqlens([0, 3, 16], 16, False, (2, 5))


@settings(max_examples=300, deadline=None)
@given(qa=st.integers(0, 40), n=st.integers(1, 12), ka=st.integers(0, 40), m=st.integers(1, 12),
       lo=st.one_of(st.none(), st.integers(-20, 20)), hi=st.one_of(st.none(), st.integers(-20, 20)))
def test_pair_counts_match_brute_force(qa, n, ka, m, lo, hi):
    lo = float("-inf") if lo is None else lo
    hi = float("inf") if hi is None else hi
    want = sum(1 for i in range(qa, qa + n) for j in range(ka, ka + m) if lo <= i - j <= hi)
    assert band_pairs(qa, n, ka, m, lo, hi) == want
    kind = band_relation(qa, n, ka, m, lo, hi)
    assert (kind == "none") == (want == 0) and (kind == "all") == (want == n * m)


def _random_mask(data, S: int) -> Mask:
    cuts = sorted(data.draw(st.sets(st.integers(1, S - 1), max_size=4))) if S > 1 else []
    gap = data.draw(st.booleans())  # padding after each document (THD-like)
    docs = [(a, b - (1 if gap and b - a > 1 else 0)) for a, b in zip([0] + cuts, cuts + [S])]
    causal = data.draw(st.booleans())
    left = data.draw(st.one_of(st.none(), st.integers(0, S)))
    right = 0 if causal else data.draw(st.one_of(st.none(), st.integers(0, S)))
    return Mask(causal, (left, right), tuple(docs))


@settings(max_examples=150, deadline=None)
@given(S=st.integers(1, 30), data=st.data())
def test_the_vectorised_rule_is_the_rule(S, data):
    """Mask.allowed (the rule on position arrays -- numpy here, torch in the runtime) agrees with
    Mask.allows pair by pair, and key_intervals hold exactly the allowed keys of each query."""
    mask = _random_mask(data, S)
    pos = np.arange(S)
    got = mask.allowed(pos, pos)
    want = np.array([[mask.allows(i, j) for j in range(S)] for i in range(S)])
    assert got.dtype == bool and (got == want).all()
    for i in range(S):
        assert [j for a, b in mask.key_intervals(i, S) for j in range(a, b)] == [j for j in range(S) if want[i, j]]


@settings(max_examples=150, deadline=None)
@given(P=st.integers(1, 6), half=st.integers(1, 4), data=st.data())
def test_block_classification_is_exactly_the_mask(P, half, data):
    """Every block of every zigzag chunk pair, under random documents and windows: the kept rows
    and columns hold every allowed pair, the kind's pattern on them is exactly the mask."""
    S = 2 * P * half
    cuts = sorted(set(data.draw(st.lists(st.integers(1, S - 1), max_size=4)))) if S > 1 else []
    causal = data.draw(st.booleans())
    left = data.draw(st.one_of(st.none(), st.integers(0, S)))
    right = 0 if causal else data.draw(st.one_of(st.none(), st.integers(0, S)))
    mask = Mask.from_cu_seqlens([0, *cuts, S], S, causal, (left, right))
    layout = ZigzagLayout(P, S)
    pos = [positions(layout, r) for r in range(P)]
    for i in range(P):
        for j in range(P):
            c = classify_block(mask, tuple((a, n) for _, a, n in layout.runs(i)),
                               (tuple((a, n) for _, a, n in layout.runs(j)),))
            allowed = {(x, y) for x in pos[i] for y in pos[j] if mask.allows(x, y)}
            if c is None:
                assert not allowed
                continue
            rows = [pos[i][t] for a, b in c.rows for t in range(a, b)]
            cols = [pos[j][t] for a, b in c.cols[0] for t in range(a, b)]
            if c.kind == "full":
                computed = {(x, y) for x in rows for y in cols}
            elif c.kind == "causal":
                assert rows == cols
                computed = {(x, y) for r, x in enumerate(rows) for y in cols[:r + 1]}
            else:
                computed = {(x, y) for x in rows for y in cols if mask.allows(x, y)}
            assert computed == allowed and c.pairs == len(allowed), (i, j, c)


@pytest.mark.parametrize("P", [1, 2, 3, 5, 8])
def test_dense_causal_blocks_are_the_zigzag_halves(P):
    """The classifier derives Megatron's zigzag rule: (i, i) causal; j < i all queries x the front
    half of chunk j; j > i the back half of the queries x all of chunk j."""
    layout = ZigzagLayout(P, 4 * P)
    runs = lambda r: tuple((a, n) for _, a, n in layout.runs(r))  # noqa: E731
    for i in range(P):
        for j in range(P):
            c = classify_block(Mask(True), runs(i), (runs(j),))
            if i == j:
                want = ("causal", ((0, 4),), ((0, 4),))
            elif j < i:
                want = ("full", ((0, 4),), ((0, 2),))
            else:
                want = ("full", ((2, 4),), ((0, 4),))
            assert (c.kind, c.rows, c.cols[0]) == want, (i, j)


# -- layouts -----------------------------------------------------------------------------------------
def test_zigzag_layout_worked_example():
    layout = ZigzagLayout(world_size=4, seq_len=16)
    assert [positions(layout, r) for r in range(4)] == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert layout.documents() is None


@pytest.mark.parametrize("layout", [ZigzagLayout(4, 16), ThdLayout(2, (0, 8, 12), (8, 3)),
                                    SpanLayout(ThdLayout(4, (0, 8, 16)), 2), SpanLayout(ZigzagLayout(4, 32), 4)])
def test_layout_text_round_trip(layout):
    again = layout_from_text(layout.text())
    assert again == layout and again.text() == layout.text()


def test_unknown_layout_text_names_it():
    with pytest.raises(ValueError, match=r"unknown layout 'spiral' in 'spiral P=4'; known: balanced, (.+, )?span, thd, zigzag"):
        layout_from_text("spiral P=4")


def test_zigzag_layout_rejects_indivisible_lengths():
    with pytest.raises(ValueError, match="divisible by 2 \\* CP size = 6"):
        ZigzagLayout(world_size=3, seq_len=10)


@pytest.mark.parametrize("P, u", [(4, 2), (6, 3), (8, 4), (8, 2), (6, 2)])
def test_span_chunks_are_the_zigzag_over_fewer_ranks(P, u):
    """The u consecutive chunks of a Ulysses group are chunk m of the zigzag over P/u ranks."""
    S = 4 * P
    layout, small = ZigzagLayout(P, S), ZigzagLayout(P // u, S)
    for m in range(P // u):
        assert sorted(p for r in range(m * u, (m + 1) * u) for p in positions(layout, r)) == \
            sorted(positions(small, m))
        assert SpanLayout(layout, u).runs(m) == small.runs(m)


def test_thd_layout_worked_example():
    layout = ThdLayout(2, (0, 8, 12), (8, 3))
    assert positions(layout, 0) == [0, 1, 6, 7, 8, 11] and positions(layout, 1) == [2, 3, 4, 5, 9, 10]
    assert layout.documents() == ((0, 8), (8, 11))
    with pytest.raises(ValueError, match=r"divisible by 2 \* CP size = 4.*got lengths \[6\]"):
        ThdLayout(2, (0, 8, 14))
    with pytest.raises(ValueError, match=r"seq_lens \(9, 3\) must give one length per sequence"):
        ThdLayout(2, (0, 8, 12), (9, 3))


def test_slot_segments_uneven_and_errors():
    assert slot_segments(12, 3) == [((0, 2), (6, 8)), ((2, 4), (8, 10)), ((4, 6), (10, 12))]
    segs = slot_segments(14, 3)  # halves of 7 tokens: slots of 2, 2, 3
    assert [s[0].stop - s[0].start for s in segs] == [2, 2, 3]
    with pytest.raises(ValueError, match="too short for 4 slots"):
        slot_segments(6, 4)


def test_head_slices_follow_gqa_and_replicate_kv_heads():
    assert [head_slice("q", u, 4, 8, 2) for u in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # 2 KV heads over 4 slices: slices 0-1 share KV head 0 (query heads 0-3), slices 2-3 KV head 1
    assert [head_slice("kv", u, 4, 8, 2) for u in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [head_slice("kv", u, 2, 8, 4) for u in range(2)] == [(0, 2), (2, 4)]

"""Mesh's owner maps against the query owner (plan/sparse_compete.py): the module's worked
example, and on random documents and windows the pick, the counts and the floors against building
every map's needs (the way the plan chose before: Needs of each map, the fewest bytes on the busiest
rank, ties to the last map)."""

from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st
import pytest

from megatron_mesh.plan import AttentionShape, Mask, tile_shapes
from megatron_mesh.plan.layout import ZigzagLayout
from megatron_mesh.plan.mesh import CONTIGUOUS, TileMap
from megatron_mesh.plan.sparse_blocks import Blocks
from megatron_mesh.plan.sparse_compete import BlockBits, NeedCounts, compete, read_tokens, sent_tokens
from megatron_mesh.plan.sparse_needs import (Keeps, Needs, QueryOwnerNeeds, bytes_per_rank, kept_of, read_bytes,
                                             read_prices, token_bytes)


def _floor_prices(tb):
    """What a row and a column cost at the least (everything kept)."""
    return tb["q"] + tb["o"] + tb["do"] + tb["dq"], tb["kv"] + tb["dkv"]


def test_worked_example():
    """4 ranks, 64 tokens, documents [0, 24) and [24, 64), GQA 32/8 of 128 in bf16, Mesh 2x2
    (contiguous q): what rank 1 sends floors the map at 16 rows x 49,536 + 8 columns x 12,288 =
    890,880 bytes, above the query owner's 589,824 on every rank: the map (1,483,776 on rank 1, what
    it sends and reads) is never counted."""
    shape = AttentionShape(seq_local=16, batch=1, heads=32, kv_heads=8, head_dim=128)
    tb = token_bytes(shape)
    row, col = _floor_prices(tb)
    assert (row, col) == (49536, 12288)
    index = Blocks(4, Mask(documents=((0, 24), (24, 64))), ZigzagLayout(4, 64), 128)
    query_owner = QueryOwnerNeeds(index)
    assert bytes_per_rank(query_owner, shape, Keeps("auto", query_owner, 16, tb, 1.0)) == [589824] * 4
    tiles = TileMap(2, 2, "q")
    assert [tiles(1, j) for j in range(4)] == [0, 1, 0, 1] and tiles(2, 1) == 3
    bits = BlockBits(index)
    assert sent_tokens(bits, tiles, 1) == (16, 8) and 16 * row + 8 * col == 890880
    rows, cols = (a + sum(b.values()) for a, b in zip(sent_tokens(bits, tiles, 1), read_tokens(bits, tiles, 1)))
    needs = Needs(4, index.spans(), tiles)
    traffic = bytes_per_rank(needs, shape, Keeps("auto", needs, 16, tb, 1.0))
    assert rows * row + cols * col == traffic[1] == max(traffic) == 1483776
    best, chosen = compete(index, [("tile", tiles)], shape, "auto", 1.0)
    assert best == 0 and type(chosen) is QueryOwnerNeeds


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(1, 40)), max_size=6))
def test_a_bit_sets_runs_are_the_union_of_its_intervals(intervals):
    """The winner's selections are its counted bit sets cut into runs (0b1110110: [1, 3), [4, 7)):
    the union of the intervals that made them, at any offset, including the top bit of a chunk."""
    from megatron_mesh.plan.sel import union_intervals
    from megatron_mesh.plan.sparse_compete import _runs

    spans = [(a, a + n) for a, n in intervals]
    bits = 0
    for a, b in spans:
        bits |= ((1 << (b - a)) - 1) << a
    assert _runs(bits) == union_intervals(spans)
    assert _runs(0b1110110) == union_intervals([(1, 3), (4, 7)])


@pytest.mark.parametrize("P", [6, 12, 256])
def test_a_tile_maps_owner_parts_are_its_owner(P):
    """NeedCounts asks a tile map for owner_parts (two lookups a block) instead of owner (a call a
    block): the same rank for every block, either ring contiguous."""
    for tiles in _maps(P):
        qs, ks = tiles.owner_parts(P)
        assert all(qs[i] + ks[j] == tiles.owner(i, j) for i in range(P) for j in range(0, P, max(1, P // 16)))


def _maps(P):
    return [TileMap(a, b, c) for a, b in tile_shapes(P) if a > 1 for c in (CONTIGUOUS if b > 1 else ("q",))]


def _brute_force(index, maps, shape, policy, limit):
    """Every map's needs built (the query owner first): the busiest rank's bytes of each, its needs
    and every rank's bytes."""
    T, tb = shape.seq_local, token_bytes(shape)
    out = []
    for needs in [QueryOwnerNeeds(index)] + [Needs(index.P, index.spans(), m) for m in maps]:
        traffic = bytes_per_rank(needs, shape, Keeps(policy, needs, T, tb, limit))
        out.append((max(traffic), needs, traffic))
    return out


class _Table:
    """An owner map that is not a tile map: every block on a random rank (drawn once)."""

    def __init__(self, P, seed):
        self.rng, self.P, self.seen = random.Random(seed), P, {}

    def __call__(self, i, j):
        if (i, j) not in self.seen:
            self.seen[i, j] = self.rng.randrange(self.P)
        return self.seen[i, j]


@settings(max_examples=40, deadline=None)
@given(P=st.sampled_from([3, 4, 5, 6, 7, 8, 12]), heads=st.sampled_from([(32, 8, 128), (2, 2, 32), (8, 1, 64)]),
       cuts=st.lists(st.integers(1, 10_000), min_size=0, max_size=12), window=st.sampled_from([None, 5, 40]),
       causal=st.booleans(), policy=st.sampled_from(["auto", "refetch", "keep"]),
       limit=st.sampled_from([0.0, 1.0, 2.0, float("inf")]), data=st.data())
def test_the_pick_is_building_every_maps_needs(P, heads, cuts, window, causal, policy, limit, data):
    T = 2 * data.draw(st.integers(4, 24))
    S = P * T
    bounds = sorted({c % S for c in cuts} - {0})
    docs = tuple(zip([0] + bounds, bounds + [S])) if bounds else None
    mask = Mask(causal=causal, window=(window, 0 if causal else window), documents=docs).normalized(S)
    shape = AttentionShape(seq_local=T, batch=1, heads=heads[0], kv_heads=heads[1], head_dim=heads[2])
    index = Blocks(P, mask, ZigzagLayout(P, S), 128)
    maps = _maps(P) + [_Table(P, data.draw(st.integers(0, 99)))]
    # a subset of the maps, in a drawn order (ties go to the last: the order matters)
    maps = data.draw(st.permutations(maps))[:data.draw(st.integers(1, len(maps)))]
    truth = _brute_force(index, maps, shape, policy, limit)
    want = min(range(len(truth)), key=lambda k: (truth[k][0], -k))
    best, needs = compete(Blocks(P, mask, ZigzagLayout(P, S), 128), [("map", m) for m in maps], shape, policy, limit)
    assert best == want
    # every block built first (several maps), or only the blocks asked (a map floored alone: on a fresh
    # index whose summaries the query owner's bytes made first, as compete's are)
    bits, fresh = BlockBits(index), Blocks(P, mask, ZigzagLayout(P, S), 128)
    bits.blocks()
    from megatron_mesh.plan.sparse_compete import _QueryOwnerCounts  # the query owner's counts off the bits
    assert [_QueryOwnerCounts(bits).col_tokens(x) for x in range(P)] == [truth[0][1].col_tokens(x) for x in range(P)]
    bytes_per_rank(QueryOwnerNeeds(fresh), shape, Keeps(policy, QueryOwnerNeeds(fresh), T, token_bytes(shape), limit))
    alone, tb, prices = BlockBits(fresh), token_bytes(shape), read_prices(shape)
    row, col = _floor_prices(tb)
    for k, m in enumerate(maps, 1):
        exact, traffic = truth[k][1], truth[k][2]
        counts = NeedCounts(bits, m)
        assert [counts.row_tokens(x) for x in range(P)] == [exact.row_tokens(x) for x in range(P)]
        assert [counts.col_tokens(x) for x in range(P)] == [exact.col_tokens(x) for x in range(P)]
        for h in range(P):  # the floors' counts are the needs' own: what h's chunk gives, what h reads
            for b in (bits, alone):
                sent = sent_tokens(b, m, h)
                assert sent == (sum(exact.row_tokens(x).get(h, 0) for x in range(P)),
                                sum(exact.col_tokens(x).get(h, 0) for x in range(P)))
                if isinstance(m, TileMap):
                    rows, cols = read_tokens(b, m, h)
                    assert (rows, cols) == (exact.row_tokens(h), exact.col_tokens(h))
                    # the floor compete prices: what h sends at the least, what it reads exactly
                    kept = kept_of(h, rows, cols, P, tb, policy, limit * T)[0]
                    assert kept == Keeps(policy, exact, T, tb, limit).kept(h)
                    assert sent[0] * row + sent[1] * col + read_bytes(rows, cols, kept, prices) <= traffic[h]
    if best:  # the winner's needs, built as before
        for part in ("rows", "cols", "blocks", "row_needers", "col_needers", "row_tokens", "col_tokens"):
            assert [getattr(needs, part)(x) for x in range(P)] == [getattr(truth[best][1], part)(x) for x in range(P)]


class _Counting(TileMap):
    """A tile map that notes each time it is counted (every block's owner asked at once: NeedCounts
    reads a tile map's owner_parts)."""

    counted: list

    def owner_parts(self, P):
        self.counted.append(1)
        return super().owner_parts(P)


@pytest.mark.parametrize("docs", ["lognormal:4096,1.0", "lognormal:16384,1.0"])
def test_at_256_ranks_most_maps_are_never_counted(docs):
    """At the paper's scale the floors rule maps out before they are counted, and the pick is the
    brute force's (seed 0, 1M tokens, Mesh's 15 maps of 256 ranks)."""
    from megatron_mesh.tools.plan_args import document_bounds
    P, S = 256, 1 << 20
    mask = Mask.from_cu_seqlens(document_bounds(docs, S, 0), S)
    shape = AttentionShape(seq_local=S // P, batch=1, heads=32, kv_heads=8, head_dim=128)
    index = Blocks(P, mask, ZigzagLayout(P, S), 128)
    maps = _maps(P)
    counting = []
    for m in maps:
        counting.append(_Counting(m.a, m.b, m.contiguous))
        object.__setattr__(counting[-1], "counted", [])
    best, _ = compete(index, [("tile", m) for m in counting], shape, "auto", 1.0)
    truth = _brute_force(index, maps, shape, "auto", 1.0)
    assert best == min(range(len(truth)), key=lambda k: (truth[k][0], -k))
    counted = [len(m.counted) for m in counting]  # the floors ask about a few ranks' blocks, one by one
    assert max(counted) == 1 and 0 < sum(counted) <= 6, counted

"""Mesh's owner maps against the query owner (plan/sparse_compete.py): the module's worked
example, and on random documents and windows the pick, the counts and the floor against building
every map's needs (the way the plan chose before: Needs of each map, the fewest bytes on the busiest
rank, ties to the last map)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from megatron_mesh.plan import AttentionShape, Mask, tile_shapes
from megatron_mesh.plan.accounting import buffer_bytes
from megatron_mesh.plan.layout import ZigzagLayout
from megatron_mesh.plan.mesh import CONTIGUOUS, TileMap
from megatron_mesh.plan.sparse_blocks import Blocks
from megatron_mesh.plan.sparse_compete import NeedCounts, compete, span_bits, traffic_floor
from megatron_mesh.plan.sparse_needs import Keeps, Needs, QueryOwnerNeeds, bytes_per_rank

KINDS = ("q", "kv", "do", "o", "dq", "dkv")


def _token_bytes(shape):
    return {k: buffer_bytes(k, 1, shape) for k in KINDS}


def _floor_prices(tb):
    return tb["q"] + tb["o"] + tb["do"] + tb["dq"], tb["kv"] + tb["dkv"]


def test_worked_example():
    """4 ranks, 64 tokens, documents [0, 24) and [24, 64), GQA 32/8 of 128 in bf16, Mesh 2x2
    (contiguous q): rank 1's floor 16 rows x 49,536 + 8 columns x 12,288 = 890,880 bytes, above
    the query owner's 589,824 on every rank: the tile map (1,483,776 on rank 1) is not counted."""
    shape = AttentionShape(seq_local=16, batch=1, heads=32, kv_heads=8, head_dim=128)
    tb = _token_bytes(shape)
    assert _floor_prices(tb) == (49536, 12288)
    index = Blocks(4, Mask(documents=((0, 24), (24, 64))), ZigzagLayout(4, 64), 128)
    query_owner = QueryOwnerNeeds(index)
    assert bytes_per_rank(query_owner, shape, Keeps("auto", query_owner, 16, tb, 1.0)) == [589824] * 4
    tiles = TileMap(2, 2, "q")
    assert [tiles.owner(1, j) for j in range(4)] == [0, 1, 0, 1] and tiles.owner(2, 1) == 3
    sent = [traffic_floor(index, tiles.owner, [h], *_floor_prices(tb), reads=False) for h in range(4)]
    assert sent == [494592, 16 * 49536 + 8 * 12288, 890880, 196608]
    needs = Needs(4, index.spans(), tiles.owner)
    assert max(bytes_per_rank(needs, shape, Keeps("auto", needs, 16, tb, 1.0))) == 1483776
    best, chosen = compete(index, [("tile", tiles.owner)], shape, tb, "auto", 1.0)
    assert best == 0 and chosen.__class__ is QueryOwnerNeeds


def _maps(P):
    return [TileMap(a, b, c) for a, b in tile_shapes(P) if a > 1 for c in (CONTIGUOUS if b > 1 else ("q",))]


def _brute_force(index, maps, shape, tb, policy, limit):
    """Every map's needs built (the query owner first): the busiest rank's bytes of each, its needs
    and every rank's bytes."""
    T = shape.seq_local
    out = []
    for needs in [QueryOwnerNeeds(index)] + [Needs(index.P, index.spans(), m.owner) for m in maps]:
        traffic = bytes_per_rank(needs, shape, Keeps(policy, needs, T, tb, limit))
        out.append((max(traffic), needs, traffic))
    return out


@settings(max_examples=40, deadline=None)
@given(P=st.sampled_from([3, 4, 5, 6, 7, 8, 12]), heads=st.sampled_from([(32, 8, 128), (2, 2, 32), (8, 1, 64)]),
       cuts=st.lists(st.integers(1, 10_000), min_size=0, max_size=12), window=st.sampled_from([None, 5, 40]),
       causal=st.booleans(), policy=st.sampled_from(["auto", "refetch", "keep"]),
       limit=st.sampled_from([0.0, 1.0, 2.0]), data=st.data())
def test_the_pick_is_building_every_maps_needs(P, heads, cuts, window, causal, policy, limit, data):
    T = 2 * data.draw(st.integers(4, 24))
    S = P * T
    bounds = sorted({c % S for c in cuts} - {0})
    docs = tuple(zip([0] + bounds, bounds + [S])) if bounds else None
    mask = Mask(causal=causal, window=(window, 0 if causal else window), documents=docs).normalized(S)
    shape = AttentionShape(seq_local=T, batch=1, heads=heads[0], kv_heads=heads[1], head_dim=heads[2])
    tb = _token_bytes(shape)
    index = Blocks(P, mask, ZigzagLayout(P, S), 128)
    maps = _maps(P)
    # a subset of the maps, in a drawn order (ties go to the last: the order matters)
    maps = data.draw(st.permutations(maps))[:data.draw(st.integers(1, len(maps)))]
    truth = _brute_force(index, maps, shape, tb, policy, limit)
    want = min(range(len(truth)), key=lambda k: (truth[k][0], -k))
    best, needs = compete(Blocks(P, mask, ZigzagLayout(P, S), 128), [("tile", m.owner) for m in maps], shape, tb,
                          policy, limit)
    assert best == want
    bits = span_bits(index.spans())
    for k, m in enumerate(maps, 1):
        exact = truth[k][1]
        counts = NeedCounts(P, bits, m.owner)
        assert [counts.row_tokens(x) for x in range(P)] == [exact.row_tokens(x) for x in range(P)]
        assert [counts.col_tokens(x) for x in range(P)] == [exact.col_tokens(x) for x in range(P)]
        for h in range(P):  # each rank's floor under its own bytes: what it sends, and what it reads too
            sent = traffic_floor(index, m.owner, [h], *_floor_prices(tb), reads=False)
            assert sent <= traffic_floor(index, m.owner, [h], *_floor_prices(tb)) <= truth[k][2][h]
    if best:  # the winner's selections, built as before
        assert [needs.rows(x) for x in range(P)] == [truth[best][1].rows(x) for x in range(P)]
        assert [needs.cols(x) for x in range(P)] == [truth[best][1].cols(x) for x in range(P)]
        assert [needs.blocks(x) for x in range(P)] == [truth[best][1].blocks(x) for x in range(P)]


@pytest.mark.parametrize("docs", ["lognormal:4096,1.0", "lognormal:16384,1.0"])
def test_at_256_ranks_the_floor_spares_the_tall_tiles(docs):
    """At the paper's scale the floor rules out maps before they are counted, and the pick is the
    brute force's (seed 0, 1M tokens, Mesh's 15 maps of 256 ranks)."""
    from megatron_mesh.tools.plan_args import document_bounds
    P, S = 256, 1 << 20
    mask = Mask.from_cu_seqlens(document_bounds(docs, S, 0), S)
    shape = AttentionShape(seq_local=S // P, batch=1, heads=32, kv_heads=8, head_dim=128)
    tb = _token_bytes(shape)
    index = Blocks(P, mask, ZigzagLayout(P, S), 128)
    maps = _maps(P)
    spies = [_Spy(m.owner) for m in maps]
    best, _ = compete(index, [("tile", spy) for spy in spies], shape, tb, "auto", 1.0)
    truth = _brute_force(index, maps, shape, tb, "auto", 1.0)
    assert best == min(range(len(truth)), key=lambda k: (truth[k][0], -k))
    blocks = len(index.spans())
    counted = [spy.calls >= blocks for spy in spies]  # asked of every block: counted (the floor asks of a few ranks')
    assert all(spy.calls < blocks for spy, c in zip(spies, counted) if not c)
    assert 0 < sum(counted) <= len(maps) - 5, counted  # a third of the maps or more never counted


class _Spy:
    """An owner map that counts the blocks it is asked about."""

    def __init__(self, owner):
        self.owner, self.calls = owner, 0

    def __call__(self, i, j):
        self.calls += 1
        return self.owner(i, j)

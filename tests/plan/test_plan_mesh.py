"""Mesh plans (pure Python, milliseconds per case): tile map, schedules, validity for every tile,
causal balance, bytes equal to the closed form, the fewest-bytes tile."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from megatron_mesh.plan import (AttentionShape, TileMap, best_tile, build_mesh_plan, mesh_bytes_formula, parse_tile,
                                plan_bytes, rank_work, tile_shapes, validate_plan)
from megatron_mesh.plan.schedule import build_template, pull_rounds, template_text

SHAPE = AttentionShape(seq_local=4, batch=1, heads=4, kv_heads=2, head_dim=8, itemsize=2)


# -- tile map -----------------------------------------------------------------------------------
def test_tile_map_worked_example():
    t = TileMap(2, 2)
    assert [t.q_group(g) for g in range(4)] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [t.kv_group(g) for g in range(4)] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    matrix = [[t.owner(i, j) for j in range(4)] for i in range(4)]
    assert matrix == [[0, 1, 0, 1], [0, 1, 0, 1], [2, 3, 2, 3], [2, 3, 2, 3]]


@pytest.mark.parametrize("P", list(range(1, 65)) + [96, 128, 210, 255, 256])
@pytest.mark.parametrize("contiguous", ["q", "kv"])
def test_tile_map_exact_cover_and_local_diagonal(P, contiguous):
    for a, b in tile_shapes(P):
        t = TileMap(a, b, contiguous)
        seen = bytearray(P * P)
        for g in range(P):
            qs, ks = t.q_group(g), t.kv_group(g)
            assert set(qs) & set(ks) == {g}  # each rank's only diagonal block is its own
            for i in qs:
                for j in ks:
                    seen[i * P + j] += 1
                    assert t.owner(i, j) == g  # the inlined owner is the rank whose rings cross there
        assert seen == bytearray([1]) * (P * P), (P, a, b)


def test_parse_tile_errors_name_value_and_allowed():
    assert parse_tile("4x2", 8) == (4, 2) and parse_tile([2, 4], 8) == (2, 4) and parse_tile("auto", 8) == "auto"
    with pytest.raises(ValueError, match=r"tile 3x2 does not fit CP size 8.*allowed tiles: 1x8, 2x4, 4x2, 8x1"):
        parse_tile((3, 2), 8)
    with pytest.raises(ValueError, match="must be 'AxB'"):
        parse_tile("4by2", 8)
    with pytest.raises(ValueError, match=r"tile sides must be integers, got \(2\.7, 2\.2\)"):
        parse_tile((2.7, 2.2), 6)
    with pytest.raises(ValueError, match=r"tile must be \(a, b\), 'AxB' or 'auto', got 7"):
        parse_tile(7, 7)


# -- schedules ----------------------------------------------------------------------------------
def test_greedy_schedule_worked_example():
    """The 2x2 MHA example of megatron_mesh/plan/schedule.py (a KV chunk is 2x a Q chunk)."""
    rounds = pull_rounds(2, 2, "greedy", q_cost=1, kv_cost=2)
    assert rounds == [[("pull", "q", 1)], [("pull", "kv", 1)]]
    text = template_text(build_template(2, 2, rounds, ("q",)))
    assert text == "P1[q1] B00 W1 P2[kv1] B10 W2 B11 P3[acc:q1] B01 W3 Mq0"


def test_greedy_prefers_cheaper_chunks_under_gqa():
    # GQA 8:1 makes KV chunks 4x cheaper than Q chunks: the greedy pulls KV first
    rounds = pull_rounds(2, 4, "greedy", q_cost=4, kv_cost=1)
    assert [r[0][1] for r in rounds][:2] == ["kv", "kv"]


def test_lockstep_pulls_both_rings_per_round():
    assert pull_rounds(2, 3, "lockstep", 1, 1) == [[("pull", "q", 1), ("pull", "kv", 1)], [("pull", "kv", 2)]]


def test_ring_is_mesh_1xP():
    text = template_text(build_template(1, 4, pull_rounds(1, 4, "greedy", 1, 2), ("q",)))
    assert text == "P1[kv1] B00 W1 P2[kv2] B01 W2 P3[kv3] B02 W3 B03"


def test_worked_example_of_the_design_doc():
    """docs/design.md and the ir.py docstring show rank 1 of the 4-rank 2x2 forward."""
    text = build_mesh_plan(4, (2, 2), SHAPE).describe([1]).split("rank 1 backward")[0]
    assert text.splitlines()[1:] == [
        "rank 1 forward:", "  post 1: send kv1->3 | recv kv3<-3", "  attend q1 x kv1 causal -> o1", "  wait 1",
        "  post 2: send q1->0 | recv q0<-0", "  attend q1[2:4] x kv3 full -> o1", "  wait 2",
        "  attend q0[2:4] x kv3,kv1 full -> o0", "  post 3: send o0->0 | recv o1'<-0", "  wait 3",
        "  merge o1' -> o1"]


# -- validity: full checks for every tile up to P = 16, both schedules/modes ---------------------
@pytest.mark.parametrize("P", range(1, 17))
def test_every_mesh_plan_validates(P):
    for tile in tile_shapes(P):
        for causal in (True, False):
            for schedule in ("greedy", "lockstep"):
                for backward_chunks in ("refetch", "keep"):
                    plan = build_mesh_plan(P, tile, SHAPE, causal=causal, schedule=schedule,
                                           backward_chunks=backward_chunks, contiguous="kv" if P % 2 else "q")
                    validate_plan(plan)


@pytest.mark.parametrize("P", list(range(17, 65, 3)) + [96, 128])
def test_rounds_match_and_never_deadlock_up_to_128(P):
    """Transfers match and the dry run finishes for every tile (blocks are not built here);
    the exhaustive sweep (--exhaustive) covers every P <= 256."""
    for tile in tile_shapes(P):
        validate_plan(build_mesh_plan(P, tile, SHAPE), cover=False, dataflow=False)


@pytest.mark.parametrize("P", [32, 48, 64])
def test_exact_cover_at_larger_P(P):
    for tile in tile_shapes(P):
        validate_plan(build_mesh_plan(P, tile, SHAPE), dataflow=False)


@pytest.mark.parametrize("P", [2, 3, 4, 6, 8, 12, 16, 64])
def test_causal_work_is_perfectly_balanced(P):
    for tile in tile_shapes(P):
        plan = build_mesh_plan(P, tile, AttentionShape(seq_local=8))
        for direction in ("forward", "backward"):
            work = rank_work(plan, direction)
            assert max(work) == min(work) == (8 * 9 // 2 + (P - 1) * 32), (P, tile, direction, work)


# -- bytes ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("P", list(range(1, 33)) + [48, 64])
def test_plan_bytes_equal_closed_form(P):
    shape = AttentionShape(seq_local=6, batch=2, heads=8, kv_heads=2, head_dim=4, itemsize=2)
    for tile in tile_shapes(P):
        for backward_chunks in ("refetch", "keep"):
            got = plan_bytes(build_mesh_plan(P, tile, shape, backward_chunks=backward_chunks), shape)
            want = mesh_bytes_formula(P, tile, shape, backward_chunks)
            assert all(g == want for g in got), (P, tile, backward_chunks, got[0], want)


def test_best_tile_examples():
    mha = AttentionShape(seq_local=1024, heads=32, kv_heads=32, head_dim=128)
    gqa = AttentionShape(seq_local=1024, heads=64, kv_heads=8, head_dim=128)
    assert best_tile(256, mha) == (16, 16)
    assert best_tile(256, gqa)[0] < 16  # GQA makes Q traffic dearer: fewer Q chunks per tile
    assert best_tile(7, mha) in ((1, 7), (7, 1))
    ring = mesh_bytes_formula(256, (1, 256), mha).sent
    assert mesh_bytes_formula(256, best_tile(256, mha), mha).sent < 0.2 * ring


@settings(max_examples=60, deadline=None)
@given(P=st.integers(1, 24), data=st.data())
def test_random_plans_validate(P, data):
    tile = data.draw(st.sampled_from(tile_shapes(P)))
    heads = data.draw(st.sampled_from([1, 2, 4, 8]))
    kv = data.draw(st.sampled_from([h for h in (1, 2, 4, 8) if heads % h == 0]))
    shape = AttentionShape(seq_local=2 * data.draw(st.integers(1, 4)), heads=heads, kv_heads=kv, head_dim=4)
    plan = build_mesh_plan(P, tile, shape, causal=data.draw(st.booleans()),
                           schedule=data.draw(st.sampled_from(["greedy", "lockstep"])),
                           backward_chunks=data.draw(st.sampled_from(["refetch", "keep"])),
                           contiguous=data.draw(st.sampled_from(["q", "kv"])))
    validate_plan(plan)
    want = mesh_bytes_formula(P, plan.facts.tile, shape, plan.backward_chunks)
    assert all(b == want for b in plan_bytes(plan, shape))

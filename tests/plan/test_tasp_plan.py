"""TASP plans (pure Python): validity (dataflow, matching, dry run, exact cover), bytes equal to
the closed form (ring attention's), causal work balanced per step, and the per-step link load
against ring attention."""

import pytest

from megatron_mesh.plan import (Attend, AttendBackward, AttentionShape, Key, Post, block_pairs, buffer_bytes,
                                build_ring_plan, build_tasp_plan, link_bytes, link_load, plan_bytes,
                                tasp_bytes_formula, tasp_rings, validate_plan)
from megatron_mesh.plan import tasp as tasp_module


def _shape(T, itemsize=2):
    return AttentionShape(seq_local=T, batch=2, heads=4, kv_heads=2, head_dim=8, itemsize=itemsize)


def _check_bytes(plan, shape):
    f = tasp_bytes_formula(plan.world_size, shape)
    for r, b in enumerate(plan_bytes(plan, shape)):
        assert (b.forward_sent, b.forward_received, b.backward_sent, b.backward_received) == \
               (f.forward_sent, f.forward_received, f.backward_sent, f.backward_received), (r, b, f)


def _every_rank_posts_every_round(plan):
    """What the all-to-all transport needs: the same rounds on every rank, each non-empty."""
    for direction in ("forward", "backward"):
        rounds = [[op.round for op in plan.round_ops(r, direction) if isinstance(op, Post)]
                  for r in range(plan.world_size)]
        assert all(x == rounds[0] for x in rounds), direction
        assert all(op.sends and op.recvs for r in range(plan.world_size)
                   for op in plan.round_ops(r, direction) if isinstance(op, Post))


def _work_is_balanced_per_step(plan):
    """Causal (zigzag + per-ring sub-chunks): in every step, between two rounds, all ranks compute
    the same number of (query, key) token pairs, forward and backward."""
    for direction in ("forward", "backward"):
        per_rank = []
        for r in range(plan.world_size):
            steps = [0]
            for op in plan.rank(r).ops(direction):
                if isinstance(op, Post):
                    steps.append(0)
                elif isinstance(op, (Attend, AttendBackward)):
                    steps[-1] += block_pairs(plan, op)
            per_rank.append(steps)
        assert all(steps == per_rank[0] for steps in per_rank), (direction, per_rank)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("P", list(range(1, 17)))
def test_single_node_plans_validate(P, causal):
    T = 2 * max(P - 1, 1) + 2  # uneven slots: one slot is longer
    shape = _shape(T)
    plan = build_tasp_plan(P, shape, causal=causal)
    validate_plan(plan)
    _check_bytes(plan, shape)
    _every_rank_posts_every_round(plan)
    _work_is_balanced_per_step(plan)
    assert plan.mode == "tasp" and plan.causal == causal
    rings = plan.rings["kv"]
    assert len(rings) == {1: 0, 4: 2, 6: 4}.get(P, P - 1)
    # slot s of a chunk: sub-chunk s of each zigzag half; together the slots cover the chunk once
    slots = [plan.segments(Key("kv", 0, s)) for s in range(len(rings))]
    covered = sorted(t for segs in slots for a, b in segs for t in range(a, b))
    assert covered == (list(range(T)) if rings else [])
    assert all(len(segs) <= 2 for segs in slots)
    assert max(map(plan.tokens, (Key("kv", 0, s) for s in range(len(rings)))), default=0) - \
        min(map(plan.tokens, (Key("kv", 0, s) for s in range(len(rings)))), default=0) <= 2  # even split
    if P in (4, 6):
        assert any("no Hamiltonian decomposition" in n for n in plan.notes)
    # forward: P - 1 rounds; backward: + the first dK/dV hop is a step late, + the hop home
    assert len([op for op in plan.round_ops(0, "forward") if isinstance(op, Post)]) == P - 1
    assert len([op for op in plan.round_ops(0, "backward") if isinstance(op, Post)]) == {1: 0, 2: 2}.get(P, P + 1)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("m,u", [(1, 3), (2, 2), (2, 3), (2, 4), (4, 2), (4, 3), (6, 2), (7, 2), (8, 2)])
def test_multi_node_plans_validate(m, u, causal):
    P = m * u
    shape = _shape(2 * m + 2)
    plan = build_tasp_plan(P, shape, causal=causal, ranks_per_node=m)
    validate_plan(plan)
    _check_bytes(plan, shape)
    _every_rank_posts_every_round(plan)
    _work_is_balanced_per_step(plan)
    assert len(plan.rings["kv"]) == m
    # one inter-node transfer per rank per round, forward (KV) -- the property the rings give
    for r in range(P):
        for op in plan.round_ops(r, "forward"):
            if isinstance(op, Post):
                assert sum(t.peer // m != r // m for t in op.sends) == 1
                assert sum(t.peer // m != r // m for t in op.recvs) == 1


def test_gpus_per_node_equal_to_group_is_one_node():
    shape = _shape(16)
    assert build_tasp_plan(8, shape, ranks_per_node=8).rings == build_tasp_plan(8, shape).rings


def test_link_load_p8_single_node_and_two_nodes_of_4():
    P = 8
    T = 2 * (P - 1) * 4  # every slot holds the same number of tokens
    shape = _shape(T)
    kv, dkv = buffer_bytes("kv", T, shape), buffer_bytes("dkv", T, shape)
    ring, tasp = build_ring_plan(P, shape), build_tasp_plan(P, shape)
    # single node: the busiest link of a step carries 1/(P-1) of ring attention's
    assert link_load(ring, shape).max_link == kv
    assert link_load(tasp, shape).max_link == kv // (P - 1)
    # backward: ring attention moves KV and dK/dV in separate rounds, TASP in one per step; over
    # the whole backward the busiest ring link carries P-1 times what the busiest TASP link does
    assert link_load(tasp, shape, "backward").max_link == (kv + dkv) // (P - 1)
    assert max(link_bytes(ring, shape, "backward").values()) == (P - 1) * (kv + dkv)
    assert max(link_bytes(tasp, shape, "backward").values()) == kv + dkv
    # two nodes of 4: ring sends a whole chunk over one NIC per node boundary; chained TASP rings
    # send 1/4 chunk from every rank; one flat K*_8 decomposition sends 4/7 chunk per rank over 4 links
    m = 4
    chained = build_tasp_plan(P, shape, ranks_per_node=m)
    ring_load, chained_load, flat_load = (link_load(p, shape, ranks_per_node=m) for p in (ring, chained, tasp))
    assert ring_load.max_inter_node == kv and ring_load.inter_node_links == 1
    assert chained_load.max_inter_node == kv // m and chained_load.inter_node_links == 1
    assert flat_load.max_inter_node == kv * m // (P - 1) and flat_load.inter_node_links == m
    assert ring_load.max_inter_node == m * chained_load.max_inter_node


def test_docstring_worked_example_is_the_plan():
    doc = tasp_module.__doc__
    block = doc[doc.index("Rank 1's forward::"):].split("\n\n")[1]
    want = [line.split("#")[0].strip() for line in block.splitlines()]
    plan = build_tasp_plan(3, AttentionShape(seq_local=4))
    assert plan.rings["kv"] == ((0, 1, 2), (0, 2, 1))
    got = plan.describe([1]).splitlines()
    got = got[got.index("rank 1 forward:") + 1:got.index("rank 1 backward:")]
    assert [g.strip() for g in got] == want


def test_errors_name_the_values():
    with pytest.raises(ValueError, match=r"7 slots.*local sequence length 12.*need >= 14"):
        build_tasp_plan(8, _shape(12))
    with pytest.raises(ValueError, match="positive divisor of the CP size 8, got 3"):
        build_tasp_plan(8, _shape(16), ranks_per_node=3)
    with pytest.raises(ValueError, match="ranks_per_node=None"):
        build_tasp_plan(10, _shape(16), ranks_per_node=5)
    with pytest.raises(ValueError, match="even"):
        build_tasp_plan(2, _shape(5))
    with pytest.raises(ValueError, match="world_size"):
        tasp_rings(0)


def test_plan_records_the_node_size():
    """The plan records the node size the rings were built for (a typed fact, printed in its text)."""
    shape = _shape(16)
    assert build_tasp_plan(8, shape).facts.ranks_per_node is None
    assert build_tasp_plan(8, shape, ranks_per_node=4).facts.ranks_per_node == 4
    assert "ranks_per_node=4" in build_tasp_plan(8, shape, ranks_per_node=4).header()

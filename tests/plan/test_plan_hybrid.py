"""Ulysses x (Mesh | TASP | ring) plans (pure Python): valid for every (U, M) and inner tile,
with exact cover per head slice; the all-to-all moves what Ulysses moves (KV replication counted);
bad head counts name the sizes."""

from __future__ import annotations

import pytest

from megatron_mesh.plan import (AttentionShape, Mask, Post, buffer_bytes, inner_shape, key_bytes, plan_bytes, resolve,
                                tile_shapes, validate_plan)

# U = 1 too: a hybrid of degree 1 (Megatron's --hierarchical-context-parallel-sizes 1 M) is its inner
# mode, with nothing to assemble -- once a copy of the rank's own chunk onto itself, which wrote
# into the caller's tensors
UM = [(1, 3), (1, 4), (2, 2), (2, 3), (3, 2), (2, 4), (4, 2)]


def _shape(U: int, heads: int, kv_heads: int, T: int = 12) -> AttentionShape:
    return AttentionShape(seq_local=T, batch=1, heads=heads, kv_heads=kv_heads, head_dim=8, itemsize=2)


def _heads(U: int):
    """(heads, kv_heads): MHA, GQA, MQA and GQA with fewer KV heads than U."""
    h = 2 * U
    return [(h, h), (h, U), (h, 1)] + ([(h, 2)] if U > 2 and U % 2 == 0 else [])


@pytest.mark.parametrize("U, M", UM)
def test_hybrid_plans_validate_for_every_inner_mode_and_tile(U, M):
    P = U * M
    for heads, kv in _heads(U):
        shape = _shape(U, heads, kv)
        for causal in (True, False):
            mask = Mask(causal)
            for t in tile_shapes(M):
                validate_plan(resolve("a2a+mesh", P, shape, ulysses_size=U, tile=t, contiguous="q").build(shape, mask))
            validate_plan(resolve("a2a+ring", P, shape, ulysses_size=U).build(shape, mask))
            validate_plan(resolve("a2a+tasp", P, shape, ulysses_size=U).build(shape, mask))


@pytest.mark.parametrize("U, M", [(1, 3), (2, 2), (2, 4), (4, 2)])
def test_hybrid_plans_take_masks(U, M):
    P, T = U * M, 12
    shape = _shape(U, 2 * U, U)
    for mask in (Mask(True, (3, 0)), Mask.from_cu_seqlens([0, 5, 30, P * T], P * T)):
        for mode, kw in (("a2a+mesh", {"tile": "auto"}), ("a2a+ring", {}), ("a2a+tasp", {})):
            validate_plan(resolve(mode, P, shape, ulysses_size=U, **kw).build(shape, mask))


def test_dq_goes_home_before_the_dkv_partials_return():
    """Under documents the inner plan's query owner gets no dQ partials back: its backward sends
    dQ home (one all-to-all round) while the dK/dV partials still return, then dK/dV (a second
    round); with Mesh's tile assignment dQ partials do come back, and one round sends both."""
    from megatron_mesh.plan.ir import Wait

    U, M, T = 2, 4, 12
    P = U * M
    shape = _shape(U, 2 * U, U, T)
    mask = Mask.from_cu_seqlens([0, 5, 30, 70, P * T], P * T)
    plan = resolve("a2a+tasp", P, shape, ulysses_size=U).build(shape, mask)
    validate_plan(plan)
    inner_last = plan.facts.inner.facts.last_round
    for r in range(P):
        ops = plan.rank(r).backward
        home = [op for op in ops if type(op) is Post and op.round > inner_last + 1]
        assert [{t.key.kind for t in op.sends} for op in home] == [{"gq"}, {"gkv"}], r
        inner_wait = next(i for i, op in enumerate(ops) if type(op) is Wait and op.round == inner_last + 1)
        assert ops.index(home[0]) < inner_wait < ops.index(home[1])
    dense = resolve("a2a+mesh", P, shape, ulysses_size=U, tile=(2, 2), contiguous="q").build(shape, Mask(True))
    inner_last = dense.facts.inner.max_round("backward")
    home = [op for op in dense.rank(0).backward if type(op) is Post and op.round > inner_last + 1]
    assert [{t.key.kind for t in op.sends} for op in home] == [{"gq", "gkv"}]


@pytest.mark.parametrize("U, heads, kv", [(2, 4, 4), (4, 8, 2), (4, 8, 1), (2, 4, 1)])
def test_all_to_all_bytes_are_ulysses_bytes(U, heads, kv):
    """What Ulysses moves, in the input dtype: forward q and k/v of U - 1 head slices out, the
    finished outputs back; backward dout out, dq and dk/dv back -- except dK/dV of a KV head
    replicated to several ranks, a partial sum that travels in fp32. A replicated KV head is sent
    to each rank that needs it."""
    P = 2 * U
    shape = _shape(U, heads, kv)
    plan = resolve("a2a+ring", P, shape, ulysses_size=U).build(shape)
    sub = inner_shape(shape, U)
    T = shape.seq_local
    slice_bytes = lambda kind: buffer_bytes(kind, T, shape, sub.heads, sub.kv_heads)  # noqa: E731
    fwd_a2a = (U - 1) * (slice_bytes("q") + slice_bytes("kv") + slice_bytes("y"))
    bwd_a2a = (U - 1) * (slice_bytes("dy") + slice_bytes("gq") + slice_bytes("dkv" if kv < U else "gkv"))
    assert slice_bytes("y") == slice_bytes("q") and slice_bytes("gkv") == slice_bytes("kv")
    ring = resolve("ring", 2, sub).build(sub)
    inner = plan_bytes(ring, sub)[0]
    for b in plan_bytes(plan, shape):
        assert b.forward_sent == fwd_a2a + inner.forward_sent
        assert b.backward_sent == bwd_a2a + inner.backward_sent
    if kv < U:  # each rank gets one replicated KV head
        first = next(op for op in plan.rank(0).forward if isinstance(op, Post))
        kv_sends = [t for t in first.sends if t.key.kind == "kv"]
        assert len(kv_sends) == U - 1 and all(key_bytes(plan, t.key, shape) == slice_bytes("kv") for t in kv_sends)


@pytest.mark.parametrize("U, heads, kv, match", [
    (3, 4, 4, r"query heads \(4\) must be divisible by the ulysses size \(3\)"),
    (4, 8, 3, r"kv heads \(3\) must be divisible by the ulysses size \(4\) or divide it"),
])
def test_bad_head_counts_name_the_sizes(U, heads, kv, match):
    shape = AttentionShape(seq_local=4, heads=heads, kv_heads=kv if heads % kv == 0 else 1, head_dim=8)
    if heads % kv:
        shape = AttentionShape(seq_local=4, heads=12, kv_heads=3, head_dim=8)
    with pytest.raises(ValueError, match=match):
        resolve("a2a+mesh", 2 * U, shape, ulysses_size=U)


def test_ulysses_size_must_divide_the_cp_size_and_fit_a_node():
    shape = AttentionShape(seq_local=4, heads=4, kv_heads=4, head_dim=8)
    with pytest.raises(ValueError, match=r"ulysses_size 4 must be a positive divisor of the CP size 6"):
        resolve("a2a+ring", 6, shape, ulysses_size=4)
    with pytest.raises(ValueError, match=r"ulysses_size 4 must divide the CP ranks per node 2"):
        resolve("a2a+ring", 8, shape, ulysses_size=4, ranks_per_node=2)
    with pytest.raises(ValueError, match=r"needs ulysses_size"):
        resolve("a2a+mesh", 8, shape)


def test_hybrid_work_is_balanced_per_head_slice():
    from megatron_mesh.plan import rank_work

    shape = _shape(2, 4, 2)
    plan = resolve("a2a+mesh", 8, shape, ulysses_size=2, tile=(2, 2), contiguous="q").build(shape)
    for direction in ("forward", "backward"):
        work = rank_work(plan, direction)
        assert max(work) == min(work), work


def test_worked_example_of_the_rounds_by_document():
    """docs/algorithms/hybrid.md: CP 8, U 4, 16 tokens per rank, two documents crossing the groups.
    Rank 0 holds 6 of group 0's 27 crossing tokens, then 10 of the document [3, 40) inside it;
    it sends the crossing ones in round 2, the others in round 3. With hide, group 0's inside
    document is its last set, group 1 sets 4 tokens first, 4 in the middle, 19 last."""
    from megatron_mesh.plan import balanced_layout

    cu = [0, 3, 40, 41, 60, 64, 100, 128]
    layout = balanced_layout(cu, 8, group=4)
    assert layout.rank_runs[0] == ((68, 5), (100, 1), (3, 10))
    assert [layout.set_tokens(g) for g in range(2)] == [(27, 0, 37, 0), (37, 0, 27, 0)]
    shape = _shape(4, 8, 4, 16)
    plan = resolve("a2a+tasp", 8, shape, ulysses_size=4).build(shape, Mask(True), layout)
    posts = [op for op in plan.rank(0).forward if type(op) is Post]
    assert [(p.round, {t.key.slot for t in p.sends}) for p in posts[:2]] == [(2, {0}), (3, {2})]
    hidden = balanced_layout(cu, 8, group=4, hide=True)
    assert [hidden.set_tokens(g) for g in range(2)] == [(27, 0, 0, 37), (37, 4, 4, 19)]


@pytest.mark.parametrize("mode", ["a2a+ring", "a2a+tasp", "a2a+mesh"])
def test_all_to_all_in_rounds_by_document_on_a_layout_balanced_for_the_group(mode):
    """On a layout balanced for its Ulysses groups the all-to-all runs in one round per set of
    documents (SETS; each rank holds 1/U of each): round 1 the inside documents run first, round 2
    the documents that cross into another group, rounds 3 and 4 the other inside ones and those run
    last. The own block runs in parts: the first documents' before round 2 is waited for (their
    rows go home in round 5, before the inner plan's rounds), the last documents' after the
    crossing rows went home. Plans stay valid (exact cover per head slice, no deadlock) and the
    bytes are Ulysses' bytes; on Megatron's zigzag the all-to-all stays one round."""
    from megatron_mesh.plan import balanced_layout
    from megatron_mesh.plan.balance import SETS
    from megatron_mesh.plan.ir import Attend, AttendBackward, Copy, Key, RowStats, Wait

    P, U, T = 8, 4, 16
    cu = [0, 2, 5, 9, 14, 40, 41, 47, 54, 60, 64, 70, 73, 77, 100, 128]  # 14..40 and 77..100 cross the groups
    layout = balanced_layout(cu, P, group=U, hide=True)
    shape = _shape(U, 8, 4, T)
    plan = resolve(mode, P, shape, ulysses_size=U).build(shape, Mask(True), layout)
    validate_plan(plan)
    # without hide the first and last documents' rounds carry nothing (the middle set has them all)
    plain = resolve(mode, P, shape, ulysses_size=U).build(shape, Mask(True), balanced_layout(cu, P, group=U))
    validate_plan(plain)
    assert not [op for r in range(P) for d in ("forward", "backward") for op in plain.rank(r).ops(d)
                if type(op) in (Post, Wait) and op.round in (1, 4, 5)]  # rounds that would move nothing are not posted
    zigzag = resolve(mode, P, shape, ulysses_size=U).build(shape, Mask.from_cu_seqlens(cu, P * T))
    assert [op.round for op in zigzag.rank(0).forward if type(op) is Post][:1] == [1]
    A, F, B, L = range(len(SETS))
    assert [layout.set_tokens(g)[B] > 0 for g in range(2)] == [False, True]  # a group without B, one with
    for g in range(P // U):
        sizes = layout.set_tokens(g)
        assert all(sizes[j] > 0 for j in (A, F, L))
        starts = [sum(sizes[:j]) for j in range(len(SETS))]
        for r in range(g * U, (g + 1) * U):
            for direction, kinds in (("forward", {"q", "kv"}), ("backward", {"dy"})):
                ops = plan.rank(r).ops(direction)
                posts = [op for op in ops if type(op) is Post]
                gathers = [j for j in (F, A, B, L) if sizes[j] > 0]  # an empty set's round is not posted
                assert [p.round for p in posts[:len(gathers) + 1]] == [1 + (F, A, B, L).index(j) for j in gathers] + [5]
                for j, post in zip(gathers, posts):
                    assert {t.key.kind for t in post.sends} <= kinds and {t.key.slot for t in post.sends} <= {j}
                    assert {t.peer for t in post.sends} <= set(range(g * U, (g + 1) * U)) - {r}
                assert {t.key.slot for t in posts[len(gathers)].sends} == {F}  # F's rows, finished, go home
                # the own block's parts: F's between waiting for rounds 1 and 2, L's after A's rows left
                own = [i for i, op in enumerate(ops) if type(op) in (Attend, AttendBackward) and op.q.span == U
                       and op.kv[0].chunk == g and op.kv[0].span == U]
                waits = {op.round: i for i, op in enumerate(ops) if type(op) is Wait}
                def within(i: int, j: int) -> bool:  # op i's rows all in set j's part of the span chunk
                    return all(starts[j] <= seg.start and seg.stop <= starts[j] + sizes[j] for seg in ops[i].rows)

                firsts = [i for i in own if within(i, F)]
                lasts = [i for i in own if within(i, L)]
                assert len(firsts) + len(lasts) + sum(within(i, A) or within(i, B) for i in own) == len(own)
                assert firsts and all(waits[1] < i < waits[2] for i in firsts)
                a_home = max(i for i, op in enumerate(ops)
                             if type(op) is Post and any(t.key.slot == A for t in op.sends))
                assert lasts and all(i > a_home for i in lasts)
                if direction == "backward":  # row statistics per round, as its rows arrive
                    assert len([op for op in ops if type(op) is RowStats]) == sum(n > 0 for n in sizes)
            # the rounds move what one all-to-all moves: every peer's head slice of my chunk
            moved = sum(key_bytes(plan, t.key, shape) for op in plan.rank(r).forward
                        if type(op) is Post and op.round <= 4 for t in op.sends)
            h, kv = plan.head_counts(Key("q", r, heads=(r + 1) % U), shape.heads, shape.kv_heads)
            assert moved == (U - 1) * (buffer_bytes("q", T, shape, h, kv) + buffer_bytes("kv", T, shape, h, kv))
            # each round's rows land in its set's part of the group's span chunk
            for op in plan.rank(r).forward:
                if type(op) is Copy and op.src.kind == "q" and op.src.slot >= 0:
                    j = op.src.slot
                    assert all(starts[j] <= seg.start and seg.stop <= starts[j] + sizes[j] for seg in op.into)
        shares = [sum(n for _, _, n in layout.runs(r)) for r in range(g * U, (g + 1) * U)]
        assert len(set(shares)) == 1


@pytest.mark.parametrize("cu", [[0, 16], [0, 5, 16], [0, 1, 2, 3, 4, 8, 12, 16], [0, 7, 9, 16]])
@pytest.mark.parametrize("mode", ["a2a+ring", "a2a+tasp", "a2a+mesh"])
def test_two_rounds_stay_valid_when_a_round_is_empty(cu, mode):
    """One document (every token crosses: round 2 is empty, the inner plan a dense one), documents
    inside one rank (round 1 empty), and mixes: the plan validates, its rounds in posting order."""
    from megatron_mesh.plan import balanced_layout

    P, U = 4, 2
    shape = _shape(U, 4, 2, 4)
    for window in (None, (3, 0)):
        plan = resolve(mode, P, shape, ulysses_size=U).build(shape, Mask(True, window),
                                                              balanced_layout(cu, P, window=window, group=U))
        validate_plan(plan)


@pytest.mark.parametrize("mode", ["a2a+ring", "a2a+tasp", "a2a+mesh"])
def test_composed_traffic_of_a_hybrid_equals_every_rank(mode):
    """The simulator prices a hybrid's traffic from its inner plan (head slice 0's group, rounds
    shifted past the all-to-all) plus the all-to-all rounds: per rank and round the same durations
    as reading every rank's rounds -- on Megatron's zigzag (one gather round) and on a layout
    balanced for the groups (two gather rounds, whose sizes differ by group and rank)."""
    from megatron_mesh.plan import Topology, balanced_layout
    from megatron_mesh.plan.simulate import round_traffic

    P, U, T = 8, 2, 16
    cu = [0, 3, 40, 41, 60, 64, 100, 128]
    shape = _shape(U, 8, 4, T)
    topo = Topology.for_cp(P, 4)
    for mask, layout in ((Mask.from_cu_seqlens(cu, P * T), None), (Mask(True), balanced_layout(cu, P, group=U))):
        plan = resolve(mode, P, shape, ulysses_size=U).build(shape, mask, layout)
        for d in ("forward", "backward"):
            fast, exact = round_traffic(plan, shape, topo, d), round_traffic(plan, shape, topo, d, exact=True)
            moving = lambda times: {k: v for k, v in times.items() if v}  # noqa: E731 (a round that moves nothing)
            assert moving(fast.duration) == pytest.approx(moving(exact.duration)), (d, layout is None)
            if fast.per_rank is not None:
                assert moving(fast.per_rank) == pytest.approx(moving(exact.per_rank)), (d, layout is None)
            assert fast.bytes_sent == exact.bytes_sent


def test_set_rows_worked_example():
    """plan/hybrid_sets.py's example: a span chunk of 6 crossing tokens and 10 others, no hide."""
    from types import SimpleNamespace

    from megatron_mesh.plan.hybrid_sets import SetRows
    from megatron_mesh.plan.sel import Segment

    layout = SimpleNamespace(set_tokens=lambda m: (6, 0, 10, 0))
    rows = SetRows(layout, 2, [(Segment(0, 8),), (Segment(8, 16),)])
    assert rows.chunk_rows(0) == ((Segment(0, 6),), (), (Segment(6, 16),), ())
    assert rows.member_sets(1) == [((), ()), ((), ()), ((Segment(0, 8),), (Segment(8, 16),)), ((), ())]


@pytest.mark.parametrize("U, M", [(2, 2), (4, 2), (8, 1)])
def test_the_all_to_all_rounds_are_collectives_of_the_ulysses_group(U, M):
    """Every round of a hybrid that moves data inside a Ulysses group is one all-to-all over it
    (``Post.group``), the inner plan's rounds point to point; the host prices such a round as its
    collective's 1-4 calls, not a call per tensor: at U = 8 a rank's forward q/kv round is 4 calls
    and one view (the receive buffer's split), where point to point it was 28 calls; its backward
    dout round one or two."""
    from megatron_mesh.plan.hostops import step_host_ops
    P = U * M
    shape = _shape(U, 2 * U, U)
    plan = resolve("a2a+ring", P, shape, ulysses_size=U).build(shape, Mask(True))
    for g in range(P):
        group = tuple(range(g - g % U, g - g % U + U))
        for d in ("forward", "backward"):
            ops = plan.rank(g).ops(d)
            posts = [op for op in ops if isinstance(op, Post)]
            ulysses = [p for p in posts if {t.peer for t in p.sends + p.recvs} <= set(group)]
            assert ulysses and all(p.group == group for p in ulysses)
            assert all(p.group == () for p in posts if p not in ulysses)
            host = step_host_ops(plan, g, d, shape)[0]
            first = ops.index(ulysses[0])
            # forward: q, k and v to and from each peer, packed and unpacked; backward: dy alone, its
            # receives one after another in the arena as the copies read them (no unpack), its sends
            # one group of cuts (no pack) where the rank's own head slice is first or last (at U = 2
            # one tensor each way: straight from and into it, one call)
            u = g % U
            packed = d == "forward" or (U > 2 and 0 < u < U - 1)
            want = (4, 1.0) if d == "forward" else (1 + packed, 0.0)
            assert (host[first].transfers, host[first].wire_views) == want, (g, d)


def test_the_simulator_runs_an_all_to_all_round_s_copies_on_the_compute_stream():
    """An all-to-all round's pack (its sends, before it starts) and unpack (its receives, after
    its wait) are the transport's copies: each its bytes read and written once at the memory
    bandwidth, on the compute stream (none where one tensor is all: U = 2's dy round)."""
    from megatron_mesh.plan import Topology, key_bytes
    from megatron_mesh.plan.simulate import simulate
    U, T = 4, 64
    shape = AttentionShape(seq_local=T, batch=1, heads=8, kv_heads=4, head_dim=16, itemsize=2)
    plan = resolve("a2a+ring", 8, shape, ulysses_size=U).build(shape, Mask(True))
    topo = Topology(nodes=1, gpus_per_node=8)
    sim = simulate(plan, shape, topo, timeline=True)
    first = next(op for op in plan.rank(0).ops("forward") if isinstance(op, Post) and op.group)
    want = 2 * sum(key_bytes(plan, t.key, shape) for t in first.sends) / topo.memory_bandwidth
    packs = [e for e in sim.forward.timeline if e.rank == 0 and e.what == "pack"]
    unpacks = [e for e in sim.forward.timeline if e.rank == 0 and e.what == "unpack"]
    # the q/kv round and the output's return pack; the return's receives lie one after another in
    # the arena, in the order they come (hostops.wire_copies): only the q/kv round unpacks
    assert len(packs) == 2 and len(unpacks) == 1
    assert abs((packs[0].end - packs[0].start) - want) < 1e-15

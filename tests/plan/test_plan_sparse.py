"""Mask-aware plans (pure Python): valid for every mode under documents, windows and the THD
layout; empty blocks skipped in compute and in communication; a window of half a chunk degrades
every mode to a halo exchange."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from megatron_mesh.plan import (ZigzagLayout, Topology, choose_tile, Attend, AttendBackward, AttentionShape, Mask, ThdLayout, plan_bytes, rank_work,
                                resolve, tile_shapes, validate_plan)
from megatron_mesh.plan.ir import MergeOut, AddGrad
from megatron_mesh.plan.tunables import TUNABLES, Tunables

SHAPE = dict(batch=1, heads=4, kv_heads=2, head_dim=8, itemsize=2)


def placements(P: int, shape: AttentionShape):
    yield resolve("ring", P, shape)
    yield resolve("ring", P, shape, backward_chunks="keep")
    for t in tile_shapes(P):
        yield resolve("mesh", P, shape, tile=t, contiguous="q", backward_chunks="keep" if t[0] == 2 else "refetch")
    yield resolve("tasp", P, shape)  # backward_chunks "auto": each rank keeps or refetches by its pulls
    yield resolve("tasp", P, shape, backward_chunks="refetch")
    yield resolve("tasp", P, shape, backward_chunks="keep")


def masks(S: int, T: int):
    """Documents shorter than a half-chunk, crossing chunk and rank boundaries, one document,
    many one-token documents; windows of one token, less than a half-chunk, several chunks."""
    h = T // 2
    yield Mask.from_cu_seqlens([0, h // 2 or 1, S], S)
    yield Mask.from_cu_seqlens(sorted({0, S} | {c for c in (3, h + 1, 3 * h + 2, S - 1) if 0 < c < S}), S)
    yield Mask.from_cu_seqlens(list(range(0, S + 1)), S)  # every token its own document
    yield Mask(True, (1, 0))
    yield Mask(True, (max(1, h // 2), 0))
    yield Mask(True, (3 * T, 0))
    yield Mask(False, (2, 3))
    yield Mask.from_cu_seqlens([0, S // 3 or 1, S], S, causal=False, window=(h, 1))


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("groups", ["few", "many"])
def test_masked_plans_validate_for_every_mode(P, groups):
    """Every mode's plan under every mask validates; "many": TASP pulls and returns in as many
    groups as it can (group_tokens = 1: every pulled token may open a group)."""
    tunables = Tunables(group_tokens=1) if groups == "many" else TUNABLES
    T = 2 * max(P - 1, 2)  # TASP's rings fit
    shape = AttentionShape(seq_local=T, **SHAPE)
    for mask in masks(P * T, T):
        for placement in placements(P, shape):
            plan = placement.build(shape, mask, tunables=tunables)
            validate_plan(plan)


@pytest.mark.parametrize("P", [2, 3, 4])
def test_thd_layout_plans_validate(P):
    # three packed sequences padded to multiples of 2P, the last one mostly padding
    lens = (2 * P * 2, 2 * P, 2 * P * 3)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    layout = ThdLayout(P, tuple(cu), (lens[0] - 1, lens[1], 2))
    shape = AttentionShape(seq_local=layout.seq_local, **SHAPE)
    for placement in placements(P, shape):
        for window in (None, (2, 0)):
            mask = Mask(True, window, layout.documents())
            plan = placement.build(shape, mask, layout)
            validate_plan(plan)


def _received_is_read(plan):
    """Every buffer a rank receives is read by one of its blocks (or merged into its own)."""
    for rp in plan.ranks:
        for direction in ("forward", "backward"):
            ops = rp.ops(direction)
            used = set()
            for op in ops:
                if isinstance(op, (Attend, AttendBackward)):
                    used |= {op.q, *op.kv} | ({op.do} if isinstance(op, AttendBackward) else set())
                elif isinstance(op, (MergeOut, AddGrad)):
                    used.add(op.src)
            received = {t.key for op in ops if hasattr(op, "recvs") for t in op.recvs}
            assert received <= used, (rp.rank, direction, received - used)


@pytest.mark.parametrize("P", [2, 4, 8])
def test_a_rank_needing_nothing_of_others_sends_and_receives_nothing(P):
    T = 2 * max(P - 1, 2)
    shape = AttentionShape(seq_local=T, **SHAPE)
    h = T // 2
    # documents = the zigzag halves: every block off a rank's own chunk is empty
    docs = Mask.from_cu_seqlens(list(range(0, 2 * P * h + 1, h)), P * T)
    for mask in (docs, Mask(True, (0, 0)), Mask(False, (0, 0))):
        for placement in placements(P, shape):
            plan = placement.build(shape, mask)
            assert all((b.sent, b.received) == (0, 0) for b in plan_bytes(plan, shape)), (placement, mask)
            _received_is_read(plan)


def test_a_half_chunk_window_at_P8_moves_a_fifth_of_ring_or_less():
    """Window of one half-chunk (S / 2P tokens) at P = 8: every mode is a halo exchange; ring
    attention unmasked moves (P - 1) chunks forward, the halo ~1/(P - 1) of that."""
    P, T = 8, 16
    shape = AttentionShape(seq_local=T, **SHAPE)
    ring = max(b.sent for b in plan_bytes(resolve("ring", P, shape).build(shape), shape))
    window = Mask(True, (T // 2, 0))
    for placement in placements(P, shape):
        plan = placement.build(shape, window)
        sent = max(b.sent for b in plan_bytes(plan, shape))
        assert sent <= 0.2 * ring, (placement.describe(), sent / ring)
        _received_is_read(plan)
        validate_plan(plan, dataflow=False)


def test_mesh_keeps_its_tile_when_the_mask_is_dense_enough():
    P, T = 8, 16
    shape = AttentionShape(seq_local=T, batch=1, heads=8, kv_heads=8, head_dim=8)
    long_docs = Mask.from_cu_seqlens([0, P * T // 2 + 3, P * T], P * T)
    plan = resolve("mesh", P, shape, tile=(2, 4), contiguous="q").build(shape, long_docs)
    assert plan.facts.assignment == "tile" and plan.facts.tile_placed == (2, 4)
    window = resolve("mesh", P, shape, tile=(2, 4), contiguous="q").build(shape, Mask(True, (2, 0)))
    assert window.facts.assignment == "query owner" and window.facts.tile_placed is None and "nothing to gain" in window.notes[0]


@pytest.mark.parametrize("P", [6, 8])
@pytest.mark.parametrize("backward_chunks", ["refetch", "auto", "keep"])
def test_mesh_auto_tile_chooses_with_the_mask(P, backward_chunks):
    """Under documents on Megatron's zigzag, Mesh's ``auto`` tile lets every tile map of the
    group (each rank order) compete with the query owner, with each map's own keep decisions:
    its busiest rank moves exactly the fewest bytes of all the explicit tiles' plans, and the plan
    names the tile it took. An explicit tile keeps competing with the query owner alone. Under
    "auto" the maps compete by what one chunk's worth keeps (ASSIGNMENT_KEEP_LIMIT): the fewest
    bytes at keep limit 1, and at the default (2) the same map, keeping more."""
    shape = AttentionShape(seq_local=64, batch=1, heads=2, kv_heads=2, head_dim=8, itemsize=4)  # MHA: tiles pay
    S = P * shape.seq_local
    docs = Mask.from_cu_seqlens([0, 7, 40, 41, 150, 151, 200, S // 2 + 9, S - 30, S], S)

    def busiest(plan):
        return max(b.sent + b.received for b in plan_bytes(plan, shape))

    limit = dict(backward_keep_limit=1.0) if backward_chunks == "auto" else {}
    explicit = {(t, c): resolve("mesh", P, shape, tile=t, contiguous=c, backward_chunks=backward_chunks, **limit)
                .build(shape, docs) for t in tile_shapes(P) for c in ("q", "kv")}
    auto = resolve("mesh", P, shape, backward_chunks=backward_chunks, **limit)
    assert auto.options.tile_auto and not resolve("mesh", P, shape, tile=(2, P // 2)).options.tile_auto
    plan = auto.build(shape, docs)
    validate_plan(plan)
    if limit:  # the default keep limit: the same map, at most the bytes
        default = resolve("mesh", P, shape).build(shape, docs)
        assert (default.facts.assignment, default.facts.tile, default.facts.contiguous) == \
            (plan.facts.assignment, plan.facts.tile, plan.facts.contiguous)
        assert busiest(default) <= busiest(plan)
    assert busiest(plan) == min(busiest(p) for p in explicit.values())
    if plan.facts.assignment == "tile":
        assert busiest(plan) == busiest(explicit[plan.facts.tile, plan.facts.contiguous])
        a, b = plan.facts.tile
        assert plan.notes[0].startswith(f"tile {a}x{b} (contiguous {plan.facts.contiguous}): "), plan.notes
    assert all(p.facts.tile == t and p.facts.contiguous == c for (t, c), p in explicit.items())  # an explicit tile stays


def test_mesh_auto_tile_takes_another_tile_where_the_mask_favours_it():
    """The worked example of MeshMode.assignment: 8 ranks, the documents of the CPU comparison
    (lognormal:4096 in 64K tokens), MHA. The dense choice is 2x4 (4x2 with the host left out: at
    8K tokens of 2 heads of 32 per rank the host's ops decide); under the mask with refetched
    backward chunks the 8x1 map's busiest rank moves fewer bytes (29.4 against 29.8 MB sent +
    received; 16.0 against 17.9 MB sent), and the plan takes it, saying so."""
    from megatron_mesh.tools.plan_args import document_bounds

    P, S = 8, 65536
    shape = AttentionShape(seq_local=S // P, batch=1, heads=2, kv_heads=2, head_dim=32, itemsize=4)
    docs = Mask.from_cu_seqlens(document_bounds("lognormal:4096,1.0", S, 0), S)
    auto = resolve("mesh", P, shape, backward_chunks="refetch")
    assert auto.options.tile == (2, 4)
    assert choose_tile(P, shape, Topology.for_cp(P, host_op_time=0), backward_chunks="refetch") == ((4, 2), "q")
    plan = auto.build(shape, docs)
    dense_choice = resolve("mesh", P, shape, tile=(4, 2), backward_chunks="refetch").build(shape, docs)
    assert (plan.facts.tile, plan.facts.contiguous, plan.facts.assignment) == ((8, 1), "q", "tile")
    assert plan.notes[0].startswith("tile 8x1 (contiguous q): of the 5 tile maps and the query owner, the fewest bytes")
    mine, theirs = (max(b.sent + b.received for b in plan_bytes(p, shape)) for p in (plan, dense_choice))
    assert mine < 0.99 * theirs, (mine, theirs)


def test_work_balance_is_reported_for_packed_documents():
    P, T = 4, 16
    shape = AttentionShape(seq_local=T, **SHAPE)
    mask = Mask.from_cu_seqlens([0, 5, 30, 33, 64], P * T)
    plan = resolve("ring", P, shape).build(shape, mask)
    fwd, bwd = rank_work(plan, "forward"), rank_work(plan, "backward")
    assert fwd == bwd and sum(fwd) == sum(1 for i in range(P * T) for j in range(P * T) if mask.allows(i, j))


@settings(max_examples=60, deadline=None)
@given(P=st.integers(1, 6), data=st.data())
def test_block_table_is_the_classification_of_every_block(P, data):
    """The linear block table (documents paired only with the ranks holding them) equals
    classify_block of every (query chunk, key chunk) pair, on zigzag, THD and balanced layouts."""
    from megatron_mesh.plan.balance import balanced_layout
    from megatron_mesh.plan.mask import classify_block
    from megatron_mesh.plan.sparse_blocks import block_table

    T = 2 * data.draw(st.integers(1, 6))
    S = P * T
    cuts = sorted(data.draw(st.sets(st.integers(1, S - 1), max_size=6))) if S > 1 else []
    causal = data.draw(st.booleans())
    left = data.draw(st.one_of(st.none(), st.integers(0, S)))
    right = 0 if causal else data.draw(st.one_of(st.none(), st.integers(0, S)))
    cu = [0, *cuts, S]
    layouts = [(ZigzagLayout(P, S), Mask.from_cu_seqlens(cu, S, causal, (left, right)))]
    layouts.append((balanced_layout(cu, P, causal=causal, window=(left, right)),
                    Mask.from_cu_seqlens(cu, S, causal, (left, right))))
    pad = 2 * P
    thd = ThdLayout(P, (0, pad, 2 * pad), (pad - 1, data.draw(st.integers(0, pad))))
    layouts.append((thd, Mask(causal, (left, right), thd.documents())))
    for layout, mask in layouts:
        mask = mask.normalized(layout.seq_len)
        runs = [tuple((a, n) for _, a, n in layout.runs(g)) for g in range(P)]
        want = {}
        for i in range(P):
            for j in range(P):
                c = classify_block(mask, runs[i], (runs[j],))
                if c is not None:
                    want[(i, j)] = c
        assert block_table.__wrapped__(P, mask, layout) == want, type(layout).__name__


def test_a_documents_remote_blocks_are_fused_per_query_rows():
    """TASP on the balanced layout (a 44-token document cut over 4 ranks of 16, three short ones),
    pulling in one group (burst_groups = 1): in its single round every rank receives all it
    needs, and the blocks with other ranks' slots of one document become one kernel call per
    query rows -- fewer calls than blocks -- with the columns in the order of their positions (a
    chunk's columns split where another's come between, so runs that continue each other join).
    Ring pulls one shift per round: one call per block. Both plans validate: every allowed pair
    exactly once. (With more groups the slots of one group are fused the same way.)"""
    import megatron_mesh as mm
    from megatron_mesh.plan.sparse_blocks import block_table
    P, T = 4, 16
    layout = mm.balanced_layout([0, 44, 50, 56, 64], P)
    shape = AttentionShape(seq_local=T, **SHAPE)
    calls = {}
    for mode in ("tasp", "ring"):
        plan = resolve(mode, P, shape).build(shape, Mask(True), layout, tunables=Tunables(burst_groups=1))
        validate_plan(plan)
        remote = [op for x in range(P) for op in plan.rank(x).forward
                  if type(op) is Attend and any(k.chunk != x for k in op.kv)]
        calls[mode] = len(remote)
        for op in remote:
            starts = [start for i, k in enumerate(op.kv) for start, _ in plan.positions(k, op.col(i))]
            assert starts == sorted(starts), op
        if mode == "tasp":
            assert any(len(set(op.kv)) < len(op.kv) for op in remote), "no chunk's columns were split"
    blocks = sum(1 for i, j in block_table(P, plan.mask, plan.layout) if i != j)
    assert calls["ring"] == blocks and calls["tasp"] < blocks, (calls, blocks)


def test_module_docstring_worked_example():
    """The window example of plan/sparse.py's docstring, forward and backward, is what the
    builder makes for rank 1 (ring, P = 4, S = 16, window (2, 0), the slots kept)."""
    import re

    from megatron_mesh.plan import sparse
    from megatron_mesh.plan.ir import Free

    shape = AttentionShape(seq_local=4, **SHAPE)
    plan = resolve("ring", 4, shape, backward_chunks="keep").build(shape, Mask(True, (2, 0)), ZigzagLayout(4, 16))
    validate_plan(plan)
    blocks = re.findall(r"::\n\n((?:    .*\n)+)", sparse.__doc__)
    want = [[line.split("#")[0].strip() for line in b.splitlines()] for b in blocks[-2:]]
    got = [[str(op) for op in plan.rank(1).ops(d) if type(op) is not Free] for d in ("forward", "backward")]
    assert got == want


def test_partials_go_home_as_soon_as_the_blocks_writing_them_ran():
    """A rank returns each slot's partial (here dK/dV) in a round of its own right after the
    blocks that write it, while its other blocks still compute -- ring: round P + d for shift d,
    every pull posted up front; TASP: a pull and a return round per group of remote slots
    (burst_groups; every rank posts all of them: its all-to-all transport is a collective). P = 4, T = 12, one causal
    document of 46 tokens on the zigzag, backward refetching: rank 0 reads K/V of ranks 3, 2, 1
    (pull rounds 1-3) and returns dkv3, dkv2, dkv1 in rounds 5, 6, 7 (ring)."""
    from megatron_mesh.plan.ir import Free, Post, Wait

    tunables = Tunables(group_tokens=1)  # a group per slot even for these few tokens
    P, T = 4, 12
    shape = AttentionShape(seq_local=T, **SHAPE)
    mask = Mask.from_cu_seqlens([0, 46, 48], P * T)
    for mode in ("ring", "tasp"):
        plan = resolve(mode, P, shape, backward_chunks="refetch").build(shape, mask, tunables=tunables)
        validate_plan(plan)
        for r in range(P):
            ops = [op for op in plan.rank(r).backward if type(op) is not Free]
            posts = {op.round: op for op in ops if type(op) is Post}
            returns = [t for t, op in posts.items() if any(x.key.kind == "dkv" for x in op.sends + op.recvs)]
            if mode == "tasp":
                assert sorted(posts) == list(range(1, 1 + 2 * tunables.burst_groups))  # every rank, every round
            for n, op in enumerate(ops):
                if type(op) is AttendBackward and op.kv[0].slot >= 0:  # a remote slot's block
                    nxt = next(o for o in ops[n + 1:] if type(o) is not Post or o.sends or o.recvs)
                    assert type(nxt) is Post and any(x.key == op.dkv[0] for x in nxt.sends), (mode, r, op, nxt)
            # the returns' waits come after the last block: the rank computes while they fly
            last_compute = max(n for n, op in enumerate(ops) if type(op) is AttendBackward)
            assert all(n > last_compute for n, op in enumerate(ops) if type(op) is Wait and op.round in returns)
            if mode == "ring" and r == 0:
                assert [t for t in sorted(returns)] == [5, 6, 7]
                assert [x.peer for t in (5, 6, 7) for x in posts[t].sends] == [3, 2, 1]


def test_tasp_groups_overlap_pulls_and_returns_with_compute():
    """TASP pulling and returning in burst_groups groups instead of one round each: on 16 ranks
    over 2 nodes with a 48K-token document cut over 12 ranks (and short ones), the simulated
    forward starts its remote blocks before all slots are in and the backward's dK/dV returns
    travel while later groups compute -- both directions faster than with one group, the same
    bytes (a deterministic model property, not a timing; validity: the "many" groups case of
    test_masked_plans_validate_for_every_mode)."""
    import megatron_mesh as mm
    from megatron_mesh.plan.simulate import simulate
    from megatron_mesh.plan.topology import Topology

    P, T = 16, 4096
    shape = AttentionShape(seq_local=T, batch=1, heads=32, kv_heads=8, head_dim=128, itemsize=2)
    cu = [0, 12 * T] + list(range(12 * T + 1024, P * T, 1024)) + [P * T]
    layout = mm.balanced_layout(cu, P, ranks_per_node=8)
    topo = Topology(nodes=2, gpus_per_node=8)
    got = {}
    for groups in (1, TUNABLES.burst_groups):
        plan = resolve("tasp", P, shape, ranks_per_node=8, backward_chunks="refetch").build(
            shape, Mask(True), layout, tunables=Tunables(burst_groups=groups))
        got[groups] = simulate(plan, shape, topo)
    one, many = got[1], got[TUNABLES.burst_groups]
    assert many.bytes_sent == one.bytes_sent
    assert many.forward.time < one.forward.time and many.backward.time < one.backward.time, \
        (one.forward.time, many.forward.time, one.backward.time, many.backward.time)


def test_backward_chunks_auto_keeps_what_fits_in_the_rank_s_own_chunk():
    """backward_chunks="auto" under a mask: each rank keeps what it pulled in the forward of the
    chunks its backward reads first (shift order), each that still fits in the bytes of its own
    Q, K and V chunk (keep_limit), and pulls only the rest again; its senders agree (they send
    again exactly what it does not keep). P = 4, T = 12, one causal document of 46 tokens on the
    zigzag: rank 0 reads 36 columns (12 of each other chunk: it keeps chunks 3 and 2, the first two
    by shift), rank 1 30 (keeps chunks 0 and 3), ranks 2 and 3 read 24 and 18 (all kept). "keep" /
    "refetch" apply to every chunk; a dense plan refetches under "auto". The mode option
    ``backward_keep_limit`` scales the budget: at 2.0 every rank keeps all it pulled here, at 0 the
    plan is "refetch"'s op for op, at inf "keep"'s. A rank keeping all runs its blocks over the kept
    columns as one call only where they are at most its own chunk's worth (rank 2), else one shift
    at a time (rank 0 at 2.0 and under "keep")."""
    import math
    from megatron_mesh.plan.accounting import buffer_bytes
    from megatron_mesh.plan.ir import Post
    from megatron_mesh.plan.sparse_needs import KEEP_LIMIT as D  # "refetch" / "keep" take the default limit

    P, T = 4, 12
    shape = AttentionShape(seq_local=T, **SHAPE)
    mask = Mask.from_cu_seqlens([0, 46, 48], P * T)
    per = {k: buffer_bytes(k, 1, shape) for k in ("q", "kv")}
    sent, ops = {}, {}
    for mode in ("ring", "tasp", "mesh"):
        for bc, limit in (("refetch", D), ("keep", D), ("auto", 1.0), ("auto", 2.0), ("auto", 0.0),
                          ("auto", math.inf)):
            budget = limit * T * (per["q"] + per["kv"])
            settings = dict(tile=(1, 4)) if mode == "mesh" else {}
            plan = resolve(mode, P, shape, backward_chunks=bc, backward_keep_limit=limit, **settings).build(shape, mask)
            validate_plan(plan)
            kept_all = []
            for r in range(P):
                rp = plan.rank(r)
                pulled = {}  # chunk -> bytes of Q / K / V this rank pulled of it in the forward
                for op in rp.forward:
                    if type(op) is Post and not op.group:
                        for t in op.recvs:
                            if t.key.kind in ("q", "kv"):
                                n = sum(b - a for a, b in plan.slots(t.key))
                                pulled[t.key.chunk] = pulled.get(t.key.chunk, 0) + n * per[t.key.kind]
                want, used = set(), 0  # the rule, by hand: shift order, each chunk that still fits
                for c in sorted(pulled, key=lambda c: (r - c) % P):
                    if bc == "keep" or (bc == "auto" and used + pulled[c] <= budget):
                        used += pulled[c]
                        want.add(c)
                kept = {k.chunk for k in rp.saved}
                again = {t.key.chunk for op in rp.backward if type(op) is Post for t in op.recvs
                         if t.key.kind in ("q", "kv")}
                assert kept == want and again == set(pulled) - want, (mode, bc, r, kept, again, pulled)
                if bc == "auto":
                    assert sum(pulled[c] for c in kept) <= budget
                kept_all.append(len(kept) == len(pulled))
            # every sender sends again exactly what its reader does not keep
            for r in range(P):
                for op in plan.rank(r).backward:
                    if type(op) is Post:
                        for t in op.sends:
                            if t.key.kind in ("q", "kv"):
                                assert t.key.chunk == r and r not in {k.chunk for k in plan.rank(t.peer).saved}
            if (bc, limit) == ("auto", 1.0):  # docs/algorithms/mesh.md's worked example
                assert [{k.chunk for k in plan.rank(r).saved} for r in range(P)] == [{2, 3}, {0, 3}, {0, 1, 3}, {0, 1, 2}]
            if (bc, limit) == ("auto", 1.0) and mode == "ring":
                # rank 0 keeps chunks 3 and 2 and pulls chunk 1 again: its blocks over the kept
                # ones run one shift at a time, each shift's partials going home before the next
                # block; rank 2 keeps all: its blocks over chunks 0 and 1 (the same rows) in one call
                text = [str(op) for op in plan.rank(0).backward if type(op).__name__ != "Free"]
                first = next(i for i, t in enumerate(text) if "x kv3.4" in t)
                assert text[first + 1].startswith("post ") and "dkv3.4->3" in text[first + 1], text
                assert any("x kv2.4 " in t for t in text[first + 2:]), text
                assert any("x kv0.6,kv1.6 " in str(op) for op in plan.rank(2).backward), plan.rank(2).backward
            if (bc, limit) in (("auto", 2.0), ("keep", D)) and mode == "ring":
                # rank 0 now keeps all of its 36 columns, more than its own chunk's worth (24 x kv
                # here): its kept blocks still run one shift at a time, each shift's partials home
                # before the next (Keeps.one_call); rank 2 keeps its 24, a chunk's worth: one call
                text = [str(op) for op in plan.rank(0).backward if type(op).__name__ != "Free"]
                first = next(i for i, t in enumerate(text) if "x kv3.4" in t)
                assert text[first + 1].startswith("post ") and "dkv3.4->3" in text[first + 1], text
                assert not any(type(op).__name__ == "Post" and t.key.kind == "kv" for op in plan.rank(0).backward
                               for t in getattr(op, "recvs", ())), "rank 0 pulls nothing again"
                assert any("x kv0.6,kv1.6 " in str(op) for op in plan.rank(2).backward), plan.rank(2).backward
            want_all = {("keep", D): [True] * P, ("refetch", D): [False] * P, ("auto", 1.0): [False, False, True, True],
                        ("auto", 2.0): [True] * P, ("auto", 0.0): [False] * P, ("auto", math.inf): [True] * P}
            assert kept_all == want_all[bc, limit], (mode, bc, limit, kept_all)
            sent[bc, limit] = sum(b.sent for b in plan_bytes(plan, shape))
            ops[bc, limit] = [[str(op) for op in (*plan.rank(r).forward, *plan.rank(r).backward)] for r in range(P)]
        assert sent["keep", D] == sent["auto", 2.0] < sent["auto", 1.0] < sent["refetch", D], mode
        assert ops["auto", 0.0] == ops["refetch", D] and ops["auto", math.inf] == ops["keep", D], mode
    dense = resolve("ring", P, shape).build(shape, Mask(True))
    assert dense.backward_chunks == "refetch" and not any(dense.rank(r).saved for r in range(P))
    assert resolve("tasp", P, shape, backward_chunks="keep").build(shape, Mask(True)).backward_chunks == "refetch"


def test_mesh_compares_its_assignments_by_the_bytes_a_chunk_s_worth_keeps(monkeypatch):
    """Mesh takes its tile map or the query owner by the busiest rank's bytes, as kept under at most
    ASSIGNMENT_KEEP_LIMIT (one chunk's worth): the bytes are blind to the work, and what a larger
    limit keeps favours the query owner. P = 6, T = 8, documents [0, 6) and [6, 48): at keep limit 1
    and 2 the tile map (2 x 3), where comparing as kept at 2 took the query owner; at 2 every rank
    keeps at least what it keeps at 1, and the plans validate."""
    import megatron_mesh.plan.sparse as sparse

    P, T = 6, 8
    shape = AttentionShape(seq_local=T, **SHAPE)
    mask = Mask.from_cu_seqlens([0, 6, P * T], P * T)

    def build(limit):
        plan = resolve("mesh", P, shape, backward_keep_limit=limit).build(shape, mask)
        validate_plan(plan)
        return plan

    one, two = build(1.0), build(2.0)
    assert one.facts.assignment == two.facts.assignment == "tile" and two.facts.tile == (2, 3)
    for r in range(P):
        assert {k.chunk for k in one.rank(r).saved} <= {k.chunk for k in two.rank(r).saved}
    assert sum(b.sent for b in plan_bytes(two, shape)) <= sum(b.sent for b in plan_bytes(one, shape))
    monkeypatch.setattr(sparse, "ASSIGNMENT_KEEP_LIMIT", float("inf"))  # compared as kept: the query owner
    assert build(2.0).facts.assignment == "query owner" and build(1.0).facts.assignment == "tile"


def test_kept_chunks_worked_example():
    """plan/sparse_needs.py's kept_chunks example: P = 4, rank 0, budget 4,000 bytes."""
    from megatron_mesh.plan.sparse_needs import kept_chunks

    assert kept_chunks(0, 4, {3: 3000, 2: 2000, 1: 500}, 4000) == {3, 1}
    assert kept_chunks(0, 4, {3: 3000, 2: 2000, 1: 500}, 10**6) == {1, 2, 3}
    assert kept_chunks(0, 4, {3: 3000, 2: 2000, 1: 500}, 0) == set()


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_kept_chunks_keeps_in_shift_order_what_fits(data):
    """kept_chunks against its definition: the chunks in the order the backward reads them, by
    shift (x - c) mod P, each kept that still fits in the budget (the code walks the chunks up to
    x downwards, then those above it, without a key per chunk; x's own first, were it pulled)."""
    from megatron_mesh.plan.sparse_needs import kept_chunks

    P = data.draw(st.integers(1, 12))
    x = data.draw(st.integers(0, P - 1))
    chunks = data.draw(st.sets(st.integers(0, P - 1)))
    pulled = {c: data.draw(st.integers(1, 50)) for c in chunks}
    budget = data.draw(st.integers(0, 200))
    kept, used = set(), 0
    for c in sorted(pulled, key=lambda c: (x - c) % P):
        if used + pulled[c] <= budget:
            used += pulled[c]
            kept.add(c)
    assert kept_chunks(x, P, pulled, budget) == kept


def test_sparse_blocks_worked_example():
    """plan/sparse_blocks.py's docstring example: the blocks of one causal document of 8 tokens on
    2 zigzag ranks; and plan/sparse_needs.py's: rank 1's columns under the window example."""
    from megatron_mesh.plan.mask import BlockKind
    from megatron_mesh.plan.sel import Segment
    from megatron_mesh.plan.sparse_blocks import block_table, blocks_of
    from megatron_mesh.plan.sparse_needs import QueryOwnerNeeds

    table = block_table(2, Mask(True).normalized(8), ZigzagLayout(2, 8))
    got = {ij: (c.kind, tuple(c.rows), tuple(c.cols[0])) for ij, c in table.items()}
    assert got == {(0, 0): (BlockKind.CAUSAL, (Segment(0, 4),), (Segment(0, 4),)),
                   (0, 1): (BlockKind.FULL, (Segment(2, 4),), (Segment(0, 4),)),
                   (1, 0): (BlockKind.FULL, (Segment(0, 4),), (Segment(0, 2),)),
                   (1, 1): (BlockKind.CAUSAL, (Segment(0, 4),), (Segment(0, 4),))}
    needs = QueryOwnerNeeds(blocks_of(4, Mask(True, (2, 0)).normalized(16), ZigzagLayout(4, 16), 1))
    assert needs.cols(1) == {0: (Segment(0, 2),), 2: (Segment(2, 4),)} and needs.rows(1) == {}
    assert needs.col_needers(1) == [0, 2]



@pytest.mark.parametrize("P", [3, 4, 8])
def test_the_query_owners_needs_on_demand_equal_the_owner_maps(P):
    """A Mesh plan's query owner competes with its tile map through QueryOwnerNeeds (each rank's
    needs read from the block index on demand), not through Needs of the map (i, j) -> i, which
    computes every rank's at once: the same blocks, columns, readers, tokens and bytes."""
    from megatron_mesh.plan.balance import balanced_layout
    from megatron_mesh.plan.sparse_blocks import blocks_of
    from megatron_mesh.plan.sparse_needs import Keeps, Needs, QueryOwnerNeeds, bytes_per_rank
    from megatron_mesh.tools.plan_args import document_bounds

    S = 96 * P
    cu = document_bounds("lognormal:40,1.0", S, P)
    shape = AttentionShape(seq_local=S // P, batch=1, heads=4, kv_heads=2, head_dim=16)
    cases = [(Mask(True, (17, 0)), ZigzagLayout(P, S)), (Mask(False, (9, 5)), ZigzagLayout(P, S)),
             (Mask.from_cu_seqlens(cu, S), ZigzagLayout(P, S)), (Mask(True), balanced_layout(cu, P))]
    for mask, layout in cases:
        index = blocks_of(P, mask.normalized(S), layout, 16)
        plain, fast = Needs(P, index.spans(), lambda i, j: i), QueryOwnerNeeds(index)
        for x in range(P):
            assert fast.blocks(x) == plain.blocks(x) and fast.rows(x) == plain.rows(x) == {}
            assert list(fast.cols(x).items()) == list(plain.cols(x).items())
            assert fast.col_needers(x) == plain.col_needers(x) and fast.row_needers(x) == plain.row_needers(x) == []
            assert fast.col_tokens(x) == plain.col_tokens(x) and fast.row_tokens(x) == plain.row_tokens(x)
        assert any(plain.cols(x) for x in range(P)), mask  # ranks read others' columns
        for policy in ("refetch", "keep", "auto"):
            sizes = {k: 2 for k in ("q", "kv", "do", "o", "dq", "dkv")}
            assert bytes_per_rank(fast, shape, Keeps(policy, fast, S // P, sizes, 0.5)) == \
                bytes_per_rank(plain, shape, Keeps(policy, plain, S // P, sizes, 0.5))


@pytest.mark.parametrize("P", [2, 5, 8])
def test_the_blocks_spans_and_summaries_are_their_calls_together(P):
    """Blocks.spans / row_summary (one pass over a rank's documents, for a band only over the key
    pieces in reach) against the plain form: each block's kernel calls (Blocks.parts), their rows
    and columns united and their pairs summed -- band masks (causal, full, windows both ways),
    documents, and the kinds whose band differs per piece (chunked, prefix), on the zigzag and on
    layouts that place documents."""
    from megatron_mesh.plan.balance import balanced_layout
    from megatron_mesh.plan.maskkinds import Chunked, Prefix
    from megatron_mesh.plan.sel import union_intervals
    from megatron_mesh.plan.sparse_blocks import Blocks
    from megatron_mesh.tools.plan_args import document_bounds

    S = 64 * P
    cu = document_bounds("lognormal:30,1.0", S, P)
    docs = tuple(zip(cu, cu[1:]))
    masks = [Mask(True), Mask(False), Mask(True, (11, 0)), Mask(False, (7, 3)), Mask.from_cu_seqlens(cu, S),
             Mask(True, (5, 0), docs), Chunked(24), Chunked(24, docs), Prefix(9, docs)]
    for mask in masks:
        for layout in (ZigzagLayout(P, S), balanced_layout(cu, P)):
            calls = Blocks(P, mask.normalized(S), layout, 8).all()
            want = {ij: (union_intervals([tuple(r) for c in parts for r in c.rows]),
                         union_intervals([tuple(r) for c in parts for r in c.cols[0]]), sum(c.pairs for c in parts))
                    for ij, parts in calls.items()}
            index = Blocks(P, mask.normalized(S), layout, 8)
            assert {ij: (rows, cols, index.summary(*ij)[1]) for ij, (rows, cols) in index.spans().items()} == want
            fresh = Blocks(P, mask.normalized(S), layout, 8)  # the summaries alone, without the spans
            assert {(i, j): fresh.summary(i, j) for i, j in want} == {ij: (c, n) for ij, (_, c, n) in want.items()}


def test_blocks_whose_partials_go_home_run_first():
    """A rank runs the blocks whose partials go home -- rows of another rank's queries -- before its
    own rows' blocks against pulled columns, and posts each return round before those: Mesh on its
    owners layout at 8 GPUs, seed 6 of lognormal:4096 (plan/sparse.py::_schedule's worked example:
    rank 5 computes a block of rank 7's queries pulled in round 6)."""
    from megatron_mesh.plan import resolve
    from megatron_mesh.plan.ir import Post
    from megatron_mesh.plan.layouts import Sample, get_layout_kind
    from megatron_mesh.tools.plan_args import document_bounds

    P, S = 8, 65536
    shape, topo = AttentionShape(S // P, 1, 32, 8, 128, 2), Topology(nodes=1, gpus_per_node=P)
    sample = Sample(tuple(document_bounds("lognormal:4096,1.0", S, 6)), P, shape=shape, topology=topo, mode="mesh")
    layout = get_layout_kind("owners").build(sample)
    plan = resolve("mesh", P, shape, topo).build(shape, sample.head, layout)
    served = {}
    for x in range(P):
        ops = plan.rank(x).ops("forward")
        attends = [(i, op) for i, op in enumerate(ops) if type(op) is Attend]
        home = [i for i, op in attends if op.out.chunk != x]
        mine = [i for i, op in attends if op.out.chunk == x and any(k.chunk != x for k in op.kv)]
        returns = [i for i, op in enumerate(ops) if type(op) is Post and op.round >= P and op.sends]
        served[x] = {ops[i].q.chunk for i in home}
        if home and mine:
            assert max(home) < min(mine) and max(returns) < min(mine), x
    assert 7 in served[5]  # the worked example's block

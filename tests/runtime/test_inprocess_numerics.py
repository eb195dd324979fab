"""The in-process transport (all P ranks of a plan as threads of one process) against the dense
fp64 reference: every Mesh tile of P = 1..8, schedules and kernels, TASP (one node and two), every
registered mode under masks (documents, windows, THD) through the public API; bytes equal to the
plan's; results bitwise equal to the public autograd path (and to the gloo transport:
test_mesh_attention.py); and the same on CUDA (``-m gpu``), where masked blocks and hybrids run the CUDA kernels."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

import megatron_mesh as mm
from megatron_mesh.comm.inprocess import run_inprocess
from megatron_mesh.plan import (MODES, AttentionShape, Topology, build_mesh_plan, build_tasp_plan, choose_tile, plan_bytes,
                                resolve, tile_shapes, validate_plan)
from megatron_mesh.plan.sparse import own_calls
from megatron_mesh.runtime.api import forward_backward

import cases


def run_case(p: cases.Problem, plan, *, device="cpu", kernel="auto", softmax_scale=None, serial=False,
             streams=False, ref=None, label="") -> list[cases.Result]:
    """Forward + backward of ``plan`` on P virtual ranks (executor calls, no autograd); per rank a
    Result with its errors, bytes (and the plan's) and outputs (on the CPU)."""
    ref = ref if ref is not None else cases.dense_reference(p, softmax_scale)
    planned = plan_bytes(plan, p.shape)
    Q, K, V, dO = ref.inputs
    offset = None if ref.offset is None else ref.offset.to(device=device, dtype=p.dtype)

    def rank_fn(rank, comm):
        q, k, v, do = (p.shard(x, rank).to(device=device, dtype=p.dtype) for x in (Q, K, V, dO))
        with mm.comm_counter() as c:
            got = forward_backward(q, k, v, do, plan, comm=comm, kernel=kernel(rank) if callable(kernel) else kernel,
                                   softmax_scale=softmax_scale, softmax_offset=offset)
        got = tuple(g.cpu() for g in got)
        errors, ratios = cases.compare(p, got, ref, rank)
        return cases.Result(label, p, errors, ratios, c.bytes_sent, c.bytes_received,
                            (("plan", (planned[rank].sent, planned[rank].received)),), outputs=got)

    results = run_inprocess(rank_fn, p.world, timeout=120, serial=serial, device=device, streams=streams)
    if offset is not None:  # (out, dq, dk, dv, this rank's share of d softmax_offset)
        cases.assert_offset_grad(p, [r.outputs[4] for r in results], ref, label)
    return results


def check(results: list[cases.Result]) -> None:
    per_rank = [[r] for r in results]
    cases.assert_accurate(per_rank)
    cases.assert_bytes_as_expected(per_rank)


# -- dense reference -------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 7, 8])
def test_mesh_matches_dense_reference(world):
    """Every tile of P (ring 1xP included), causal/full, MHA/GQA in fp32; MQA and bf16 on the ring
    and on the most square tile. Bytes moved equal the plan's bytes."""
    tiles = tile_shapes(world)
    square = min(tiles, key=lambda t: abs(t[0] - t[1]))
    grid = [(t, c, h, torch.float32) for t, c, h in itertools.product(tiles, (True, False), ("MHA", "GQA"))]
    grid += [(t, True, h, torch.bfloat16) for t in sorted({(1, world), square}) for h in ("GQA", "MQA")]
    for tile, causal, heads, dtype in grid:
        p = cases.Problem(world, *cases.HEADS[heads], causal, dtype)
        check(run_case(p, build_mesh_plan(world, tile, p.shape, causal=causal),
                       label=f"P={world} tile={tile} causal={causal} {heads} {dtype}"))


def test_mesh_variants_on_odd_tile():
    """Schedules, backward modes, rank orders, kernels and softmax scale on a 2x3 tile."""
    p = cases.Problem(6, 4, 2, True, torch.float32, seed=1)
    ref = cases.dense_reference(p, 0.3)
    for schedule, backward_chunks, contiguous, kernel in itertools.product(
            ("greedy", "lockstep"), ("refetch", "keep"), ("q", "kv"), ("auto", "math")):
        plan = build_mesh_plan(6, (2, 3), p.shape, schedule=schedule, backward_chunks=backward_chunks,
                               contiguous=contiguous)
        check(run_case(p, plan, kernel=kernel, softmax_scale=0.3, ref=ref,
                       label=f"{schedule} {backward_chunks} contiguous={contiguous} kernel={kernel}"))


@pytest.mark.parametrize("world", [3, 4, 5, 6])
def test_tasp_matches_dense_reference(world):
    for causal, heads, dtype in [(True, "GQA", torch.float32), (False, "MHA", torch.float32),
                                 (True, "MQA", torch.bfloat16)]:
        p = cases.Problem(world, *cases.HEADS[heads], causal, dtype, seq_local=max(8, 2 * world))
        check(run_case(p, build_tasp_plan(world, p.shape, causal=causal),
                       label=f"TASP P={world} causal={causal} {heads} {dtype}"))


def test_tasp_two_nodes_matches_dense_reference():
    """The chained rings: 8 ranks as 2 nodes of 4."""
    p = cases.Problem(8, 4, 2, True, torch.float32)
    check(run_case(p, build_tasp_plan(8, p.shape, causal=True, ranks_per_node=4), label="TASP P=8 as 2 nodes x 4"))


def _mode_settings(mode: str, world: int) -> dict:
    """Settings that make every registered mode run something non-trivial at P = 4 or 6."""
    return {"mesh": dict(tile=(2, world // 2), contiguous="q"), "a2a+mesh": dict(ulysses_size=2, tile=(world // 2, 1)),
            "a2a+ring": dict(ulysses_size=2), "a2a+tasp": dict(ulysses_size=2)}.get(mode, {})


@pytest.mark.parametrize("mode", ["a2a+mesh", "a2a+ring", "a2a+tasp"])
def test_hybrid_of_degree_one_is_its_inner_mode(mode):
    """ulysses_size 1 (Megatron's --hierarchical-context-parallel-sizes 1 M) runs the inner mode
    on the rank's own chunk, exactly and with the inner mode's bytes, at an odd CP size, with one
    KV head too -- where the group's buffer once was a copy of the input onto itself, written into
    the caller's key/value tensors (run_local asserts they stay unwritten)."""
    world, inner = 3, mode.split("+")[1]
    for causal, heads in ((True, "MQA"), (False, "GQA")):
        # batch 1: a [s, 1, 1, d] key's cut is then a contiguous view of the caller's tensor
        p = cases.Problem(world, *cases.HEADS[heads], causal, torch.float32, seq_local=12, batch=1, seed=3)
        ref = cases.dense_reference(p)
        inner_plan = resolve(inner, world, p.shape).build(p.shape, p.mask, p.layout)

        def rank_fn(rank, comm):
            return cases.measure(rank, p, f"{mode} U=1 causal={causal} {heads}", lambda q, k, v: mm.attention(
                q, k, v, mode=mode, ulysses_size=1, comm=comm, causal=causal), ref, plan=inner_plan)

        out = [[res] for res in run_inprocess(rank_fn, world, timeout=120)]
        cases.assert_accurate(out)
        cases.assert_bytes_as_expected(out)


def test_the_executor_refuses_a_plan_that_writes_into_an_input():
    """Plans are validated in the tests (MEGATRON_MESH_VALIDATE=1 at run time); one that slipped
    through and wrote into an input buffer -- a view of the caller's tensor -- stops with an
    error instead of changing the caller's tensor."""
    import dataclasses

    from megatron_mesh.kernels import get_kernel
    from megatron_mesh.plan import Copy, Key
    from megatron_mesh.runtime.executor import Executor

    shape = AttentionShape(seq_local=8, batch=1, heads=2, kv_heads=1, head_dim=4)
    plan = resolve("ring", 1, shape).build(shape)
    rp = plan.rank(0)
    (key,) = [key for key in rp.forward_inputs if key.kind == "kv"]
    bad = dataclasses.replace(rp, forward=(Copy(key, key), *rp.forward))
    plan = dataclasses.replace(plan, build_rank=lambda r: bad, build_rounds=None, _cache={})
    q, k, v = (torch.randn(1, h, 8, 4) for h in (2, 1, 1))
    before = k.clone()
    with pytest.raises(RuntimeError, match=rf"the plan writes into {key}, an input or saved buffer"):
        Executor(plan, FakeComm(0, 1), get_kernel("auto", torch.device("cpu")), 1.0).forward(q, k, v)
    assert torch.equal(k, before) and k._version == 0


def _masked_problems(world: int) -> list[cases.Problem]:
    T = 12  # TASP's rings fit (each zigzag half holds a token per ring)
    S = world * T
    lens = (2 * world * 2, 2 * world, 2 * world * 3)
    cu = tuple(itertools.accumulate(lens, initial=0))
    return [cases.Problem(world, 4, 2, True, torch.float32, seq_local=T, cu_seqlens=(0, 5, S // 2 + 3, S),
                          window=(4, 0)),
            cases.Problem(world, 4, 1, False, torch.float32, seq_local=T, window=(2, 3), seed=1),
            cases.Problem(world, 4, 2, True, torch.float32, thd=(cu, (lens[0] - 1, lens[1], 2)), seed=2)]


@pytest.mark.parametrize("world, tile", [(4, None), (6, None), (4, 5)])
@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_under_masks_through_the_public_api(world, tile, mode, monkeypatch):
    """Every registered mode (Ulysses hybrids included) with documents + a window, a two-sided
    window without causality, and the THD layout with padding (rows that attend nothing), through
    ``megatron_mesh.attention`` on the in-process transport: outputs, gradients and bytes. With
    ``tile``, masked blocks run as tiles of that many tokens (cut across runs and documents)."""
    if tile is not None:
        monkeypatch.setenv("MEGATRON_MESH_MASK_PIECE", str(tile))
    settings = _mode_settings(mode, world)
    for p in _masked_problems(world):
        ref = cases.dense_reference(p)
        plan = resolve(mode, world, p.shape, **settings).build(p.shape, p.mask, p.layout)
        planned = [(b.sent, b.received) for b in plan_bytes(plan, p.shape)]

        def rank_fn(rank, comm):
            return cases.measure(rank, p, f"{mode} {settings} {p.mask.text()}",
                                 lambda q, k, v: mm.attention(q, k, v, mode=mode, comm=comm, **p.mask_args(),
                                                              **settings), ref)

        out = run_inprocess(rank_fn, world, timeout=120)
        cases.assert_accurate([[res] for res in out])
        assert [(res.sent, res.received) for res in out] == planned, p.mask.text()
        assert any(sent for sent, _ in planned), planned  # something travelled


def test_hybrids_with_a_group_that_holds_only_thd_padding():
    """THD padding no document reaches can fill a whole Ulysses group (6 ranks, U = 3, one
    3-token document padded to 12 tokens: ranks 3-5 hold padding alone). That group computes
    nothing and sends nothing home; its outputs and gradients are zeros. Every hybrid, causal
    and not, forward and backward against the fp64 reference, through the public API (before:
    the plan read an output buffer no op had made, a KeyError on the group's ranks)."""
    for mode, settings in (("a2a+ring", {}), ("a2a+tasp", {}), ("a2a+mesh", {"tile": (2, 1)})):
        for causal in (True, False):
            p = cases.Problem(6, 6, 3, causal, torch.float32, head_dim=8, thd=((0, 12), (3,)))
            plan = resolve(mode, 6, p.shape, ulysses_size=3, **settings).build(p.shape, p.mask, p.layout)
            validate_plan(plan)
            ref = cases.dense_reference(p)

            def rank_fn(rank, comm):
                return cases.measure(rank, p, f"{mode} causal={causal}", lambda q, k, v: mm.attention(
                    q, k, v, mode=mode, comm=comm, ulysses_size=3, **p.mask_args(), **settings), ref)

            cases.assert_accurate([[res] for res in run_inprocess(rank_fn, 6, timeout=120)])


@pytest.mark.parametrize("world, cu, chosen", [(4, (0, 2, 14, 25, 29, 32), ((4, 1), "q")),
                                               (6, (0, 3, 17, 27, 33, 48), ((3, 2), "kv"))])
def test_mesh_auto_tile_under_documents_runs_the_tile_the_mask_favours(world, cu, chosen):
    """``mesh`` with the ``auto`` tile through the public API on documents where the mask-aware
    choice is another tile map than the dense choice (the simulator's fastest tile: 2 x P/2 with
    the host left out, ring's 1 x P where the host's ops decide, as at these few tokens per rank):
    the plan runs that map, exactly (forward and backward against fp64, MHA and GQA), moving the
    plan's bytes."""
    for heads, kv_heads in ((4, 4), (4, 2)):
        p = cases.Problem(world, heads, kv_heads, True, torch.float32, cu_seqlens=cu)
        placement = resolve("mesh", world, p.shape)
        plan = placement.build(p.shape, p.mask, p.layout)
        dense = choose_tile(world, p.shape, Topology.for_cp(world), backward_chunks="refetch")[0]
        assert placement.options.tile == dense and placement.options.tile_auto
        assert choose_tile(world, p.shape, Topology.for_cp(world, host_op_time=0), backward_chunks="refetch")[0] == \
            (2, world // 2)
        if heads == kv_heads:  # with GQA the query side is dearer: another map may win
            assert (plan.facts.tile, plan.facts.contiguous, plan.facts.assignment) == (*chosen, "tile"), plan.notes
        ref = cases.dense_reference(p)
        planned = [(b.sent, b.received) for b in plan_bytes(plan, p.shape)]

        def rank_fn(rank, comm):
            return cases.measure(rank, p, f"mesh auto {p.mask.text()}",
                                 lambda q, k, v: mm.attention(q, k, v, mode="mesh", comm=comm, **p.mask_args()), ref)

        out = run_inprocess(rank_fn, world, timeout=120)
        cases.assert_accurate([[res] for res in out])
        assert [(res.sent, res.received) for res in out] == planned


def test_hybrid_inner_mesh_auto_tile_under_documents():
    """The same for a2a+mesh's inner Mesh (U = 2 over 8 ranks): the inner tile's dense choice
    (ring's 1x4 here, where the host decides; 2x2 without it) is not the documents' fewest bytes,
    4x1, and the hybrid runs that exactly."""
    p = cases.Problem(8, 4, 4, True, torch.float32, cu_seqlens=(0, 3, 17, 27, 33, 48, 60, 64))
    placement = resolve("a2a+mesh", 8, p.shape, ulysses_size=2)
    plan = placement.build(p.shape, p.mask, p.layout)
    assert placement.tile in ((2, 2), (1, 4)) and (plan.facts.tile, plan.facts.assignment) == ((4, 1), "tile")
    ref = cases.dense_reference(p)
    planned = [(b.sent, b.received) for b in plan_bytes(plan, p.shape)]

    def rank_fn(rank, comm):
        return cases.measure(rank, p, "a2a+mesh auto", lambda q, k, v: mm.attention(
            q, k, v, mode="a2a+mesh", ulysses_size=2, comm=comm, **p.mask_args()), ref)

    out = run_inprocess(rank_fn, 8, timeout=120)
    cases.assert_accurate([[res] for res in out])
    assert [(res.sent, res.received) for res in out] == planned


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("groups", ["few", "many"])
def test_backward_chunks_under_a_mask_match_the_dense_reference(mode, groups):
    """backward_chunks "refetch", "keep" and "auto" on a mask-aware plan of every mode (hybrids
    included): outputs and gradients exact, bytes the plan's. One causal document of 46 of the 48
    tokens, P = 4: under "auto" at keep limit 1 the ranks reading most of it keep what fits of it
    and pull the rest again, the others keep all (a plan whose ranks differ on purpose: senders
    must send exactly what each receiver pulls again); at the default, 2, every rank keeps all,
    rank 0 more than its own chunk's worth (its kept blocks one shift at a time).
    "many": TASP pulls and returns in a group per slot (group_tokens = 1), its returns posted
    while later groups compute."""
    from megatron_mesh.plan.tunables import TUNABLES, Tunables
    tunables = Tunables(group_tokens=1) if groups == "many" else TUNABLES
    world = 4
    p = cases.Problem(world, 4, 2, True, torch.float32, seq_local=12, cu_seqlens=(0, 46, 48))
    ref = cases.dense_reference(p)
    settings = _mode_settings(mode, world)
    for backward_chunks, limit in (("refetch", {}), ("keep", {}), ("auto", dict(backward_keep_limit=1.0)), ("auto", {})):
        plan = resolve(mode, world, p.shape, backward_chunks=backward_chunks, **limit, **settings).build(
            p.shape, p.mask, tunables=tunables)
        inner = getattr(plan.facts, "inner", None) or plan
        if limit and inner.world_size == world:  # some rank keeps part of what it pulled
            assert any(inner.rank(r).saved and any(t.key.kind == "kv" for op in inner.rank(r).backward
                                                   if type(op).__name__ == "Post" for t in op.recvs)
                       for r in range(world)), mode
        check(run_case(p, plan, ref=ref, label=f"{mode} {settings} backward_chunks={backward_chunks} {limit}"))


@pytest.mark.parametrize("world", [3, 5, 6, 7])
def test_keeping_part_of_the_pulls_matches_the_dense_reference_at_odd_cp_sizes(world):
    """backward_chunks "auto" where ranks read more of one long document than they hold: each
    keeps what fits of its pulls and pulls the rest again (sparse_needs.kept_chunks), its blocks
    over the kept columns one shift at a time. Ring, TASP and Mesh on the zigzag and on the
    balanced layout, MHA / GQA / MQA by layout: outputs and gradients exact against the fp64
    reference, bytes the plan's; at P >= 5 every mode has a rank that keeps part (asserted). On the
    GQA problem the modes' ``backward_keep_limit`` away from its default too (0.5: less kept, 2.0:
    more; some rank keeps other chunks than at 1.0, asserted at P >= 5; at 2.0 some rank of ring and
    Mesh keeps all it pulled, more than its own chunk's worth, and runs those blocks one shift at a
    time, asserted at P >= 5)."""
    S = world * 12
    partial, other, more = set(), set(), set()
    for heads, balanced in (("MHA", False), ("GQA", True), ("MQA", False)):
        p = cases.Problem(world, *cases.HEADS[heads], True, torch.float32, seq_local=12,
                          cu_seqlens=(0, S - 5, S), balanced=balanced)
        ref = cases.dense_reference(p)
        limits = (1.0, 0.5, 2.0) if heads == "GQA" else (1.0,)
        for mode in ("ring", "tasp", "mesh"):
            kept = {}
            for limit in limits:
                plan = resolve(mode, world, p.shape, backward_keep_limit=limit).build(p.shape, p.mask, p.layout)
                assert plan.backward_chunks == "auto"
                kept[limit] = [{k.chunk for k in plan.rank(r).saved} for r in range(world)]
                if limit == 1.0 and any(plan.rank(r).saved and any(
                        t.key.kind == "kv" for op in plan.rank(r).backward if type(op).__name__ == "Post"
                        for t in op.recvs) for r in range(world)):
                    partial.add(mode)
                if limit == 2.0 and any(_keeps_more_than_its_chunk(plan, p.shape, r) for r in range(world)):
                    more.add(mode)  # its kept blocks one shift at a time (sparse_needs.Keeps.one_call)
                check(run_case(p, plan, ref=ref, label=f"{mode} {heads} balanced={balanced} P={world} keep {limit}"))
            if any(kept[x] != kept[1.0] for x in limits):
                other.add(mode)
    if world >= 5:
        assert partial == {"ring", "tasp", "mesh"} and other == partial, (partial, other)
        assert {"ring", "mesh"} <= more, more


def _keeps_more_than_its_chunk(plan, shape, r: int) -> bool:
    """Whether rank r keeps all it pulled (its backward pulls no Q / K / V again) and that is more
    than its own Q, K and V chunk's bytes."""
    from megatron_mesh.plan.accounting import buffer_bytes

    rp = plan.rank(r)
    again = any(t.key.kind in ("q", "kv") for op in rp.backward if type(op).__name__ == "Post" for t in op.recvs)
    kept = sum(sum(b - a for a, b in plan.slots(k)) * buffer_bytes(k.kind, 1, shape) for k in rp.saved
               if k.kind in ("q", "kv"))
    return not again and kept > plan.seq_local * (buffer_bytes("q", 1, shape) + buffer_bytes("kv", 1, shape))


@pytest.mark.parametrize("world", [3, 5, 6, 7])
def test_own_blocks_first_or_last_match_the_dense_reference(world):
    """Plans whose ranks run the first k calls of their own block before their other blocks as
    the plan's ``own_first`` choices say (what :mod:`megatron_mesh.plan.polish` chooses by
    simulation): even ranks all of them in the forward, none in the backward, odd ranks one and
    all but one (or none) -- ring, TASP,
    Mesh and a Ulysses hybrid (U = 2 where it divides P), documents on the zigzag and on the
    balanced layout, causal and not, MHA / GQA / MQA: outputs and gradients exact against the
    fp64 reference, bytes the plan's; the choices change some rank's ops in at least half of the
    plans (asserted; elsewhere they are what the bytes' share gives)."""
    from megatron_mesh.plan.tunables import Tunables

    S = world * 12
    calls = Tunables(own_call_tokens=2)  # a call per document of 2+ rows: own blocks of several calls
    changed = []  # per plan: whether its choices changed some rank's ops
    modes = [("ring", {}), ("tasp", {}), ("mesh", {})]
    modes += [("a2a+ring", {"ulysses_size": 2})] if world % 2 == 0 else []  # inner ring over 3 ranks at P = 6
    for heads, balanced, causal in (("MHA", False, True), ("GQA", True, True), ("MQA", False, False)):
        p = cases.Problem(world, *cases.HEADS[heads], causal, torch.float32, seq_local=12,
                          cu_seqlens=(0, 7, 13, S - 5, S), balanced=balanced)
        ref = cases.dense_reference(p)
        for name, settings in modes:
            spec = f"{name}{settings or ''}"
            if balanced and settings:
                continue  # a hybrid's balanced layout is its Ulysses groups' (GroupProblem, below)
            placement = resolve(name, world, p.shape, **settings)
            ranks = world // settings.get("ulysses_size", 1)
            plain = placement.build(p.shape, p.mask, p.layout, own_first=(), tunables=calls)
            base = plain.facts.inner if plain.facts.inner is not None else plain
            n = {(x, d): own_calls(base, x, d) for x in range(ranks) for d in ("forward", "backward")}
            choices = tuple((x, d, (n[x, d] if d == "forward" else 0) if x % 2 == 0 else
                             (min(1, n[x, d]) if d == "forward" else max(0, n[x, d] - 1)))
                            for x in range(ranks) for d in ("forward", "backward"))
            plan = placement.build(p.shape, p.mask, p.layout, own_first=choices, tunables=calls)
            inner = plan.facts.inner if plan.facts.inner is not None else plan
            changed.append(any(inner.rank(x).ops(d) != base.rank(x).ops(d) for x in range(ranks)
                               for d in ("forward", "backward")))
            check(run_case(p, plan, ref=ref, label=f"{spec} {heads} balanced={balanced} causal={causal} P={world}"))
    assert sum(changed) >= len(changed) // 2, changed


def test_plans_the_polish_chose_match_the_dense_reference():
    """Plans polished by the search itself (:mod:`megatron_mesh.plan.polish`; ``polish_tokens``
    lowered to 16 and the machine slowed -- compute, memory and links -- so that 48 tokens per rank
    weigh as thousands do and the search finds choices): P = 5, 6, 7, ring, TASP, Mesh, documents
    on the zigzag and the balanced layout, keep limits 2 (the default) and 1: exact against the
    fp64 reference, forward and backward, bytes the plan's; at least six of the plans carry choices
    (asserted)."""
    from megatron_mesh.plan.tunables import Tunables

    chosen = 0
    for world in (5, 6, 7):
        S = world * 48
        slow = Topology(nodes=1, gpus_per_node=world, attention_flops=1.6e7, memory_bandwidth=3.35e4,
                        intra_bandwidth=1.35e4)
        for heads, balanced in (("MHA", False), ("GQA", True)):
            p = cases.Problem(world, *cases.HEADS[heads], True, torch.float32, seq_local=48,
                              cu_seqlens=(0, 7, 100, S - 30, S), balanced=balanced)
            ref = cases.dense_reference(p)
            for mode, limit in itertools.product(("ring", "tasp", "mesh"), (2.0, 1.0)):
                plan = resolve(mode, world, p.shape, backward_keep_limit=limit).build(
                    p.shape, p.mask, p.layout, topology=slow, tunables=Tunables(polish_tokens=16))
                if not plan.facts.own_first:
                    continue
                chosen += 1
                check(run_case(p, plan, ref=ref, label=f"{mode} {heads} balanced={balanced} P={world} "
                                                        f"keep {limit} {plan.facts.own_first}"))
    assert chosen >= 6, chosen


# -- bitwise the same on other code paths (the gloo transport: test_mesh_attention.py) ---------------------------------------------------
class FakeComm:
    """Just what an Executor reads of its communicator when it is made."""

    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size


def test_backward_rows_made_once_per_buffer_and_own_rows_take_their_output():
    """torch's fused backward ops want the rows' output. For its own rows a rank has it (the
    forward's, or a Ulysses group's partial output behind RowStats); for rows it works on for
    another rank the kernel makes a stand-in from dO and delta (a dozen ops per element). The
    executor makes either once per buffer of rows (``backward_rows``), not once per block or call
    (several blocks read the same rows: a launch per op on a GPU), and the gradients match those
    of a stand-in per call: dense ring, documents on the zigzag (blocks of several calls), a Mesh
    tile (remote rows) and a Ulysses hybrid (RowStats)."""
    from megatron_mesh.kernels import torch_sdpa
    from megatron_mesh.plan import AttendBackward, RowStats
    from megatron_mesh.runtime.executor import Executor

    class Counting(torch_sdpa.TorchAttentionKernel):
        def __init__(self):
            super().__init__("cpu")
            self.made = self.stand_ins = 0

        def backward_rows(self, dout, lse, delta, out=None):
            self.made += 1
            self.stand_ins += out is None
            # delta is computed only where something reads it: rows other ranks compute blocks of
            # (NaN elsewhere, so a missed read fails the results)
            assert out is not None or not delta.isnan().any()
            return super().backward_rows(dout, lse, delta, out)

    class PerCall(torch_sdpa.TorchAttentionKernel):
        backward_rows = None  # the contract's optional method absent: a stand-in per call

    docs = (0, 5, 21, 40, 64)
    for mode, settings, cu in (("ring", {}, None), ("ring", {}, docs), ("mesh", {"tile": (2, 2)}, None),
                               ("a2a+ring", {"ulysses_size": 2}, docs)):
        p = cases.Problem(4, 4, 2, True, torch.float32, seq_local=16, cu_seqlens=cu)
        plan = resolve(mode, 4, p.shape, **settings).build(p.shape, p.mask, p.layout)
        kernels = [Counting() for _ in range(4)]
        once = run_case(p, plan, kernel=lambda r: kernels[r], serial=True)
        per_call = run_case(p, plan, kernel=lambda r: PerCall("cpu"), serial=True)
        check(once)
        for rank, (a, b) in enumerate(zip(once, per_call)):
            for x, y in zip(a.outputs, b.outputs):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
            ops = plan.rank(rank).ops("backward")
            reads = {op.do for op in ops if type(op) is AttendBackward}
            blocks = sum(type(op) is AttendBackward for op in ops)
            own = {op.dst for op in ops if type(op) is RowStats} | set(plan.rank(rank).backward_inputs)
            what = (mode, cu, rank)
            assert kernels[rank].made == len(reads | {k for k in own if k.kind == "do"}), what
            assert kernels[rank].stand_ins == len(reads - own), what  # remote rows only
            if mode != "mesh":
                assert kernels[rank].stand_ins == 0 and len(reads) < blocks, what
        assert (mode == "mesh") == any(k.stand_ins for k in kernels), mode  # a tile's rows come from others
        # this rank's delta = rowsum(dO * O): only for rows whose dO goes to another rank
        computed = [Executor(plan, FakeComm(r, 4), kernels[r], 1.0)._delta_rows for r in range(4)]
        assert all(rows == () for rows in computed) if mode != "mesh" else all(computed), (mode, computed)
        assert Executor(plan, FakeComm(0, 4), PerCall("cpu"), 1.0)._delta_rows is None  # no backward_rows: all


def test_own_head_slices_only_copied_are_cut_as_views():
    """A Ulysses group member's own head slice of its q, k/v (and dout) is only copied into the
    group's tokens: the executor cuts it as a view instead of a contiguous copy first (its bytes
    moved once, not twice); the slices it sends, and every buffer a block reads, stay
    contiguous. The hybrid's results against the fp64 reference are in the tests above."""
    from megatron_mesh.plan import Key
    from megatron_mesh.runtime.executor import Executor

    p = cases.Problem(4, 4, 2, True, torch.float32, seq_local=16)
    plan = resolve("a2a+ring", 4, p.shape, ulysses_size=2).build(p.shape, p.mask, p.layout)
    for r in range(4):
        views = Executor(plan, FakeComm(r, 4), None, 1.0)._copied_only
        own = r % 2
        assert views["forward"] == {Key("q", r, heads=own), Key("kv", r, heads=own)}, (r, views)
        assert views["backward"] == {Key("dy", r, heads=own)}, (r, views)
    plain = resolve("ring", 4, p.shape).build(p.shape, p.mask, p.layout)
    assert Executor(plain, FakeComm(0, 4), None, 1.0)._copied_only == {"forward": frozenset(), "backward": frozenset()}


def test_saved_partial_outputs_are_kept_in_the_inputs_dtype():
    """A Ulysses group's span output, which the backward reads only for delta, goes to the
    backward in the inputs' dtype (bf16: half the bytes) with its fp32 lse; the buffers the forward
    hands over are exactly the memory model's ``saved`` bytes (plan.memory.kept_bytes), fp32 and
    bf16, plain and hybrid; and a bf16 hybrid stays exact against the fp64 reference (its
    backward forms delta in fp32 from the kept output)."""
    from megatron_mesh.kernels import get_kernel
    from megatron_mesh.plan.memory import buffer_memory
    from megatron_mesh.runtime.executor import Executor

    for dtype in (torch.float32, torch.bfloat16):
        for mode, settings in (("a2a+ring", {"ulysses_size": 2}), ("a2a+mesh", {"ulysses_size": 4}), ("ring", {})):
            p = cases.Problem(4, 4, 2, True, dtype, seq_local=16, cu_seqlens=(0, 5, 21, 40, 64))
            plan = resolve(mode, 4, p.shape, **settings).build(p.shape, p.mask, p.layout)
            Q, K, V = (torch.randn(64, p.shape.batch, h, p.shape.head_dim).to(dtype) for h in (4, 2, 2))

            def rank_fn(rank, comm):
                q, k, v = (p.shard(x, rank).permute(1, 2, 0, 3) for x in (Q, K, V))
                kernel = get_kernel("auto", torch.device("cpu"))
                return Executor(plan, comm, kernel, 0.5).forward(q, k, v).saved

            for rank, saved in enumerate(run_inprocess(rank_fn, 4, timeout=120, serial=True)):
                for key, tensors in saved.items():
                    want = ((dtype, torch.float32) if key.kind == "o"
                            else (dtype,) * len(tensors))
                    assert tuple(t.dtype for t in tensors) == want, (mode, key)
                held = sum(t.numel() * t.element_size() for ts in saved.values() for t in ts)
                assert held == buffer_memory(plan, p.shape, rank).saved, (mode, dtype, rank)
                assert mode == "ring" or any(key.kind == "o" for key in saved), mode
    p = cases.Problem(4, 4, 2, True, torch.bfloat16, seq_local=16, cu_seqlens=(0, 5, 21, 40, 64))
    check(run_case(p, resolve("a2a+ring", 4, p.shape, ulysses_size=2).build(p.shape, p.mask, p.layout),
                   serial=True))

def test_first_writes_copy_and_give_bitwise_the_same_results(monkeypatch):
    """Where a block is the first op to write rows of an accumulator (``Plan.first_writes``), the
    executor copies its kernel calls' results instead of merging them into (0, -inf) or adding
    them to zeros, and fills a new accumulator only in the rows nothing writes before they are
    read (``Plan.creation_fills``; the rows a masked block's calls leave out after them):
    outputs and gradients bitwise those of filling every new accumulator and merging / adding
    everywhere -- dense, documents and a window on the zigzag, THD padding (rows that attend
    nothing), a Mesh tile, a hybrid. New buffers come back full of NaN here, so a row left
    unwritten would show (the arena's bytes too, at every call); and fewer rows are filled."""
    from megatron_mesh.plan import Plan
    from megatron_mesh.runtime import executor

    from megatron_mesh.runtime import buffers

    own = executor.Buffers.own
    monkeypatch.setattr(executor.Buffers, "own", lambda self, key: tuple(t.fill_(float("nan"))
                                                                         for t in own(self, key)))
    bind = buffers.Scratch.bind

    def nan_arena(self, *args):  # the arena's bytes all 0xff (NaN in every float dtype) at every call
        views = bind(self, *args)
        self.arena.fill_(255)
        return views

    monkeypatch.setattr(buffers.Scratch, "bind", nan_arena)
    filled = [0]
    fill = executor.Buffers.fill

    def counting_fill(key, tensors, rows=None, zeros=None):
        filled[0] += sum(b - a for a, b in (rows if rows is not None else [(0, tensors[0].shape[2])]))
        fill(key, tensors, rows, zeros)

    monkeypatch.setattr(executor.Buffers, "fill", staticmethod(counting_fill))

    problems = [("ring", {}, cases.Problem(4, 4, 2, True, torch.float32, seq_local=16)),
                ("ring", {}, cases.Problem(4, 4, 2, True, torch.float32, seq_local=16, cu_seqlens=(0, 5, 21, 40, 64),
                                           window=(6, 0))),
                ("mesh", {"tile": (2, 2)}, cases.Problem(4, 4, 1, False, torch.float32, seq_local=16)),
                ("a2a+tasp", {"ulysses_size": 2}, cases.Problem(4, 4, 2, True, torch.float32, seq_local=16,
                                                                cu_seqlens=(0, 5, 21, 40, 64))),
                ("ring", {}, _masked_problems(4)[2])]
    for mode, settings, p in problems:
        plan = resolve(mode, 4, p.shape, **settings).build(p.shape, p.mask, p.layout)
        assert any(plan.first_writes(r, d) for r in range(4) for d in ("forward", "backward")), mode
        filled[0] = 0
        copied = run_case(p, plan, serial=True)
        check(copied)
        rows_filled = filled[0]
        with monkeypatch.context() as m:
            m.setattr(Plan, "first_writes", lambda self, r, direction: {})
            m.setattr(Plan, "creation_fills", lambda self, *args: {})  # every new accumulator filled
            merged = run_case(p, resolve(mode, 4, p.shape, **settings).build(p.shape, p.mask, p.layout), serial=True)
        for a, b in zip(copied, merged):
            assert all(torch.equal(x, y) for x, y in zip(a.outputs, b.outputs)), mode
        assert rows_filled < filled[0] - rows_filled, (mode, rows_filled, filled[0] - rows_filled)


def test_copy_runs_and_joined_cuts_give_bitwise_the_same_results(monkeypatch):
    """A Ulysses hybrid's copies issued as runs (plan/arena_runs.py ``CopyRun``: a round's buffers into
    the group's rows, the group's rows into the buffers going home, those come home into head
    slices: one copy per tensor each) and its sends cut as one group per kind
    (``cut_groups``: one gather per tensor, not one per peer): outputs and gradients bitwise
    those of a copy per op and a cut per head slice, and exact against the fp64 reference --
    on layouts balanced for the groups (rounds by document set, attention sinks: rows finished
    as they go home), on the zigzag, with K/V heads replicated over a group."""
    import dataclasses
    import functools

    from megatron_mesh.plan import arena, arena_runs

    @dataclasses.dataclass(frozen=True)
    class GroupProblem(cases.Problem):
        group: int = 1

        @functools.cached_property
        def layout(self):
            return mm.balanced_layout(self.cu_seqlens, self.world, causal=self.causal, group=self.group)

    cu = (0, 7, 40, 41, 90, 150, 192)
    problems = [("a2a+tasp", 4, GroupProblem(8, 8, 4, True, torch.float32, seq_local=24, cu_seqlens=cu, balanced=True,
                                             sink=True, group=4)),
                ("a2a+ring", 4, GroupProblem(8, 8, 2, True, torch.float32, seq_local=24, cu_seqlens=cu, balanced=True,
                                             group=4)),
                ("a2a+mesh", 4, cases.Problem(4, 8, 4, False, torch.float32, seq_local=12, sink=True))]
    joined_cuts = False
    for mode, U, p in problems:
        def build():
            return resolve(mode, p.world, p.shape, ulysses_size=U).build(p.shape, p.mask, p.layout)

        plan = build()
        runs = [arena.scratch_layout(plan, r, d, p.shape) for r in range(p.world) for d in ("forward", "backward")]
        assert any(layout.copy_runs for layout in runs), mode
        joined_cuts = joined_cuts or any(slices > 1 for layout in runs for *_, slices in layout.cuts)
        joined = run_case(p, plan, serial=True)
        check(joined)
        with monkeypatch.context() as m:
            m.setattr(arena_runs, "copy_runs", lambda *args: {})
            m.setattr(arena_runs, "_next_slice", lambda *args: False)
            plain = build()
            layouts = [arena.scratch_layout(plain, r, d, p.shape) for r in range(p.world) for d in ("forward", "backward")]
            assert not any(layout.copy_runs for layout in layouts)  # the baseline is one copy per op, a cut per slice
            assert all(slices == 1 for layout in layouts for *_, slices in layout.cuts)
            apart = run_case(p, plain, serial=True)
        for a, b in zip(joined, apart):
            assert all(torch.equal(x, y) for x, y in zip(a.outputs, b.outputs)), (
                mode, [(x - y).abs().max().item() for x, y in zip(a.outputs, b.outputs)])
    assert joined_cuts


def test_serial_mode_gives_the_same_results():
    p = cases.Problem(5, 4, 1, True, torch.float32)
    ref = cases.dense_reference(p)
    plan = build_mesh_plan(5, (1, 5), p.shape)
    a = run_case(p, plan, ref=ref)
    b = run_case(p, plan, ref=ref, serial=True)
    check(a)
    for ra, rb in zip(a, b):
        assert all(torch.equal(x, y) for x, y in zip(ra.outputs, rb.outputs))


def test_comm_counter_counts_a_backward_run_on_another_thread():
    """On CUDA, autograd runs backward on its own device thread; comm_counter() of the thread
    that ran the forward must still see the backward's bytes (here: backward on a new thread)."""
    p = cases.Problem(4, 4, 2, True, torch.float32)
    Q, K, V, dO = cases.make_inputs(p)
    planned = plan_bytes(build_mesh_plan(4, (2, 2), p.shape), p.shape)

    def rank_fn(rank, comm):
        q, k, v = (p.shard(x, rank).float().requires_grad_() for x in (Q, K, V))
        with mm.comm_counter() as c:
            out = mm.mesh_attention(q, k, v, tile=(2, 2), causal=True, comm=comm)
            forward_only = (c.bytes_sent, c.bytes_received)
            errors = []
            worker = threading.Thread(target=_run_catching, args=(errors, out.backward, p.shard(dO, rank).float()))
            worker.start()
            worker.join()
        assert not errors, errors
        return forward_only, (c.bytes_sent, c.bytes_received)

    got = run_inprocess(rank_fn, p.world, timeout=120)
    assert [total for _, total in got] == [(b.sent, b.received) for b in planned]
    assert all(fwd[0] < total[0] for fwd, total in got)  # the backward's bytes were added


def _run_catching(errors: list, fn, *args):
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 - reported by the caller
        errors.append(e)


# -- CUDA tier ------------------------------------------------------------------------------------------------
GPU_DTYPES = [(torch.bfloat16, "auto"), (torch.float16, "auto"), (torch.float32, "torch-efficient")]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 3, 4, 6])
@pytest.mark.parametrize("dtype,kernel", GPU_DTYPES, ids=["bf16", "fp16", "fp32-efficient"])
def test_cuda_mesh_matches_dense_reference(world, dtype, kernel):
    """Every tile, causal/full, MHA/GQA on one GPU with CUDA kernels (head_dim 64, 64-token halves)."""
    for tile, causal, heads in itertools.product(tile_shapes(world), (True, False), ("MHA", "GQA")):
        p = cases.Problem(world, *cases.HEADS[heads], causal, dtype, seq_local=128, head_dim=64)
        check(run_case(p, build_mesh_plan(world, tile, p.shape, causal=causal), device="cuda", kernel=kernel,
                       label=f"CUDA P={world} tile={tile} causal={causal} {heads} {dtype} {kernel}"))


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["torch-flash", "torch-efficient", "torch-cudnn"])
def test_cuda_each_op_on_streams_and_deterministic(kernel):
    """Each CUDA op through a 2x2 mesh, virtual ranks on their own streams (the mailbox's events
    order the copies), twice: both runs match the reference, and flash and cuDNN give bitwise
    equal results. The efficient kernel's backward adds dQ with atomics, in no fixed order
    (torch lists it among the nondeterministic ops), so there only the outputs are bitwise equal."""
    p = cases.Problem(4, 4, 2, True, torch.bfloat16, seq_local=256, head_dim=128)
    ref = cases.dense_reference(p)
    plan = build_mesh_plan(4, (2, 2), p.shape)
    first = run_case(p, plan, device="cuda", kernel=kernel, streams=True, ref=ref, label=f"{kernel} streams")
    second = run_case(p, plan, device="cuda", kernel=kernel, streams=True, ref=ref, label=f"{kernel} again")
    check(first)
    check(second)
    compared = 1 if kernel == "torch-efficient" else 4  # (out, dq, dk, dv)
    for a, b in zip(first, second):
        assert all(torch.equal(x, y) for x, y in zip(a.outputs[:compared], b.outputs[:compared])), kernel


@pytest.mark.gpu
@pytest.mark.parametrize("world", [4, 5])
def test_cuda_tasp_matches_dense_reference(world):
    p = cases.Problem(world, 4, 2, True, torch.bfloat16, seq_local=128, head_dim=64)
    check(run_case(p, build_tasp_plan(world, p.shape, causal=True), device="cuda", label=f"CUDA TASP P={world}"))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
def test_cuda_every_mode_under_masks(mode):
    """Masked blocks (the efficient kernel's attn_bias) and the Ulysses hybrids' copies on CUDA,
    P = 4, bf16, head_dim 64."""
    world = 4
    settings = _mode_settings(mode, world)
    T = 128
    S = world * T
    for p in (cases.Problem(world, 4, 2, True, torch.bfloat16, seq_local=T, head_dim=64,
                            cu_seqlens=(0, 37, S // 2 + 5, S), window=(50, 0)),
              cases.Problem(world, 4, 1, False, torch.bfloat16, seq_local=T, head_dim=64, window=(20, 9))):
        plan = resolve(mode, world, p.shape, **settings).build(p.shape, p.mask)
        check(run_case(p, plan, device="cuda", label=f"CUDA {mode} {p.mask.text()}"))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
def test_cuda_sinks_and_value_head_dims(mode):
    """Learnable sinks (their gradient summed over the ranks) with values of another head dim than
    queries and keys (MLA's 192 / 128 halved) and with equal ones, documents and a window, on
    CUDA: bf16 through "auto" (flash for equal dims, the efficient op for the others) and fp32
    through the efficient op, P = 4."""
    world, T = 4, 128
    settings = _mode_settings(mode, world)
    for dtype, kernel, dv in ((torch.bfloat16, "auto", 48), (torch.bfloat16, "auto", None),
                              (torch.float32, "torch-efficient", 48)):
        p = cases.Problem(world, 4, 2, True, dtype, seq_local=T, head_dim=96, v_head_dim=dv, sink=True,
                          cu_seqlens=(0, 37, world * T // 2 + 5, world * T), window=(50, 0))
        plan = resolve(mode, world, p.shape, **settings).build(p.shape, p.mask)
        check(run_case(p, plan, device="cuda", kernel=kernel, label=f"CUDA {mode} sinks dv={dv} {dtype}"))


@pytest.mark.gpu
def test_cuda_step_loop_has_no_host_sync():
    """torch's sync debug mode raises on any operation that synchronises the host with the GPU
    (``.item()``, device-to-host copies, ...): the executor's step loop and the kernels have none."""
    p = cases.Problem(4, 4, 2, True, torch.bfloat16, seq_local=128, head_dim=64)
    Q, K, V, dO = (x.to("cuda", torch.bfloat16) for x in cases.make_inputs(p))
    plan = build_mesh_plan(4, (2, 2), p.shape)
    plan.ranks  # noqa: B018 -- build every rank plan before the check (pure Python)

    def fn(rank, comm):
        q, k, v, do = (p.shard(x, rank) for x in (Q, K, V, dO))
        return forward_backward(q, k, v, do, plan, comm=comm)[0].shape

    torch.cuda.set_sync_debug_mode("error")  # process-wide: covers every virtual rank's thread
    try:
        shapes = run_inprocess(fn, 4, device="cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert shapes == [torch.Size([128, 2, 4, 64])] * 4


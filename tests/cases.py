"""Distributed test cases, run inside spawned gloo process groups (see megatron_mesh.launch).

Each function runs on every rank and returns a list of result records; the pytest side asserts
on them, so one process group serves many cases. Global inputs are drawn from a seeded generator
(identical on every rank), sharded with Megatron's zigzag layout, and compared with a dense fp64
reference computed on the full sequence.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

import megatron_mesh as mm
from megatron_mesh.kernels import reference_attention

# Transformer Engine's context-parallel test tolerances (tests/pytorch/attention, bf16: MHA vs GQA)
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float64: (1e-10, 1e-10),
    torch.float16: (5e-3, 5e-3),
}


def tolerance(dtype: torch.dtype, heads: int, kv_heads: int) -> tuple[float, float]:
    if dtype == torch.bfloat16:
        return (2.5e-2, 2.5e-2) if heads == kv_heads else (3.5e-2, 3.5e-2)
    return TOLERANCES[dtype]


HEADS = {"MHA": (4, 4), "GQA": (4, 2), "MQA": (4, 1)}


@dataclass(frozen=True)
class Problem:
    world: int
    heads: int
    kv_heads: int
    causal: bool
    dtype: torch.dtype
    seq_local: int = 8
    batch: int = 2
    head_dim: int = 16
    seed: int = 0


def make_inputs(p: Problem):
    g = torch.Generator().manual_seed(p.seed)
    S = p.seq_local * p.world
    f64 = torch.float64
    Q = torch.randn(S, p.batch, p.heads, p.head_dim, generator=g, dtype=f64)
    K = torch.randn(S, p.batch, p.kv_heads, p.head_dim, generator=g, dtype=f64)
    V = torch.randn(S, p.batch, p.kv_heads, p.head_dim, generator=g, dtype=f64)
    dO = torch.randn(S, p.batch, p.heads, p.head_dim, generator=g, dtype=f64)
    return Q, K, V, dO


def dense_reference(p: Problem):
    Q, K, V, dO = make_inputs(p)
    Qr, Kr, Vr = (x.clone().requires_grad_() for x in (Q, K, V))
    out = reference_attention(Qr, Kr, Vr, causal=p.causal)
    out.backward(dO)
    return Q, K, V, dO, out.detach(), Qr.grad, Kr.grad, Vr.grad


# Every CP size 1..8 in one 8-process spawn: each phase splits the 8 ranks into disjoint groups that
# run concurrently (process start-up, not compute, dominates small distributed tests on 2 cores).
PHASES = ((8,), (7, 1), (6, 2), (5, 3), (4, 4))


def in_subgroups(rank: int, world: int, case_fn, phases=PHASES, **kwargs) -> dict[int, list]:
    """Run ``case_fn(group_rank, group_size, group=..., **kwargs)`` for every group size of every
    phase, on process subgroups (group ranks differ from global ranks, as in Megatron's CP groups).
    Returns {group size: records of this rank} for the groups this rank was in."""
    import torch.distributed as dist

    out: dict[int, list] = {}
    for sizes in phases:
        assert sum(sizes) <= world, (sizes, world)
        start, mine = 0, None
        for size in sizes:  # new_group is collective: every rank creates every group, in order
            ranks = list(range(start, start + size))
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = (size, group, ranks.index(rank))
            start += size
        if mine is not None:
            size, group, group_rank = mine
            out.setdefault(size, []).extend(case_fn(group_rank, size, group=group, **kwargs))
        dist.barrier()
    return out


def run_local(rank: int, p: Problem, attention, ref=None):
    """Run ``attention(q, k, v)`` on this rank's chunk, forward and backward; return
    (max errors vs the reference as allclose ratios, raw max abs errors, bytes, outputs)."""
    Q, K, V, dO, out_ref, dQ, dK, dV = ref if ref is not None else dense_reference(p)
    shard = lambda x: mm.zigzag_shard(x, rank, p.world)  # noqa: E731
    q, k, v = (shard(x).to(p.dtype).requires_grad_() for x in (Q, K, V))
    with mm.comm_counter() as c:
        out = attention(q, k, v)
        out.backward(shard(dO).to(p.dtype))
    atol, rtol = tolerance(p.dtype, p.heads, p.kv_heads)
    ratios, abs_err = {}, {}
    for name, got, want in (("out", out, out_ref), ("dq", q.grad, dQ), ("dk", k.grad, dK), ("dv", v.grad, dV)):
        want = shard(want)
        if got.shape != want.shape or got.dtype != p.dtype:
            raise AssertionError(f"{name}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {p.dtype}")
        err = (got.double() - want).abs()
        abs_err[name] = err.max().item()
        ratios[name] = (err / (atol + rtol * want.abs())).max().item()  # <= 1 means allclose
    return ratios, abs_err, (c.bytes_sent, c.bytes_received), (out.detach(), q.grad, k.grad, v.grad)


def mesh_grid(rank: int, world: int, group=None, dtypes=(torch.float32, torch.bfloat16)) -> list[dict]:
    """Every tile of P x causal/full x MHA/GQA/MQA x dtypes, forward and backward."""
    from megatron_mesh.plan import (AttentionShape, best_tile, build_mesh_plan, mesh_bytes_formula, plan_bytes,
                                    tile_shapes)

    records = []
    for tile, causal, heads, dtype in itertools.product(tile_shapes(world), (True, False), HEADS, dtypes):
        h, g = HEADS[heads]
        p = Problem(world, h, g, causal, dtype)
        ratios, abs_err, (sent, recv), _ = run_local(
            rank, p, lambda q, k, v: mm.mesh_attention(q, k, v, group=group, tile=tile, causal=causal))
        shape = AttentionShape(p.seq_local, p.batch, h, g, p.head_dim, torch.tensor([], dtype=dtype).element_size())
        planned = plan_bytes(build_mesh_plan(world, tile, shape, causal=causal), shape)[rank]
        formula = mesh_bytes_formula(world, tile, shape)
        records.append(dict(case=f"P={world} tile={tile[0]}x{tile[1]} causal={causal} {heads} {dtype}",
                            tile=tile, heads=heads, causal=causal, best=tuple(best_tile(world, shape)), ratios=ratios, abs_err=abs_err, dtype=str(dtype), sent=sent, received=recv,
                            planned=(planned.sent, planned.received), formula=(formula.sent, formula.received)))
    return records


def mesh_variants(rank: int, world: int, group=None) -> list[dict]:
    """Schedules, backward modes, kernels, softmax scale, and run-to-run determinism."""
    from megatron_mesh.plan import tile_shapes

    records = []
    tiles = [t for t in tile_shapes(world) if 1 < t[0] < world] or tile_shapes(world)
    for tile, schedule, backward_chunks, kernel, contiguous in itertools.product(
            tiles, ("greedy", "lockstep"), ("refetch", "keep"), ("auto", "math"), ("q", "kv")):
        p = Problem(world, 4, 2, True, torch.float32, seed=1)
        fn = lambda q, k, v: mm.mesh_attention(q, k, v, group=group, tile=tile, schedule=schedule,  # noqa: E731
                                               backward_chunks=backward_chunks, kernel=kernel, softmax_scale=0.3,
                                               contiguous=contiguous)
        ref = _scaled_reference(p, 0.3)
        ratios, abs_err, _, first = run_local(rank, p, fn, ref)
        _, _, _, second = run_local(rank, p, fn, ref)
        identical = all(torch.equal(a, b) for a, b in zip(first, second))
        records.append(dict(case=f"P={world} tile={tile} {schedule} {backward_chunks} kernel={kernel} "
                                 f"contiguous={contiguous}",
                            ratios=ratios, abs_err=abs_err, identical=identical))
    return records


def all_mesh_cases(rank: int, world: int) -> dict:
    """The whole Mesh/ring grid for CP sizes 1..8 and the variants at 4 and 6, in one spawn."""
    return {"grid": in_subgroups(rank, world, mesh_grid),
            "variants": in_subgroups(rank, world, mesh_variants, phases=((4,), (6,)))}


def _scaled_reference(p: Problem, scale: float):
    Q, K, V, dO = make_inputs(p)
    Qr, Kr, Vr = (x.clone().requires_grad_() for x in (Q, K, V))
    out = reference_attention(Qr, Kr, Vr, causal=p.causal, softmax_scale=scale)
    out.backward(dO)
    return Q, K, V, dO, out.detach(), Qr.grad, Kr.grad, Vr.grad

"""Distributed test cases and the one spawn that runs them.

Every distributed (gloo) test of the suite reads its results from ONE spawn of 8 processes
(:func:`run_gloo`, through the session fixture ``gloo`` in conftest.py): process start-up costs
5-10 s on 2 cores, so the CP sizes 1..8 run as concurrent process subgroups (:data:`PHASES`)
and every *part* (Mesh grid, TASP grid, bytes vs plan, ...) runs on the groups of its CP sizes.
Group ranks differ from global ranks, as in Megatron's CP groups.

A part is ``fn(group_rank, group_size, group) -> list[Result]``; each :class:`Result` is what one
rank measured for one case (errors against a dense fp64 reference, bytes moved and what they
must equal), asserted on the pytest side. Global inputs come from a seeded generator (identical
on every rank), are sharded with the problem's layout (Megatron's zigzag, or Transformer
Engine's THD) and compared with :func:`megatron_mesh.kernels.reference_attention` on the full
sequence with the same :class:`~megatron_mesh.plan.Mask`.
"""

from __future__ import annotations

import importlib
import itertools
from dataclasses import dataclass

import torch

from helpers import tolerance

import megatron_mesh as mm
from megatron_mesh.kernels import reference_attention
from megatron_mesh.plan import AttentionShape, Mask, ThdLayout, plan_bytes

# Transformer Engine's context-parallel test tolerances (tests/pytorch/attention, bf16: MHA vs GQA)
HEADS = {"MHA": (4, 4), "GQA": (4, 2), "MQA": (4, 1)}
NAMES = ("out", "dq", "dk", "dv")


@dataclass(frozen=True)
class Problem:
    """One attention problem over ``world`` CP ranks: per-rank shape, mask and layout.

    ``window`` / ``cu_seqlens`` are the public API's arguments (a sliding window, documents over
    the global zigzag sequence); ``thd`` = (cu_seqlens_padded, seq_lens) selects Transformer
    Engine's THD layout instead of the zigzag (its sequences are the documents, padding attends
    nothing)."""

    world: int
    heads: int
    kv_heads: int
    causal: bool
    dtype: torch.dtype
    seq_local: int = 8
    batch: int = 2
    head_dim: int = 16
    seed: int = 0
    window: tuple | None = None
    cu_seqlens: tuple | None = None
    thd: tuple | None = None
    v_head_dim: int | None = None  # None: head_dim (MLA's differ)
    sink: bool = False  # learnable attention sinks (softmax_offset), one random logit per query head

    @property
    def layout(self) -> ThdLayout | None:
        return None if self.thd is None else ThdLayout(self.world, *self.thd)

    @property
    def seq_len(self) -> int:
        return self.layout.seq_len if self.thd else self.world * self.seq_local

    @property
    def local_len(self) -> int:
        return self.layout.seq_local if self.thd else self.seq_local

    @property
    def mask(self) -> Mask:
        """The mask the public arguments mean (what the dense reference applies)."""
        if self.thd is not None:
            return Mask(self.causal, self.window, self.layout.documents())
        if self.cu_seqlens is not None:
            return Mask.from_cu_seqlens(self.cu_seqlens, self.seq_len, self.causal, self.window)
        return Mask(self.causal, self.window)

    @property
    def shape(self) -> AttentionShape:
        return AttentionShape(self.local_len, self.batch, self.heads, self.kv_heads, self.head_dim,
                              torch.tensor([], dtype=self.dtype).element_size(), self.v_head_dim)

    def mask_args(self) -> dict:
        """The mask arguments of the public API (``causal``, ``window``, ``cu_seqlens``, ``layout``)."""
        return dict(causal=self.causal, window=self.window, cu_seqlens=self.cu_seqlens, layout=self.layout)

    def shard(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s tokens of a global [S, ...] tensor in this problem's layout."""
        if self.thd is not None:
            return mm.thd_shard(x, rank, self.layout)
        return mm.zigzag_shard(x, rank, self.world)


def make_inputs(p: Problem):
    """Global fp64 q, k, v and dout of ``p`` (the same on every rank)."""
    g = torch.Generator().manual_seed(p.seed)
    S, f64, dv = p.seq_len, torch.float64, p.v_head_dim or p.head_dim
    Q = torch.randn(S, p.batch, p.heads, p.head_dim, generator=g, dtype=f64)
    K = torch.randn(S, p.batch, p.kv_heads, p.head_dim, generator=g, dtype=f64)
    V = torch.randn(S, p.batch, p.kv_heads, dv, generator=g, dtype=f64)
    dO = torch.randn(S, p.batch, p.heads, dv, generator=g, dtype=f64)
    return Q, K, V, dO


def sink_logits(p: Problem) -> torch.Tensor | None:
    """The fp64 softmax_offset of ``p`` (None without sinks): one logit per query head."""
    return torch.randn(p.heads, generator=torch.Generator().manual_seed(p.seed + 1), dtype=torch.float64) \
        if p.sink else None


@dataclass(frozen=True)
class Reference:
    """Global inputs and the dense fp64 output and gradients of one problem (and the sinks'
    logits and their gradient, with sinks)."""

    inputs: tuple  # Q, K, V, dO
    wanted: tuple  # out, dQ, dK, dV
    offset: torch.Tensor | None = None
    offset_grad: torch.Tensor | None = None


def dense_reference(p: Problem, softmax_scale: float | None = None) -> Reference:
    Q, K, V, dO = make_inputs(p)
    Qr, Kr, Vr = (x.clone().requires_grad_() for x in (Q, K, V))
    offset = sink_logits(p)
    sink = None if offset is None else offset.clone().requires_grad_()
    out = reference_attention(Qr, Kr, Vr, softmax_scale=softmax_scale, mask=p.mask, softmax_offset=sink)
    out.backward(dO)
    return Reference((Q, K, V, dO), (out.detach(), Qr.grad, Kr.grad, Vr.grad), offset,
                     None if sink is None else sink.grad)


def assert_offset_grad(p: Problem, shares, ref: Reference, what: str = "") -> None:
    """The ranks' shares of d softmax_offset sum to the dense reference's gradient (within the
    problem's tolerance, as the other gradients)."""
    atol, rtol = tolerance(p.dtype, p.heads, p.kv_heads)
    got = sum(s.double().cpu() for s in shares)
    err = (got - ref.offset_grad).abs()
    assert (err <= atol + rtol * ref.offset_grad.abs()).all(), \
        f"{what}: d softmax_offset {got.tolist()} != {ref.offset_grad.tolist()} (max error {err.max().item():.2e})"


@dataclass(frozen=True)
class Result:
    """What one rank measured for one case; spawned ranks return lists of these to pytest.

    ``errors`` / ``ratios``: per tensor (out, dq, dk, dv) the max absolute error against the
    dense fp64 reference and that error over Transformer Engine's tolerance (<= 1 passes).
    ``expected_bytes``: (source, (sent, received)) pairs the measured ``sent`` / ``received``
    must equal (the plan's accounting, a closed form). ``outputs``: (out, dq, dk, dv) when a
    bitwise comparison needs them; ``identical``: False when a rerun differed bitwise;
    ``collectives``: the all_to_all_single calls the case made, with the number expected."""

    case: str
    problem: Problem
    errors: dict
    ratios: dict
    sent: int = 0
    received: int = 0
    expected_bytes: tuple = ()
    tile: tuple | None = None
    outputs: tuple = ()
    identical: bool = True
    collectives: tuple[int, int] = (0, 0)


def compare(p: Problem, got, ref: Reference, rank: int) -> tuple[dict, dict]:
    """(max abs errors, ratios to the tolerance) of this rank's (out, dq, dk, dv) ``got``."""
    atol, rtol = tolerance(p.dtype, p.heads, p.kv_heads)
    errors, ratios = {}, {}
    for name, g, want in zip(NAMES, got, ref.wanted):
        want = p.shard(want, rank)
        if g.shape != want.shape or g.dtype != p.dtype:
            raise AssertionError(f"{name}: got {tuple(g.shape)} {g.dtype}, want {tuple(want.shape)} {p.dtype}")
        err = (g.detach().double() - want).abs()
        errors[name] = err.max().item() if err.numel() else 0.0
        ratios[name] = (err / (atol + rtol * want.abs())).max().item() if err.numel() else 0.0
    return errors, ratios


def run_local(rank: int, p: Problem, attention, ref: Reference) -> tuple[tuple, tuple[int, int]]:
    """``attention(q, k, v)`` on this rank's tokens, forward and backward (autograd): returns
    (out, dq, dk, dv) and the (sent, received) bytes ``comm_counter()`` saw."""
    Q, K, V, dO = ref.inputs
    q, k, v = (p.shard(x, rank).to(p.dtype).requires_grad_() for x in (Q, K, V))
    with mm.comm_counter() as c:
        out = attention(q, k, v)
        out.backward(p.shard(dO, rank).to(p.dtype))
    # the caller's tensors are read, never written (a buffer cut as a view of them and then written
    # changed them, and broke autograd's saved views: a hybrid of degree 1 with one KV head did)
    assert [x._version for x in (q, k, v)] == [0, 0, 0], f"rank {rank} wrote into its inputs"
    return (out.detach(), q.grad, k.grad, v.grad), (c.bytes_sent, c.bytes_received)


def measure(rank: int, p: Problem, case: str, attention, ref: Reference | None = None, plan=None, formula=None,
            tile=None, keep_outputs: bool = False, repeat: bool = False) -> Result:
    """Run one case on this rank and describe it as a :class:`Result`; ``plan`` / ``formula``
    (a RankBytes of this rank) give the bytes the measured ones must equal; ``repeat`` runs it
    twice and records whether the two runs agree bitwise."""
    ref = ref if ref is not None else dense_reference(p)
    got, (sent, received) = run_local(rank, p, attention, ref)
    identical = True
    if repeat:
        again, _ = run_local(rank, p, attention, ref)
        identical = all(torch.equal(a, b) for a, b in zip(got, again))
    errors, ratios = compare(p, got, ref, rank)
    expected = []
    if plan is not None:
        mine = plan_bytes(plan, p.shape)[rank]
        expected.append(("plan", (mine.sent, mine.received)))
    if formula is not None:
        expected.append(("formula", (formula.sent, formula.received)))
    return Result(case, p, errors, ratios, sent, received, tuple(expected), tile,
                  tuple(t.contiguous() for t in got) if keep_outputs else (), identical)


# -- checks on the pytest side -------------------------------------------------------------------------
def assert_accurate(per_rank: list[list[Result]]) -> None:
    """Every case of every rank within tolerance, and every rank ran the same cases."""
    assert per_rank and per_rank[0], "no cases ran"
    assert all([r.case for r in recs] == [r.case for r in per_rank[0]] for recs in per_rank), "ranks ran other cases"
    failures = [f"group rank {r}: {rec.case}: {name} error {rec.errors[name]:.2e} ({ratio:.2f}x tolerance)"
                for r, recs in enumerate(per_rank) for rec in recs for name, ratio in rec.ratios.items()
                if not ratio <= 1.0]
    assert not failures, "\n".join(failures[:20])


def assert_bytes_as_expected(per_rank: list[list[Result]]) -> None:
    """Measured bytes equal every expectation of the case (the plan's, the closed form)."""
    failures = [f"group rank {r}: {rec.case}: measured {(rec.sent, rec.received)}, {what} {want}"
                for r, recs in enumerate(per_rank) for rec in recs for what, want in rec.expected_bytes
                if (rec.sent, rec.received) != want]
    assert not failures, "\n".join(failures[:20])


# -- the one spawn ---------------------------------------------------------------------------------------
# Every CP size 1..8 on 8 processes: each phase splits them into disjoint groups that run concurrently.
PHASES = ((8,), (7, 1), (6, 2), (5, 3), (4, 4))

# name -> ("module:function", CP sizes it runs at). Parts of one size in a phase with several groups of
# that size (4, 4) go to those groups in turn, in this order.
PARTS = {
    "mesh": ("cases:mesh_grid", (1, 2, 3, 4, 5, 6, 7, 8)),
    "tasp": ("tasp_cases:tasp_grid", (2, 3, 4, 5, 6, 7, 8)),
    "mesh_variants": ("cases:mesh_variants", (4, 6)),
    "tasp_variants": ("tasp_cases:tasp_variants", (3, 4)),
    "bytes": ("bytes_cases:measure_group", (2, 3, 4, 5, 6, 7, 8)),
    "gloo_outputs": ("cases:gloo_outputs", (4,)),
    "strides": ("mask_cases:strides_grid", (5, 6)),
}
# run after the phases on the whole default group (they make their own subgroups, and their hostile
# API cases destroy and re-create the default group): name -> "module:function(rank, world)"
WHOLE_GROUP_PARTS = {"mask_cases": "mask_cases:all_cases"}


def in_subgroups(rank: int, world: int, case_fn, phases=PHASES, **kwargs) -> dict[int, list]:
    """Run ``case_fn(group_rank, group_size, group=..., **kwargs)`` for every group of every phase
    (mask_cases.py's driver). Returns {group size: records of this rank} for its groups."""
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


def _part(name: str):
    module, fn = (PARTS[name][0] if name in PARTS else WHOLE_GROUP_PARTS[name]).split(":")
    return getattr(importlib.import_module(module), fn)


def assign(sizes: tuple[int, ...], parts) -> list[list[str]]:
    """The parts each group of a phase runs (see :data:`PARTS`)."""
    out: list[list[str]] = [[] for _ in sizes]
    turn: dict[int, int] = {}
    for name in (n for n in parts if n in PARTS):
        for size in sorted(set(sizes)):
            if size not in PARTS[name][1]:
                continue
            groups = [i for i, s in enumerate(sizes) if s == size]
            i = turn.get(size, 0)
            out[groups[i % len(groups)]].append(name)
            turn[size] = i + 1
    return out


def run_parts(rank: int, world: int, parts: tuple[str, ...]) -> dict:
    """(In each spawned rank.) Every part of ``parts`` on its groups; returns {part: {size: (group
    rank, results)}} for the groups this rank was in."""
    import torch.distributed as dist

    out: dict = {}
    for sizes in PHASES:
        start, mine = 0, None
        jobs = assign(sizes, parts)
        for i, size in enumerate(sizes):  # new_group is collective: every rank creates every group, in order
            ranks = list(range(start, start + size))
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = (i, size, group, ranks.index(rank))
            start += size
        i, size, group, group_rank = mine
        for name in jobs[i]:
            out.setdefault(name, {})[size] = (group_rank, _part(name)(group_rank, size, group))
        dist.barrier()
    for name in WHOLE_GROUP_PARTS:
        if name in parts:
            out[name] = _part(name)(rank, world)
    return out


def run_gloo(parts, timeout: float = 840) -> dict:
    """{part: {CP size: [results of group rank 0, 1, ...]}} of ``parts`` (a whole-group part: [its
    result on rank 0, 1, ...]), from one spawn of 8 gloo processes (killed after ``timeout`` s,
    below pytest's own limit of 900 s)."""
    from megatron_mesh.comm.spawn import spawn

    unknown = set(parts) - set(PARTS) - set(WHOLE_GROUP_PARTS)
    assert not unknown, f"unknown gloo parts {sorted(unknown)}"
    parts = tuple(name for name in (*PARTS, *WHOLE_GROUP_PARTS) if name in set(parts))
    merged: dict = {name: {} for name in parts if name in PARTS}
    if not parts:
        return merged
    per_rank = spawn(run_parts, 8, parts, timeout=timeout)
    whole = {name: [r[name] for r in per_rank] for name in WHOLE_GROUP_PARTS if name in parts}
    for ranks in per_rank:
        for name, by_size in ((n, v) for n, v in ranks.items() if n in PARTS):
            for size, (group_rank, results) in by_size.items():
                ranks = merged[name].setdefault(size, {})
                assert group_rank not in ranks, f"{name}: two groups of {size} ran it"
                ranks[group_rank] = results
    return {**{name: {size: [ranks[r] for r in sorted(ranks)] for size, ranks in by_size.items()}
               for name, by_size in merged.items()}, **whole}


# -- Mesh-Attention and ring attention ------------------------------------------------------------------
DTYPES = (torch.float32, torch.bfloat16)


def mesh_grid(rank: int, world: int, group=None) -> list[Result]:
    """Every tile of P x causal/full x MHA/GQA/MQA x fp32/bf16, forward and backward; bytes equal
    the plan's and the closed form's."""
    from megatron_mesh.plan import build_mesh_plan, mesh_bytes_formula, tile_shapes

    results = []
    for tile, causal, heads, dtype in itertools.product(tile_shapes(world), (True, False), HEADS, DTYPES):
        p = Problem(world, *HEADS[heads], causal, dtype)
        plan = build_mesh_plan(world, tile, p.shape, causal=causal)
        results.append(measure(
            rank, p, f"P={world} tile={tile[0]}x{tile[1]} causal={causal} {heads} {dtype}",
            lambda q, k, v: mm.mesh_attention(q, k, v, group=group, tile=tile, causal=causal),
            plan=plan, formula=mesh_bytes_formula(world, tile, p.shape), tile=tile))
    return results


def mesh_variants(rank: int, world: int, group=None) -> list[Result]:
    """Schedules, backward modes, rank orders, kernels and softmax scale on the non-ring tiles,
    each run twice: bitwise identical."""
    from megatron_mesh.plan import tile_shapes

    results = []
    p = Problem(world, 4, 2, True, torch.float32, seed=1)
    ref = dense_reference(p, softmax_scale=0.3)
    tiles = [t for t in tile_shapes(world) if 1 < t[0] < world]
    for tile, schedule, backward_chunks, kernel, contiguous in itertools.product(
            tiles, ("greedy", "lockstep"), ("refetch", "keep"), ("auto", "math"), ("q", "kv")):
        fn = lambda q, k, v: mm.mesh_attention(q, k, v, group=group, tile=tile, schedule=schedule,  # noqa: E731
                                               backward_chunks=backward_chunks, kernel=kernel, softmax_scale=0.3,
                                               contiguous=contiguous)
        results.append(measure(rank, p, f"P={world} tile={tile} {schedule} {backward_chunks} kernel={kernel} "
                                        f"contiguous={contiguous}", fn, ref, tile=tile, repeat=True))
    return results


# -- the bitwise comparison with the in-process transport (test_inprocess_numerics.py) --------------------
GLOO_CASES = [((1, 4), True, "GQA", torch.float32), ((4, 1), False, "MHA", torch.float32),
              ((1, 4), True, "MQA", torch.bfloat16), ((2, 2), True, "GQA", torch.float32),
              ((1, 4), False, "GQA", torch.bfloat16), ((2, 2), True, "MHA", torch.bfloat16)]


def gloo_outputs(rank: int, world: int, group=None) -> list[Result]:
    """out, dq, dk, dv of the public API for GLOO_CASES (compared bitwise with the in-process runs)."""
    results = []
    for tile, causal, heads, dtype in GLOO_CASES:
        p = Problem(world, *HEADS[heads], causal, dtype)
        results.append(measure(rank, p, f"{tile} causal={causal} {heads} {dtype}",
                               lambda q, k, v: mm.mesh_attention(q, k, v, group=group, tile=tile, causal=causal),
                               tile=tile, keep_outputs=True))
    return results

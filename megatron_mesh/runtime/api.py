"""Public, differentiable entry points -- ``mesh_attention``, ``ring_attention``,
``tasp_attention``, ``hybrid_attention``, all thin wrappers of :func:`attention` -- plus the
layout helpers (zigzag and THD shard / unshard).

Layout is Megatron's: q [s_local, batch, heads, head_dim], k/v [s_local, batch, kv_heads,
head_dim], each rank holding its chunk of the global sequence: Megatron's zigzag by default
(:class:`megatron_mesh.plan.ZigzagLayout`), or Transformer Engine's THD layout (``layout=`` a
:class:`megatron_mesh.plan.ThdLayout`). Every mode takes the same inputs, so switching modes
never touches the data.

One call: check the tensors and options (errors name the value and what is allowed) -> resolve
the mode's :class:`~megatron_mesh.plan.Placement` -> the plan for (placement, shape, mask,
layout) (cached) -> check that every rank of the group makes the same call (:mod:`.agreement`:
one small all-reduce per call) -> the executor, forward under autograd, backward when autograd
asks.
"""

from __future__ import annotations

import math
import os
import numbers
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.alltoall import AllToAllCommunicator
from ..comm.base import Communicator, active_counters, counting_into
from ..comm.torch_dist import TorchDistCommunicator
from ..kernels import BlockKernel, get_kernel
from ..plan.ir import Plan
from ..plan.layout import Layout, ThdLayout, ZigzagLayout
from ..plan.mask import Mask
from ..plan.modes import HYBRID_PREFIX, MODES, TRANSPORTS, Placement, resolve
from ..plan.problem import normalize
from ..plan.shape import AttentionShape
from ..plan.validate import validate_plan
from . import agreement
from .agreement import PlanMismatchError
from .executor import Executor

__all__ = ["attention", "mesh_attention", "ring_attention", "tasp_attention", "hybrid_attention", "plan_attention",
           "forward_backward", "zigzag_shard", "zigzag_unshard", "thd_shard", "thd_unshard", "layout_shard",
           "layout_unshard", "attention_shape",
           "group_communicator", "attention_mask", "PlanMismatchError"]


# -- input checks -------------------------------------------------------------------------------------
def attention_shape(q: Tensor, k: Tensor, v: Tensor) -> AttentionShape:
    """Check q, k, v against each other (raising ValueError naming the values) and return the
    per-rank problem shape."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [s_local, batch, heads, head_dim] (Megatron's sbhd layout), "
                             f"got shape {tuple(x.shape)}")
        if 0 in x.shape[1:]:
            raise ValueError(f"{name} must have batch, heads and head_dim >= 1, got shape {tuple(x.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    s, b, h, d = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (s, b, d):
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree in s_local, batch and head_dim")
    if h % k.shape[2]:
        raise ValueError(f"query heads ({h}) must be divisible by kv heads ({k.shape[2]}) "
                         "for grouped-query / multi-query attention")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must be floating point, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on the same device, got {q.device}, {k.device}, {v.device}")
    if s % 2 or s == 0:
        raise ValueError(f"s_local ({s}) must be even and > 0: each rank holds two equal zigzag halves "
                         "(the global sequence must be divisible by 2 * CP size)")
    return AttentionShape(seq_local=s, batch=b, heads=h, kv_heads=k.shape[2], head_dim=d, itemsize=q.element_size())


def _check_scale(softmax_scale) -> None:
    if softmax_scale is None:
        return
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real) or \
            not math.isfinite(float(softmax_scale)) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a finite number > 0 (or None for 1/sqrt(head_dim)), got "
                         f"{softmax_scale!r}")


def attention_mask(world_size: int, shape: AttentionShape, *, causal: bool = True, window=None, cu_seqlens=None,
                   layout=None) -> tuple[Mask, Layout]:
    """The plan's (mask, layout) from the public arguments, checked: ``window`` (left, right) with
    ints >= 0 or None; ``cu_seqlens`` the document boundaries of the global sequence (on
    Megatron's zigzag); ``layout`` a layout that defines its own documents (:class:`ThdLayout`:
    its sequences are the documents, cu_seqlens must be None). Normalised by
    :func:`megatron_mesh.plan.normalize`."""
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise ValueError(f"window must be (left, right) with ints >= 0 or None, got {window!r}")
        window = tuple(window)
    if layout is not None and not isinstance(layout, Layout):
        raise ValueError(f"layout must be None (Megatron's zigzag) or a megatron_mesh layout (e.g. ThdLayout), got "
                         f"{type(layout).__name__}")
    if layout is not None and layout.documents() is not None and cu_seqlens is not None:
        raise ValueError(f"cu_seqlens and a {type(layout).__name__} both give documents: the layout's sequences are "
                         "the documents, pass cu_seqlens=None")
    if layout is not None and (layout.world_size != world_size or layout.seq_local != shape.seq_local):
        raise ValueError(f"{type(layout).__name__} over {layout.world_size} ranks x {layout.seq_local} tokens per rank "
                         f"does not match the CP size {world_size} and the local tensors' {shape.seq_local} tokens")
    mask = Mask(causal, window)
    if cu_seqlens is not None:
        if isinstance(cu_seqlens, Tensor):
            if cu_seqlens.device.type == "meta":
                raise ValueError(f"cu_seqlens is on the {cu_seqlens.device} device, which holds no values: pass the "
                                 "document boundaries on the CPU or the inputs' device")
            if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
                raise ValueError(f"cu_seqlens must be a 1-D integer tensor or sequence, got {cu_seqlens!r}")
            cu_seqlens = cu_seqlens.tolist()
        if not all(isinstance(c, numbers.Integral) and not isinstance(c, bool) for c in cu_seqlens):
            raise ValueError(f"cu_seqlens must hold integers, got {cu_seqlens!r}")
        mask = Mask.from_cu_seqlens(cu_seqlens, world_size * shape.seq_local, causal, window)
    return normalize(world_size, shape, mask, layout)


# -- communicators --------------------------------------------------------------------------------------
class _SingleRank(Communicator):
    rank, world_size = 0, 1

    def _start(self, sends, recvs):  # a one-rank plan has no transfers
        raise RuntimeError("a single-rank group has no peers")


def group_communicator(group, transport: str = "p2p") -> Communicator:
    """A communicator over ``group`` (None: the default group; without an initialised default
    group, a single rank). Made per call from the *live* group, so a re-initialised process group
    is never served a stale one (building one is cheap)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return _SingleRank()
    if transport == "alltoall":
        return AllToAllCommunicator(group)
    return TorchDistCommunicator(group)


# -- the autograd function ------------------------------------------------------------------------------
class _PlanAttention(torch.autograd.Function):
    """Autograd wrapper: forward walks the plan's forward ops, backward its backward ops."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, executor: Executor) -> Tensor:
        res = executor.forward(*(x.permute(1, 2, 0, 3) for x in (q, k, v)))  # sbhd views as bhsd
        out = res.out.to(q.dtype)  # token-major storage: the sbhd view below is contiguous
        ctx.executor = executor
        ctx.counters = active_counters()  # backward may run on autograd's device thread
        ctx.saved_keys = list(res.saved)
        ctx.saved_counts = [len(res.saved[key]) for key in ctx.saved_keys]
        saved = [t for key in ctx.saved_keys for t in res.saved[key]]
        lse = res.lse if res.lse is not None else out.new_empty(0)  # a Ulysses plan keeps lse remotely
        ctx.has_lse = res.lse is not None
        ctx.save_for_backward(q, k, v, out, lse, *saved)
        return out.permute(2, 0, 1, 3)

    @staticmethod
    def backward(ctx, dout: Tensor):
        if torch.is_grad_enabled():
            raise RuntimeError("megatron_mesh attention supports one backward: double backward (create_graph=True) "
                               "is not supported")
        q, k, v, out, lse, *flat = ctx.saved_tensors
        saved, i = {}, 0
        for key, n in zip(ctx.saved_keys, ctx.saved_counts):
            saved[key] = tuple(flat[i:i + n])
            i += n
        with counting_into(ctx.counters):
            dq, dk, dv = ctx.executor.backward(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3),
                                                    v.permute(1, 2, 0, 3), out, lse if ctx.has_lse else None,
                                                    dout.permute(1, 2, 0, 3), saved)
        return tuple(g.to(x.dtype).permute(2, 0, 1, 3) for g, x in ((dq, q), (dk, k), (dv, v))) + (None,)


@lru_cache(maxsize=128)
def _plan(placement: Placement, shape: AttentionShape, mask: Mask, layout) -> Plan:
    plan = placement.build(shape, mask, layout)
    if os.environ.get("MEGATRON_MESH_VALIDATE") == "1":  # debugging: prove every new plan before running it
        validate_plan(plan)
    return plan


@dataclass
class Prepared:
    """Everything one rank needs to run one attention call (see :func:`prepare`)."""

    plan: Plan
    placement: Placement
    comm: Communicator
    kernel: BlockKernel
    scale: float

    def executor(self, timer=None) -> Executor:
        return Executor(self.plan, self.comm, self.kernel, self.scale, timer)


def prepare(q: Tensor, k: Tensor, v: Tensor, *, mode: str = "mesh", group=None, comm: Communicator | None = None,
            causal: bool = True, window=None, cu_seqlens=None, layout=None, softmax_scale: float | None = None,
            kernel: "str | BlockKernel" = "auto", placement: Placement | None = None, **settings) -> Prepared:
    """Check everything and build (or fetch) the plan of one call; ``settings`` go to the mode
    (see :func:`megatron_mesh.plan.resolve`). ``placement`` skips the resolution (the
    Megatron adapter resolves it once per layer)."""
    own = group_communicator(group) if comm is None else comm  # also checks this rank is in the group
    with agreement.joined_on_error(own):  # a rank whose input fails still joins the check: no rank waits for it
        shape = attention_shape(q, k, v)
        _check_scale(softmax_scale)
        kern = get_kernel(kernel, q.device)
        P = own.world_size
        mask, layout = attention_mask(P, shape, causal=causal, window=window, cu_seqlens=cu_seqlens, layout=layout)
        if placement is None:
            placement = _resolve(mode, P, shape, Mask(mask.causal), tuple(sorted((k, _hashable(v))
                                                                                  for k, v in settings.items())))
        elif placement.world_size != P:
            raise ValueError(f"placement for {placement.world_size} ranks used on a CP group of {P}")
        plan = _plan(placement, shape, mask, layout)
    if comm is None:
        comm = own if placement.transport == "p2p" else group_communicator(group, placement.transport)
    scale = float(softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(shape.head_dim))
    agreement.check(comm, agreement.Call(plan, placement, tuple(q.shape), tuple(k.shape), q.dtype, scale, kern))
    return Prepared(plan, placement, comm, kern, scale)


@lru_cache(maxsize=256)
def _resolve(mode: str, P: int, shape: AttentionShape, mask: Mask, settings: tuple) -> Placement:
    kw = dict(settings)
    return resolve(mode, P, shape, ranks_per_node=kw.pop("ranks_per_node", None), mask=mask, **kw)


def _hashable(v):
    return tuple(v) if isinstance(v, list) else v


def attention(q: Tensor, k: Tensor, v: Tensor, *, mode: str = "mesh", group=None, causal: bool = True,
              window=None, cu_seqlens=None, layout=None, softmax_scale: float | None = None,
              kernel: "str | BlockKernel" = "auto", comm: Communicator | None = None, timer=None, **settings) -> Tensor:
    """Context-parallel attention over the CP group ``group`` (None: the default process group)
    with CP mode ``mode`` (``"mesh"``, ``"ring"``, ``"tasp"``, ``"a2a+mesh"``, ``"a2a+tasp"``,
    ``"a2a+ring"``; ``settings`` are the mode's, see the wrappers below).

    Args:
        q: [s_local, batch, heads, head_dim], this rank's chunk of the global sequence.
        k, v: [s_local, batch, kv_heads, head_dim]; heads % kv_heads == 0 (GQA / MQA).
        causal: causal (True) or full (False) attention over the global sequence.
        window: (left, right) sliding window (None = unlimited on that side; right must be 0 or
            None when causal): query i attends key j only if i - j <= left and j - i <= right.
        cu_seqlens: packed documents -- their boundaries over the global (unsharded) sequence,
            0 = c0 < c1 < ... < cn = S (Megatron's zigzag layout with documents anywhere).
        layout: None (Megatron's zigzag) or a :class:`megatron_mesh.ThdLayout` (Transformer
            Engine's THD layout: each packed sequence padded to 2 * CP and split on its own; its
            sequences are the documents). See :func:`thd_shard`.
        softmax_scale: defaults to 1 / sqrt(head_dim).
        kernel: block kernel backend ("auto", "torch", "math", "torch-flash", ...) or an instance.
        comm: an explicit communicator (tests, in-process transports).
        timer: ``timer("compute")`` / ``timer("wait")`` context managers around kernel calls and
            waits (e.g. Megatron's timers).

    Returns the attention output, shaped and typed like q; differentiable w.r.t. q, k, v (one
    backward). Only the (query, key) pairs the mask allows are computed and only the tokens they
    need are sent.
    """
    call = prepare(q, k, v, mode=mode, group=group, comm=comm, causal=causal, window=window, cu_seqlens=cu_seqlens,
                   layout=layout, softmax_scale=softmax_scale, kernel=kernel, **settings)
    return _PlanAttention.apply(q, k, v, call.executor(timer))


def mesh_attention(q: Tensor, k: Tensor, v: Tensor, *, group=None, tile="auto", causal: bool = True,
                   window=None, cu_seqlens=None, layout=None, softmax_scale: float | None = None,
                   schedule: str = "greedy", backward_chunks: str = "refetch", contiguous: str = "auto",
                   gpus_per_node: int | None = None, kernel: "str | BlockKernel" = "auto",
                   comm: Communicator | None = None) -> Tensor:
    """Mesh-Attention (see :func:`attention` for the common arguments).

    Args:
        tile: (a, b) with a * b == CP size -- a query chunks by b key/value chunks per rank; "AxB"
            strings and "auto" (the tile the planner's simulator predicts fastest on nodes of
            ``gpus_per_node`` CP ranks, one node when None). (1, P) is ring attention.
        schedule: "greedy" (pull order by unlocked compute per byte) or "lockstep".
        backward_chunks: "refetch" (re-communicate Q/KV chunks in the backward, ring attention's
            memory) or "keep" (keep the forward's chunks: fewer bytes, more activation memory).
        contiguous: which group is made of consecutive CP ranks, i.e. shares a node when the CP
            group spans nodes: "q" (Q rings), "kv" (KV rings) or "auto" (with the tile).
    """
    return attention(q, k, v, mode="mesh", group=group, causal=causal, window=window, cu_seqlens=cu_seqlens,
                     layout=layout, softmax_scale=softmax_scale, kernel=kernel, comm=comm, tile=tile,
                     schedule=schedule, backward_chunks=backward_chunks, contiguous=contiguous,
                     ranks_per_node=gpus_per_node)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, group=None, causal: bool = True, window=None,
                   cu_seqlens=None, layout=None, softmax_scale: float | None = None,
                   kernel: "str | BlockKernel" = "auto", comm: Communicator | None = None) -> Tensor:
    """Ring attention (zigzag, as Transformer Engine's ``p2p``): Mesh-Attention with tile (1, P).
    Same arguments and layout as :func:`attention`."""
    return attention(q, k, v, mode="ring", group=group, causal=causal, window=window, cu_seqlens=cu_seqlens,
                     layout=layout, softmax_scale=softmax_scale, kernel=kernel, comm=comm)


def tasp_attention(q: Tensor, k: Tensor, v: Tensor, *, group=None, causal: bool = True, window=None,
                   cu_seqlens=None, layout=None, softmax_scale: float | None = None,
                   gpus_per_node: int | None = None, transport: str = "p2p", kernel: "str | BlockKernel" = "auto",
                   comm: Communicator | None = None) -> Tensor:
    """TASP attention (see :func:`attention` for the common arguments).

    Args:
        gpus_per_node: None -- one Hamiltonian decomposition over the whole group (one node);
            m -- the group spans nodes of m consecutive CP ranks: m rings chained over the nodes,
            one inter-node send per rank per step. Must divide the CP size; m = 3 and 5 are
            impossible (no Hamiltonian path decomposition exists) and raise ValueError.
        transport: "p2p" (batched isend/irecv per round) or "alltoall" (one all_to_all_single
            per round); ignored when ``comm`` is given.

    Each rank's local sequence must hold at least one token per ring in each zigzag half
    (s_local >= 2 * rings; rings = CP size - 1 on one node).
    """
    if gpus_per_node is not None and (not isinstance(gpus_per_node, int) or isinstance(gpus_per_node, bool)
                                      or gpus_per_node < 1):
        raise ValueError(f"gpus_per_node must be None or a positive integer, got {gpus_per_node!r}")
    return attention(q, k, v, mode="tasp", group=group, causal=causal, window=window, cu_seqlens=cu_seqlens,
                     layout=layout, softmax_scale=softmax_scale, kernel=kernel, comm=comm,
                     ranks_per_node=gpus_per_node, transport=transport)


def hybrid_attention(q: Tensor, k: Tensor, v: Tensor, *, group=None, ulysses_size: int, inner: str = "mesh",
                     tile="auto", gpus_per_node: int | None = None, causal: bool = True, window=None,
                     cu_seqlens=None, layout=None, softmax_scale: float | None = None,
                     kernel: "str | BlockKernel" = "auto", comm: Communicator | None = None, **inner_settings) -> Tensor:
    """Ulysses x Mesh / TASP / ring: an all-to-all over ``ulysses_size`` consecutive CP ranks
    (inside a node) scatters heads and gathers tokens, then ``inner`` ("mesh", "tasp" or "ring")
    runs across the CP size / ulysses_size groups on that head slice; the reverse all-to-all
    brings the output back. Same input layout as the other modes (this rank's chunk over the
    whole CP group). Query heads must divide by ``ulysses_size``; KV heads must divide by it or
    divide it (then they are replicated). ``tile`` is the inner Mesh tile; ``gpus_per_node`` the
    CP ranks per node; ``inner_settings`` go to the inner mode (e.g. ``schedule``). The inner rings
    run point-to-point: inner="tasp" with ``transport="alltoall"`` raises ValueError.
    """
    mode = HYBRID_PREFIX + str(inner)
    if mode not in MODES:
        raise ValueError(f"inner must be a mode with a Ulysses hybrid, one of "
                         f"{', '.join(m[len(HYBRID_PREFIX):] for m in MODES if m.startswith(HYBRID_PREFIX))}; "
                         f"got {inner!r}")
    settings = dict(inner_settings, ulysses_size=ulysses_size, ranks_per_node=gpus_per_node)
    if tile != "auto":  # a setting of the inner mode: resolve names a mode that has no tile
        settings["tile"] = tile
    return attention(q, k, v, mode=mode, group=group, causal=causal, window=window,
                     cu_seqlens=cu_seqlens, layout=layout, softmax_scale=softmax_scale, kernel=kernel, comm=comm,
                     **settings)


def plan_attention(q: Tensor, k: Tensor, v: Tensor, plan: Plan, *, comm: Communicator,
                   softmax_scale: float | None = None, kernel: "str | BlockKernel" = "auto", timer=None) -> Tensor:
    """Run an explicit ``plan`` (e.g. one parsed from text with :meth:`Plan.from_text`) on this
    rank, differentiably. The plan must match the tensors' shape and the communicator; the ranks of
    the communicator's group must pass the same plan, scale, dtype, shapes and kernel (checked on
    every call, as for :func:`attention`)."""
    with agreement.joined_on_error(comm):
        shape = attention_shape(q, k, v)
        _check_scale(softmax_scale)
        if plan.seq_local != shape.seq_local or plan.world_size != comm.world_size:
            raise ValueError(f"plan for {plan.world_size} ranks x {plan.seq_local} tokens does not fit "
                             f"{comm.world_size} ranks x {shape.seq_local} tokens")
        kern = get_kernel(kernel, q.device)
    scale = float(softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(shape.head_dim))
    agreement.check(comm, agreement.Call(plan, None, tuple(q.shape), tuple(k.shape), q.dtype, scale, kern))
    executor = Executor(plan, comm, kern, scale, timer)
    return _PlanAttention.apply(q, k, v, executor)


def forward_backward(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, plan: "Plan | Callable", *, comm: Communicator,
                     softmax_scale: float | None = None, kernel="auto") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Forward and backward of ``plan`` (a Plan, or ``build(P, shape) -> Plan``) on this rank
    without autograd -- the same executor calls and layout views as the autograd path, for
    drivers that cannot use autograd (in-process virtual ranks on CUDA threads, benchmarks).
    Returns (out, dq, dk, dv) in q's dtype and layout, bitwise what ``.backward(dout)`` gives."""
    shape = attention_shape(q, k, v)
    if dout.shape != q.shape:
        raise ValueError(f"dout must be shaped like q {tuple(q.shape)}, got {tuple(dout.shape)}")
    plan = plan if isinstance(plan, Plan) else plan(comm.world_size, shape)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(shape.head_dim)
    executor = Executor(plan, comm, get_kernel(kernel, q.device), scale)
    bhsd = lambda x: x.permute(1, 2, 0, 3)  # noqa: E731
    res = executor.forward(bhsd(q), bhsd(k), bhsd(v))
    out = res.out.to(q.dtype)
    dq, dk, dv = executor.backward(bhsd(q), bhsd(k), bhsd(v), out, res.lse, bhsd(dout), res.saved)
    return tuple(t.to(q.dtype).permute(2, 0, 1, 3) for t in (out, dq, dk, dv))


# -- layouts on tensors ------------------------------------------------------------------------------------
def layout_shard(x: Tensor, rank: int, layout: Layout, dim: int = 0) -> Tensor:
    """Rank ``rank``'s tokens of a full-sequence tensor under ``layout`` (any layout: Megatron's
    zigzag, Transformer Engine's THD, :func:`megatron_mesh.balanced_layout`), in the rank's local
    order -- what that rank passes to attention."""
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a megatron_mesh layout (ZigzagLayout, ThdLayout, BalancedLayout), got "
                         f"{type(layout).__name__}")
    if x.shape[dim] != layout.seq_len:
        raise ValueError(f"tensor has {x.shape[dim]} tokens along dim {dim}, the {type(layout).__name__} "
                         f"{layout.seq_len}")
    if not isinstance(rank, int) or not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank!r} out of range for CP size {layout.world_size}")
    return torch.cat([x.narrow(dim, start, n) for _, start, n in layout.runs(rank)], dim=dim)


def layout_unshard(chunks: list[Tensor], layout: Layout, dim: int = 0) -> Tensor:
    """The full-sequence tensor from every rank's tokens under ``layout`` (inverse of
    :func:`layout_shard`)."""
    if len(chunks) != layout.world_size:
        raise ValueError(f"{len(chunks)} chunks for a {type(layout).__name__} over {layout.world_size} ranks")
    pieces = []
    for r, c in enumerate(chunks):
        for local, start, n in layout.runs(r):
            pieces.append((start, c.narrow(dim, local, n)))
    return torch.cat([p for _, p in sorted(pieces, key=lambda t: t[0])], dim=dim)


def zigzag_shard(x: Tensor, rank: int, world_size: int, dim: int = 0) -> Tensor:
    """Rank ``rank``'s zigzag chunk of a full-sequence tensor (Megatron's CP batch split)."""
    return layout_shard(x, rank, ZigzagLayout(world_size, x.shape[dim]), dim)


def zigzag_unshard(chunks: list[Tensor], dim: int = 0) -> Tensor:
    """The full-sequence tensor from every rank's zigzag chunk (inverse of :func:`zigzag_shard`)."""
    return layout_unshard(chunks, ZigzagLayout(len(chunks), chunks[0].shape[dim] * len(chunks)), dim)


def thd_shard(x: Tensor, rank: int, layout: ThdLayout, dim: int = 0) -> Tensor:
    """Rank ``rank``'s tokens of a packed THD tensor in Transformer Engine's CP layout (each
    sequence, padded to a multiple of 2 * CP, zigzag-split on its own): what TE's
    ``thd_get_partitioned_indices`` selects."""
    return layout_shard(x, rank, layout, dim)


def thd_unshard(chunks: list[Tensor], layout: ThdLayout, dim: int = 0) -> Tensor:
    """The packed THD tensor from every rank's tokens (inverse of :func:`thd_shard`)."""
    return layout_unshard(chunks, layout, dim)

"""Public, differentiable entry points: ``mesh_attention``, ``ring_attention`` (and
``tasp_attention`` in :mod:`.tasp_api`), plus the zigzag shard/unshard helpers.

Layout is Megatron's: q [s_local, batch, heads, head_dim], k/v [s_local, batch, kv_heads,
head_dim], each rank holding its zigzag chunk (see :class:`megatron_mesh.plan.ZigzagLayout`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.base import Communicator, active_counters, counting_into
from ..comm.torch_dist import TorchDistCommunicator
from ..kernels import BlockKernel, get_kernel
from ..plan.accounting import AttentionShape
from ..plan.ir import Plan
from ..plan.layout import ZigzagLayout
from ..plan.mesh import build_mesh_plan, parse_tile
from .executor import Executor

__all__ = ["mesh_attention", "ring_attention", "plan_attention", "zigzag_shard", "zigzag_unshard",
           "attention_shape", "group_communicator"]


def attention_shape(q: Tensor, k: Tensor, v: Tensor) -> AttentionShape:
    """Check q, k, v against each other (raising ValueError naming the values) and return the
    per-rank problem shape."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [s_local, batch, heads, head_dim] (Megatron's sbhd layout), "
                             f"got shape {tuple(x.shape)}")
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


_COMMS: dict = {}


def group_communicator(group) -> Communicator:
    """A (cached) :class:`TorchDistCommunicator` for ``group``; None means the default group.
    Without an initialised default group, None is a single-rank group."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return _SingleRank()
    comm = _COMMS.get(group)
    if comm is None:
        comm = _COMMS[group] = TorchDistCommunicator(group)
    return comm


class _SingleRank(Communicator):
    rank, world_size = 0, 1

    def _start(self, sends, recvs):  # a one-rank plan has no transfers
        raise RuntimeError("a single-rank group has no peers")


@dataclass(frozen=True)
class _Call:
    executor: Executor


class _PlanAttention(torch.autograd.Function):
    """Autograd wrapper: forward walks the plan's forward ops, backward its backward ops."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, call: _Call) -> Tensor:
        qb, kb, vb = (x.permute(1, 2, 0, 3).contiguous() for x in (q, k, v))  # sbhd -> bhsd
        res = call.executor.forward(qb, kb, vb)
        out = res.out.to(q.dtype)
        ctx.call = call
        ctx.counters = active_counters()  # backward may run on autograd's device thread
        ctx.saved_keys = list(res.saved)
        saved = [t for key in ctx.saved_keys for t in res.saved[key]]
        ctx.saved_counts = [len(res.saved[key]) for key in ctx.saved_keys]
        ctx.save_for_backward(qb, kb, vb, out, res.lse, *saved)
        return out.permute(2, 0, 1, 3)  # bhsd -> sbhd (a view; Megatron reshapes it)

    @staticmethod
    def backward(ctx, dout: Tensor):
        qb, kb, vb, out, lse, *flat = ctx.saved_tensors
        saved, i = {}, 0
        for key, n in zip(ctx.saved_keys, ctx.saved_counts):
            saved[key] = tuple(flat[i:i + n])
            i += n
        dout_b = dout.permute(1, 2, 0, 3).contiguous()
        with counting_into(ctx.counters):
            dq, dk, dv = ctx.call.executor.backward(qb, kb, vb, out, lse, dout_b, saved)
        to_sbhd = lambda g, like: g.to(like.dtype).permute(2, 0, 1, 3)  # noqa: E731
        return to_sbhd(dq, qb), to_sbhd(dk, kb), to_sbhd(dv, vb), None


def plan_attention(q: Tensor, k: Tensor, v: Tensor, build: Callable[[int, AttentionShape], Plan], *,
                   group=None, softmax_scale: float | None = None, kernel: "str | BlockKernel" = "auto",
                   comm: Communicator | None = None) -> Tensor:
    """Run the plan ``build(P, shape)`` over ``group`` (or an explicit ``comm``); the shared body
    of every public attention function."""
    shape = attention_shape(q, k, v)
    comm = comm if comm is not None else group_communicator(group)
    plan = build(comm.world_size, shape)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(shape.head_dim)
    executor = Executor(plan, comm, get_kernel(kernel, q.device), scale)
    return _PlanAttention.apply(q, k, v, _Call(executor))


def mesh_attention(q: Tensor, k: Tensor, v: Tensor, *, group=None, tile="auto",
                   causal: bool = True, softmax_scale: float | None = None, schedule: str = "greedy",
                   backward_chunks: str = "refetch", contiguous: str = "q",
                   kernel: "str | BlockKernel" = "auto", comm: Communicator | None = None) -> Tensor:
    """Mesh-Attention over the CP group ``group`` (None: the default process group).

    Args:
        q: [s_local, batch, heads, head_dim], this rank's zigzag chunk (Megatron's CP layout).
        k, v: [s_local, batch, kv_heads, head_dim]; heads % kv_heads == 0 (GQA / MQA).
        tile: (a, b) with a * b == CP size -- a query chunks by b key/value chunks per rank; "AxB"
            strings and "auto" (fewest bytes per rank, closed form) are accepted. (1, P) is ring
            attention. Megatron's ``--mesh-tile-shape auto`` instead takes the tile the planner
            predicts fastest on the node layout; from Python that is
            ``tile, contiguous = megatron_mesh.plan.choose_tile(P, shape, topology)``.
        causal: causal (True) or full (False) attention over the global sequence.
        softmax_scale: defaults to 1 / sqrt(head_dim).
        schedule: "greedy" (pull order by unlocked compute per byte) or "lockstep".
        backward_chunks: "refetch" (re-communicate Q/KV chunks in the backward, ring attention's
            memory) or "keep" (keep the forward's chunks: fewer bytes, more activation memory).
        contiguous: which group is made of consecutive CP ranks, i.e. shares a node when the CP
            group spans nodes: "q" (Q rings) or "kv" (KV rings).
        kernel: block kernel backend ("auto", "torch", "math", "torch-flash", ...) or an instance.

    Returns the attention output, shaped and typed like q. Differentiable w.r.t. q, k, v.
    """
    def build(world: int, shape: AttentionShape) -> Plan:
        t = parse_tile(tile, world)
        return build_mesh_plan(world, t, shape, causal=causal, schedule=schedule, backward_chunks=backward_chunks,
                               contiguous=contiguous)
    return plan_attention(q, k, v, build, group=group, softmax_scale=softmax_scale, kernel=kernel, comm=comm)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, group=None, causal: bool = True,
                   softmax_scale: float | None = None, kernel: "str | BlockKernel" = "auto",
                   comm: Communicator | None = None) -> Tensor:
    """Ring attention (zigzag, as Transformer Engine's ``p2p``): Mesh-Attention with tile (1, P).
    Same arguments and layout as :func:`mesh_attention`."""
    def build(world: int, shape: AttentionShape) -> Plan:
        return build_mesh_plan(world, (1, world), shape, causal=causal)
    return plan_attention(q, k, v, build, group=group, softmax_scale=softmax_scale, kernel=kernel, comm=comm)


def zigzag_shard(x: Tensor, rank: int, world_size: int, dim: int = 0) -> Tensor:
    """Rank ``rank``'s zigzag chunk of a full-sequence tensor (Megatron's CP batch split)."""
    layout = ZigzagLayout(world_size, x.shape[dim])
    h = layout.half_len
    parts = [x.narrow(dim, half * h, h) for half in layout.halves(rank)]
    return torch.cat(parts, dim=dim)


def zigzag_unshard(chunks: list[Tensor], dim: int = 0) -> Tensor:
    """The full-sequence tensor from every rank's zigzag chunk (inverse of :func:`zigzag_shard`)."""
    world = len(chunks)
    layout = ZigzagLayout(world, chunks[0].shape[dim] * world)
    h = layout.half_len
    halves: list[Tensor | None] = [None] * (2 * world)
    for r, c in enumerate(chunks):
        front, back = layout.halves(r)
        halves[front] = c.narrow(dim, 0, h)
        halves[back] = c.narrow(dim, h, h)
    return torch.cat(halves, dim=dim)

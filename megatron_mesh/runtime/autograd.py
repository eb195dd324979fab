"""One path from Megatron's tensors to the executor and back, for autograd (:class:`PlanAttention`)
and for drivers without it (:func:`forward_backward`: in-process virtual ranks on CUDA threads,
benchmarks). Megatron's [s, b, h, d] tensors are viewed as the executor's [b, h, s, d] (no copy);
the output comes back token-major, so the [s, b, h, d] view of it is contiguous.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable

import torch
from torch import Tensor

from ..comm.base import Communicator, active_counters, counting_into
from ..kernels import get_kernel
from ..plan.ir import Plan
from .executor import Executor, ForwardResult
from .inputs import attention_shape, scale_of
from .sinks import check_offset

__all__ = ["PlanAttention", "forward_backward", "compiler_boundary"]


def compiler_boundary(fn: Callable) -> Callable:
    """``fn`` as ``torch.compile``'s boundary: Dynamo runs it as it is (a graph break before and
    after) instead of tracing it.

    Why: traced under ``aot_eager`` or inductor, the executor's arena views (bytes seen as the
    inputs' dtype) came out a quarter of their size, the ranks posted transfers of different sizes
    and gloo aborted both processes (stop 79); traced at all, the planning code (caches, locks, the
    host's reads of the document boundaries) is traced again for every new shape. The attention is
    host work around kernels, as a collective is: it runs eagerly, the model around it compiles.
    ``torch.compiler.disable`` imports Dynamo (seconds), so it is applied at the first call made
    once Dynamo is loaded: a process that never compiles never imports it."""
    disabled = None

    @functools.wraps(fn)
    def entry(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            if "torch._dynamo" not in sys.modules:  # nothing can be compiling
                return fn(*args, **kwargs)
            disabled = torch.compiler.disable(fn, reason="megatron_mesh's context-parallel attention runs eagerly")
        return disabled(*args, **kwargs)
    return entry


def _bhsd(x: Tensor) -> Tensor:
    return x.permute(1, 2, 0, 3)


def _sbhd(x: Tensor) -> Tensor:
    return x.permute(2, 0, 1, 3)


def _forward(executor: Executor, q: Tensor, k: Tensor, v: Tensor,
             offset: Tensor | None) -> tuple[Tensor, ForwardResult]:
    """(out in q's dtype, [b, h, s, d] view of token-major storage; the executor's result)."""
    res = executor.forward(_bhsd(q), _bhsd(k), _bhsd(v), offset)
    return res.out.to(q.dtype), res


def _backward(executor: Executor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse, dout: Tensor,
              saved: dict, offset: Tensor | None, offset_grad: bool) -> tuple[Tensor, ...]:
    """(dq, dk, dv) in the inputs' dtypes and [s, b, h, d] layout, and d softmax_offset in the
    offset's dtype (None unless ``offset_grad``)."""
    grads = executor.backward(_bhsd(q), _bhsd(k), _bhsd(v), out, lse, _bhsd(dout), saved, offset, offset_grad)
    d_offset = None if executor.offset_grad is None else executor.offset_grad.to(offset.dtype)
    return tuple(_sbhd(g.to(x.dtype)) for g, x in zip(grads, (q, k, v))) + (d_offset,)


class PlanAttention(torch.autograd.Function):
    """Autograd wrapper: forward walks the plan's forward ops, backward its backward ops.
    ``softmax_offset`` [heads]: attention sinks (:mod:`.sinks`); its gradient, where it requires
    one, is this rank's share: the sum over the rows it finished."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, executor: Executor,
                softmax_offset: Tensor | None = None) -> Tensor:
        out, res = _forward(executor, q, k, v, softmax_offset)
        ctx.executor = executor
        ctx.counters = active_counters()  # backward may run on autograd's device thread
        ctx.saved_keys = list(res.saved)
        ctx.saved_counts = [len(res.saved[key]) for key in ctx.saved_keys]
        saved = [t for key in ctx.saved_keys for t in res.saved[key]]
        lse = res.lse if res.lse is not None else out.new_empty(0)  # a Ulysses plan keeps lse remotely
        ctx.has_lse = res.lse is not None
        ctx.has_offset = softmax_offset is not None
        ctx.save_for_backward(q, k, v, out, lse, *((softmax_offset,) if ctx.has_offset else ()), *saved)
        return _sbhd(out)

    @staticmethod
    def backward(ctx, dout: Tensor):
        if torch.is_grad_enabled():
            raise RuntimeError("megatron_mesh attention supports one backward: double backward (create_graph=True) "
                               "is not supported")
        q, k, v, out, lse, *flat = ctx.saved_tensors
        offset = flat.pop(0) if ctx.has_offset else None
        saved, i = {}, 0
        for key, n in zip(ctx.saved_keys, ctx.saved_counts):
            saved[key] = tuple(flat[i:i + n])
            i += n
        with counting_into(ctx.counters):
            dq, dk, dv, d_offset = _backward(ctx.executor, q, k, v, out, lse if ctx.has_lse else None, dout, saved,
                                             offset, ctx.has_offset and ctx.needs_input_grad[4])
        return dq, dk, dv, None, d_offset


def forward_backward(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, plan: "Plan | Callable", *, comm: Communicator,
                     softmax_scale: float | None = None, kernel="auto",
                     softmax_offset: Tensor | None = None) -> tuple[Tensor, ...]:
    """Forward and backward of ``plan`` (a Plan, or ``build(P, shape) -> Plan``) on this rank
    without autograd -- the same executor calls and layout views as the autograd path, for
    drivers that cannot use autograd (in-process virtual ranks on CUDA threads, benchmarks).
    Returns (out, dq, dk, dv) in q's dtype and layout, bitwise what ``.backward(dout)`` gives;
    with a ``softmax_offset`` also this rank's share of its gradient (:class:`PlanAttention`)."""
    shape = attention_shape(q, k, v)
    check_offset(softmax_offset, shape.heads, q.device)
    want = (shape.seq_local, shape.batch, shape.heads, shape.v_head_dim)
    if tuple(dout.shape) != want:
        raise ValueError(f"dout must be shaped like the output {want} (q's heads, v's head dim), got "
                         f"{tuple(dout.shape)}")
    plan = plan if isinstance(plan, Plan) else plan(comm.world_size, shape)
    executor = Executor(plan, comm, get_kernel(kernel, q.device), scale_of(shape, softmax_scale))
    out, res = _forward(executor, q, k, v, softmax_offset)
    grads = _backward(executor, q, k, v, out, res.lse, dout, res.saved, softmax_offset, softmax_offset is not None)
    return (_sbhd(out),) + (grads if softmax_offset is not None else grads[:3])

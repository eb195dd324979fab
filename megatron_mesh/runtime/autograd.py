"""One path from Megatron's tensors to the executor and back, for autograd (:class:`PlanAttention`)
and for drivers without it (:func:`forward_backward`: in-process virtual ranks on CUDA threads,
benchmarks). Megatron's [s, b, h, d] tensors are viewed as the executor's [b, h, s, d] (no copy);
the output comes back token-major, so the [s, b, h, d] view of it is contiguous.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ..comm.base import Communicator, active_counters, counting_into
from ..kernels import get_kernel
from ..plan.ir import Plan
from .executor import Executor, ForwardResult
from .inputs import attention_shape, scale_of

__all__ = ["PlanAttention", "forward_backward"]


def _bhsd(x: Tensor) -> Tensor:
    return x.permute(1, 2, 0, 3)


def _sbhd(x: Tensor) -> Tensor:
    return x.permute(2, 0, 1, 3)


def _forward(executor: Executor, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, ForwardResult]:
    """(out in q's dtype, [b, h, s, d] view of token-major storage; the executor's result)."""
    res = executor.forward(_bhsd(q), _bhsd(k), _bhsd(v))
    return res.out.to(q.dtype), res


def _backward(executor: Executor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse, dout: Tensor,
              saved: dict) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in the inputs' dtypes and [s, b, h, d] layout."""
    grads = executor.backward(_bhsd(q), _bhsd(k), _bhsd(v), out, lse, _bhsd(dout), saved)
    return tuple(_sbhd(g.to(x.dtype)) for g, x in zip(grads, (q, k, v)))


class PlanAttention(torch.autograd.Function):
    """Autograd wrapper: forward walks the plan's forward ops, backward its backward ops."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, executor: Executor) -> Tensor:
        out, res = _forward(executor, q, k, v)
        ctx.executor = executor
        ctx.counters = active_counters()  # backward may run on autograd's device thread
        ctx.saved_keys = list(res.saved)
        ctx.saved_counts = [len(res.saved[key]) for key in ctx.saved_keys]
        saved = [t for key in ctx.saved_keys for t in res.saved[key]]
        lse = res.lse if res.lse is not None else out.new_empty(0)  # a Ulysses plan keeps lse remotely
        ctx.has_lse = res.lse is not None
        ctx.save_for_backward(q, k, v, out, lse, *saved)
        return _sbhd(out)

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
            grads = _backward(ctx.executor, q, k, v, out, lse if ctx.has_lse else None, dout, saved)
        return grads + (None,)


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
    executor = Executor(plan, comm, get_kernel(kernel, q.device), scale_of(shape, softmax_scale))
    out, res = _forward(executor, q, k, v)
    return (_sbhd(out),) + _backward(executor, q, k, v, out, res.lse, dout, res.saved)

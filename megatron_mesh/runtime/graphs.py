"""A rank's forward and backward of one plan captured as CUDA graphs, and replayed.

At a few thousand tokens per rank the host's torch ops set a step's pace (docs/performance.md, "One
rank alone"): a replayed CUDA graph issues the whole direction with one launch, so the host's
cost per layer no longer grows with the plan's ops. What makes a plan capturable is what the
executor already does after a plan's first call: its buffers have fixed places in the rank's
arena (:mod:`.buffers`: no allocation, the same addresses every call), its block masks, gathers'
indices and variable-length offsets are made once and kept, and no op synchronises the host with
the device (``tests/runtime/test_inprocess_numerics.py::test_cuda_step_loop_has_no_host_sync``).
So :class:`PlanGraphs` runs each direction once eagerly (on a side stream: everything that is
made once gets made), captures it over static input tensors, and replays it: the same kernels on
the same memory, so the results are bitwise the eager ones (``tests/runtime/test_graphs.py``,
CUDA tier).

What applies:

* **static plans** -- no mask, a sliding window: one plan per shape, captured once;
* **packed documents**: each sample brings its own plan (its blocks, masks and transfers), so a
  graph would be captured for one use -- eager runs them (the arena still spares their
  allocations);
* the communicator's transfers must be capturable: the one-rank replay
  (:class:`~megatron_mesh.comm.replay.ReplayCommunicator`: device copies) is, and is what the
  benchmarks' "alone" runs use (``--graphs``); NCCL's point-to-point calls are capturable in
  recent NCCL / torch, untested here; gloo and the in-process transport are not;
* off by default: measured only on one rank alone so far, and the Megatron adapter does not
  capture (Megatron's own ``--enable-cuda-graph`` captures whole layers).

Cost: the graphs' private memory pool keeps the allocations a direction makes while it runs
(its kernels' outputs, the output and gradients) for as long as the graphs live; the replayed
outputs live there and are overwritten by the next replay -- copy what must outlive it.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .executor import Executor, ForwardResult

__all__ = ["PlanGraphs", "capture"]


def capture(step: Callable[[], object], warmup: int = 1, pool=None) -> tuple["torch.cuda.CUDAGraph", object]:
    """``step()`` run ``warmup`` times on a side stream (what a plan makes once gets made), then
    captured: (the graph, what the captured call returned -- tensors a replay writes again)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = step()
    return graph, out


class PlanGraphs:
    """One rank's forward and backward of a plan as two CUDA graphs over static inputs.

    ``forward_executor`` / ``backward_executor``: executors of the plan (one each where their
    communicators differ, e.g. two replays of recorded messages; else the same one); ``q``, ``k``,
    ``v``, ``dout``: [B, H, T, D] views, as :meth:`Executor.forward` takes them (their values are
    copied into static tensors of the same layout). :meth:`forward` / :meth:`backward` replay:
    their results live in the graphs' memory until the next replay."""

    def __init__(self, forward_executor: Executor, backward_executor: Executor, q: Tensor, k: Tensor, v: Tensor,
                 dout: Tensor, warmup: int = 1):
        if not q.is_cuda:
            raise ValueError(f"CUDA graphs need CUDA tensors, got q on {q.device}")
        self.inputs = tuple(_static(x) for x in (q, k, v, dout))
        sq, sk, sv, sd = self.inputs
        self.pool = torch.cuda.graph_pool_handle()

        def fwd() -> tuple[ForwardResult, Tensor]:
            res = forward_executor.forward(sq, sk, sv)
            return res, res.out.to(sq.dtype)

        self.fwd_graph, (self.result, self.out) = capture(fwd, warmup, self.pool)
        res, out = self.result, self.out

        def bwd() -> tuple[Tensor, Tensor, Tensor]:
            return backward_executor.backward(sq, sk, sv, out, res.lse, sd, res.saved)

        self.bwd_graph, self.grads = capture(bwd, warmup, self.pool)

    def load(self, *tensors: Tensor | None) -> None:
        """Copy new values of (q, k, v, dout) -- None: keep -- into the static inputs."""
        for dst, src in zip(self.inputs, tensors):
            if src is not None:
                dst.copy_(src)

    def forward(self) -> tuple[Tensor, Tensor | None]:
        """Replay the forward: (the output in the inputs' dtype, lse)."""
        self.fwd_graph.replay()
        return self.out, self.result.lse

    def backward(self) -> tuple[Tensor, Tensor, Tensor]:
        """Replay the backward (after a forward's replay): (dq, dk, dv)."""
        self.bwd_graph.replay()
        return self.grads


def _static(x: Tensor) -> Tensor:
    """A tensor with ``x``'s values, shape and strides (a token-major view stays one)."""
    out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    out.copy_(x)
    return out

"""A rank's results in the inputs' dtype, where some of their rows go there straight.

A plain plan accumulates its rank's output and gradients in fp32 and returns them in the inputs'
dtype. Rows that one kernel call writes and nothing else
(:func:`~megatron_mesh.plan.single_writes.single_writes`: a short document's rows, a rank's own
keys no peer computes with) are final as the kernel returns them: where the inputs are bf16 or
fp16 the blocks copy those rows into the result itself (:mod:`.blocks`), and at the end of the
direction the accumulator's other rows are cast into it (:func:`finish_result`) -- the same values
as copying every row into fp32 and casting the whole accumulator, two passes over those rows fewer
(in bf16, 4 bytes an element instead of 12; with attention sinks such a row is scaled as it is
copied, in fp32, and rounded once, as an accumulator's row is scaled and then cast). The
simulator prices it so
(:func:`~megatron_mesh.plan.costs.block_cost_parts`, :func:`~megatron_mesh.plan.costs.result_casts`).

Worked example: the module docstring of :mod:`megatron_mesh.plan.single_writes` (ring, 2 ranks:
rank 0's rows 0-1 go to its bf16 output straight, rows 6-7 through fp32).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..plan.ir import KINDS, Key, Plan
from ..plan.single_writes import cast_rows, single_writes
from .buffers import Buffers, one_allocation
from .masks import mask_piece
from .merge import part_of

__all__ = ["straight_results", "finish_result"]


def straight_results(plan: Plan, rank: int, bufs: Buffers) -> dict:
    """Where the inputs are narrower than the accumulators, make the results with single writes
    in the inputs' dtype (``bufs.results``) and return the direction's single writes by op index
    for the blocks; else {}."""
    if bufs.acc_dtype == bufs.dtype:
        return {}
    piece = mask_piece(bufs.device)
    singles = single_writes(plan, rank, bufs.direction, piece)
    for key in cast_rows(plan, rank, bufs.direction, piece):
        bufs.results[key] = _own_result(bufs, key)
    return singles


def _own_result(bufs: Buffers, key: Key) -> tuple[Tensor, ...]:
    """Result ``key``'s values (an output without its lse: the accumulator keeps that) in the
    inputs' dtype, allocated for the call, token-major as the accumulators (one allocation for dK
    and dV, returned together)."""
    bufs.allocations += 1
    tokens = bufs.plan.tokens(key)
    h, g = bufs.plan.head_counts(key, bufs.heads, bufs.kv_heads)
    shapes = [(tokens, bufs.batch, h if side == "q" else g, bufs.dims[dim])
              for side, dim, _ in KINDS[key.kind].tensors if dim]
    return one_allocation(shapes, bufs.dtype, bufs.device)


def finish_result(plan: Plan, rank: int, bufs: Buffers, key: Key, acc: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Result ``key``: its accumulator's values (the caller casts them), or the result in the
    inputs' dtype (:func:`straight_results`) with the accumulator's other rows cast into it in one op."""
    res = bufs.results.get(key)
    if res is None:
        return acc
    rest = cast_rows(plan, rank, bufs.direction, mask_piece(bufs.device))[key]
    pairs = [(part_of(r, 2, a, b - a), part_of(t, 2, a, b - a)) for r, t in zip(res, acc) for a, b in rest]
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
    return res


"""Merging partial attention results (the online-softmax identity) in the accumulator dtype."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["merge_partial_", "part_of"]

_FLOOR = -1e30  # the reference of rows no key has reached (their weights are exp(-inf) = 0)


def merge_partial_(out: Tensor, lse: Tensor, blk_out: Tensor, blk_lse: Tensor) -> None:
    """In place: (out, lse) <- the attention over the union of both key sets.

    ``out`` [..., S, D] and ``lse`` [..., S] are fp32 (or fp64) accumulators (possibly views); ``blk_*`` a
    partial result over other keys. With L = logaddexp(lse, blk_lse):
    out <- out * exp(lse - L) + blk_out * exp(blk_lse - L). Rows that no key has reached yet have
    lse = -inf and out = 0; they stay so (the exp weights are taken against a finite floor there
    instead of -inf, which would give NaN: exp(-inf - floor) = 0).
    """
    new_lse = torch.logaddexp(lse, blk_lse)
    # one op, not isneginf + masked_fill: a merge runs per block, and on a GPU each op is a launch.
    # Any finite lse lies far above the floor (|lse| <= log(keys) + max|q.k| * scale)
    ref = new_lse.clamp_min(_FLOOR)
    out.mul_((lse - ref).exp_().unsqueeze(-1))
    out.addcmul_(blk_out, (blk_lse.to(out.dtype) - ref).exp_().unsqueeze(-1))
    lse.copy_(new_lse)


def part_of(t: Tensor, dim: int, start: int, length: int) -> Tensor:
    """``t.narrow(dim, start, length)``, or ``t`` itself where that is all of it: the executor
    cuts its accumulators and block results per range, mostly whole, and every view costs a
    dispatch on the host (a GPU waits for the host at a few thousand tokens per rank)."""
    return t if start == 0 and length == t.shape[dim] else t.narrow(dim, start, length)

"""Merging partial attention results (the online-softmax identity) in the accumulator dtype."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["merge_partial_", "part_of"]

_FLOOR = -1e30  # the reference of rows no key has reached (their weights are exp(-inf) = 0)


def merge_partial_(out: Tensor, lse: Tensor, blk_out: Tensor, blk_lse: Tensor) -> None:
    """In place: (out, lse) <- the attention over the union of both key sets.

    ``out`` [..., S, D] and ``lse`` [..., S] are fp32 (or fp64) accumulators (possibly views); ``blk_*`` a
    partial result over other keys. With L = logaddexp(lse, blk_lse) the block's weight is
    w = exp(blk_lse - L) = sigmoid(blk_lse - lse) and the old rows' 1 - w, so
    out <- out + w (blk_out - out) (one ``lerp_``), lse <- L. Rows that no key has reached yet have
    lse = -inf and out = 0; they stay so (the difference is taken against a finite floor there
    instead of -inf, which would give NaN: sigmoid(-inf - floor) = 0), and a row the block reaches
    first becomes the block's, exactly (w = 1).

    Five elementwise ops, six where the block is in a narrower dtype (its cast: ``lerp_`` takes one
    dtype): on a GPU each is a launch, and a merge runs per forward block, so at a few thousand
    tokens per rank the host's launches set the pace (docs/performance.md, one rank alone). The
    form out * exp(lse - L) + blk_out * exp(blk_lse - L) took nine.
    """
    # Any finite lse lies far above the floor (|lse| <= log(keys) + max|q.k| * scale)
    w = (blk_lse.to(lse.dtype) - lse.clamp_min(_FLOOR)).sigmoid_()  # lerp_ wants w in out's dtype
    out.lerp_(blk_out.to(out.dtype), w.unsqueeze(-1))
    if lse.requires_grad or blk_lse.requires_grad:  # a test differentiating through merges: out= has no grad
        lse.copy_(torch.logaddexp(lse, blk_lse))
    else:
        torch.logaddexp(lse, blk_lse, out=lse)


def part_of(t: Tensor, dim: int, start: int, length: int) -> Tensor:
    """``t.narrow(dim, start, length)``, or ``t`` itself where that is all of it: the executor
    cuts its accumulators and block results per range, mostly whole, and every view costs a
    dispatch on the host (a GPU waits for the host at a few thousand tokens per rank)."""
    return t if start == 0 and length == t.shape[dim] else t.narrow(dim, start, length)

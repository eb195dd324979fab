"""Merging partial attention results (the online-softmax identity) in the accumulator dtype."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["merge_partial_"]


def merge_partial_(out: Tensor, lse: Tensor, blk_out: Tensor, blk_lse: Tensor) -> None:
    """In place: (out, lse) <- the attention over the union of both key sets.

    ``out`` [..., S, D] and ``lse`` [..., S] are fp32 (or fp64) accumulators (possibly views); ``blk_*`` a
    partial result over other keys. With L = logaddexp(lse, blk_lse):
    out <- out * exp(lse - L) + blk_out * exp(blk_lse - L). Rows that no key has reached yet have
    lse = -inf and out = 0; they stay so (the exp weights are taken against 0 there instead of
    -inf, which would give NaN).
    """
    new_lse = torch.logaddexp(lse, blk_lse)
    ref = new_lse.masked_fill(new_lse.isneginf(), 0.0)
    out.mul_((lse - ref).exp_().unsqueeze(-1))
    out.addcmul_(blk_out, (blk_lse.to(out.dtype) - ref).exp_().unsqueeze(-1))
    lse.copy_(new_lse)

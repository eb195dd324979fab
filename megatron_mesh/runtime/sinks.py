"""Attention sinks: Megatron's ``softmax_offset``, one logit per query head in every row's softmax.

With a sink of logit o_h (``softmax_type`` "off-by-one": o = 0; "learnable": a parameter), the
weights of row i of head h are p_ij = exp(s_ij) / (exp(o_h) + sum_k exp(s_ik)): the sink takes
a share of the row and brings no value. It changes each row's normaliser, not which keys are read,
so the plan (its blocks, transfers and bytes) is the plan without it, and it is applied **once**,
where a row's partial results have all been merged (the rank's own output at the end of the
forward; in a Ulysses hybrid, each row of a group's head slice as it is finished, before the
all-to-all brings it home): with lse = log sum_k exp(s_ik) of the merged row,

    out' = out * exp(lse) / (exp(lse) + exp(o)) = out * sigmoid(lse - o),    lse' = logaddexp(lse, o).

Backward: the weights are p_ij = exp(s_ij - lse') and the sink's p_i = exp(o - lse'); the sink's
value is 0, so delta_i = rowsum(dout_i * out'_i) is unchanged in form, and the block backwards run
as without a sink given lse' and out' (dS_ij = p_ij (dout_i . v_j - delta_i)). The sink's own
score gradient is p_i (0 - delta_i), so

    d o_h = -sum over the rows i (and the batch) of exp(o_h - lse'_i) * delta_i.

Each rank sums it over the rows it finished (its own rows; in a hybrid, its group's rows of its
head slice), so the CP group's sum is the whole gradient -- what Megatron's gradient reduction over
the data-parallel x CP group computes. A row no key reaches (padding) has lse = -inf and out = 0:
it gets out' = 0, lse' = o, and adds nothing to d o (delta = 0).

Worked example: one row of one head whose two keys have scores 0 and log 3 (lse = log 4), values
v0 and v1, and o = 0 (off-by-one): out = (v0 + 3 v1) / 4, and out' = out * sigmoid(log 4) =
out * 4 / 5 = (v0 + 3 v1) / 5 -- the weights 1/5, 3/5 and the sink's 1/5; lse' = log 5.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .inputs import INPUT_DTYPES

__all__ = ["check_offset", "sink_kind", "apply_sink_", "sink_weight", "add_sink_grad_"]

_FLOOR = -1e30  # a row no key reached (lse -inf) against an offset of -inf: sigmoid(+inf) = 1, not NaN


def check_offset(offset, heads: int, device: torch.device) -> None:
    """``softmax_offset`` checked: None, or a floating tensor of shape [heads] (this rank's query
    heads, as Megatron's ``DotProductAttention.softmax_offset``) on the inputs' device."""
    if offset is None:
        return
    if not isinstance(offset, Tensor):
        raise ValueError(f"softmax_offset must be None or a tensor of shape [{heads}] (one logit per query head), got "
                         f"{type(offset).__name__}")
    if tuple(offset.shape) != (heads,):
        raise ValueError(f"softmax_offset must have shape [{heads}] (one logit per query head of q), got "
                         f"{list(offset.shape)}")
    if offset.dtype not in INPUT_DTYPES:
        raise ValueError(f"softmax_offset must be one of {', '.join(str(t) for t in INPUT_DTYPES)}, got {offset.dtype}")
    if offset.device != device:
        raise ValueError(f"softmax_offset must be on the inputs' device {device}, got {offset.device}")


def sink_kind(offset: Tensor | None) -> str:
    """What the ranks of a group must agree on: "none", "fixed" (no gradient: off-by-one) or
    "learnable" (its gradient is asked for). The values are not compared: that would read them on
    the host on every call (a device synchronisation)."""
    if offset is None:
        return "none"
    return "learnable" if offset.requires_grad else "fixed"


def apply_sink_(out: Tensor, lse: Tensor, offset: Tensor) -> None:
    """In place on merged rows: out [B, H, T, Dv] *= sigmoid(lse - o), lse [B, H, T] <-
    logaddexp(lse, o), with ``offset`` o [H] in the accumulators' dtype."""
    o = offset.view(1, -1, 1)
    out.mul_(sink_weight(lse, offset))
    torch.logaddexp(lse, o.expand_as(lse), out=lse)


def sink_weight(lse: Tensor, offset: Tensor) -> Tensor:
    """sigmoid(lse - o) [B, H, T, 1]: what a row's output is scaled by (before its lse takes the
    sink). A result row in the inputs' dtype (runtime/results.py) is scaled by it in the
    accumulators' dtype and rounded once, as an accumulator row is and then cast: the same bits."""
    return (lse.clamp_min(_FLOOR) - offset.view(1, -1, 1)).sigmoid_().unsqueeze(-1)


def add_sink_grad_(grad: Tensor, dout: Tensor, out: Tensor, lse: Tensor, offset: Tensor) -> None:
    """grad [H] (fp32 or fp64) -= sum over batch and rows of exp(o - lse') * rowsum(dout * out')
    for rows whose final output ``out`` and lse ``lse`` ([B, H, T, Dv], [B, H, T]) are given."""
    acc = grad.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1)
    p = (offset.to(acc).view(1, -1, 1) - lse.to(acc).clamp_min(_FLOOR)).exp_()
    grad.sub_((p * delta).sum((0, 2)))

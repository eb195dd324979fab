"""Pure-math attention in torch: the dense reference the tests compare against, and a block kernel
that works for every dtype and device (slow; used for fp64 checks and as an independent kernel)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..plan.mask import BlockKind

__all__ = ["MathKernel", "reference_attention", "dense_mask"]


def _scores(q: Tensor, k: Tensor, allowed: Tensor | None, scale: float) -> Tensor:
    """Scaled scores with disallowed pairs at -inf (``allowed`` [Sq, Sk] bool, None: all)."""
    groups = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(groups, dim=1) if groups > 1 else k
    s = torch.matmul(q, kk.transpose(-1, -2)) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def _allowed(mask, sq: int, sk: int, device) -> Tensor | None:
    if mask.kind == BlockKind.FULL:
        return None
    if mask.kind == BlockKind.CAUSAL:
        return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()
    return mask.allowed


def _softmax(s: Tensor) -> tuple[Tensor, Tensor]:
    """(p, lse) of scores with rows possibly all -inf (then p = 0 and lse = -inf, not NaN)."""
    lse = torch.logsumexp(s, dim=-1)
    safe = lse.masked_fill(lse.isneginf(), 0.0)
    return torch.exp(s - safe.unsqueeze(-1)), lse


class MathKernel:
    """Block kernel in plain matmuls, computed in ``compute_dtype`` (default: fp32, or fp64 for
    fp64 inputs)."""

    name = "math"

    def __init__(self, compute_dtype: torch.dtype | None = None):
        self.compute_dtype = compute_dtype

    def _dtype(self, x: Tensor) -> torch.dtype:
        if self.compute_dtype is not None:
            return self.compute_dtype
        return torch.float64 if x.dtype == torch.float64 else torch.float32

    def forward(self, q, k, v, *, mask, scale):
        dt = self._dtype(q)
        s = _scores(q.to(dt), k.to(dt), _allowed(mask, q.shape[2], k.shape[2], q.device), scale)
        p, lse = _softmax(s)
        groups = q.shape[1] // k.shape[1]
        vv = v.to(dt).repeat_interleave(groups, dim=1) if groups > 1 else v.to(dt)
        return torch.matmul(p, vv), lse

    def backward(self, dout, q, k, v, lse, delta, *, mask, scale):
        dt = self._dtype(q)
        groups = q.shape[1] // k.shape[1]
        q_, k_, v_, do = q.to(dt), k.to(dt), v.to(dt), dout.to(dt)
        s = _scores(q_, k_, _allowed(mask, q.shape[2], k.shape[2], q.device), scale)
        lse = lse.to(dt)
        p = torch.exp(s - lse.masked_fill(lse.isneginf(), 0.0).unsqueeze(-1))
        vv = v_.repeat_interleave(groups, dim=1) if groups > 1 else v_
        kk = k_.repeat_interleave(groups, dim=1) if groups > 1 else k_
        ds = p * (torch.matmul(do, vv.transpose(-1, -2)) - delta.to(dt).unsqueeze(-1))
        dq = torch.matmul(ds, kk) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q_) * scale
        dv = torch.matmul(p.transpose(-1, -2), do)
        if groups > 1:
            b, h, sk = dk.shape[:3]
            dk = dk.view(b, h // groups, groups, sk, dk.shape[-1]).sum(2)
            dv = dv.view(b, h // groups, groups, sk, dv.shape[-1]).sum(2)
        return dq, dk, dv


def dense_mask(mask, seq_len: int, device=None) -> Tensor:
    """[S, S] bool: which (query, key) pairs of the global sequence ``mask`` (a
    :class:`megatron_mesh.plan.Mask`) allows -- the reference every distributed test compares
    against, built straight from the rule (:meth:`Mask.allowed`, itself tested against the
    scalar :meth:`Mask.allows` on every pair), not from the plan's blocks."""
    pos = torch.arange(seq_len, device=device)
    return mask.allowed(pos, pos)


def reference_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True,
                        softmax_scale: float | None = None, mask=None, softmax_offset: Tensor | None = None) -> Tensor:
    """Dense attention over the full sequence in Megatron's layout [S, B, H, D] (k: [S, B, Hkv, D],
    v: [S, B, Hkv, Dv]), differentiable, computed in q's dtype with plain matmuls (use fp64 inputs
    for a reference). ``mask`` (a :class:`megatron_mesh.plan.Mask`) overrides ``causal``; a query
    with no allowed key (padding) gets output 0. ``softmax_offset`` [H]: attention sinks as
    Megatron's ``SoftmaxOne`` applies them -- one more (unscaled) logit per row, of no value --
    differentiable too."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qb, kb, vb = (x.permute(1, 2, 0, 3) for x in (q, k, v))
    groups = qb.shape[1] // kb.shape[1]
    if groups > 1:
        kb, vb = kb.repeat_interleave(groups, dim=1), vb.repeat_interleave(groups, dim=1)
    S = q.shape[0]
    if mask is None:
        allowed = torch.ones(S, S, dtype=torch.bool, device=q.device).tril() if causal else None
    else:
        allowed = dense_mask(mask, S, q.device)
    s = _scores(qb, kb, allowed, scale)
    if softmax_offset is not None:  # the sink's column, dropped after the softmax
        sink = softmax_offset.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:3], 1)
        p, _ = _softmax(torch.cat([s, sink], dim=-1))
        p = p[..., :-1]
    else:
        p, _ = _softmax(s)
    out = torch.matmul(p, vb)
    return out.permute(2, 0, 1, 3)

"""Pure-math attention in torch: the dense reference the tests compare against, and a block kernel
that works for every dtype and device (slow; used for fp64 checks and as an independent kernel)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["MathKernel", "reference_attention"]


def _scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    groups = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(groups, dim=1) if groups > 1 else k
    s = torch.matmul(q, kk.transpose(-1, -2)) * scale
    if causal:
        sq, sk = s.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return s


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

    def forward(self, q, k, v, *, causal, scale):
        dt = self._dtype(q)
        s = _scores(q.to(dt), k.to(dt), causal, scale)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1))
        groups = q.shape[1] // k.shape[1]
        vv = v.to(dt).repeat_interleave(groups, dim=1) if groups > 1 else v.to(dt)
        return torch.matmul(p, vv), lse

    def backward(self, dout, q, k, v, lse, delta, *, causal, scale):
        dt = self._dtype(q)
        groups = q.shape[1] // k.shape[1]
        q_, k_, v_, do = q.to(dt), k.to(dt), v.to(dt), dout.to(dt)
        s = _scores(q_, k_, causal, scale)
        p = torch.exp(s - lse.to(dt).unsqueeze(-1))
        vv = v_.repeat_interleave(groups, dim=1) if groups > 1 else v_
        kk = k_.repeat_interleave(groups, dim=1) if groups > 1 else k_
        ds = p * (torch.matmul(do, vv.transpose(-1, -2)) - delta.to(dt).unsqueeze(-1))
        dq = torch.matmul(ds, kk) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q_) * scale
        dv = torch.matmul(p.transpose(-1, -2), do)
        if groups > 1:
            b, h, sk, d = dk.shape
            dk = dk.view(b, h // groups, groups, sk, d).sum(2)
            dv = dv.view(b, h // groups, groups, sk, d).sum(2)
        return dq, dk, dv


def reference_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True,
                        softmax_scale: float | None = None) -> Tensor:
    """Dense attention over the full sequence in Megatron's layout [S, B, H, D] (k, v: [S, B, Hkv,
    D]), differentiable, computed in q's dtype with plain matmuls (use fp64 inputs for a
    reference)."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qb, kb, vb = (x.permute(1, 2, 0, 3) for x in (q, k, v))
    groups = qb.shape[1] // kb.shape[1]
    if groups > 1:
        kb, vb = kb.repeat_interleave(groups, dim=1), vb.repeat_interleave(groups, dim=1)
    s = _scores(qb, kb, causal, scale)
    out = torch.matmul(torch.softmax(s, dim=-1), vb)
    return out.permute(2, 0, 1, 3)

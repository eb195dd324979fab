"""The block-kernel contract: one attention block in, (out, lse) out; and its backward.

Every kernel (torch's CPU/CUDA attention ops, the pure-math reference, later flash-attn or
Transformer Engine) implements :class:`BlockKernel`, so the executor never knows which one runs.
Kernel quirks (layouts, padding of lse, GQA support, what a backward op needs) stay inside the
kernel's module.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

__all__ = ["BlockKernel"]


@runtime_checkable
class BlockKernel(Protocol):
    """Attention of one block.

    Layout: ``q`` [B, H, Sq, D]; ``k``, ``v`` [B, Hkv, Sk, D] with H % Hkv == 0 (grouped-query
    attention: query head h uses KV head h // (H / Hkv)). Inputs may be strided views (slices of
    a chunk along the sequence). ``causal`` is the top-left-aligned causal mask over the block's
    own token order (the plan only uses it when Sq == Sk and the tokens coincide).
    """

    name: str

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        """Returns ``out`` [B, H, Sq, D] (any float dtype) and ``lse`` [B, H, Sq] (fp32, or fp64
        for fp64 inputs), the log-sum-exp of the scaled scores of each row over this block's keys."""

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor, *,
                 causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of this block's contribution, given the *global* row statistics: ``lse`` and
        ``delta`` = rowsum(dout * out) [B, H, Sq] (fp32 or fp64) of the full attention rows. With
        P = exp(s - lse) and dS = P * (dout v^T - delta):
        dq = scale dS k, dk = scale dS^T q, dv = P^T dout. Returns (dq, dk, dv) shaped like
        (q, k, v), any float dtype (the executor accumulates in fp32)."""

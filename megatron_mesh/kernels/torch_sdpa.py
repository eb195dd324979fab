"""Block kernels built on torch's own fused attention ops (no extra packages).

* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``): fp64/fp32/bf16/fp16,
  native grouped-query attention, returns the log-sum-exp.
* CUDA: ``aten._scaled_dot_product_flash_attention`` (default), ``..._efficient_attention`` or
  ``..._cudnn_attention``, chosen by :func:`cuda_ops_available` / the ``op`` argument.

The fused backward ops take the row's *output* ``out`` only to form delta = rowsum(dout * out). A
rank that computes blocks of a remote query chunk has that row's dout and delta (sent with it),
not its output -- sending the output would cost as many bytes again as dout. So the backward
passes a stand-in output ``out' = dout * delta / |dout|^2`` (per row), for which
rowsum(dout * out') == delta exactly in real arithmetic; |out'| <= |out| by Cauchy-Schwarz, so it
cannot overflow. The ops' gradients are then those of the block given the global statistics.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["TorchAttentionKernel", "CUDA_OPS", "stand_in_output"]

CUDA_OPS = ("flash", "efficient", "cudnn")


def stand_in_output(dout: Tensor, delta: Tensor) -> Tensor:
    """A tensor ``o`` shaped like ``dout`` with rowsum(dout * o) == delta (see the module doc)."""
    wide = torch.float64 if dout.dtype == torch.float64 else torch.float32
    d = dout.to(wide)
    norm2 = (d * d).sum(-1)
    coef = torch.where(norm2 > 0, delta.to(wide) / norm2.clamp_min(torch.finfo(wide).tiny), torch.zeros_like(norm2))
    return (d * coef.unsqueeze(-1)).to(dout.dtype)


class TorchAttentionKernel:
    """torch's fused attention as a :class:`~megatron_mesh.kernels.base.BlockKernel`.

    ``op``: "auto" (CPU op on CPU; on CUDA flash for bf16/fp16 and the efficient kernel for fp32),
    or one of "flash", "efficient", "cudnn" on CUDA.
    """

    def __init__(self, device_type: str = "cpu", op: str = "auto"):
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"TorchAttentionKernel supports device types 'cpu' and 'cuda', got {device_type!r}")
        if device_type == "cpu" and op not in ("auto", "cpu"):
            raise ValueError(f"on CPU the only torch attention op is the CPU flash kernel; got op={op!r}")
        if device_type == "cuda" and op not in ("auto", *CUDA_OPS):
            raise ValueError(f"CUDA op must be one of {('auto',) + CUDA_OPS}, got {op!r}")
        self.device_type = device_type
        self.auto = device_type == "cuda" and op == "auto"
        self.op = "cpu" if device_type == "cpu" else ("flash" if op == "auto" else op)
        self.name = f"torch-{self.op}"

    def _op(self, q: Tensor) -> str:
        """The op for these inputs: "auto" takes flash for 16-bit inputs and the efficient kernel
        otherwise (flash has no fp32/fp64 kernel). ``name`` says which one ran last."""
        op = "efficient" if self.auto and q.dtype not in (torch.float16, torch.bfloat16) else self.op
        self.name = f"torch-{op}"
        return op

    # -- forward -------------------------------------------------------------------------------
    def forward(self, q, k, v, *, causal, scale):
        if self.op == "cpu":
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        op = self._op(q)
        k, v = self._expand_kv(q, k, v)
        sq = q.shape[2]
        if op == "flash":
            res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
            return res[0], res[1].float()
        if op == "efficient":
            res = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
            return res[0], res[1][..., :sq].float()  # lse is padded along the rows
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        return res[0], res[1].reshape(q.shape[0], q.shape[1], sq).float()

    # -- backward ------------------------------------------------------------------------------
    def backward(self, dout, q, k, v, lse, delta, *, causal, scale):
        out = stand_in_output(dout, delta)
        if self.op == "cpu":
            # the CPU op wants lse in fp32 (fp64 for fp64 inputs)
            lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse, 0.0, causal, scale=scale)
        op = self._op(q)
        lse, delta = lse.contiguous(), delta.contiguous()  # the executor passes row slices
        groups = q.shape[1] // k.shape[1]
        ke, ve = self._expand_kv(q, k, v)
        sq, sk = q.shape[2], ke.shape[2]
        if op == "flash":
            empty = torch.empty(0, dtype=torch.int64, device=q.device)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout, q, ke, ve, out, lse, empty, empty, sq, sk, 0.0, causal, empty, empty, scale=scale)
        elif op == "efficient":
            lse_p = lse
            pad = (-sq) % 32
            if pad:
                lse_p = torch.nn.functional.pad(lse, (0, pad))
            seed = torch.zeros((), dtype=torch.int64, device=q.device)
            dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                dout, q, ke, ve, torch.empty(0, device=q.device, dtype=q.dtype), out, lse_p, seed, seed, 0.0,
                [True, True, True, False], causal, scale=scale)
        else:
            empty = torch.empty(0, dtype=torch.int64, device=q.device)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                dout, q, ke, ve, out, lse.unsqueeze(-1), empty, empty, torch.empty(0, device=q.device, dtype=q.dtype),
                empty, empty, sq, sk, 0.0, causal, scale=scale)
        if groups > 1:  # fold the gradients of the repeated KV heads back onto the shared heads
            b, h, _, d = dk.shape
            dk = dk.view(b, h // groups, groups, sk, d).sum(2, dtype=torch.float32)
            dv = dv.view(b, h // groups, groups, sk, d).sum(2, dtype=torch.float32)
        return dq, dk, dv

    @staticmethod
    def _expand_kv(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        # torch's CUDA ops want as many KV heads as query heads
        groups = q.shape[1] // k.shape[1]
        if groups == 1:
            return k, v
        return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)

"""Block attention kernels: each returns (out, lse) and has a backward taking global lse/delta."""

from __future__ import annotations

import torch

from .base import CAUSAL, FULL, BlockKernel, BlockMask, check_head_dims
from .reference import MathKernel, dense_mask, reference_attention
from .torch_sdpa import CUDA_OPS, TorchAttentionKernel

__all__ = ["BlockKernel", "BlockMask", "FULL", "CAUSAL", "check_head_dims", "MathKernel", "TorchAttentionKernel",
           "reference_attention", "dense_mask", "get_kernel", "KERNEL_BACKENDS"]

KERNEL_BACKENDS = ("auto", "torch", "math") + tuple(f"torch-{op}" for op in CUDA_OPS)


def get_kernel(backend: "str | BlockKernel", device: torch.device) -> BlockKernel:
    """The block kernel for ``backend`` on ``device``.

    "auto"/"torch": torch's fused op for the device (CPU flash kernel, or CUDA flash);
    "torch-flash" / "torch-efficient" / "torch-cudnn": a specific CUDA op; "math": plain matmuls
    (any dtype, slow). A :class:`BlockKernel` instance is returned as is.

    A value head dim other than the query/key head dim (MLA) runs on "math", on the CPU op (it
    pads the smaller dim with zeros: exact), on "torch-efficient" and on "auto" on CUDA (which
    then takes the efficient kernel); "torch-flash" and "torch-cudnn" raise ValueError naming
    themselves (:func:`check_head_dims`).
    """
    if not isinstance(backend, str):
        if not isinstance(backend, BlockKernel):
            raise ValueError(f"kernel must be a backend name {KERNEL_BACKENDS} or a BlockKernel, got {backend!r}")
        return backend
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; allowed: {', '.join(KERNEL_BACKENDS)}")
    if backend == "math":
        return MathKernel()
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"torch attention kernels run on cpu or cuda devices, got {device}")
    if backend in ("auto", "torch"):
        return TorchAttentionKernel(device.type)
    if device.type != "cuda":
        raise ValueError(f"kernel backend {backend!r} needs a CUDA device; tensors are on {device}")
    return TorchAttentionKernel("cuda", backend.split("-", 1)[1])

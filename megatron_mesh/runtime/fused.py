"""The merge of a partial result into an accumulator as one op: ``torch.ops.megatron_mesh.merge_``.

:func:`~.merge.merge_partial_` is five elementwise torch ops (six with a 16-bit block), each a
launch on a GPU, and the executor merges once per kernel call: at a few thousand tokens per rank
the host's launches set the pace (docs/performance.md, one rank alone). Here the same update is
one op in torch's dispatcher, so the executor issues one op per merge on every device:

* on CUDA with Triton (shipped with torch's CUDA wheels): one Triton kernel, each program one
  row -- w = sigmoid(blk_lse - lse), out += w (blk_out - out) in torch's ``lerp`` form, lse =
  logaddexp(lse, blk_lse) -- reading any strides (head_dim of stride 1), in fp32;
* elsewhere (CPU, fp64 accumulators, CUDA without Triton): :func:`~.merge.merge_partial_`'s torch
  ops, inside the op (``scripts/count_host_ops.py`` counts the op once, as the executor issues it;
  its host cost there is the five ops').

Both keep the merge's exact cases: a row no key has reached (lse = -inf, out = 0) stays so, and a
row a block reaches first becomes the block's (w = 1). The Triton kernel's rounding may differ
from the torch ops' in the last bit (another order of the same fp32 operations); each is
deterministic (no atomics): results never depend on timing. The CUDA tier compares the two
(``tests/runtime/test_graphs.py``), and so does every CPU run, the kernel executed by Triton's
interpreter (``tests/runtime/test_fused_interpreted.py``).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .merge import merge_partial_

__all__ = ["merge_", "triton_merge_available"]

_FLOOR = -1e30

try:  # one registration per process (a reloaded module finds the op defined)
    _LIB = torch.library.Library("megatron_mesh", "DEF")
    _LIB.define("merge_(Tensor(a!) out, Tensor(b!) lse, Tensor blk_out, Tensor blk_lse) -> ()")
except RuntimeError:  # pragma: no cover -- already defined in this process
    _LIB = None

@functools.lru_cache(maxsize=None)
def _kernel():
    """(triton, the merge kernel), made on the first CUDA merge; None without Triton."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # no Triton: the torch ops
        return None

    @triton.jit
    def merge_rows(out, lse, bo, bl, H, T, D, so_b, so_h, so_t, sl_b, sl_h, sl_t, sb_b, sb_h, sb_t,
                   sc_b, sc_h, sc_t, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        t = row % T
        h = (row // T) % H
        b = row // (T * H)
        l_ptr = lse + b * sl_b + h * sl_h + t * sl_t
        old = tl.load(l_ptr)
        new = tl.load(bl + b * sc_b + h * sc_h + t * sc_t).to(tl.float32)
        w = tl.sigmoid(new - tl.maximum(old, -1e30))
        cols = tl.arange(0, BLOCK)
        keep = cols < D
        o_ptr = out + b * so_b + h * so_h + t * so_t + cols
        o = tl.load(o_ptr, mask=keep, other=0.0)
        x = tl.load(bo + b * sb_b + h * sb_h + t * sb_t + cols, mask=keep, other=0.0).to(tl.float32)
        diff = x - o
        o = tl.where(w < 0.5, o + w * diff, x - diff * (1.0 - w))  # torch's lerp
        tl.store(o_ptr, o, mask=keep)
        m = tl.maximum(old, new)
        both = tl.where(m < -3.0e38, m, m + tl.log(tl.exp(old - m) + tl.exp(new - m)))  # -inf with -inf: -inf
        tl.store(l_ptr, both)

    return triton, merge_rows


def triton_merge_available() -> bool:
    """Whether CUDA merges run as the Triton kernel (Triton importable)."""
    return _kernel() is not None


def _triton_merge(out: Tensor, lse: Tensor, blk_out: Tensor, blk_lse: Tensor) -> bool:
    """The merge as one Triton kernel; False where it does not apply (not fp32 accumulators on
    CUDA, a head dim of stride other than 1, or no Triton)."""
    if not (out.is_cuda and out.dtype == torch.float32 and lse.dtype == torch.float32 and out.dim() == 4
            and out.stride(-1) == 1 and blk_out.stride(-1) == 1 and out.numel() > 0):
        return False
    got = _kernel()
    if got is None:
        return False
    _launch(got, out, lse, blk_out, blk_lse)
    return True


def _launch(got, out: Tensor, lse: Tensor, blk_out: Tensor, blk_lse: Tensor) -> None:
    """Run the merge kernel of ``got`` (:func:`_kernel`'s) over every row of ``out`` [B, H, T, D]
    (a program per row). Also what the CPU tests launch through Triton's interpreter
    (``TRITON_INTERPRET=1``: ``tests/runtime/test_fused_interpreted.py``)."""
    triton, kernel = got
    b, h, t, d = out.shape
    kernel[(b * h * t,)](out, lse, blk_out, blk_lse, h, t, d, *out.stride()[:3], *lse.stride(),
                         *blk_out.stride()[:3], *blk_lse.stride(), BLOCK=triton.next_power_of_2(d))


def _merge_impl(out: Tensor, lse: Tensor, blk_out: Tensor, blk_lse: Tensor) -> None:
    if not _triton_merge(out, lse, blk_out, blk_lse):
        merge_partial_(out, lse, blk_out, blk_lse)


if _LIB is not None:
    _LIB.impl("merge_", _merge_impl, "CompositeExplicitAutograd")


def merge_(out: Tensor, lse: Tensor, blk_out: Tensor, blk_lse: Tensor) -> None:
    """In place: (out, lse) <- their merge with the partial (blk_out, blk_lse), as
    :func:`~.merge.merge_partial_` does, in one dispatched op (see the module docstring)."""
    torch.ops.megatron_mesh.merge_(out, lse, blk_out, blk_lse)

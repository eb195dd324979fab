"""Attention masks for :func:`megatron_mesh.attention` (``mask=``) and the per-mode wrappers.

    from megatron_mesh import masks
    mm.attention(q, k, v, mode="tasp", mask=masks.documents(cu) & masks.chunked(8192))

* :func:`causal`, :func:`full` -- causal or full attention over the global sequence;
* :func:`window` ``(left, right=0)`` -- a sliding window: query i attends key j iff
  i - left <= j <= i + right (right 0: causal);
* :func:`documents` ``(cu_seqlens)`` -- packed documents: a query attends keys of its own
  document only (alone: full attention inside each; ``& causal()`` for causal);
* :func:`chunked` ``(size)`` -- Llama 4's chunked local attention: causal inside chunks of
  ``size`` tokens counted from each document's start;
* :func:`prefix` ``(length)`` -- prefix-LM: each document's first ``length`` tokens attend each
  other both ways, the rest causally (a document shorter than ``length`` is bidirectional as a
  whole).

``a & b`` allows the pairs both allow; the supported compositions and the refused ones are those
of :meth:`megatron_mesh.plan.maskkinds.MaskKind.__and__` (documents & any kind, causal / full /
window with each other, full or causal & chunked, full & prefix). A mask kind of one's own
subclasses :class:`~megatron_mesh.plan.maskkinds.MaskKind` (docs/algorithms/masks.md).
"""

from __future__ import annotations

import numbers

from .plan.maskkinds import Chunked, Mask, MaskKind, Prefix

__all__ = ["causal", "full", "window", "documents", "chunked", "prefix", "MaskKind"]


def causal() -> MaskKind:
    return Mask(True)


def full() -> MaskKind:
    return Mask(False)


def window(left: int | None, right: int | None = 0) -> MaskKind:
    """Query i attends key j iff i - left <= j <= i + right (None: unlimited on that side)."""
    left, right = (_int(v, f"window {side}") for v, side in ((left, "left"), (right, "right")))
    return Mask(right == 0, (left, right))


def documents(cu_seqlens) -> MaskKind:
    """Documents with boundaries ``cu_seqlens`` (0 = c0 < c1 < ... < cn = S, a list or a 1-D
    integer tensor): full attention inside each (combine with ``&``)."""
    cu = cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else list(cu_seqlens)
    if len(cu) < 2 or any(not isinstance(c, numbers.Integral) or isinstance(c, bool) for c in cu) or cu[0] != 0 or \
            any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must be integers strictly increasing from 0, got {cu_seqlens!r}")
    return Mask(False, None, tuple(zip(cu, cu[1:])))


def chunked(size: int) -> MaskKind:
    """Causal attention inside chunks of ``size`` > 0 tokens, counted from each document's start."""
    return Chunked(_int(size, "chunk size"))


def prefix(length: int) -> MaskKind:
    """Each document's first ``length`` >= 0 tokens attend each other both ways, the rest causally."""
    return Prefix(_int(length, "prefix length"))


def _int(v, what: str):
    """Integer scalars of numpy / torch as ints (None stays); the kinds check the range."""
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, numbers.Integral) or (hasattr(v, "item") and getattr(v, "ndim", 1) == 0):
        try:
            return int(v)
        except (TypeError, ValueError):
            pass
    raise ValueError(f"{what} must be an integer, got {v!r}")

"""Layouts on tensors: a rank's tokens of a full-sequence tensor under any layout (zigzag, THD,
balanced) and back -- what a data loader or a test does before and after attention.

Worked example: zigzag over 2 ranks of an 8-token sequence [0..7]: rank 0 holds [0, 1, 6, 7],
rank 1 [2, 3, 4, 5]; ``zigzag_unshard`` of the two puts [0..7] back together.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor

from ..plan.layout import Layout, ThdLayout, ZigzagLayout

__all__ = ["layout_shard", "layout_unshard", "zigzag_shard", "zigzag_unshard", "thd_shard", "thd_unshard"]


def layout_shard(x: Tensor, rank: int, layout: Layout, dim: int = 0) -> Tensor:
    """Rank ``rank``'s tokens of a full-sequence tensor under ``layout`` (any layout: Megatron's
    zigzag, Transformer Engine's THD, :func:`megatron_mesh.balanced_layout`), in the rank's local
    order -- what that rank passes to attention."""
    _check_layout(layout)
    _check_dim(x, dim, "x")
    if x.shape[dim] != layout.seq_len:
        raise ValueError(f"tensor has {x.shape[dim]} tokens along dim {dim}, the {type(layout).__name__} "
                         f"{layout.seq_len}")
    try:
        r = None if isinstance(rank, bool) else operator.index(rank)  # numpy / 0-d tensor integers too
    except TypeError:
        r = None
    if r is None or not 0 <= r < layout.world_size:
        raise ValueError(f"rank must be an integer in 0..{layout.world_size - 1} (the CP size {layout.world_size}), "
                         f"got {rank!r}")
    rank = r
    return torch.cat([x.narrow(dim, start, n) for _, start, n in layout.runs(rank)], dim=dim)


def layout_unshard(chunks: list[Tensor], layout: Layout, dim: int = 0) -> Tensor:
    """The full-sequence tensor from every rank's tokens under ``layout`` (inverse of
    :func:`layout_shard`)."""
    _check_layout(layout)
    chunks = list(chunks)
    if len(chunks) != layout.world_size:
        raise ValueError(f"{len(chunks)} chunks for a {type(layout).__name__} over {layout.world_size} ranks")
    for r, c in enumerate(chunks):
        _check_dim(c, dim, f"rank {r}'s chunk")
    sizes = [c.shape[dim] for c in chunks]
    if any(n != layout.seq_local for n in sizes):
        raise ValueError(f"every rank's chunk must have the layout's {layout.seq_local} tokens along dim {dim}, got "
                         f"{sizes}")
    others = {c.shape[:dim % c.dim()] + c.shape[dim % c.dim() + 1:] for c in chunks}
    if len(others) > 1:
        raise ValueError(f"the ranks' chunks must agree on every dim but {dim}, got shapes "
                         f"{[tuple(c.shape) for c in chunks]}")
    if len({c.dtype for c in chunks}) > 1:  # torch.cat would promote them silently
        raise ValueError(f"the ranks' chunks must have one dtype, got {[str(c.dtype) for c in chunks]}")
    if len({c.device for c in chunks}) > 1:  # gathered from ranks: move them to one device first
        raise ValueError(f"the ranks' chunks must be on one device, got {[str(c.device) for c in chunks]}")
    parts = []
    for r, c in enumerate(chunks):
        for local, start, n in layout.runs(r):
            parts.append((start, c.narrow(dim, local, n)))
    return torch.cat([p for _, p in sorted(parts, key=lambda t: t[0])], dim=dim)


def _check_dim(x, dim: int, name: str) -> None:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ValueError(f"dim must be an int (the sequence dim to split), got {dim!r}")
    if not -x.dim() <= dim < x.dim() or x.dim() == 0:
        raise ValueError(f"dim {dim} is not a dim of {name} of shape {tuple(x.shape)} (the sequence dim to split)")


def _check_layout(layout) -> None:
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a megatron_mesh layout (ZigzagLayout, ThdLayout, BalancedLayout), got "
                         f"{type(layout).__name__}")


def zigzag_shard(x: Tensor, rank: int, world_size: int, dim: int = 0) -> Tensor:
    """Rank ``rank``'s zigzag chunk of a full-sequence tensor (Megatron's CP batch split)."""
    _check_dim(x, dim, "x")
    return layout_shard(x, rank, ZigzagLayout(world_size, x.shape[dim]), dim)


def zigzag_unshard(chunks: list[Tensor], dim: int = 0) -> Tensor:
    """The full-sequence tensor from every rank's zigzag chunk (inverse of :func:`zigzag_shard`)."""
    chunks = list(chunks)
    if not chunks:
        raise ValueError("zigzag_unshard needs every rank's chunk, got none")
    _check_dim(chunks[0], dim, "rank 0's chunk")
    return layout_unshard(chunks, ZigzagLayout(len(chunks), chunks[0].shape[dim] * len(chunks)), dim)


def thd_shard(x: Tensor, rank: int, layout: ThdLayout, dim: int = 0) -> Tensor:
    """Rank ``rank``'s tokens of a packed THD tensor in Transformer Engine's CP layout (each
    sequence, padded to a multiple of 2 * CP, zigzag-split on its own): what TE's
    ``thd_get_partitioned_indices`` selects."""
    return layout_shard(x, rank, layout, dim)


def thd_unshard(chunks: list[Tensor], layout: ThdLayout, dim: int = 0) -> Tensor:
    """The packed THD tensor from every rank's tokens (inverse of :func:`thd_shard`)."""
    return layout_unshard(chunks, layout, dim)

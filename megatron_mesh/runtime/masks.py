"""Block masks for the kernels: the plan says a block is "masked"; this builds its [Sq, Sk]
allowed matrix from the tokens' global positions and the plan's :class:`~megatron_mesh.plan.Mask`
(block-local: never an [S, S] matrix), once per plan, block and device."""

from __future__ import annotations

import weakref

import torch

from ..kernels.base import CAUSAL, FULL, BlockMask
from ..plan.ir import Plan

__all__ = ["block_mask", "allowed_matrix"]

_CACHE: "weakref.WeakKeyDictionary[Plan, dict]" = weakref.WeakKeyDictionary()


def _positions(runs, device) -> torch.Tensor:
    return torch.cat([torch.arange(a, a + n, device=device) for a, n in runs]) if runs else \
        torch.empty(0, dtype=torch.long, device=device)


def allowed_matrix(mask, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """[len(q_pos), len(k_pos)] bool: ``mask`` applied to these global positions."""
    d = q_pos.unsqueeze(1) - k_pos.unsqueeze(0)
    lo, hi = mask.band()
    allowed = d >= lo if lo != float("-inf") else torch.ones_like(d, dtype=torch.bool)
    if hi != float("inf"):
        allowed &= d <= hi
    if mask.documents is not None:
        starts = torch.tensor([a for a, _ in mask.documents], device=q_pos.device)
        stops = torch.tensor([b for _, b in mask.documents], device=q_pos.device)

        def doc(pos):
            i = torch.searchsorted(starts, pos, right=True) - 1
            inside = (i >= 0) & (pos < stops[i.clamp_min(0)])
            return torch.where(inside, i, torch.full_like(i, -1))
        dq, dk = doc(q_pos), doc(k_pos)
        allowed &= (dq.unsqueeze(1) == dk.unsqueeze(0)) & (dq.unsqueeze(1) >= 0)
    return allowed


def block_mask(plan: Plan, op, device: torch.device) -> BlockMask:
    """The kernel mask of block ``op`` (an Attend / AttendBackward) of ``plan``."""
    if op.mask == "full":
        return FULL
    if op.mask == "causal":
        return CAUSAL
    per_plan = _CACHE.get(plan)
    if per_plan is None:
        per_plan = _CACHE[plan] = {}
    ck = (op.q, op.rows, op.kv, op.cols, device)
    m = per_plan.get(ck)
    if m is None:
        q_pos = _positions(plan.positions(op.q, op.rows), device)
        k_pos = torch.cat([_positions(plan.positions(k, op.col(i)), device) for i, k in enumerate(op.kv)])
        m = per_plan[ck] = BlockMask("masked", allowed_matrix(plan.mask, q_pos, k_pos))
    return m

"""Block masks for the kernels: the plan says a block is "masked"; this builds what the kernel
needs from the tokens' global positions and the plan's :class:`~megatron_mesh.plan.Mask`, once
per plan, block and device -- never an [S, S] matrix.

A small masked block gets its [Sq, Sk] allowed matrix. A large one (more than TILE x TILE pairs,
TILE = ``MEGATRON_MESH_MASK_TILE`` or 512 tokens on CPU, 2048 on CUDA) is cut into tiles of at
most TILE x TILE along its token runs, and each tile is classified from its position ranges like
a plan block: empty tiles are skipped, tiles inside one document and band are "full" or
"causal" (the kernels' fast paths), only the tiles a document edge or a window edge crosses get
a (small) allowed matrix. :func:`block_forward` / :func:`block_backward` run either kind through
the kernel; the tiles' partial results merge with the online-softmax identity, and their
backward uses the rows' global statistics, so the result is the block's.

Worked example: a 4096 x 4096 block of one rank's own tokens (positions 0..4095, causal) with a
window of 512 and documents [0, 1000), [1000, 4096), TILE 512: of the 8 x 8 tiles, the 28 above
the diagonal and those more than one tile below it are empty; the diagonal tiles are causal
except the one holding position 1000 (masked), the tiles just below the diagonal are masked by
the window's edge -- 15 kernel calls with masks of at most 512 x 512 instead of one 4096 x 4096
mask.
"""

from __future__ import annotations

import os
import weakref
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from ..kernels.base import CAUSAL, FULL, BlockKernel, BlockMask
from ..plan.ir import Plan
from ..plan.mask import Mask, pair_kind
from .merge import merge_partial_

__all__ = ["block_mask", "allowed_matrix", "TiledMask", "Tile", "tile_kind", "block_forward", "block_backward",
           "mask_tile"]

DEFAULT_TILE = {"cpu": 512, "cuda": 2048}


def mask_tile(device: torch.device) -> int:
    """Tokens per tile side for masked blocks on ``device`` (``MEGATRON_MESH_MASK_TILE`` overrides)."""
    env = os.environ.get("MEGATRON_MESH_MASK_TILE")
    if env:
        try:
            tile = int(env)
        except ValueError:
            tile = 0
        if tile < 1:
            raise ValueError(f"MEGATRON_MESH_MASK_TILE must be a positive integer, got {env!r}")
        return tile
    return DEFAULT_TILE.get(device.type, DEFAULT_TILE["cuda"])


@dataclass(frozen=True)
class Tile:
    """Block rows [rows[0], rows[1]) x columns [cols[0], cols[1]) (block-local) with their mask."""

    rows: tuple[int, int]
    cols: tuple[int, int]
    mask: BlockMask


@dataclass(frozen=True, eq=False)
class TiledMask:
    """A masked block as its non-empty tiles (see the module docstring)."""

    tiles: tuple[Tile, ...]
    kind: str = "tiled"


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


def block_mask(plan: Plan, op, device: torch.device) -> "BlockMask | TiledMask":
    """The kernel mask of block ``op`` (an Attend / AttendBackward) of ``plan``."""
    if op.mask == "full":
        return FULL
    if op.mask == "causal":
        return CAUSAL
    per_plan = _CACHE.get(plan)
    if per_plan is None:
        per_plan = _CACHE[plan] = {}
    tile = mask_tile(device)
    ck = (op.q, op.rows, op.kv, op.cols, device, tile)
    m = per_plan.get(ck)
    if m is None:
        q_runs = tuple(plan.positions(op.q, op.rows))
        k_runs = tuple(run for i, k in enumerate(op.kv) for run in plan.positions(k, op.col(i)))
        sq, sk = sum(n for _, n in q_runs), sum(n for _, n in k_runs)
        if sq * sk <= tile * tile:
            q_pos = _positions(q_runs, device)
            k_pos = _positions(k_runs, device)
            m = BlockMask("masked", allowed_matrix(plan.mask, q_pos, k_pos))
        else:
            m = _tiled(plan.mask, q_runs, k_runs, tile, device)
        per_plan[ck] = m
    return m


def _pieces(runs, tile: int) -> list[tuple[int, int, int]]:
    """(block-local offset, global start, length) of the runs cut into pieces of <= ``tile``."""
    out, local = [], 0
    for start, n in runs:
        for a in range(0, n, tile):
            m = min(tile, n - a)
            out.append((local + a, start + a, m))
        local += n
    return out


@lru_cache(maxsize=64)
def _bounds(mask: Mask) -> tuple[list[int], list[int]]:
    """The documents' starts and stops as plain lists (bisect over them per tile)."""
    return [a for a, _ in mask.documents], [b for _, b in mask.documents]


def _documents(mask: Mask, a: int, n: int) -> tuple[int, int, bool] | None:
    """(first, last) indices of the documents positions [a, a+n) touch, and whether the range
    lies inside one document; None when it holds padding only."""
    if mask.documents is None:
        return 0, 0, True
    starts, stops = _bounds(mask)
    first = bisect_right(stops, a)
    last = bisect_left(starts, a + n) - 1
    if first > last:
        return None
    return first, last, first == last and starts[first] <= a and a + n <= stops[first]


def tile_kind(mask: Mask, qa: int, n: int, ka: int, m: int) -> str:
    """"empty", "full", "causal" or "masked": queries [qa, qa+n) x keys [ka, ka+m) (global
    positions) under ``mask``; "causal" only for identical ranges (the kernels' top-left causal)."""
    lo, hi = mask.band()
    band = pair_kind(qa, n, ka, m, lo, hi)
    if band == "empty":
        return "empty"
    dq, dk = _documents(mask, qa, n), _documents(mask, ka, m)
    if dq is None or dk is None or dq[1] < dk[0] or dk[1] < dq[0]:
        return "empty"
    if not (dq[2] and dk[2] and dq[0] == dk[0]):
        return "masked"  # a document edge (or padding) inside the tile
    if band == "full":
        return "full"
    if qa == ka and n == m and lo == 0 and hi >= n - 1:
        return "causal"
    return "masked"


def _tiled(mask: Mask, q_runs, k_runs, tile: int, device) -> TiledMask:
    tiles = []
    for r0, qa, n in _pieces(q_runs, tile):
        for c0, ka, m in _pieces(k_runs, tile):
            kind = tile_kind(mask, qa, n, ka, m)
            if kind == "empty":
                continue
            if kind == "masked":
                allowed = allowed_matrix(mask, torch.arange(qa, qa + n, device=device),
                                         torch.arange(ka, ka + m, device=device))
                if not bool(allowed.any()):
                    continue
                bm = BlockMask("masked", allowed)
            else:
                bm = FULL if kind == "full" else CAUSAL
            tiles.append(Tile((r0, r0 + n), (c0, c0 + m), bm))
    return TiledMask(tuple(tiles))


# -- running a block through the kernel ------------------------------------------------------------------
def block_forward(kernel: BlockKernel, q: Tensor, k: Tensor, v: Tensor, mask, scale: float,
                  acc_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(out, lse) of one block: one kernel call, or its tiles merged in ``acc_dtype``."""
    if not isinstance(mask, TiledMask):
        return kernel.forward(q, k, v, mask=mask, scale=scale)
    b, h, sq, d = q.shape
    out = torch.zeros(b, h, sq, d, dtype=acc_dtype, device=q.device)
    lse = torch.full((b, h, sq), float("-inf"), dtype=acc_dtype, device=q.device)
    for t in mask.tiles:
        (r0, r1), (c0, c1) = t.rows, t.cols
        o, l = kernel.forward(q[:, :, r0:r1], k[:, :, c0:c1], v[:, :, c0:c1], mask=t.mask, scale=scale)
        merge_partial_(out[:, :, r0:r1], lse[:, :, r0:r1], o, l)
    return out, lse


def block_backward(kernel: BlockKernel, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor,
                   mask, scale: float, acc_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one block given the rows' global statistics: one kernel call, or its tiles'
    gradients summed in ``acc_dtype``."""
    if not isinstance(mask, TiledMask):
        return kernel.backward(dout, q, k, v, lse, delta, mask=mask, scale=scale)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc_dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc_dtype, device=q.device)
    for t in mask.tiles:
        (r0, r1), (c0, c1) = t.rows, t.cols
        gq, gk, gv = kernel.backward(dout[:, :, r0:r1], q[:, :, r0:r1], k[:, :, c0:c1], v[:, :, c0:c1],
                                     lse[..., r0:r1], delta[..., r0:r1], mask=t.mask, scale=scale)
        dq[:, :, r0:r1] += gq
        dk[:, :, c0:c1] += gk
        dv[:, :, c0:c1] += gv
    return dq, dk, dv

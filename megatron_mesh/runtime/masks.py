"""Block masks for the kernels: the plan says a block is "masked"; this builds what the kernel
needs from the tokens' global positions and the plan's :class:`~megatron_mesh.plan.Mask`, once
per plan, block and device -- never an [S, S] matrix. Nothing here re-derives the mask: the
allowed matrix is :meth:`Mask.allowed`, the kind of a piece is :func:`~megatron_mesh.plan.classify_block`.

A masked block runs as the kernel calls :func:`~megatron_mesh.plan.mask_pieces` cuts it into
(PIECE = ``MEGATRON_MESH_MASK_PIECE`` or 512 tokens on CPU, 2048 on CUDA): its long token runs
apart, its short ones together, each pair of them one call when it is full or causal, else cut
into *mask pieces* of at most PIECE x PIECE; a block that is one masked piece gets its [Sq, Sk]
allowed matrix. Each piece is classified like a plan block: empty pieces are skipped, pieces
inside one document and band are "full" or "causal" (the kernels' fast paths), only the pieces a
document edge or a window edge crosses get a (small) allowed matrix. :func:`block_forward` / :func:`block_backward` run either kind through the
kernel; the pieces' partial results merge with the online-softmax identity, and their backward
uses the rows' global statistics, so the result is the block's.

Worked example: a 4096 x 4096 block of one rank's own tokens (positions 0..4095, causal) with a
window of 512 and documents [0, 1000), [1000, 4096), PIECE 512: each document is cut apart (its
own runs: no piece crosses position 1000) into pieces of 512 from its start; the diagonal pieces
are causal (2 + 7), the pieces just below them are masked by the window's edge (1 + 6), the rest
empty -- 16 pieces with masks of at most 512 x 512 instead of one 4096 x 4096 mask. With a
variable-length kernel (CUDA flash) the first document's last diagonal piece and the second's
first, which follow each other, are one call: 15 kernel calls.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from ..kernels.base import CAUSAL, FULL, BlockKernel, BlockMask, rows_of, varlen_backward, varlen_forward
from ..plan.ir import Plan
from ..plan.mask import MASK_PIECE, BlockKind, KernelCalls, Mask, call_groups, mask_pieces
from .merge import merge_partial_, part_of

__all__ = ["block_mask", "PiecedMask", "Piece", "block_forward", "block_backward", "forward_partials", "backward_partials",
           "mask_piece", "PIECE_ENV"]

PIECE_ENV = "MEGATRON_MESH_MASK_PIECE"


def mask_piece(device: torch.device) -> int:
    """Tokens per side of a mask piece on ``device`` (``MEGATRON_MESH_MASK_PIECE`` overrides)."""
    env = os.environ.get(PIECE_ENV)
    if env:
        try:
            piece = int(env)
        except ValueError:
            piece = 0
        if piece < 1:
            raise ValueError(f"{PIECE_ENV} must be a positive integer, got {env!r}")
        return piece
    return MASK_PIECE.get(device.type, MASK_PIECE["cuda"])


@dataclass(frozen=True)
class Piece:
    """Block rows [rows[0], rows[1]) x columns [cols[0], cols[1]) (block-local) with their mask."""

    rows: tuple[int, int]
    cols: tuple[int, int]
    mask: BlockMask


@dataclass(frozen=True, eq=False)
class PiecedMask:
    """A masked block as its non-empty pieces (see the module docstring)."""

    pieces: tuple[Piece, ...]

    def groups(self, kernel_calls: KernelCalls) -> list[tuple[Piece, ...]]:
        """The pieces each kernel call runs (:func:`~megatron_mesh.plan.call_groups`, the
        simulator's count of calls)."""
        cut = [(t.mask.kind, t.rows, t.cols) for t in self.pieces]
        return [tuple(self.pieces[i] for i in g) for g in call_groups(cut, kernel_calls)]


def _positions(runs, device) -> torch.Tensor:
    return torch.cat([torch.arange(a, a + n, device=device) for a, n in runs]) if runs else \
        torch.empty(0, dtype=torch.long, device=device)


def block_mask(plan: Plan, op, device: torch.device, piece: int | None = None) -> "BlockMask | PiecedMask":
    """The kernel mask of block ``op`` (an Attend / AttendBackward) of ``plan``, in mask pieces of
    ``piece`` tokens (default: the device's, :func:`mask_piece`)."""
    if op.mask == BlockKind.FULL:
        return FULL
    if op.mask == BlockKind.CAUSAL:
        return CAUSAL
    piece = mask_piece(device) if piece is None else piece
    return plan.memo(("block mask", op.q, op.rows, op.kv, op.cols, device, piece),
                     lambda: _block_mask(plan, op, device, piece))  # once per plan, block and device


def _block_mask(plan: Plan, op, device: torch.device, piece: int) -> "BlockMask | PiecedMask":
    if device.type == "meta":  # shapes only: made on the CPU, where its values exist
        return _on(block_mask(plan, op, torch.device("cpu"), piece), device)
    q_runs = tuple(plan.positions(op.q, op.rows))
    k_runs = tuple(run for i, k in enumerate(op.kv) for run in plan.positions(k, op.col(i)))
    sq, sk = sum(n for _, n in q_runs), sum(n for _, n in k_runs)
    cut = mask_pieces(plan.mask, q_runs, k_runs, piece)  # the calls the simulator prices
    if cut == [(BlockKind.MASKED, (0, sq), (0, sk))]:
        return BlockMask(BlockKind.MASKED, plan.mask.allowed(_positions(q_runs, device), _positions(k_runs, device)))
    return _pieced(plan.mask, q_runs, k_runs, piece, device, cut)


def _on(m: "BlockMask | PiecedMask", device: torch.device) -> "BlockMask | PiecedMask":
    if isinstance(m, PiecedMask):
        return PiecedMask(tuple(Piece(t.rows, t.cols, t.mask.to(device)) for t in m.pieces))
    return m.to(device)


def _pieced(mask: Mask, q_runs, k_runs, piece: int, device, cut=None) -> PiecedMask:
    """The pieces :func:`~megatron_mesh.plan.mask_pieces` cuts the block into (``cut``, when
    already made), with their kernel masks."""
    pieces = []
    q_pos = k_pos = None  # the block's positions, made once and sliced per masked piece
    for kind, (r0, r1), (c0, c1) in (mask_pieces(mask, q_runs, k_runs, piece) if cut is None else cut):
        if kind == BlockKind.FULL:
            bm = FULL
        elif kind == BlockKind.CAUSAL:
            bm = CAUSAL
        else:
            if q_pos is None:
                q_pos, k_pos = _positions(q_runs, device), _positions(k_runs, device)
            bm = BlockMask(BlockKind.MASKED, mask.allowed(q_pos[r0:r1], k_pos[c0:c1]))
        pieces.append(Piece((r0, r1), (c0, c1), bm))
    return PiecedMask(tuple(pieces))


# -- running a block through the kernel ------------------------------------------------------------------
def _span(t: Tensor, group, side: int, dim: int = 2) -> Tensor:
    """The rows (``side`` 0) or columns (1) of a group's pieces, one after another: a view, as the
    pieces of a variable-length call follow each other (:func:`_varlen`)."""
    a, b = (group[0].rows, group[-1].rows) if side == 0 else (group[0].cols, group[-1].cols)
    return part_of(t, dim, a[0], b[1] - a[0])


def _varlen(kernel: BlockKernel, group) -> bool:
    """Whether ``group`` of pieces runs as one variable-length call of ``kernel``: several pieces
    of one kind, full or causal (a masked piece needs its allowed matrix), each starting where
    the last one ends (packed without a copy). A plan priced as one call per block, Transformer
    Engine's, may group others: they run piece by piece here."""
    kind = group[0].mask.kind
    return (len(group) > 1 and getattr(kernel, "varlen", False) and kind != BlockKind.MASKED
            and all(t.mask.kind == kind for t in group)
            and all(p.rows[1] == t.rows[0] and p.cols[1] == t.cols[0] for p, t in zip(group, group[1:])))


def _rows(t: Tensor | None, r0: int, r1: int) -> Tensor | None:
    """Rows [r0, r1) of a row statistic; None stays None (a delta nothing reads: the kernel
    takes the rows' output instead)."""
    return None if t is None else t[..., r0:r1]


def forward_partials(kernel: BlockKernel, q: Tensor, k: Tensor, v: Tensor, mask, scale: float,
                     kernel_calls: KernelCalls = "varlen"):
    """The kernel calls of one block, as partial results: yields (r0, r1, out, lse) -- block rows
    [r0, r1) and their (out, lse) over the keys of one call -- for the caller to merge where
    those rows' accumulator is. A pieced block runs as :meth:`PiecedMask.groups`: several full
    (or causal) pieces in one variable-length call where the kernel has one
    (:func:`~megatron_mesh.kernels.base.varlen_forward`), each piece a sequence of its own."""
    if not isinstance(mask, PiecedMask):
        out, lse = kernel.forward(q, k, v, mask=mask, scale=scale)
        yield 0, q.shape[2], out, lse
        return
    for group in mask.groups(kernel_calls):
        if not _varlen(kernel, group):
            for t in group:
                (r0, r1), (c0, c1) = t.rows, t.cols
                o, l = kernel.forward(q[:, :, r0:r1], k[:, :, c0:c1], v[:, :, c0:c1], mask=t.mask, scale=scale)
                yield r0, r1, o, l
            continue
        o, l = varlen_forward(kernel, _span(q, group, 0), _span(k, group, 1), _span(v, group, 1),
                              [(t.rows[1] - t.rows[0], t.cols[1] - t.cols[0]) for t in group],
                              causal=group[0].mask.causal, scale=scale)
        off = 0
        for t in group:
            n = t.rows[1] - t.rows[0]
            yield t.rows[0], t.rows[1], part_of(o, 2, off, n), part_of(l, 2, off, n)
            off += n


def backward_partials(kernel: BlockKernel, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor,
                      delta: Tensor, mask, scale: float, kernel_calls: KernelCalls = "varlen",
                      rows: tuple[Tensor, ...] | None = None):
    """The gradients of one block's kernel calls given the rows' global statistics: yields
    ("q", r0, r1, dq) for block rows [r0, r1) and ("kv", c0, c1, dk, dv) for block columns
    [c0, c1), for the caller to add where their accumulators are (the calls of
    :func:`forward_partials`). ``rows``: what the kernel's ``backward_rows`` made of the block's
    rows (each call gets its own rows of it), or None."""
    if not isinstance(mask, PiecedMask):
        dq, dk, dv = kernel.backward(dout, q, k, v, lse, delta, mask=mask, scale=scale, **rows_of(rows, 0, q.shape[2]))
        yield "q", 0, q.shape[2], dq
        yield "kv", 0, k.shape[2], dk, dv
        return
    for group in mask.groups(kernel_calls):
        if not _varlen(kernel, group):
            for t in group:
                (r0, r1), (c0, c1) = t.rows, t.cols
                gq, gk, gv = kernel.backward(dout[:, :, r0:r1], q[:, :, r0:r1], k[:, :, c0:c1], v[:, :, c0:c1],
                                             lse[..., r0:r1], _rows(delta, r0, r1), mask=t.mask, scale=scale,
                                             **rows_of(rows, r0, r1 - r0))
                yield "q", r0, r1, gq
                yield "kv", c0, c1, gk, gv
            continue
        gq, gk, gv = varlen_backward(kernel, _span(dout, group, 0), _span(q, group, 0), _span(k, group, 1),
                                     _span(v, group, 1), _span(lse, group, 0, -1),
                                     None if delta is None else _span(delta, group, 0, -1),
                                     [(t.rows[1] - t.rows[0], t.cols[1] - t.cols[0]) for t in group],
                                     causal=group[0].mask.causal, scale=scale,
                                     rows=None if rows is None else tuple(_span(t, group, 0) for t in rows))
        qo = ko = 0
        for t in group:
            n, m = t.rows[1] - t.rows[0], t.cols[1] - t.cols[0]
            yield "q", t.rows[0], t.rows[1], part_of(gq, 2, qo, n)
            yield "kv", t.cols[0], t.cols[1], part_of(gk, 2, ko, m), part_of(gv, 2, ko, m)
            qo, ko = qo + n, ko + m


def block_forward(kernel: BlockKernel, q: Tensor, k: Tensor, v: Tensor, mask, scale: float,
                  acc_dtype: torch.dtype, kernel_calls: KernelCalls = "varlen") -> tuple[Tensor, Tensor]:
    """(out, lse) of one block: one kernel call, or its calls' partials merged in ``acc_dtype``."""
    if not isinstance(mask, PiecedMask):
        return kernel.forward(q, k, v, mask=mask, scale=scale)
    b, h, sq = q.shape[:3]
    out = torch.zeros(b, h, sq, v.shape[-1], dtype=acc_dtype, device=q.device)
    lse = torch.full((b, h, sq), float("-inf"), dtype=acc_dtype, device=q.device)
    for r0, r1, o, l in forward_partials(kernel, q, k, v, mask, scale, kernel_calls):
        merge_partial_(out[:, :, r0:r1], lse[:, :, r0:r1], o, l)
    return out, lse


def block_backward(kernel: BlockKernel, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor,
                   mask, scale: float, acc_dtype: torch.dtype,
                   kernel_calls: KernelCalls = "varlen") -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one block given the rows' global statistics: one kernel call, or its calls'
    gradients summed in ``acc_dtype``."""
    if not isinstance(mask, PiecedMask):
        return kernel.backward(dout, q, k, v, lse, delta, mask=mask, scale=scale)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc_dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc_dtype, device=q.device)
    for part in backward_partials(kernel, dout, q, k, v, lse, delta, mask, scale, kernel_calls):
        if part[0] == "q":
            _, r0, r1, g = part
            dq[:, :, r0:r1] += g
        else:
            _, c0, c1, gk, gv = part
            dk[:, :, c0:c1] += gk
            dv[:, :, c0:c1] += gv
    return dq, dk, dv

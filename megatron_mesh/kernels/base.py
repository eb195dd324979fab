"""The block-kernel contract: one attention block in, (out, lse) out; and its backward.

Every kernel (torch's CPU/CUDA attention ops, the pure-math reference, later flash-attn or
Transformer Engine) implements :class:`BlockKernel`, so the executor never knows which one runs.
Kernel quirks (layouts, padding of lse, GQA support, what a backward op needs, how a mask is
passed) stay inside the kernel's module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from ..plan.mask import BlockKind

__all__ = ["BlockKernel", "BlockMask", "FULL", "CAUSAL", "check_head_dims", "varlen_forward", "varlen_backward",
           "loop_varlen_forward", "loop_varlen_backward", "rows_of", "head_dim_dense"]


def head_dim_dense(*tensors: Tensor) -> tuple[Tensor, ...]:
    """``tensors`` with their last axis (head_dim) of stride 1: each as it is where it already is --
    any other strides, 0 included, the kernels read as they are -- else a copy.

    torch's fused attention ops read head_dim as if its stride were 1: the CPU op gives wrong
    numbers without an error on ``k = buf[..., ::2]``, a projection stored [d, h] and transposed or
    a broadcast head_dim (it reads memory the view does not cover); the CUDA ops refuse such
    inputs. A copy, as torch's own ops make one, rather than an error: the values are what the
    caller means, and only these rare layouts pay the pass over the tensor. The caller's tensor is
    never written."""
    return tuple(x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous() for x in tensors)


@dataclass(eq=False)
class BlockMask:
    """The mask of one block: ``kind`` "full" (every pair), "causal" (top-left: key j <= query i
    in the block's own order; the plan uses it only on identical query and key tokens) or
    "masked" (``allowed`` [Sq, Sk] bool says which pairs attend; built by the runtime from the
    tokens' global positions and the plan's mask).

    A masked block may have rows with no allowed key in it: their ``lse`` is -inf and their
    ``out`` 0, whatever the kernel does underneath."""

    kind: BlockKind
    allowed: Tensor | None = None
    _bias: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in tuple(BlockKind):
            raise ValueError(f"block mask kind must be one of {', '.join(BlockKind)}, got {self.kind!r}")
        self.kind = BlockKind(self.kind)
        if (self.kind == BlockKind.MASKED) != (self.allowed is not None):
            raise ValueError("a 'masked' block mask needs its allowed matrix (and only it)")

    @property
    def causal(self) -> bool:
        return self.kind == BlockKind.CAUSAL

    def bias(self, dtype: torch.dtype, pad_to: int = 1) -> Tensor:
        """The additive mask (0 where allowed, -inf elsewhere) in ``dtype``, columns padded to a
        multiple of ``pad_to`` (kernels that need aligned strides), cached per dtype."""
        key = (dtype, pad_to)
        b = self._bias.get(key)
        if b is None:
            sq, sk = self.allowed.shape
            cols = -(-sk // pad_to) * pad_to
            full = torch.full((sq, cols), float("-inf"), dtype=dtype, device=self.allowed.device)
            full[:, :sk].masked_fill_(self.allowed, 0.0)
            b = self._bias[key] = full[:, :sk]
        return b

    def to(self, device: torch.device) -> "BlockMask":
        """This mask on ``device``, with what it knows of its empty rows carried over: a mask on
        the meta device (shapes only, to count a plan's memory traffic) cannot find them out."""
        if self.allowed is None:
            return self
        moved = BlockMask(self.kind, self.allowed.to(device))
        empty = self.empty_rows()
        moved._bias["empty"] = False if empty is None else empty.to(device)
        return moved

    def empty_rows(self) -> Tensor | None:
        """Rows with no allowed key (None when there are none)."""
        if self.allowed is None:
            return None
        e = self._bias.get("empty")
        if e is None:
            rows = ~self.allowed.any(dim=-1)
            e = self._bias["empty"] = rows if bool(rows.any()) else False
        return None if e is False else e


FULL = BlockMask(BlockKind.FULL)
CAUSAL = BlockMask(BlockKind.CAUSAL)


def check_head_dims(kernel, head_dim: int, v_head_dim: int) -> None:
    """Raise ValueError, naming the kernel, where ``kernel`` cannot take values of ``v_head_dim``
    with queries and keys of ``head_dim`` (its optional ``check_head_dims``; a kernel without one
    takes any)."""
    check = getattr(kernel, "check_head_dims", None)
    if v_head_dim != head_dim and check is not None:
        check(head_dim, v_head_dim)


def rows_of(rows: tuple[Tensor, ...] | None, start: int, n: int) -> dict:
    """``backward(..., **rows_of(rows, start, n))``: rows [start, start + n) of what a kernel's
    ``backward_rows`` made (nothing when it made nothing)."""
    if rows is None:
        return {}
    return {"rows": tuple(t if start == 0 and n == t.shape[2] else t.narrow(2, start, n) for t in rows)}


@runtime_checkable
class BlockKernel(Protocol):
    """Attention of one block.

    Layout: ``q`` [B, H, Sq, D]; ``k`` [B, Hkv, Sk, D], ``v`` [B, Hkv, Sk, Dv] with H % Hkv == 0
    (grouped-query attention: query head h uses KV head h // (H / Hkv)); Dv may differ from D
    (MLA) where the kernel takes it: a kernel that cannot defines ``check_head_dims(d, dv)``,
    raising ValueError naming itself (:func:`check_head_dims`). The output and dout have Dv.
    Inputs may be strided views (slices of a chunk along the sequence, or of a [S, B, H, D]
    tensor); the executor hands them with head_dim of stride 1 (:func:`head_dim_dense`), and a
    kernel called with any other strides must give the same result (torch's kernel copies such
    inputs).
    """

    name: str

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, mask: BlockMask, scale: float) -> tuple[Tensor, Tensor]:
        """Returns ``out`` [B, H, Sq, Dv] (any float dtype) and ``lse`` [B, H, Sq] (fp32, or fp64
        for fp64 inputs), the log-sum-exp of the scaled scores of each row over this block's
        allowed keys (-inf for a row with none)."""

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor, *,
                 mask: BlockMask, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of this block's contribution, given the *global* row statistics: ``lse`` and
        ``delta`` = rowsum(dout * out) [B, H, Sq] (fp32 or fp64) of the full attention rows. With
        P = exp(s - lse) on allowed pairs (0 elsewhere) and dS = P * (dout v^T - delta):
        dq = scale dS k, dk = scale dS^T q, dv = P^T dout. Returns (dq, dk, dv) shaped like
        (q, k, v), any float dtype (the executor accumulates in fp32).

        A kernel that makes something of the rows' statistics before its op can take them (torch's
        fused ops want an output, and lse without -inf) may define ``backward_rows(dout, lse,
        delta, out=None) -> tuple[Tensor, ...]`` of tensors with the rows along dim 2: the executor
        then calls it once per buffer of rows -- not once per block, as many blocks read the same
        rows -- and passes each call its rows of them as ``backward(..., rows=...)`` (and
        ``backward_varlen``). Where the rows' output is on the rank (its own rows), the executor
        passes it as ``out``; the kernel must then take delta from ``out`` and not read the
        ``delta`` argument. The executor computes that argument only for the rows other ranks
        compute blocks of, and leaves NaN in the others."""


# -- variable-length calls ------------------------------------------------------------------------------------
# A kernel with ``varlen = True`` runs several sequences in one call (flash-attention's varlen
# kernels): ``q`` [B, H, sum nq, D] and ``k``, ``v`` [B, Hkv, sum nk, D] hold the sequences one
# after another, ``seqs`` their (nq, nk); sequence i's queries attend only its own keys, all of
# them (``causal`` False) or causally (``causal`` True, nq == nk). Its ``forward_varlen`` /
# ``backward_varlen`` return what ``forward`` / ``backward`` return, for the packed rows and
# columns. The runtime groups a masked block's full pieces, and its causal ones, into such calls
# (:func:`megatron_mesh.plan.call_groups`); a kernel without them runs each piece alone.
def varlen_forward(kernel: BlockKernel, q: Tensor, k: Tensor, v: Tensor, seqs, *, causal: bool,
                   scale: float) -> tuple[Tensor, Tensor]:
    """(out, lse) of the packed sequences ``seqs`` in one call of ``kernel`` (see above)."""
    _check_seqs(q, k, seqs, causal)
    return kernel.forward_varlen(q, k, v, tuple(seqs), causal=causal, scale=scale)


def varlen_backward(kernel: BlockKernel, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor,
                    seqs, *, causal: bool, scale: float,
                    rows: tuple[Tensor, ...] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of the packed sequences ``seqs`` given the rows' global statistics (and
    ``rows``: what the kernel's ``backward_rows`` made of them, if it has one)."""
    _check_seqs(q, k, seqs, causal)
    return kernel.backward_varlen(dout, q, k, v, lse, delta, tuple(seqs), causal=causal, scale=scale,
                                  **rows_of(rows, 0, q.shape[2]))


def _check_seqs(q: Tensor, k: Tensor, seqs, causal: bool) -> None:
    if sum(n for n, _ in seqs) != q.shape[2] or sum(m for _, m in seqs) != k.shape[2]:
        raise ValueError(f"sequences {list(seqs)} do not add up to {q.shape[2]} queries and {k.shape[2]} keys")
    if causal and any(n != m for n, m in seqs):
        raise ValueError(f"causal sequences must have as many queries as keys, got {list(seqs)}")
    if any(n < 1 or m < 1 for n, m in seqs):
        raise ValueError(f"every sequence needs a query and a key, got {list(seqs)}")


def loop_varlen_forward(kernel: BlockKernel, q: Tensor, k: Tensor, v: Tensor, seqs, *, causal: bool,
                        scale: float) -> tuple[Tensor, Tensor]:
    """A variable-length call as one ``forward`` per sequence (kernels whose inputs the fused
    op does not take, e.g. fp32 on flash)."""
    outs, lses, qo, ko = [], [], 0, 0
    mask = CAUSAL if causal else FULL
    for n, m in seqs:
        o, l = kernel.forward(q.narrow(2, qo, n), k.narrow(2, ko, m), v.narrow(2, ko, m), mask=mask, scale=scale)
        outs.append(o)
        lses.append(l)
        qo, ko = qo + n, ko + m
    return torch.cat(outs, 2), torch.cat(lses, 2)


def loop_varlen_backward(kernel: BlockKernel, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor,
                         delta: Tensor, seqs, *, causal: bool, scale: float,
                         rows: tuple[Tensor, ...] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of :func:`loop_varlen_forward`."""
    dqs, dks, dvs, qo, ko = [], [], [], 0, 0
    mask = CAUSAL if causal else FULL
    for n, m in seqs:
        gq, gk, gv = kernel.backward(dout.narrow(2, qo, n), q.narrow(2, qo, n), k.narrow(2, ko, m), v.narrow(2, ko, m),
                                     lse.narrow(-1, qo, n), None if delta is None else delta.narrow(-1, qo, n),
                                     mask=mask, scale=scale,
                                     **rows_of(rows, qo, n))
        dqs.append(gq)
        dks.append(gk)
        dvs.append(gv)
        qo, ko = qo + n, ko + m
    return torch.cat(dqs, 2), torch.cat(dks, 2), torch.cat(dvs, 2)

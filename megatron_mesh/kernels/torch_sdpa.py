"""Block kernels built on torch's own fused attention ops (no extra packages).

* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``): fp64/fp32/bf16/fp16,
  native grouped-query attention, returns the log-sum-exp.
* CUDA: ``aten._scaled_dot_product_flash_attention`` (default; native grouped-query attention),
  ``..._efficient_attention`` or ``..._cudnn_attention`` (these two get K/V repeated to the query
  heads), chosen by the ``op`` argument ("auto": flash for 16-bit inputs, else efficient).

Value head dims other than the query/key head dim (MLA): the CPU op wants equal dims, so the
smaller side is padded with zeros to the larger (zero columns of q and k add nothing to a score,
zero columns of v give zero output columns: exact) and the result cut back; on CUDA the efficient
op takes them as they are ("auto" picks it for them), flash and cuDNN refuse them up front
(:meth:`TorchAttentionKernel.check_head_dims`).

Masks: "full" and "causal" blocks use the ops' own ``is_causal``; a "masked" block passes the
additive mask (0 / -inf in the inputs' dtype) -- the CPU op's ``attn_mask``, or the efficient
kernel's ``attn_bias`` on CUDA (flash and cuDNN take no arbitrary mask). Rows with no allowed key
come back with lse 0 from the ops; the kernel sets them to -inf (their output is already 0).

The fused backward ops take the row's *output* ``out`` only to form delta = rowsum(dout * out). A
rank that computes blocks of a remote query chunk has that row's dout and delta (sent with it),
not its output -- sending the output would cost as many bytes again as dout. So the backward
passes a stand-in output ``out'`` with rowsum(dout * out') == delta (see
:func:`stand_in_output`): the ops' gradients are then those of the block given the global
statistics.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..plan.mask import BlockKind
from .base import head_dim_dense, loop_varlen_backward, loop_varlen_forward

__all__ = ["TorchAttentionKernel", "CUDA_OPS", "stand_in_output", "flash_varlen_forward", "flash_varlen_backward"]

CUDA_OPS = ("flash", "efficient", "cudnn")


def stand_in_output(dout: Tensor, delta: Tensor) -> Tensor:
    """A tensor ``o`` shaped like ``dout`` with rowsum(dout * o) == delta (see the module doc).

    ``o = u * delta / (s * |u|^2)`` with s = max|dout| per row and u = dout / s: the same as
    ``dout * delta / |dout|^2`` in real arithmetic, but |u|^2 lies in [1, head_dim], so neither
    a tiny dout (x 1e-30: |dout|^2 underflows) nor a huge one (x 1e19: it overflows) loses it.
    With |out| bounded, |o| <= |out| (Cauchy-Schwarz), so it does not overflow either."""
    wide = torch.float64 if dout.dtype == torch.float64 else torch.float32
    tiny = torch.finfo(wide).tiny
    d = dout.to(wide)
    # a row of zeros: s and |u|^2 are clamped to tiny, u stays 0 and so does delta (= dout . out),
    # so the row's o is 0 without a branch -- this runs once per backward block, and on a GPU
    # every elementwise op is a kernel launch (12 here, where a version with torch.where took 20)
    s = d.abs().amax(-1, keepdim=True).clamp_min_(tiny)
    u = d / s if d is dout else d.div_(s)  # (in place only on our own copy)
    norm2 = (u * u).sum(-1, keepdim=True).clamp_min_(tiny)
    # divide by s first: s * norm2 overflows once max|dout| is near the dtype's maximum / head_dim
    coef = delta.to(wide).unsqueeze(-1).div(s).div_(norm2)
    return u.mul_(coef).to(dout.dtype)


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
        # several documents' pieces in one call: flash-attention's varlen kernels (CUDA); the CPU
        # op has none, so there the runtime calls it once per piece
        self.varlen = device_type == "cuda" and self.op == "flash"

    def _op(self, q: Tensor, v: Tensor) -> str:
        """The op for these inputs: "auto" takes flash for 16-bit inputs of equal head dims and
        the efficient kernel otherwise (flash has no fp32/fp64 kernel and wants V's head dim to
        be Q's). ``name`` says which one ran last."""
        op = "efficient" if self.auto and not _flash_takes(q, v) else self.op
        self.name = f"torch-{op}"
        return op

    def check_head_dims(self, head_dim: int, v_head_dim: int) -> None:
        """Flash and cuDNN (asked for by name) take no value head dim other than the query/key one."""
        if head_dim != v_head_dim and not self.auto and self.op in ("flash", "cudnn"):
            raise ValueError(f"kernel backend torch-{self.op} cannot take a value head dim ({v_head_dim}) other than "
                             f"the query/key head dim ({head_dim}); use 'auto' or 'torch-efficient' on CUDA "
                             "(or 'math')")

    # -- forward -------------------------------------------------------------------------------
    def forward(self, q, k, v, *, mask, scale):
        out, lse = self._forward(*head_dim_dense(q, k, v), mask, scale)
        empty = mask.empty_rows()
        if empty is not None:  # the ops report lse 0 for a row with no allowed key
            lse = lse.masked_fill(empty, float("-inf"))
        return out, lse

    def _forward(self, q, k, v, mask, scale):
        causal = mask.causal
        if self.op == "cpu":
            bias = mask.bias(q.dtype) if mask.kind == BlockKind.MASKED else None
            dv = v.shape[-1]
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*_same_dims(q, k, v), 0.0, causal,
                                                                                  attn_mask=bias, scale=scale)[:2]
            return _cut(out, dv), lse
        op = "efficient" if mask.kind == BlockKind.MASKED else self._op(q, v)
        if mask.kind == BlockKind.MASKED:
            self.name = "torch-efficient"
        sq = q.shape[2]
        if op != "flash":  # flash takes grouped KV heads as they are (see _expand_kv)
            k, v = self._expand_kv(q, k, v)
        if op == "flash":
            res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
            return res[0], res[1].float()
        if op == "efficient":
            bias = self._bias(q, mask)
            res = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal, scale=scale)
            return res[0], res[1][..., :sq].float()  # lse is padded along the rows
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        return res[0], res[1].reshape(q.shape[0], q.shape[1], sq).float()

    # -- backward ------------------------------------------------------------------------------
    def backward_rows(self, dout: Tensor, lse: Tensor, delta: Tensor, out: Tensor | None = None
                      ) -> tuple[Tensor, Tensor]:
        """What the ops take of these rows: their output -- ``out`` in dout's dtype where the
        caller has it (its own rows), else the stand-in (:func:`stand_in_output`: a dozen ops, each
        a pass over dout-sized memory) -- and lse with 0 for -inf (a row no key of the whole
        attention reaches, THD padding: its gradients are 0). The executor makes them once per
        buffer of rows and hands each call its rows (``backward(..., rows=...)``)."""
        if out is None:
            return _backward_rows(dout, lse, delta)
        return out.to(dout.dtype), _finite_lse(lse)

    def backward(self, dout, q, k, v, lse, delta, *, mask, scale, rows=None):
        causal = mask.causal
        out, lse = _backward_rows(dout, lse, delta) if rows is None else rows
        dout, q, k, v, out = head_dim_dense(dout, q, k, v, out)
        if self.op == "cpu":
            # the CPU op wants lse in fp32 (fp64 for fp64 inputs)
            lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
            bias = mask.bias(q.dtype) if mask.kind == BlockKind.MASKED else None
            d, dv = q.shape[-1], v.shape[-1]
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                *_same_dims(dout, q, k, v, out), lse, 0.0, causal, attn_mask=bias, scale=scale)
            return _cut(gq, d), _cut(gk, d), _cut(gv, dv)
        op = "efficient" if mask.kind == BlockKind.MASKED else self._op(q, v)
        lse = lse.contiguous()  # the executor passes row slices (delta: the ops form it from out)
        ke, ve = (k, v) if op == "flash" else self._expand_kv(q, k, v)
        groups = ke.shape[1] // k.shape[1]  # 1 for flash: it sums dK/dV over each KV head's query heads
        sq, sk = q.shape[2], ke.shape[2]
        if op == "flash":
            # no cumulative offsets (None, not an empty tensor: a defined one selects the varlen
            # path); the dropout state, unused at p = 0, as the forward would hand it over
            rng, unused = _no_dropout_state(q.device)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout, q, ke, ve, out, lse, None, None, sq, sk, 0.0, causal, rng, unused, scale=scale)
        elif op == "efficient":
            lse_p = lse
            pad = (-sq) % 32
            if pad:
                lse_p = torch.nn.functional.pad(lse, (0, pad))
            seed = _no_dropout_seed(q.device)
            bias = self._bias(q, mask)
            # the op reads dout, q, k, v and out as [B, S, H, D] memory (it transposes them and
            # assumes the heads of a token lie together): in any other layout -- a contiguous
            # [B, H, S, D] tensor, say -- it returns garbage, NaN included, without an error (seen on
            # an H100, torch 2.11)
            dout_, q_, ke_, ve_, out_ = (_bshd_memory(x) for x in (dout, q, ke, ve, out))
            dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                dout_, q_, ke_, ve_, bias, out_, lse_p, seed, seed, 0.0, [True, True, True, False], causal,
                scale=scale)
        else:
            empty = torch.empty(0, dtype=torch.int64, device=q.device)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                dout, q, ke, ve, out, lse.unsqueeze(-1), empty, empty, None, None, None, sq, sk, 0.0, causal,
                scale=scale)
        if groups > 1:  # fold the gradients of the repeated KV heads back onto the shared heads
            b, h = dk.shape[:2]
            dk = dk.view(b, h // groups, groups, sk, dk.shape[-1]).sum(2, dtype=torch.float32)
            dv = dv.view(b, h // groups, groups, sk, dv.shape[-1]).sum(2, dtype=torch.float32)
        return dq, dk, dv

    # -- variable-length calls (CUDA flash; see kernels.base) -----------------------------------
    def forward_varlen(self, q, k, v, seqs, *, causal, scale):
        if not _flash_takes(q, v):  # flash takes 16-bit inputs of equal head dims only
            return loop_varlen_forward(self, q, k, v, seqs, causal=causal, scale=scale)
        self.name = "torch-flash"
        q, k, v = head_dim_dense(q, k, v)
        b, h, tq, d = q.shape
        cu_q, cu_k, max_q, max_k = _cu_seqlens(seqs, b, q.device)
        out, lse = flash_varlen_forward(_tokens(q), _tokens(k), _tokens(v), cu_q, cu_k, max_q, max_k, causal, scale)
        return _heads(out, b), lse.reshape(h, b, tq).permute(1, 0, 2)

    def backward_varlen(self, dout, q, k, v, lse, delta, seqs, *, causal, scale, rows=None):
        if not _flash_takes(q, v):
            return loop_varlen_backward(self, dout, q, k, v, lse, delta, seqs, causal=causal, scale=scale, rows=rows)
        b, h, tq, d = q.shape
        cu_q, cu_k, max_q, max_k = _cu_seqlens(seqs, b, q.device)
        out = stand_in_output(dout, delta) if rows is None else rows[0]
        dout, q, k, v, out = head_dim_dense(dout, q, k, v, out)
        lse = lse.float().permute(1, 0, 2).reshape(h, b * tq).contiguous()
        dq, dk, dv = flash_varlen_backward(_tokens(dout), _tokens(q), _tokens(k), _tokens(v), _tokens(out), lse,
                                           cu_q, cu_k, max_q, max_k, causal, scale)
        return _heads(dq, b), _heads(dk, b), _heads(dv, b)

    @staticmethod
    def _bias(q: Tensor, mask) -> Tensor | None:
        """The efficient kernel's attn_bias for a masked block: [B, H, Sq, Sk] (a broadcast view),
        its rows aligned to 16 elements as the kernel requires."""
        if mask.kind != BlockKind.MASKED:
            return None
        b, h, sq, _ = q.shape
        bias = mask.bias(q.dtype, pad_to=16)
        return bias.expand(b, h, sq, bias.shape[-1])

    @staticmethod
    def _expand_kv(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        # the efficient and cuDNN ops want as many KV heads as query heads. Flash takes grouped
        # heads natively (as its varlen op below): no copy of K and V per call, and dK/dV come
        # back summed over a KV head's query heads inside the kernel, in the input dtype (the
        # executor accumulates them in fp32, as it does the varlen call's)
        groups = q.shape[1] // k.shape[1]
        if groups == 1:
            return k, v
        return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


# -- flash-attention's variable-length kernels, as torch ships them ----------------------------------------
# (torch.nn.attention.varlen calls the same ops: packed [tokens, heads, head_dim] inputs, int32
# cumulative sequence offsets, lse [heads, tokens] in fp32, native grouped-query attention -- whose
# dK/dV come back in the input dtype, summed over a KV head's query heads inside the kernel,
# where the one-call-per-piece path sums them in fp32; the executor accumulates both in fp32)
def flash_varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                         causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                                                                 scale=scale)
    return out, lse


def flash_varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Tensor,
                          cu_k: Tensor, max_q: int, max_k: int, causal: bool,
                          scale: float) -> tuple[Tensor, Tensor, Tensor]:
    rng, unused = _no_dropout_state(q.device)
    return torch.ops.aten._flash_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal,
                                                    rng, unused, scale=scale)


def _flash_takes(q: Tensor, v: Tensor) -> bool:
    """Whether flash's kernels take these inputs: 16-bit, values of the queries' head dim."""
    return q.dtype in (torch.float16, torch.bfloat16) and v.shape[-1] == q.shape[-1]


def _same_dims(*xs: Tensor) -> tuple[Tensor, ...]:
    """``xs`` with their last dim padded with zeros to the largest (the CPU op's equal head dims);
    as they are where the dims agree."""
    width = max(x.shape[-1] for x in xs)
    return tuple(x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1])) for x in xs)


def _cut(x: Tensor, width: int) -> Tensor:
    """The first ``width`` columns of ``x`` (what :func:`_same_dims` padded), ``x`` where that is all."""
    return x if x.shape[-1] == width else x[..., :width]


def _backward_rows(dout: Tensor, lse: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
    return stand_in_output(dout, delta), _finite_lse(lse)


def _finite_lse(lse: Tensor) -> Tensor:
    """lse with 0 for -inf (a row no key reaches: its gradients are 0 either way), in one op;
    NaN and +inf stay what they are."""
    return torch.nan_to_num(lse, nan=float("nan"), posinf=float("inf"), neginf=0.0)


def _bshd_memory(x: Tensor) -> Tensor:
    """``x`` ([B, H, S, D]) with its memory laid out as [B, S, H, D] (a copy only when it is not)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


@functools.lru_cache(maxsize=None)
def _no_dropout_state(device) -> tuple[Tensor, Tensor]:
    """The (rng state, unused) pair flash's backward takes; with no dropout it is never read, so
    one pair per device serves every call (two ops per backward call less for the host, issue 52)."""
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.empty(0, device=device)


@functools.lru_cache(maxsize=None)
def _no_dropout_seed(device) -> Tensor:
    """The philox seed and offset the efficient kernel's backward takes: never read without
    dropout, so one per device (not an op per call)."""
    return torch.zeros((), dtype=torch.int64, device=device)


_CU: dict = {}  # (seqs, batch, device) -> offsets: a plan's calls repeat every step, and a host-to-device
_CU_KEPT = 4096  # copy per call would stall the launch queue


def _cu_seqlens(seqs, batch: int, device) -> tuple[Tensor, Tensor, int, int]:
    """int32 cumulative offsets of ``seqs`` repeated for each batch element (the batch is folded
    into the packed tokens), and the longest query and key sequence; made once per shape."""
    key = (tuple(seqs), batch, str(device))
    got = _CU.get(key)
    if got is None:
        qs = [n for _ in range(batch) for n, _ in seqs]
        ks = [m for _ in range(batch) for _, m in seqs]
        cu = [[0], [0]]
        for n, m in zip(qs, ks):
            cu[0].append(cu[0][-1] + n)
            cu[1].append(cu[1][-1] + m)
        if len(_CU) >= _CU_KEPT:
            _CU.clear()
        got = _CU[key] = (torch.tensor(cu[0], dtype=torch.int32, device=device),
                          torch.tensor(cu[1], dtype=torch.int32, device=device), max(qs), max(ks))
    return got


def _tokens(x: Tensor) -> Tensor:
    """[B, H, T, D] -> [B * T, H, D] (the packed layout of the varlen kernels)."""
    b, h, t, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(b * t, h, d)


def _heads(x: Tensor, batch: int) -> Tensor:
    """[B * T, H, D] -> [B, H, T, D]."""
    bt, h, d = x.shape
    return x.reshape(batch, bt // batch, h, d).permute(0, 2, 1, 3)

"""The executor: walks one rank's plan with an injected communicator and block kernel.

There is no rank logic here: which buffers exist, what is computed with which mask, what goes
to whom and in which round all come from the :class:`~megatron_mesh.plan.RankPlan`. Partial
outputs and gradients accumulate in fp32 buffers that belong to the executor (kernel outputs are
only ever read, never kept as accumulators), in the order the plan fixes, so results are
bitwise reproducible.

Tensors are [B, H, T, D] (heads before tokens) inside the executor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..comm.base import Communicator, Work
from ..kernels.base import BlockKernel
from ..plan.ir import AddGrad, Attend, AttendBackward, Free, Key, MergeOut, Plan, Post, RankPlan, Segment, Wait
from .merge import merge_partial_

__all__ = ["Executor", "ForwardResult", "accumulator_dtype"]


@dataclass
class ForwardResult:
    out: Tensor  # [B, H, T, D] accumulator dtype (fp32; fp64 for fp64 inputs)
    lse: Tensor  # [B, H, T] accumulator dtype
    saved: dict[Key, tuple[Tensor, ...]]  # forward buffers the backward reads (backward_chunks="keep")


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs: partial outputs and gradients never accumulate in 16 bits."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows(n: int, half: str) -> slice:
    if half == "all":
        return slice(0, n)
    return slice(0, n // 2) if half == "front" else slice(n // 2, n)


class _Buffers:
    """Named buffers of one rank plus a pool that recycles freed ones (steady state: no new
    allocations from one step to the next)."""

    def __init__(self, plan: Plan, batch: int, heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.plan = plan
        self.dims = (batch, heads, kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.acc_dtype = accumulator_dtype(dtype)
        self.live: dict[Key, tuple[Tensor, ...]] = {}
        self.owned: set[Key] = set()  # pool-allocated (user inputs are never recycled)
        self.pool: dict[tuple[str, int], list[tuple[Tensor, ...]]] = {}
        self.allocations = 0  # buffers created (not recycled): constant per call in steady state

    def _new(self, kind: str, tokens: int) -> tuple[Tensor, ...]:
        self.allocations += 1
        b, h, hkv, d = self.dims
        f32, dt, dev = self.acc_dtype, self.dtype, self.device
        e = torch.empty
        if kind == "q":
            return (e(b, h, tokens, d, dtype=dt, device=dev),)
        if kind == "kv":
            return (e(b, hkv, tokens, d, dtype=dt, device=dev), e(b, hkv, tokens, d, dtype=dt, device=dev))
        if kind == "o":
            return (e(b, h, tokens, d, dtype=f32, device=dev), e(b, h, tokens, dtype=f32, device=dev))
        if kind == "do":
            return (e(b, h, tokens, d, dtype=dt, device=dev), e(b, h, tokens, dtype=f32, device=dev),
                    e(b, h, tokens, dtype=f32, device=dev))
        if kind == "dq":
            return (e(b, h, tokens, d, dtype=f32, device=dev),)
        if kind == "dkv":
            return (e(b, hkv, tokens, d, dtype=f32, device=dev), e(b, hkv, tokens, d, dtype=f32, device=dev))
        raise ValueError(f"unknown buffer kind {kind!r}")

    def alloc(self, key: Key) -> tuple[Tensor, ...]:
        tokens = self.plan.tokens(key)
        free = self.pool.get((key.kind, tokens))
        return free.pop() if free else self._new(key.kind, tokens)

    def put(self, key: Key, tensors: tuple[Tensor, ...], owned: bool) -> None:
        self.live[key] = tensors
        if owned:
            self.owned.add(key)

    def get(self, key: Key) -> tuple[Tensor, ...]:
        return self.live[key]

    def accumulator(self, key: Key) -> tuple[Tensor, ...]:
        """The accumulator ``key``, created (out = 0, lse = -inf / grads = 0) on first use."""
        acc = self.live.get(key)
        if acc is None:
            acc = self.alloc(key)
            acc[0].zero_()
            if key.kind == "o":
                acc[1].fill_(float("-inf"))
            else:
                for t in acc[1:]:
                    t.zero_()
            self.put(key, acc, owned=True)
        return acc

    def free(self, key: Key) -> None:
        tensors = self.live.pop(key)
        if key in self.owned:
            self.owned.discard(key)
            self.pool.setdefault((key.kind, self.plan.tokens(key)), []).append(tensors)


def _cut(tensors: tuple[Tensor, ...], segments: tuple[Segment, ...], dim: int = 2) -> tuple[tuple[Tensor, ...], bool]:
    """The local buffer made of ``segments`` of each tensor (a view when it is one segment)."""
    if len(segments) == 1:
        s = segments[0]
        return tuple(t.narrow(dim, s.start, s.stop - s.start) for t in tensors), False
    return tuple(torch.cat([t.narrow(dim, s.start, s.stop - s.start) for s in segments], dim=dim).contiguous()
                 for t in tensors), True


class Executor:
    """Runs ``plan.rank(rank)`` with ``comm`` and ``kernel``."""

    def __init__(self, plan: Plan, comm: Communicator, kernel: BlockKernel, scale: float):
        if comm.world_size != plan.world_size:
            raise ValueError(f"communicator spans {comm.world_size} ranks but the plan {plan.world_size}")
        self.plan = plan
        self.rank_plan: RankPlan = plan.rank(comm.rank)
        self.comm, self.kernel, self.scale = comm, kernel, scale

    # -- public ----------------------------------------------------------------------------------
    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> ForwardResult:
        """q [B, H, T, D], k/v [B, Hkv, T, D], contiguous. Returns fp32 out and lse."""
        rp = self.rank_plan
        bufs = self._buffers(q, k)
        for key, segs in rp.forward_inputs.items():
            src = (q,) if key.kind == "q" else (k, v)
            tensors, copied = _cut(src, segs)
            bufs.put(key, tensors, owned=copied)
        self._run(rp.forward, bufs)
        out, lse = bufs.get(rp.output)
        saved = {key: bufs.get(key) for key in rp.saved}
        return ForwardResult(out, lse, saved)

    def backward(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
                 saved: dict[Key, tuple[Tensor, ...]]) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients (fp32) of q, k, v given the forward's final ``out`` (q's dtype or fp32) and
        fp32 ``lse`` and the incoming ``dout`` [B, H, T, D]."""
        rp = self.rank_plan
        bufs = self._buffers(q, k)
        acc = accumulator_dtype(q.dtype)
        delta = (dout.to(acc) * out.to(acc)).sum(-1)  # rowsum(dout * out): the backward's row statistic
        for key, segs in rp.backward_inputs.items():
            src = {"q": (q,), "kv": (k, v), "do": (dout, lse, delta)}[key.kind]
            tensors, copied = _cut(src, segs)
            bufs.put(key, tensors, owned=copied)
        for key, tensors in saved.items():
            bufs.put(key, tensors, owned=False)
        self._run(rp.backward, bufs)
        dq = bufs.get(rp.grad_q)[0]
        dk, dv = bufs.get(rp.grad_kv)
        return dq, dk, dv

    # -- the loop ----------------------------------------------------------------------------------
    def _buffers(self, q: Tensor, k: Tensor) -> _Buffers:
        b, h, _, d = q.shape
        return _Buffers(self.plan, b, h, k.shape[1], d, q.dtype, q.device)

    def _run(self, ops, bufs: _Buffers) -> None:
        pending: dict[int, tuple[Work, list[tuple[Key, tuple[Tensor, ...]]]]] = {}
        for op in ops:
            if isinstance(op, Attend):
                self._attend(op, bufs)
            elif isinstance(op, AttendBackward):
                self._attend_backward(op, bufs)
            elif isinstance(op, Post):
                sends = [(t.peer, x) for t in op.sends for x in bufs.get(t.key)]
                arriving = [(t.key, bufs.alloc(t.key)) for t in op.recvs]
                recvs = [(t.peer, x) for t, (_, ts) in zip(op.recvs, arriving) for x in ts]
                pending[op.round] = (self.comm.start(sends, recvs), arriving)
            elif isinstance(op, Wait):
                work, arriving = pending.pop(op.round)
                work.wait()
                for key, tensors in arriving:
                    bufs.put(key, tensors, owned=True)
            elif isinstance(op, MergeOut):
                src, dst = bufs.get(op.src), bufs.get(op.dst)
                merge_partial_(dst[0], dst[1], src[0], src[1])
            elif isinstance(op, AddGrad):
                self._add_grad(op, bufs)
            elif isinstance(op, Free):
                bufs.free(op.key)
            else:
                raise TypeError(f"unknown plan op {op!r}")
        if pending:
            raise RuntimeError(f"plan left rounds {sorted(pending)} unwaited")

    def _kv(self, keys: tuple[Key, ...], half: str, bufs: _Buffers) -> tuple[Tensor, Tensor, list[int]]:
        parts = []
        for key in keys:
            k, v = bufs.get(key)
            rows = _rows(k.shape[2], half)
            parts.append((k[:, :, rows], v[:, :, rows]))
        if len(parts) == 1:
            return parts[0][0], parts[0][1], [parts[0][0].shape[2]]
        return (torch.cat([p[0] for p in parts], dim=2), torch.cat([p[1] for p in parts], dim=2),
                [p[0].shape[2] for p in parts])

    def _attend(self, op: Attend, bufs: _Buffers) -> None:
        (q,) = bufs.get(op.q)
        rows = _rows(q.shape[2], op.q_half)
        k, v, _ = self._kv(op.kv, op.kv_half, bufs)
        blk_out, blk_lse = self.kernel.forward(q[:, :, rows], k, v, causal=op.causal, scale=self.scale)
        out, lse = bufs.accumulator(op.out)
        merge_partial_(out[:, :, rows], lse[:, :, rows], blk_out, blk_lse)

    def _attend_backward(self, op: AttendBackward, bufs: _Buffers) -> None:
        (q,) = bufs.get(op.q)
        dout, lse, delta = bufs.get(op.do)
        rows = _rows(q.shape[2], op.q_half)
        k, v, lengths = self._kv(op.kv, op.kv_half, bufs)
        dq, dk, dv = self.kernel.backward(dout[:, :, rows], q[:, :, rows], k, v, lse[:, :, rows],
                                          delta[:, :, rows], causal=op.causal, scale=self.scale)
        bufs.accumulator(op.dq)[0][:, :, rows].add_(dq)
        start = 0
        for key, n in zip(op.dkv, lengths):
            acc_k, acc_v = bufs.accumulator(key)
            kv_rows = _rows(acc_k.shape[2], op.kv_half)
            acc_k[:, :, kv_rows].add_(dk[:, :, start:start + n])
            acc_v[:, :, kv_rows].add_(dv[:, :, start:start + n])
            start += n

    def _add_grad(self, op: AddGrad, bufs: _Buffers) -> None:
        src, dst = bufs.get(op.src), bufs.get(op.dst)
        if op.into is None:
            for d, s in zip(dst, src):
                d.add_(s)
            return
        start = 0
        for seg in op.into:
            n = seg.stop - seg.start
            for d, s in zip(dst, src):
                d[:, :, seg.start:seg.stop].add_(s[:, :, start:start + n])
            start += n

"""The executor: walks one rank's plan with an injected communicator and block kernel.

There is no rank logic here: which buffers exist, what is computed with which mask, what goes
to whom and in which round all come from the :class:`~megatron_mesh.plan.RankPlan`. The op
types dispatch through one table (:data:`Executor.HANDLERS`). Partial outputs and gradients
accumulate in fp32 buffers that belong to the executor (kernel outputs are only ever read,
never kept as accumulators), in the order the plan fixes, so results are bitwise reproducible.

Tensors are [B, H, T, D] (heads before tokens) inside the executor, as *views*: the public API
hands it ``x.permute(1, 2, 0, 3)`` of Megatron's [T, B, H, D] tensors, and the final output and
gradients are allocated token-major, so neither side copies to change layouts (the kernels take
strided inputs). A buffer is copied only where it must be contiguous: when it is sent, or cut
from several token ranges or one head slice that a block reads or that is sent (a head slice
only copies read stays a view). The one stride the kernels cannot take is a head_dim that is not
stride 1 (``buf[..., ::2]``, a projection stored [d, h] and transposed, a broadcast head_dim): such
an input (or dout) is copied once per pass, at entry (:func:`~megatron_mesh.kernels.base.head_dim_dense`),
instead of once per block that reads it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from torch import Tensor

from ..comm.base import Communicator, Work
from ..kernels.base import BlockKernel, head_dim_dense
from ..plan.sel import union_intervals
from ..plan.ir import (AddGrad, Attend, AttendBackward, Copy, Free, Key, MergeOut, Plan, Post, RankPlan, RowStats,
                       Wait, op_keys)
from .buffers import Buffers, accumulator_dtype, parts as _parts
from .masks import backward_partials, block_mask, forward_partials
from .merge import merge_partial_, part_of
from .sinks import add_sink_grad_, apply_sink_

__all__ = ["Executor", "ForwardResult", "accumulator_dtype", "Buffers"]


@dataclass
class ForwardResult:
    out: Tensor  # [B, H, T, D] accumulator dtype (fp32; fp64 for fp64 inputs), token-major storage
    lse: Tensor  # [B, H, T] accumulator dtype
    saved: dict[Key, tuple[Tensor, ...]]  # forward buffers the backward reads


def _take(t: Tensor, sel, dim: int = 2) -> Tensor:
    """Tokens ``sel`` of ``t`` along ``dim``: a view for one range, a copy for several."""
    if sel is None:
        return t
    if len(sel) == 1:
        a, b = sel[0]
        return part_of(t, dim, a, b - a)
    return torch.cat([t.narrow(dim, a, b - a) for a, b in sel], dim=dim)


def _overlaps(parts, r0: int, r1: int):
    """Where block rows [r0, r1) go: (buffer start, offset in [r0, r1), length) for each range of
    ``parts`` (:func:`_parts`) they overlap."""
    for a, pos, n in parts:
        lo, hi = max(r0, pos), min(r1, pos + n)
        if lo < hi:
            yield a + lo - pos, lo - r0, hi - lo


def _add_or_copy(acc: Tensor, part: Tensor, first: bool) -> None:
    """acc += part, or acc <- part where acc still holds its initial zeros (the same values)."""
    if first:
        acc.copy_(part)
    else:
        acc.add_(part)


def _fresh(first: dict, key) -> list[list[int]]:
    """The rows of accumulator ``key`` an op writes first (mutable: :func:`_split_fresh` uses them up)."""
    return [list(s) for s in first.get(key, ())]


def _split_fresh(fresh: list[list[int]], a: int, n: int):
    """Rows [a, a + n) as (start, length, first) runs: ``first`` where they lie in ``fresh``
    (sorted [start, stop) ranges not written yet), which then drops them."""
    pos, end = a, a + n
    for f in fresh:
        if pos >= end:
            break
        lo, hi = max(pos, f[0]), min(end, f[1])
        if lo >= hi:
            continue
        if lo > pos:
            yield pos, lo - pos, False
        yield lo, hi - lo, True
        pos = hi
    if pos < end:
        yield pos, end - pos, False
    if fresh:  # what was just written is no longer fresh
        fresh[:] = [r for f in fresh for r in _without(f, a, end)]


def _without(f: list[int], a: int, b: int) -> list[list[int]]:
    return [r for r in ([f[0], min(f[1], a)], [max(f[0], b), f[1]]) if r[0] < r[1]]


def _delta_facts(rank_plan: RankPlan, own_rows_made: bool) -> tuple:
    """(the rows of this rank's delta to compute, None for all; the ``do`` buffers whose
    delta is read): see :func:`_delta_reads`."""
    reads = _delta_reads(rank_plan, own_rows_made)
    if not own_rows_made:
        return None, reads
    return union_intervals(seg for key, segs in rank_plan.backward_inputs.items() if key in reads
                           for seg in segs), reads


def _delta_reads(rank_plan: RankPlan, own_rows_made: bool) -> set[Key]:
    """The ``do`` buffers whose delta something reads: those sent to another rank (its blocks
    get a stand-in output made from delta), those a block reads without its rows' output --
    every one when the kernel has no ``backward_rows`` (``own_rows_made`` False), else all
    but this rank's own rows (the backward inputs, whose output is here) and RowStats'
    results -- and the sources of copies into either, found walking the ops backwards."""
    ops = rank_plan.ops("backward")
    made = set(rank_plan.backward_inputs) if own_rows_made else set()
    # an input buffer's name that a receive or copy makes again holds rows that are not this
    # rank's own (no builder does this; a safe answer if one ever did)
    made -= {t.key for op in ops if isinstance(op, Post) for t in op.recvs}
    made -= {op.dst for op in ops if isinstance(op, Copy)}
    made |= {op.dst for op in ops if isinstance(op, RowStats)} if own_rows_made else set()
    reads: set[Key] = set()
    for op in reversed(ops):
        if isinstance(op, Post):
            reads |= {t.key for t in op.sends if t.key.kind == "do"}
        elif isinstance(op, AttendBackward) and op.do not in made:
            reads.add(op.do)
        elif isinstance(op, Copy) and op.dst in reads and op.src.kind == "do":
            reads.add(op.src)
    return reads


def _copy_sources(rank_plan: RankPlan, direction: str) -> frozenset:
    """The input buffers of ``direction`` that only :class:`Copy` ops read (a Ulysses group
    member's own head slice, copied into the group's tokens): cutting them as a contiguous
    copy first would move their bytes twice. A buffer that is sent or that a block reads
    stays contiguous (a send needs it; kernels read it many times)."""
    inputs = rank_plan.forward_inputs if direction == "forward" else rank_plan.backward_inputs
    ops = rank_plan.ops(direction)
    others = {key for op in ops if type(op) is not Copy for key in op_keys(op)}
    others |= {op.dst for op in ops if type(op) is Copy}  # a view must never be written into
    copied = {op.src for op in ops if type(op) is Copy}
    return frozenset(key for key in inputs if key in copied and key not in others)


class Executor:
    """Runs ``plan.rank(comm.rank)`` with ``comm`` and ``kernel``.

    ``timer``, when given, is called as ``timer("compute")`` / ``timer("wait")`` and must return
    a context manager wrapped around each kernel call / each wait for a round (e.g. Megatron's
    timers)."""

    def __init__(self, plan: Plan, comm: Communicator, kernel: BlockKernel, scale: float,
                 timer: Callable[[str], ContextManager] | None = None):
        if comm.world_size != plan.world_size:
            raise ValueError(f"communicator spans {comm.world_size} ranks but the plan {plan.world_size}")
        self.plan = plan
        self.rank_plan: RankPlan = plan.rank(comm.rank)
        self.comm, self.kernel, self.scale = comm, kernel, scale
        # the kernel's optional backward_rows (kernels.base.BlockKernel.backward): what it makes of a
        # buffer of rows once, instead of in every call
        self.backward_rows = getattr(kernel, "backward_rows", None)
        # made once per plan and rank (an executor is made per call; these walk the rank's ops):
        # the rows of this rank's delta = rowsum(dout * out) that something reads (None: all), and
        # the do buffers whose delta is read (RowStats results among them); the input buffers only
        # copies read
        rp, made = self.rank_plan, self.backward_rows is not None
        self._delta_rows, self._delta_keys = plan.memo(("delta", comm.rank, made),
                                                       lambda: _delta_facts(rp, made))
        self._copied_only = plan.memo(("copied only", comm.rank), lambda: {
            d: _copy_sources(rp, d) for d in ("forward", "backward")})
        self.timer = timer or (lambda what: contextlib.nullcontext())
        self._sink: Tensor | None = None  # the call's softmax_offset in the accumulators' dtype (runtime/sinks.py)
        self.offset_grad: Tensor | None = None  # the last backward's d softmax_offset over the rows it finished

    # -- public ----------------------------------------------------------------------------------
    def forward(self, q: Tensor, k: Tensor, v: Tensor, softmax_offset: Tensor | None = None) -> ForwardResult:
        """q [B, H, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv] (views of any strides);
        ``softmax_offset`` [H]: attention sinks, applied where rows are finished (:mod:`.sinks`).
        Returns the fp32 out (token-major storage) and lse."""
        q, k, v = head_dim_dense(q, k, v)
        rp = self.rank_plan
        self._set_sink(softmax_offset, q.dtype)
        bufs = self._buffers(q, k, v, {rp.output})
        self._inputs(bufs, rp.forward_inputs, {"q": (q,), "kv": (k, v)}, self._copied_only["forward"])
        self._run("forward", bufs)
        final = bufs.accumulator(rp.output)
        out, lse = final if len(final) == 2 else (final[0], None)  # a finished output ("y") has no lse
        if lse is not None:  # the rank's own rows, all merged (a Ulysses plan's are finished by its casts)
            self._finish_rows(rp.output, out, lse, None)
        saved = {key: self._kept(key, bufs.get(key), q.dtype) for key in rp.saved}
        return ForwardResult(out, lse, saved)

    @staticmethod
    def _kept(key: Key, tensors: tuple[Tensor, ...], dtype: torch.dtype) -> tuple[Tensor, ...]:
        """A forward buffer as the backward gets it. A partial output ``o`` (a Ulysses group's
        output of its span, which RowStats reads) is kept in the inputs' dtype with its lse: the
        backward reads it only for delta = rowsum(dout * out), formed in fp32 from it as the fused
        backward ops form it from their own output in that dtype, and as the executor does for a
        rank's own rows (the autograd output). In bf16 that halves the buffer the backward waits
        for: 128 MiB instead of 256 per layer at 32K tokens x 16 heads of 128."""
        if key.kind == "o" and tensors[0].dtype != dtype:
            return (tensors[0].to(dtype), *tensors[1:])
        return tensors

    def backward(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor | None, dout: Tensor,
                 saved: dict[Key, tuple[Tensor, ...]], softmax_offset: Tensor | None = None,
                 offset_grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients (fp32 or the input dtype, token-major storage) of q, k, v given the
        forward's final ``out`` (q's dtype or fp32) and ``lse`` (with the forward's
        ``softmax_offset`` in them) and the incoming ``dout`` [B, H, T, Dv] (views of any strides).
        The inputs are copied again where the forward copied them (:func:`head_dim_dense`): keeping
        the forward's copies would hold that memory in between. ``offset_grad``: also sum d
        softmax_offset over the rows this rank finished, into :attr:`offset_grad` [H]."""
        q, k, v, dout = head_dim_dense(q, k, v, dout)
        rp = self.rank_plan
        self._set_sink(softmax_offset, q.dtype)
        self.offset_grad = None
        if offset_grad and self._sink is not None:
            self.offset_grad = torch.zeros_like(self._sink)
            if lse is not None:  # the rank's own rows (a Ulysses plan's rows are its RowStats')
                add_sink_grad_(self.offset_grad, dout, out, lse, self._sink)
        bufs = self._buffers(q, k, v, {rp.grad_q, rp.grad_kv})
        sources = {"q": (q,), "kv": (k, v), "dy": (dout,)}
        if any(key.kind == "do" for key in rp.backward_inputs):
            sources["do"] = (dout, lse, self._delta(dout, out, lse))
        self._inputs(bufs, rp.backward_inputs, sources, self._copied_only["backward"])
        make = self.backward_rows
        if make is not None and "do" in sources:  # this rank's rows: the kernel may take their output itself
            for key, segs in rp.backward_inputs.items():
                if key.kind == "do":
                    (o,) = self._cut(bufs, key, segs, (out,))
                    bufs.derive(key, lambda: make(*bufs.get(key), out=o))
        for key, tensors in saved.items():
            bufs.put(key, tensors, owned=False)
            bufs.read_only.add(key)
        self._run("backward", bufs)
        (dq,) = bufs.accumulator(rp.grad_q)
        dk, dv = bufs.accumulator(rp.grad_kv)
        return dq, dk, dv

    # -- setup -------------------------------------------------------------------------------------
    def _delta(self, dout: Tensor, out: Tensor, lse: Tensor) -> Tensor:
        """delta = rowsum(dout * out) (fp32) of this rank's rows, where anything reads it
        (:func:`_delta_reads`); NaN elsewhere, so a read the analysis missed cannot pass unnoticed.

        Its fp32 casts, product and sum are the largest elementwise pass of a backward (~28 bytes
        of memory traffic per element in bf16: 1.9 GB per rank at 16K tokens, 32 heads of 128),
        and with a kernel that takes the rows' output (``backward_rows``) only the rows other ranks
        compute blocks of need it -- the fused backward forms delta itself from dout and out."""
        acc = accumulator_dtype(dout.dtype)
        rows = self._delta_rows
        if rows is None:
            return (dout.to(acc) * out.to(acc)).sum(-1)
        delta = torch.full(lse.shape, float("nan"), dtype=acc, device=lse.device)
        for a, b in rows:
            torch.sum(dout.narrow(2, a, b - a).to(acc) * out.narrow(2, a, b - a).to(acc), dim=-1,
                      out=delta.narrow(2, a, b - a))
        return delta

    def _buffers(self, q: Tensor, k: Tensor, v: Tensor, token_major: set[Key]) -> Buffers:
        b, h, _, d = q.shape
        return Buffers(self.plan, h, k.shape[1], b, {"qk": d, "v": v.shape[-1]}, q.dtype, q.device, token_major)

    def _set_sink(self, offset: Tensor | None, dtype: torch.dtype) -> None:
        self._sink = None if offset is None else offset.detach().to(accumulator_dtype(dtype))

    def _finish_rows(self, key: Key, out: Tensor, lse: Tensor, rows) -> None:
        """Rows ``rows`` (None: all) of the merged output ``key`` are final: add the sink (once per
        row: each is finished once, by the end of the forward or the cast that sends it home),
        sliced to the buffer's heads."""
        if self._sink is None:
            return
        offset = self._sink[self._sink_heads(key)]
        for a, _, n in _parts(rows, out.shape[2]):
            apply_sink_(part_of(out, 2, a, n), part_of(lse, 2, a, n), offset)

    def _sink_heads(self, key: Key) -> slice:
        """The query heads buffer ``key`` holds (a Ulysses head slice), as the sink's index."""
        heads = self.plan.head_range(key, self._sink.shape[0], 1)
        return slice(None) if heads is None else slice(*heads)

    def _inputs(self, bufs: Buffers, table: dict, sources: dict, views: frozenset = frozenset()) -> None:
        """Cut the rank plan's input buffers from the local tensors: one token range of all heads
        is a view; several ranges or one head slice are copied (once per distinct cut), except a
        head slice in ``views`` (read by copies alone, :func:`_copy_sources`): a view too."""
        cuts: dict = {}
        for key, segs in table.items():
            ck = (key.kind, tuple(segs), key.heads, key in views)
            tensors = cuts.get(ck)
            if tensors is None:
                tensors = cuts[ck] = self._cut(bufs, key, segs, sources[key.kind], view=key in views)
            bufs.put(key, tensors, owned=False)
            bufs.read_only.add(key)

    def _cut(self, bufs: Buffers, key: Key, segs, tensors, view: bool = False) -> tuple[Tensor, ...]:
        """The input buffer ``key``'s cut (token ranges ``segs``, its head slice) of the local
        ``tensors``: a view for one range of all heads (or of a head slice, with ``view``), else a
        copy."""
        heads = self.plan.head_range(key, bufs.heads, bufs.kv_heads) if key.heads >= 0 else None
        parts = []
        for t in tensors:
            if heads is not None:
                t = t.narrow(1, heads[0], heads[1] - heads[0])
            parts.append(_take(t, segs))
        copied = (heads is not None and not view) or len(segs) > 1
        return tuple(p.contiguous() if copied else p for p in parts)

    # -- the loop ----------------------------------------------------------------------------------
    def _run(self, direction: str, bufs: Buffers) -> None:
        pending: dict[int, tuple[Work, list, list]] = {}
        handlers = self.HANDLERS
        first = self.plan.first_writes(self.comm.rank, direction)
        fills = self.plan.creation_fills(self.comm.rank, direction, bufs.heads, bufs.kv_heads)
        for i, op in enumerate(self.rank_plan.ops(direction)):
            handler = handlers.get(type(op))
            if handler is None:
                raise TypeError(f"unknown plan op {op!r}")
            self._first = first.get(i, {})  # a block's accumulator rows no earlier op wrote (plan.first_writes)
            self._fills = fills.get(i, {})  # what to fill of an accumulator this op creates (plan.creation_fills)
            handler(self, op, bufs, pending)
        if pending:
            raise RuntimeError(f"plan left rounds {sorted(pending)} unwaited")

    def _post(self, op: Post, bufs: Buffers, pending) -> None:
        # a transport reads a send until its round completes: keep the (contiguous) tensors alive
        sends = [(t.peer, x if x.is_contiguous() else x.contiguous()) for t in op.sends for x in bufs.get(t.key)]
        arriving = [(t.key, bufs.alloc(t.key)) for t in op.recvs]
        recvs = [(t.peer, x) for t, (_, ts) in zip(op.recvs, arriving) for x in ts]
        pending[op.round] = (self.comm.start(sends, recvs), arriving, sends)

    def _wait(self, op: Wait, bufs: Buffers, pending) -> None:
        work, arriving, _ = pending.pop(op.round)
        with self.timer("wait"):
            work.wait()
        for key, tensors in arriving:
            bufs.put(key, tensors, owned=True)

    def _kv(self, op, bufs: Buffers) -> tuple[Tensor, Tensor, list[int]]:
        parts = []
        for i, key in enumerate(op.kv):
            k, v = bufs.get(key)
            sel = op.col(i)
            parts.append((_take(k, sel), _take(v, sel)))
        if len(parts) == 1:
            return parts[0][0], parts[0][1], [parts[0][0].shape[2]]
        return (torch.cat([p[0] for p in parts], dim=2), torch.cat([p[1] for p in parts], dim=2),
                [p[0].shape[2] for p in parts])

    def _created(self, bufs: Buffers, key: Key) -> tuple[Tensor, ...]:
        """Accumulator ``key`` of a block or copy: where this op creates it, filled only in the rows
        the plan says no block or whole copy writes before they are read (``creation_fills``;
        all of them where the plan names none)."""
        return bufs.accumulator(key, rows=self._fills.get(key))

    @staticmethod
    def _fill_unwritten(bufs: Buffers, key: Key, fresh: list[list[int]]) -> None:
        """Rows a block was to write first but whose kernel calls left them out (a masked block's
        rows without an allowed key in it): their initial values, as later ops add into them."""
        if fresh:
            bufs.fill(key, bufs.get(key), [tuple(f) for f in fresh])

    def _attend(self, op: Attend, bufs: Buffers, pending) -> None:
        (q,) = bufs.get(op.q)
        k, v, _ = self._kv(op, bufs)
        mask = block_mask(self.plan, op, q.device)
        with self.timer("compute"):
            out, lse = self._created(bufs, op.out)
            rows = list(_parts(op.rows, out.shape[2]))
            fresh = _fresh(self._first, op.out)
            # each kernel call's partial result merges straight into the rows' accumulator; on rows
            # nothing has written yet (still 0, -inf) a copy gives the same values
            for r0, r1, o, l in forward_partials(self.kernel, _take(q, op.rows), k, v, mask, self.scale,
                                                 self.plan.kernel_calls):
                for a, off, n in _overlaps(rows, r0, r1):
                    for s, m, first in _split_fresh(fresh, a, n):
                        dst_o, dst_l = part_of(out, 2, s, m), part_of(lse, 2, s, m)
                        src_o, src_l = part_of(o, 2, off + s - a, m), part_of(l, 2, off + s - a, m)
                        if first:
                            dst_o.copy_(src_o)
                            dst_l.copy_(src_l)
                        else:
                            merge_partial_(dst_o, dst_l, src_o, src_l)
            self._fill_unwritten(bufs, op.out, fresh)

    def _attend_backward(self, op: AttendBackward, bufs: Buffers, pending) -> None:
        (q,) = bufs.get(op.q)
        dout, lse, delta = bufs.get(op.do)
        k, v, lengths = self._kv(op, bufs)
        mask = block_mask(self.plan, op, q.device)
        with self.timer("compute"):
            make = self.backward_rows  # once per buffer of rows, not per block
            made = None if make is None else tuple(_take(t, op.rows) for t in
                                                   bufs.derive(op.do, lambda: make(dout, lse, delta)))
            (acc_q,) = self._created(bufs, op.dq)
            rows = list(_parts(op.rows, acc_q.shape[2]))
            fresh_q = _fresh(self._first, op.dq)  # rows still 0: a copy instead of an add
            cols, start = [], 0  # each key buffer's accumulators, where its block columns go, its fresh rows
            fresh_kv: dict[Key, list[list[int]]] = {}  # one list per buffer: a block may name it for several ranges
            for i, (key, n_cols) in enumerate(zip(op.dkv, lengths)):
                acc_k, acc_v = self._created(bufs, key)
                fresh = fresh_kv.get(key)
                if fresh is None:
                    fresh = fresh_kv[key] = _fresh(self._first, key)
                cols.append((acc_k, acc_v, [(a, start + pos, n) for a, pos, n in _parts(op.col(i), acc_k.shape[2])],
                             fresh))
                start += n_cols
            for part in backward_partials(self.kernel, _take(dout, op.rows), _take(q, op.rows), k, v,
                                          _take(lse, op.rows), _take(delta, op.rows), mask, self.scale,
                                          self.plan.kernel_calls, rows=made):
                if part[0] == "q":
                    _, r0, r1, dq = part
                    for a, off, n in _overlaps(rows, r0, r1):
                        for s, m, first in _split_fresh(fresh_q, a, n):
                            _add_or_copy(part_of(acc_q, 2, s, m), part_of(dq, 2, off + s - a, m), first)
                    continue
                _, c0, c1, dk, dv = part
                for acc_k, acc_v, parts, fresh in cols:
                    for a, off, n in _overlaps(parts, c0, c1):
                        for s, m, first in _split_fresh(fresh, a, n):
                            _add_or_copy(part_of(acc_k, 2, s, m), part_of(dk, 2, off + s - a, m), first)
                            _add_or_copy(part_of(acc_v, 2, s, m), part_of(dv, 2, off + s - a, m), first)
            self._fill_unwritten(bufs, op.dq, fresh_q)
            for key, fresh in fresh_kv.items():
                self._fill_unwritten(bufs, key, fresh)

    def _merge(self, op: MergeOut, bufs: Buffers, pending) -> None:
        src_out, src_lse = bufs.get(op.src)
        out, lse = bufs.accumulator(op.dst)
        for a, pos, n in _parts(op.into, out.shape[2]):
            merge_partial_(part_of(out, 2, a, n), part_of(lse, 2, a, n), part_of(src_out, 2, pos, n),
                           part_of(src_lse, 2, pos, n))

    def _add(self, op: AddGrad, bufs: Buffers, pending) -> None:
        src, dst = bufs.get(op.src), bufs.accumulator(op.dst)
        for d, s in zip(dst, src):
            if op.heads is not None:
                d = d.narrow(1, op.heads[0], op.heads[1] - op.heads[0])
            for a, pos, n in _parts(op.into, d.shape[2]):
                part_of(d, 2, a, n).add_(part_of(s, 2, pos, n))

    def _copy(self, op: Copy, bufs: Buffers, pending) -> None:
        src, dst = bufs.get(op.src), self._created(bufs, op.dst)
        if op.src.kind == "o" and op.dst.kind == "y":  # these rows are finished (a Ulysses group's output)
            self._finish_rows(op.src, *src, op.rows)
        # range by range: gathering the source rows first (_take) would copy them twice
        rows = list(_parts(op.rows, src[0].shape[2]))
        for d, s in zip(dst, src):  # a cast to a finished kind keeps the leading tensors (out, not lse)
            if op.heads is not None:
                d = d.narrow(1, op.heads[0], op.heads[1] - op.heads[0])
            for a, pos, n in _parts(op.into, d.shape[2]):
                for start, off, m in _overlaps(rows, pos, pos + n):
                    part_of(d, 2, a + off, m).copy_(part_of(s, 2, start, m))

    def _rowstats(self, op: RowStats, bufs: Buffers, pending) -> None:
        (dout,) = bufs.get(op.dout)
        out, lse = bufs.get(op.out)
        d_out, d_lse, d_delta = bufs.accumulator(op.dst, filled=op.rows is not None)
        for a, _, n in _parts(op.rows, d_out.shape[2]):
            o = part_of(out, 2, a, n)
            part_of(d_out, 2, a, n).copy_(part_of(dout, 2, a, n))
            part_of(d_lse, 2, a, n).copy_(part_of(lse, 2, a, n))
            if op.dst in self._delta_keys:  # in fp32 (fp64 for fp64), out being kept in the inputs' dtype
                acc = d_delta.dtype
                torch.sum(part_of(dout, 2, a, n).to(acc) * o.to(acc), dim=-1, out=part_of(d_delta, 2, a, n))
            else:  # nothing reads these rows' delta (:meth:`_delta`): the kernel takes their output
                part_of(d_delta, 2, a, n).fill_(float("nan"))
            if self.offset_grad is not None:  # rows this rank finished in the forward (its group's head slice)
                heads = self._sink_heads(op.dst)
                add_sink_grad_(self.offset_grad[heads], part_of(dout, 2, a, n), o, part_of(lse, 2, a, n),
                               self._sink[heads])
        make = self.backward_rows
        if make is not None:  # these rows' output is here: the kernel may take it instead of a stand-in
            # (``out`` is a saved forward buffer: never recycled while the backward runs); the
            # rows of a later RowStats make it again
            bufs.derived[op.dst] = make(d_out, d_lse, d_delta, out=out)

    def _free(self, op: Free, bufs: Buffers, pending) -> None:
        bufs.free(op.key)

    HANDLERS = {Post: _post, Wait: _wait, Attend: _attend, AttendBackward: _attend_backward, MergeOut: _merge,
                AddGrad: _add, Copy: _copy, RowStats: _rowstats, Free: _free}


"""The executor's block ops: :class:`~megatron_mesh.plan.ir.Attend` and
:class:`~megatron_mesh.plan.ir.AttendBackward` (a mixin of :class:`~.executor.Executor`).

A forward block's kernel calls merge straight into the rows' fp32 accumulator, one op per call
(:func:`~.fused.merge_`), or are copied where no earlier op wrote those rows (one
``_foreach_copy_`` for out and lse); a backward block's gradients go to the executor's queue of
copies and adds (:mod:`.deferred`), issued a few ops at a time. A block reading several key/value
buffers that lie one after another in the arena reads them as one view (:meth:`Buffers.span`),
else as one concatenated copy per tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..plan.ir import Attend, AttendBackward, Key
from ..plan.sel import sel_len
from .buffers import Buffers, parts as _parts, zero
from .fused import merge_
from .masks import backward_partials, block_mask, forward_partials
from .merge import part_of
from .sinks import sink_weight

__all__ = ["BlockOps", "take"]


def take(t: Tensor | None, sel, dim: int = 2) -> Tensor | None:
    """Tokens ``sel`` of ``t`` along ``dim``: a view for one range, a copy for several."""
    if sel is None or t is None:
        return t
    if len(sel) == 1:
        a, b = sel[0]
        return part_of(t, dim, a, b - a)
    return torch.cat([t.narrow(dim, a, b - a) for a, b in sel], dim=dim)


def _overlaps(parts, r0: int, r1: int):
    """Where block rows [r0, r1) go: (buffer start, offset in [r0, r1), length) for each range of
    ``parts`` (:func:`~.buffers.parts`) they overlap."""
    for a, pos, n in parts:
        lo, hi = max(r0, pos), min(r1, pos + n)
        if lo < hi:
            yield a + lo - pos, lo - r0, hi - lo


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


class BlockOps:
    """Attend / AttendBackward handlers; the executor supplies ``plan``, ``kernel``, ``scale``,
    ``timer``, ``backward_rows``, ``_sink`` (and ``_sink_heads``) and, per op, ``_at`` (its index),
    ``_first``, ``_single``, ``_fills``, ``_queue``."""

    def _kv(self, op, bufs: Buffers) -> tuple[Tensor, Tensor, list[int]]:
        lengths = [sel_len(op.col(i), self.plan.tokens(key)) for i, key in enumerate(op.kv)]
        span = bufs.span(self._at)
        if span is not None:  # the pieces lie one after another in the arena: one view
            return span[0], span[1], lengths
        pair = bufs.gather(self._at)
        if pair is not None:  # k and v of the pieces in one gather
            return pair[0], pair[1], lengths
        pieces = []
        for i, key in enumerate(op.kv):
            k, v = bufs.get(key)
            pieces.append((take(k, op.col(i)), take(v, op.col(i))))
        if len(pieces) == 1:
            return pieces[0][0], pieces[0][1], lengths
        return torch.cat([p[0] for p in pieces], dim=2), torch.cat([p[1] for p in pieces], dim=2), lengths

    def _created(self, bufs: Buffers, key: Key, zeros: list | None = None) -> tuple[Tensor, ...]:
        """Accumulator ``key`` of a block or copy: where this op creates it, filled only in the rows
        the plan says no block or whole copy writes before they are read (``creation_fills``;
        all of them where the plan names none); ``zeros``: see :meth:`Buffers.accumulator`."""
        return bufs.accumulator(key, rows=self._fills.get(key), zeros=zeros)

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
            result = bufs.results.get(op.out)  # (runtime/results.py)
            single = _fresh(self._single, op.out) if result is not None else []
            # with attention sinks a row going straight is scaled as it goes: in fp32, rounded once
            sink = None if result is None or self._sink is None else self._sink[self._sink_heads(op.out)]
            # each kernel call's partial result merges straight into the rows' accumulator; on rows
            # nothing has written yet (still 0, -inf) a copy gives the same values, and on rows
            # nothing else writes the copy goes into the result itself (its lse into the accumulator)
            for r0, r1, o, l in forward_partials(self.kernel, take(q, op.rows), k, v, mask, self.scale,
                                                 self.plan.kernel_calls):
                dsts, srcs = [], []  # the call's copies, as one op
                for a, off, n in _overlaps(rows, r0, r1):
                    for s, m, first in _split_fresh(fresh, a, n):
                        src_o, src_l = part_of(o, 2, off + s - a, m), part_of(l, 2, off + s - a, m)
                        if not first:
                            merge_(part_of(out, 2, s, m), part_of(lse, 2, s, m), src_o, src_l)
                            continue
                        for s2, m2, into in _split_fresh(single, s, m):
                            o2, l2 = part_of(src_o, 2, s2 - s, m2), part_of(src_l, 2, s2 - s, m2)
                            if into and sink is not None:
                                torch.mul(o2, sink_weight(l2, sink), out=part_of(result[0], 2, s2, m2))
                                dsts.append(part_of(lse, 2, s2, m2))
                                srcs.append(l2)
                                continue
                            dsts += [part_of(result[0] if into else out, 2, s2, m2), part_of(lse, 2, s2, m2)]
                            srcs += [o2, l2]
                if dsts:
                    torch._foreach_copy_(dsts, srcs)
            self._fill_unwritten(bufs, op.out, fresh)

    def _grad_to(self, bufs: Buffers, key: Key, tensors, part, rows, fresh, heads: int, single=()) -> None:
        """Queue block gradient ``part`` (per tensor, its rows [r0, r1) of the block) into ``rows``
        (:func:`_overlaps` parts) of accumulator ``key``: a copy where no op wrote them yet, into
        the result itself on rows ``single`` (:func:`_fresh` of the block's single writes)."""
        r0, r1, grads = part
        ident = bufs.ident(key)
        result = bufs.results.get(key)
        for a, off, n in _overlaps(rows, r0, r1):
            for s, m, first in _split_fresh(fresh, a, n):
                for s2, m2, into in _split_fresh(single, s, m) if first else ((s, m, False),):
                    for t, (acc, g) in enumerate(zip(result if into else tensors, grads)):
                        self._queue.put(not first, part_of(acc, 2, s2, m2), part_of(g, 2, off + s2 - a, m2),
                                        (key, t, s2, s2 + m2, 0, heads), dst_id=None if into else ident, straight=into)

    def _grads_whole(self, bufs: Buffers, op: AttendBackward, cols, part, total: int) -> bool:
        """Where the block's new dK/dV partials lie one after another in the arena
        (:attr:`~megatron_mesh.plan.arena.ScratchLayout.grad_spans`) and this kernel call's
        gradients are all their columns, written first: one copy per tensor, queued."""
        span = bufs.grad_span(self._at)
        if span is None or part[1] != 0 or part[2] != total or \
                any(fresh != [[0, acc[0].shape[2]]] or self._single.get(key) for key, acc, _, fresh in cols):
            return False
        heads = span[0].shape[1]
        for t, (acc, g) in enumerate(zip(span, part[3:])):  # one write over every buffer's rows
            where = [(key, t, 0, a[0].shape[2], 0, heads) for key, a, _, _ in cols]
            self._queue.put(False, acc, g, where)
        for key, acc, _, fresh in cols:
            fresh.clear()
            self._queue.written.add(key)
            self._queue.arena.add(bufs.ident(key))
        return True

    def _attend_backward(self, op: AttendBackward, bufs: Buffers, pending) -> None:
        (q,) = bufs.get(op.q)
        dout, lse, delta = bufs.get(op.do)
        k, v, lengths = self._kv(op, bufs)
        mask = block_mask(self.plan, op, q.device)
        with self.timer("compute"):
            make = self.backward_rows  # once per buffer of rows, not per block
            made = None if make is None else tuple(take(t, op.rows) for t in
                                                   bufs.derive(op.do, lambda: make(dout, lse, delta)))
            zeros: list = []  # the new accumulators' zeros, set in one op
            (acc_q,) = self._created(bufs, op.dq, zeros)
            rows = list(_parts(op.rows, acc_q.shape[2]))
            fresh_q = _fresh(self._first, op.dq)  # rows still 0: a copy instead of an add
            single = {key: _fresh(self._single, key) for key in (op.dq, *op.dkv) if key in bufs.results}
            cols, start = [], 0  # each key buffer's accumulators, where its block columns go, its fresh rows
            fresh_kv: dict[Key, list[list[int]]] = {}  # one list per buffer: a block may name it for several ranges
            for i, (key, n_cols) in enumerate(zip(op.dkv, lengths)):
                acc = self._created(bufs, key, zeros)
                fresh = fresh_kv.get(key)
                if fresh is None:
                    fresh = fresh_kv[key] = _fresh(self._first, key)
                cols.append((key, acc, [(a, start + pos, n) for a, pos, n in _parts(op.col(i), acc[0].shape[2])],
                             fresh))
                start += n_cols
            zero(zeros)
            for part in backward_partials(self.kernel, take(dout, op.rows), take(q, op.rows), k, v,
                                          take(lse, op.rows), take(delta, op.rows), mask, self.scale,
                                          self.plan.kernel_calls, rows=made):
                if part[0] == "q":
                    self._grad_to(bufs, op.dq, (acc_q,), (part[1], part[2], part[3:]), rows, fresh_q,
                                  acc_q.shape[1], single.get(op.dq, ()))
                    continue
                if self._grads_whole(bufs, op, cols, part, start):
                    continue
                for key, acc, where, fresh in cols:
                    self._grad_to(bufs, key, acc, (part[1], part[2], part[3:]), where, fresh, acc[0].shape[1],
                                  single.get(key, ()))
            self._fill_unwritten(bufs, op.dq, fresh_q)
            for key, fresh in fresh_kv.items():
                self._fill_unwritten(bufs, key, fresh)

"""The executor's ops that move and combine buffers (a mixin of :class:`~.executor.Executor`):
:class:`~megatron_mesh.plan.ir.Post` / :class:`~megatron_mesh.plan.ir.Wait` (a round of
transfers), :class:`~megatron_mesh.plan.ir.MergeOut` (a partial output into an accumulator),
:class:`~megatron_mesh.plan.ir.AddGrad` / :class:`~megatron_mesh.plan.ir.Copy` (queued row adds and
copies), :class:`~megatron_mesh.plan.ir.RowStats` (a backward's finished rows: dout, lse, delta)
and :class:`~megatron_mesh.plan.ir.Free`. The block ops are :class:`~.blocks.BlockOps`.

Each handler is ``(self, op, bufs, pending)``: ``pending`` maps a posted round to its transfer
(the communicator's work, the buffers arriving, the sends kept alive until it completes). They
read the executor's ``comm``, ``timer``, the call's queue (``_queue``, :mod:`.deferred`), its
sink (``_sink``, ``_finish_rows``, ``_sink_heads``, ``offset_grad``: :mod:`.sinks`) and the facts it
made once per plan (``_delta_keys``, ``backward_rows``).

Example: on rank 2 of a ring, the ``Post`` of round 1 sends its key/value buffer to rank 3 and
starts receiving rank 1's into the place the arena has for it; the ``Wait`` of round 1 waits for
that transfer and only then makes the received buffer readable (:meth:`Buffers.put`).
"""

from __future__ import annotations

import torch

from ..plan.ir import AddGrad, Copy, Free, MergeOut, Post, RowStats, Wait
from .blocks import _overlaps as _overlaps_rows
from .buffers import Buffers, arena_run, arena_run_by_buffer, parts as _parts
from .fused import merge_
from .merge import part_of
from .sinks import add_sink_grad_

__all__ = ["MoveOps"]


class MoveOps:
    """The move and combine handlers of :class:`~.executor.Executor` (see the module docstring)."""

    def _post(self, op: Post, bufs: Buffers, pending) -> None:
        # a transport reads a send until its round completes: keep the (contiguous) tensors alive
        sends = [(t.peer, x) for t in op.sends for x in bufs.wire(t.key)]
        arriving = []
        for t in op.recvs:
            tensors = bufs.create(t.key)
            arriving.append((t.key, tensors, bufs.made))
        recvs = [(t.peer, x) for t, (key, ts, ident) in zip(op.recvs, arriving) for x in bufs.wire(key, ts, ident)]
        # an all-to-all round (a Ulysses group's) is one collective call where the transport has one
        work = self.comm.exchange(op.group, sends, recvs) if op.group else self.comm.start(sends, recvs)
        pending[op.round] = (work, arriving, sends)

    def _wait(self, op: Wait, bufs: Buffers, pending) -> None:
        work, arriving, _ = pending.pop(op.round)
        with self.timer("wait"):
            work.wait()
        for key, tensors, ident in arriving:
            bufs.put(key, tensors, ident)

    def _merge(self, op: MergeOut, bufs: Buffers, pending) -> None:
        src_out, src_lse = bufs.get(op.src)
        out, lse = bufs.accumulator(op.dst)
        for a, pos, n in _parts(op.into, out.shape[2]):
            merge_(part_of(out, 2, a, n), part_of(lse, 2, a, n), part_of(src_out, 2, pos, n),
                   part_of(src_lse, 2, pos, n))

    def _add(self, op: AddGrad, bufs: Buffers, pending) -> None:
        src, dst = bufs.get(op.src), bufs.accumulator(op.dst)
        self._queue_parts(bufs, op, True, src, dst, [(a, pos, n, pos, n) for a, pos, n in
                                                     _parts(op.into, dst[0].shape[2])])

    def _queue_parts(self, bufs: Buffers, op, add: bool, src, dst, ranges) -> None:
        """Queue ``dst`` rows (+)= ``src`` rows (``ranges``: (dst start, _, length, src start, _))
        per tensor, on ``op.heads`` of ``dst`` (None: all)."""
        h0, h1 = op.heads if op.heads is not None else (0, dst[0].shape[1])
        dst_id, src_id = bufs.ident(op.dst), bufs.ident(op.src)
        for t, (d, s) in enumerate(zip(dst, src)):  # a cast to a finished kind keeps the leading tensors
            if op.heads is not None:
                d = d.narrow(1, h0, h1 - h0)
            for a, _, n, pos, _ in ranges:
                self._queue.put(add, part_of(d, 2, a, n), part_of(s, 2, pos, n), (op.dst, t, a, a + n, h0, h1),
                                dst_id=dst_id, src_key=op.src, src_id=src_id)

    def _copy(self, op: Copy, bufs: Buffers, pending) -> None:
        run = bufs.layout.copy_runs.get(bufs.at)
        if run is not None:  # one of consecutive copies between two runs of memory: issued as one
            if bufs.at == run.ops[0]:
                self._copy_run(run, bufs)
            return
        src, dst = bufs.get(op.src), self._created(bufs, op.dst)
        if op.src.kind == "o" and op.dst.kind == "y":  # these rows are finished (a Ulysses group's output)
            if self._queue.touches((op.src,)):
                self._queue.flush()
            self._finish_rows(op.src, *src, op.rows)
        # range by range: gathering the source rows first (_take) would copy them twice
        rows = list(_parts(op.rows, src[0].shape[2]))
        ranges = [(a + off, None, m, start, None) for a, pos, n in _parts(op.into, dst[0].shape[2])
                  for start, off, m in _overlaps_rows(rows, pos, pos + n)]
        self._queue_parts(bufs, op, False, src, dst, ranges)

    def _copy_run(self, run, bufs: Buffers) -> None:
        """The copies of ``run`` (:class:`~megatron_mesh.plan.arena_runs.CopyRun`) as one write per
        tensor, from one run of memory into another: whole arena buffers side by side are one
        view made once per arena (:func:`~.buffers.arena_run`), consecutive rows (or head slices) of one
        buffer one view (three)."""
        ops = self.rank_plan.ops(bufs.direction)
        first, last = ops[run.ops[0]], ops[run.ops[-1]]
        srcs = [ops[j].src for j in run.ops]
        if run.heads is not None:  # whole buffers into consecutive head slices of the same rows
            src = arena_run_by_buffer(bufs, run.ops[0], len(run.ops))
        elif run.src is not None:  # whole buffers side by side
            src = arena_run(bufs, run.ops[0], run.src, first.src.kind)
        else:  # consecutive rows of one buffer (a Ulysses group's rows going home)
            a, b = run.src_rows
            src = bufs.get(first.src)
            if first.src.kind == "o" and first.dst.kind == "y":  # these rows are finished (their sink)
                if self._queue.touches((first.src,)):
                    self._queue.flush()
                for j in run.ops:  # copy by copy, as each would (the same ranges: the same bits on a CPU too)
                    self._finish_rows(first.src, *src, ops[j].rows)
            src = [part_of(t, 2, a, b - a) for t in src]
        if run.dst is None:  # rows, or head slices of rows, of one buffer
            made = self._created(bufs, first.dst)
            a, b = run.dst_rows if run.dst_rows is not None else (0, made[0].shape[2])
            dst = [part_of(t, 2, a, b - a) for t in made]
            if run.heads is None:
                where = [(first.dst, t, a, b, 0, d.shape[1]) for t, d in enumerate(dst)]
            else:
                h0, h1 = run.heads
                dst = [d.narrow(1, h0, h1 - h0).unflatten(1, (len(run.ops), -1)) for d in dst]
                where = [(first.dst, t, a, b, h0, h1) for t in range(len(dst))]
            dst_ids = [bufs.ident(first.dst)]
        else:  # new whole buffers side by side, each made where its own copy would make it
            at = bufs.at
            where, dst_ids = [], []
            for j in run.ops:
                bufs.at, self._fills = j, self._all_fills.get(j, {})
                made = self._created(bufs, ops[j].dst)
                where += [(ops[j].dst, t, 0, made[t].shape[2], 0, made[t].shape[1]) for t in range(len(run.dst))]
                dst_ids.append(bufs.ident(ops[j].dst))
            bufs.at, self._fills = at, self._all_fills.get(at, {})
            dst = arena_run(bufs, run.ops[0], run.dst, last.dst.kind, "dst")
        src_ids = [bufs.ident(k) for k in srcs]
        for t, (d, s) in enumerate(zip(dst, src)):
            self._queue.put(False, d, s, [w for w in where if w[1] == t], dst_id=dst_ids, src_key=srcs, src_id=src_ids)

    def _rowstats(self, op: RowStats, bufs: Buffers, pending) -> None:
        (dout,) = bufs.get(op.dout)
        out, lse = bufs.get(op.out)
        d_out, d_lse, d_delta = bufs.accumulator(op.dst, filled=op.rows is not None)
        for a, _, n in _parts(op.rows, d_out.shape[2]):
            o = part_of(out, 2, a, n)
            torch._foreach_copy_([part_of(d_out, 2, a, n), part_of(d_lse, 2, a, n)],
                                 [part_of(dout, 2, a, n), part_of(lse, 2, a, n)])
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

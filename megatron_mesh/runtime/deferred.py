"""Copies and gradient adds into accumulators, issued together.

A backward block's gradients go into several accumulators (dQ of its rows, dK and dV of each
key/value buffer it read), a received gradient partial is added into its buffer (``AddGrad``), a
Ulysses reorder copies token ranges into a group's buffer (``Copy``): each was one torch op per
tensor and range -- a launch on a GPU, and the host's time at a few thousand tokens per rank. The
executor queues them here instead and issues the queue as a few ``torch._foreach_copy_`` /
``torch._foreach_add_`` calls (one dispatch for many tensors) when something is about to read or
send what they write, or to reuse their memory (:meth:`Deferred.touches`), and at the end of a
direction.

Order and values: writes into the same rows keep their order (a copy, then the adds, as queued),
so every element sees the same operations in the same order as issued one by one -- bitwise the
same results, independent of timing. One call never holds two writes into overlapping rows (on
CUDA ``_foreach_add_`` may run the pairs of a list together).

Cost: a queued source (a kernel's gradient output, a received partial) lives until the queue is
issued -- at most until the next round a rank posts, so at most one step's kernel outputs (see
docs/design.md, "Layouts in memory").

Worked example (ring backward, one step): the block over kv2 queues "add dq3 += dq", "copy dkv2
<- dk, dv"; the next round sends dkv2, so the queue goes out as two calls: ``_foreach_copy_([dk2,
dv2], [dk, dv])``, then ``add_`` of dq3 -- three tensors, two ops instead of three.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..plan.hostops import write_calls

__all__ = ["Deferred", "Write"]


class Write(NamedTuple):
    """One queued write: ``dst`` (+)= ``src``. ``where``: (buffer key, tensor index, first row,
    stop row, first head, stop head) of ``dst`` -- what two writes of one call must not share --
    or a list of them (a run of the arena over several buffers)."""

    add: bool
    dst: Tensor
    src: Tensor
    where: tuple
    straight: bool = False  # a copy into a result in the inputs' dtype (runtime/results.py)


class Deferred:
    """The queue of one direction's pending writes (see the module docstring)."""

    def __init__(self):
        self.writes: list[Write] = []
        self.written: set = set()  # buffer keys the queue writes
        self.read: set = set()  # buffer keys it reads
        self.arena: set = set()  # the arena buffers, (op index, key), it writes or reads

    def __bool__(self) -> bool:
        return bool(self.writes)

    def put(self, add: bool, dst: Tensor, src: Tensor, where: tuple, dst_id=None, src_key=None, src_id=None,
            straight: bool = False) -> None:
        """Queue ``dst`` (+)= ``src`` (``where``: see :class:`Write`); ``dst_id`` / ``src_id``:
        the arena buffers written / read, ``src_key``: the buffer read (None: a kernel's output;
        a list of them: a run of several, as are then the ids).
        A write that reads what the queue writes, or writes what it reads, issues the queue first."""
        keys = [w[0] for w in where] if isinstance(where, list) else [where[0]]
        srcs = src_key if isinstance(src_key, list) else [] if src_key is None else [src_key]
        if any(k in self.written for k in srcs) or any(k in self.read for k in keys):
            self.flush()
        self.writes.append(Write(add, dst, src, where, straight))
        self.written.update(keys)
        self.read.update(srcs)
        for i in (dst_id, src_id):  # a run of several buffers: each of them
            if isinstance(i, list):
                self.arena.update(x for x in i if x is not None)
            elif i is not None:
                self.arena.add(i)

    def touches(self, keys) -> bool:
        """Whether a queued write writes or reads any of ``keys``."""
        return bool(self.writes) and any(k in self.written or k in self.read for k in keys)

    def flush(self) -> None:
        """Issue the queue in as few calls as it allows (:func:`~megatron_mesh.plan.hostops.write_calls`:
        the grouping the planner's host model counts)."""
        if not self.writes:
            return
        # one call writes one dtype: a copy into a result in the inputs' dtype (runtime/results.py)
        # is a call of its own (a _foreach_copy_ of mixed destinations runs as a copy per tensor)
        for group in write_calls([(w.add or ("result" if w.straight else False), w.where) for w in self.writes]):
            ws = [self.writes[i] for i in group]
            if len(ws) == 1:
                (ws[0].dst.add_ if ws[0].add else ws[0].dst.copy_)(ws[0].src)
            elif ws[0].add:
                torch._foreach_add_([w.dst for w in ws], [w.src for w in ws])
            else:
                torch._foreach_copy_([w.dst for w in ws], [w.src for w in ws])
        self.writes.clear()
        self.written.clear()
        self.read.clear()
        self.arena.clear()

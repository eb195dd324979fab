"""The executor: walks one rank's plan with an injected communicator and block kernel.

There is no rank logic here: which buffers exist, what is computed with which mask, what goes
to whom and in which round all come from the :class:`~megatron_mesh.plan.RankPlan`. The op
types dispatch through one table (:data:`Executor.HANDLERS`), whose handlers are mixins: the
blocks' in :mod:`.blocks`, the transfers', merges', copies', adds' and row statistics' in
:mod:`.moves`; the input buffers are cut from the local tensors by :mod:`.cuts`. Partial outputs
and gradients accumulate in fp32 buffers that belong to the executor (kernel outputs are only
ever read, never kept as accumulators), in the order the plan fixes, so results are bitwise
reproducible.

Tensors are [B, H, T, D] (heads before tokens) inside the executor, as *views*: the public API
hands it ``x.permute(1, 2, 0, 3)`` of Megatron's [T, B, H, D] tensors, and its own buffers are
token-major too (:mod:`.buffers`: each at its place in the rank's arena, laid out once per plan,
:mod:`megatron_mesh.plan.arena`), so neither side copies to change layouts and a transfer moves a
buffer's storage as it is (a rank's own chunk too). A buffer is copied only where it is cut from
several token ranges or one head slice that a block reads or that is sent (a head slice only
copies read stays a view). The one stride the kernels cannot take is a head_dim that is not
stride 1 (``buf[..., ::2]``, a projection stored [d, h] and transposed, a broadcast head_dim): such
an input (or dout) is copied once per pass, at entry (:func:`~megatron_mesh.kernels.base.head_dim_dense`),
instead of once per block that reads it.

Few ops per step (the host's time sets the pace at a few thousand tokens per rank): a merge is one
op (:mod:`.fused`), copies and gradient adds wait in a queue issued as a few ``_foreach_*`` calls
(:mod:`.deferred`), a block's key/value pieces are one view where they lie side by side in the
arena; :mod:`megatron_mesh.plan.hostops` counts what is left, for the planner.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from torch import Tensor

from ..comm.base import Communicator, Work
from ..kernels.base import BlockKernel, head_dim_dense
from ..plan.arena import copied_only, cut_keys
from ..plan.sel import union_intervals
from ..plan.ir import (AddGrad, Attend, AttendBackward, Copy, Free, Key, MergeOut, Plan, Post, RankPlan, RowStats,
                       Wait, op_keys)
from ..plan.shape import AttentionShape
from .blocks import BlockOps
from .buffers import Arenas, Buffers, accumulator_dtype, parts as _parts
from .cuts import InputCuts
from .deferred import Deferred
from .merge import part_of
from .moves import MoveOps
from .results import finish_result, straight_results
from .sinks import add_sink_grad_, apply_sink_

__all__ = ["Executor", "ForwardResult", "accumulator_dtype", "Buffers"]


@dataclass
class ForwardResult:
    out: Tensor  # [B, H, T, D] accumulator dtype (fp32; fp64 for fp64 inputs) or, where rows went
    # straight into it (runtime/results.py), the inputs' dtype; token-major storage
    lse: Tensor  # [B, H, T] accumulator dtype
    saved: dict[Key, tuple[Tensor, ...]]  # forward buffers the backward reads


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


class Executor(InputCuts, BlockOps, MoveOps):
    """Runs ``plan.rank(comm.rank)`` with ``comm`` and ``kernel``.

    ``timer``, when given, is called as ``timer("compute")`` / ``timer("wait")`` and must return
    a context manager wrapped around each kernel call / each wait for a round (e.g. Megatron's
    timers)."""

    def __init__(self, plan: Plan, comm: Communicator, kernel: BlockKernel, scale: float,
                 timer: Callable[[str], ContextManager] | None = None, arenas: Arenas | None = None):
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
            d: copied_only(rp, d) for d in ("forward", "backward")})
        self._cut_keys = plan.memo(("cut keys", comm.rank), lambda: {d: cut_keys(rp, d) for d in ("forward", "backward")})
        self.timer = timer or (lambda what: contextlib.nullcontext())
        self.arenas = arenas  # where its buffers live (None: the process's, runtime/state.py RUNTIME.arenas)
        self._sink: Tensor | None = None  # the call's softmax_offset in the accumulators' dtype (runtime/sinks.py)
        self._all_fills: dict = {}  # the direction's creation fills by op (a run of copies reads its ops')
        self.offset_grad: Tensor | None = None  # the last backward's d softmax_offset over the rows it finished
        self._singles: dict = {}  # the direction's single writes by op (results.py)

    # -- public ----------------------------------------------------------------------------------
    def forward(self, q: Tensor, k: Tensor, v: Tensor, softmax_offset: Tensor | None = None) -> ForwardResult:
        """q [B, H, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv] (views of any strides);
        ``softmax_offset`` [H]: attention sinks, applied where rows are finished (:mod:`.sinks`).
        Returns the out (fp32, or q's dtype where rows went straight into it: :mod:`.results`;
        token-major storage) and the fp32 lse."""
        q, k, v = head_dim_dense(q, k, v)
        rp = self.rank_plan
        self._set_sink(softmax_offset, q.dtype)
        bufs = self._buffers(q, k, v, "forward")
        self._singles = straight_results(self.plan, self.comm.rank, bufs)
        self._inputs(bufs, rp.forward_inputs, {"q": (q,), "kv": (k, v)}, self._copied_only["forward"])
        self._run("forward", bufs)
        final = bufs.accumulator(rp.output)
        out, lse = final if len(final) == 2 else (final[0], None)  # a finished output ("y") has no lse
        if lse is not None:  # the rank's own rows, all merged (a Ulysses plan's are finished by its casts)
            self._finish_rows(rp.output, out, lse, None)
        (out,) = finish_result(self.plan, self.comm.rank, bufs, rp.output, (out,))
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
        bufs = self._buffers(q, k, v, "backward")
        self._singles = straight_results(self.plan, self.comm.rank, bufs)
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
            bufs.put(key, tensors)
            bufs.read_only.add(key)
        self._run("backward", bufs)
        (dq,) = finish_result(self.plan, self.comm.rank, bufs, rp.grad_q, bufs.accumulator(rp.grad_q))
        dk, dv = finish_result(self.plan, self.comm.rank, bufs, rp.grad_kv, bufs.accumulator(rp.grad_kv))
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
        # one cast: the product of an fp32 tensor and a 16-bit one is formed in fp32, the 16-bit
        # operand widened exactly -- the same values as casting both
        if rows is None:
            return (dout.to(acc) * out).sum(-1)
        if not rows:  # nothing reads it: none (a read would fail as loudly as NaN would)
            return None
        delta = torch.full(lse.shape, float("nan"), dtype=acc, device=lse.device)
        for a, b in rows:
            torch.sum(dout.narrow(2, a, b - a).to(acc) * out.narrow(2, a, b - a), dim=-1,
                      out=delta.narrow(2, a, b - a))
        return delta

    def _buffers(self, q: Tensor, k: Tensor, v: Tensor, direction: str) -> Buffers:
        b, h, t, d = q.shape
        shape = AttentionShape(t, b, h, k.shape[1], d, q.element_size(), v.shape[-1])
        # a communicator of one's own that does not derive from Communicator: the process's one group
        members = getattr(self.comm, "members", None)
        bufs = Buffers(self.plan, self.comm.rank, direction, shape, q.dtype, q.device, self.arenas, members)
        self._queue = bufs.queue = Deferred()
        return bufs

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

    # -- the loop ----------------------------------------------------------------------------------
    def _run(self, direction: str, bufs: Buffers) -> None:
        pending: dict[int, tuple[Work, list, list]] = {}
        handlers = self.HANDLERS
        first = self.plan.first_writes(self.comm.rank, direction)
        singles = self._singles
        fills = self.plan.creation_fills(self.comm.rank, direction, bufs.heads, bufs.kv_heads)
        queue = self._queue
        self._all_fills = fills  # a run of copies makes its buffers where their own ops would (moves._copy_run)
        for i, op in enumerate(self.rank_plan.ops(direction)):
            handler = handlers.get(type(op))
            if handler is None:
                raise TypeError(f"unknown plan op {op!r}")
            bufs.at = self._at = i
            self._first = first.get(i, {})  # a block's accumulator rows no earlier op wrote (plan.first_writes)
            self._single = singles.get(i, {})  # those it writes into the result itself (results.py)
            self._fills = fills.get(i, {})  # what to fill of an accumulator this op creates (plan.creation_fills)
            if queue and type(op) not in _QUEUED and queue.touches(_reads_of(op)):
                queue.flush()  # what the op reads or sends is written by a queued copy or add
            handler(self, op, bufs, pending)
        queue.flush()
        if pending:
            raise RuntimeError(f"plan left rounds {sorted(pending)} unwaited")

    HANDLERS = {Post: MoveOps._post, Wait: MoveOps._wait, Attend: BlockOps._attend,
                AttendBackward: BlockOps._attend_backward, MergeOut: MoveOps._merge, AddGrad: MoveOps._add,
                Copy: MoveOps._copy, RowStats: MoveOps._rowstats, Free: MoveOps._free}


# ops that queue their writes (the queue orders them itself) or touch no tensor
_QUEUED = frozenset({AddGrad, Copy, Free, Wait})


def _reads_of(op) -> tuple[Key, ...]:
    """The buffers an op reads or sends, and those it writes outside the queue (a backward
    block's gradients go to the queue)."""
    return op.reads() if type(op) is AttendBackward else op_keys(op)

"""Extra buffer memory of a plan on one rank: what the executor allocates beyond the user's
tensors, walked through the op list.

Rules (the executor's, see :mod:`megatron_mesh.runtime.executor`):

* a receive allocates its buffer at the ``Post`` (the transport writes into it in flight);
* an accumulator (partial output ``o``, ``dq``, ``dkv``) is allocated at its first write;
* an input cut from more than one token segment (a TASP slot: front + back sub-chunk) is a copy
  and counts from the start; single-segment inputs are views of the user's tensors and do not;
* ``Free`` releases a buffer.

The final output (out + lse) and the gradient accumulators of the rank's own chunk are listed
separately (``outputs``), not in the peaks: every mode needs them. Buffers the forward keeps for
the backward (``backward_chunks="keep"``) are in the forward peak, listed as ``saved``, and live
at the start of the backward; a kept partial output (a Ulysses group's span) is kept in the
inputs' dtype (:func:`kept_bytes`), its copy made at the end of the forward.

Worked example (ring attention, P = 2, forward): round 1 allocates the incoming KV chunk (2
tensors of T tokens x Hkv heads), the accumulator of the own output is an output, so the forward
peak is one KV chunk; the backward receives KV and then the incoming dK/dV (fp32), and holds the
dK/dV partial of the remote chunk while it travels: peak KV + 2 dKV.

The executor holds its buffers in an arena per rank, laid out once per plan
(:func:`~.arena.scratch_layout`: each buffer at a fixed place, freed places taken again) and kept
from call to call, one for both directions: ``held`` is the larger direction's arena (at least its
live peak, plus whatever its first-fit placement leaves between), held by the process between
calls too (the largest plan's seen on that rank), plus the buffers the forward keeps for the
backward while a step runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from .accounting import FP32, key_bytes
from .arena import scratch_layout
from .shape import AttentionShape
from .ir import AddGrad, Attend, AttendBackward, Copy, Free, Key, MergeOut, Plan, Post, RowStats, Wait

__all__ = ["BufferMemory", "buffer_memory", "kept_bytes"]


@dataclass(frozen=True)
class BufferMemory:
    """Bytes on one rank (see the module docstring)."""

    forward_peak: int
    backward_peak: int
    saved: int
    outputs: int
    held: int  # what the executor holds: its arena (the larger direction's) + the saved buffers

    @property
    def peak(self) -> int:
        return max(self.forward_peak, self.backward_peak)


class _Walk:
    def __init__(self, plan: Plan, shape: AttentionShape, exclude):
        self.plan, self.shape, self.exclude = plan, shape, set(exclude)
        self.live: dict = {}
        self.total = self.peak = 0

    def bytes(self, key) -> int:
        return key_bytes(self.plan, key, self.shape)

    def add(self, key, n: int | None = None) -> None:
        if key in self.live or key in self.exclude:
            return
        n = self.bytes(key) if n is None else n
        self.total += n
        self.peak = max(self.peak, self.total)
        self.live[key] = n

    def free(self, key) -> None:
        self.total -= self.live.pop(key, 0)

    def run(self, ops) -> None:
        for op in ops:
            _WALK[type(op)](self, op)


# what each op type allocates or releases (a test checks every op type has an entry)
_WALK = {
    Post: lambda w, op: [w.add(t.key) for t in op.recvs],
    Wait: lambda w, op: None,
    Attend: lambda w, op: w.add(op.out),
    AttendBackward: lambda w, op: [w.add(k) for k in (op.dq, *op.dkv)],
    MergeOut: lambda w, op: w.add(op.dst),
    AddGrad: lambda w, op: w.add(op.dst),
    Copy: lambda w, op: w.add(op.dst),
    RowStats: lambda w, op: w.add(op.dst),
    Free: lambda w, op: w.free(op.key),
}


def kept_bytes(plan: Plan, key: Key, shape: AttentionShape) -> int:
    """Bytes of forward buffer ``key`` as the backward gets it: a partial output ``o`` in the
    inputs' dtype with its lse (the executor casts it at the end of the forward), any other as
    it is."""
    n = key_bytes(plan, key, shape)
    if key.kind == "o":
        h, _ = plan.head_counts(key, shape.heads, shape.kv_heads)
        n -= shape.batch * h * plan.tokens(key) * shape.v_head_dim * (max(FP32, shape.itemsize) - shape.itemsize)
    return n


def buffer_memory(plan: Plan, shape: AttentionShape, rank: int = 0) -> BufferMemory:
    """Peak extra buffer bytes of ``rank`` in the forward and the backward of ``plan``."""
    rp = plan.rank(rank)
    outputs = (rp.output, rp.grad_q, rp.grad_kv)
    out_bytes = sum(key_bytes(plan, k, shape) for k in outputs)

    fwd = _Walk(plan, shape, outputs)
    for key, segs in rp.forward_inputs.items():
        if len(segs) > 1 or key.heads >= 0:  # cut by copying (a view otherwise)
            fwd.add(key)
    fwd.run(rp.forward)
    kept = {k: kept_bytes(plan, k, shape) for k in rp.saved}
    # the kept copies of partial outputs are made at the end, while the originals still live
    fwd.peak = max(fwd.peak, fwd.total + sum(n for k, n in kept.items() if k.kind == "o"))
    saved = sum(kept.values())

    bwd = _Walk(plan, shape, outputs)
    for key, n in kept.items():
        bwd.add(key, n=n)  # the forward's buffers, handed over
    for key, segs in rp.backward_inputs.items():
        if len(segs) > 1 or key.heads >= 0:
            bwd.add(key)
    bwd.run(rp.backward)
    arena = max(scratch_layout(plan, rank, d, shape).size for d in ("forward", "backward"))
    return BufferMemory(fwd.peak, bwd.peak, saved, out_bytes, arena + saved)

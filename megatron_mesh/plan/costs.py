"""Seconds a rank's compute stream spends on each op -- the compute half of
:func:`~.simulate.simulate` (its model is in that module's docstring).

``Attend``: 2 * batch * heads * (head_dim + v_head_dim) FLOPs (:func:`pair_flops`; 4 * head_dim at
equal dims) per (query, key) pair the kernel call computes (:func:`~.accounting.block_area`; a
masked block runs as the calls of its mask pieces, :func:`~.mask.mask_pieces`, as the runtime runs
it) at ``attention_flops``, plus ``kernel_latency``
per call, plus the fp32 merge into the accumulator at ``memory_bandwidth``: read and write the
accumulator, read the kernel's result in the input dtype (a copy -- read the result, write the
accumulator -- on rows no earlier op wrote, :meth:`~.ir.Plan.first_writes`; on rows it alone
writes, :func:`~.single_writes.single_writes`, a copy into the result in the input dtype, which
then needs no cast). ``AttendBackward``:
:data:`BACKWARD_FLOPS` x the forward FLOPs plus the dQ/dKV accumulation. Merges, gradient adds and
row statistics read two buffers and write one; a copy reads and writes the rows it moves (a cast
of an accumulator into the input dtype -- ``o`` -> ``y`` -- reads its fp32 values, not the row
statistics, and writes half the bytes in bf16).

Worked example: a causal block of n = 4096 tokens, 32 heads of 128, batch 1, computes
4096 * 4097 / 2 pairs = 4 * 32 * 128 * 8.39e6 = 1.37e11 FLOPs: 0.34 ms at 400 TFLOP/s, plus one
launch (5 us) and, in bf16, the merge of 32 * 4096 * (2 * 129 * 4 + 128 * 2 + 4) bytes (the fp32
accumulator and its lse read and written, the bf16 result and its fp32 lse read) at 3.35 TB/s
(0.05 ms) -- 0.03 ms when it is the first op to write those rows (a copy: 32 * 4096 * (129 * 4 +
128 * 2 + 4) bytes), 0.02 ms when it is the only one (its one call's result copied into the bf16
result: 32 * 4096 * (2 * 128 * 2 + 2 * 4) bytes; and those rows leave the result's cast, 32 * 4096
* 128 * 6 bytes, another 0.03 ms).
"""

from __future__ import annotations

from functools import lru_cache

from .accounting import FP32, block_area, buffer_bytes, key_bytes
from .ir import AddGrad, Attend, AttendBackward, Copy, MergeOut, Op, Plan, RowStats
from .mask import BlockKind, KernelCalls, Mask, block_pieces, call_groups
from .sel import sel_len, union_intervals
from .shape import AttentionShape
from .single_writes import result_keys, single_writes
from .topology import Topology

__all__ = ["BACKWARD_FLOPS", "pair_flops", "block_cost_parts", "compute_cost", "cost_signature", "fresh_rows",
           "masked_block", "result_casts"]

BACKWARD_FLOPS = 2.5  # backward FLOPs / forward FLOPs of one block (5 matmuls vs 2) at equal head dims


def pair_flops(shape: AttentionShape, heads: int, backward: bool = False) -> float:
    """FLOPs of one (query, key) pair over ``heads`` query heads and the batch. Forward: the score
    q.k (2 head_dim) and its share of P V (2 v_head_dim); backward: the score again, dP = dO V^T
    and dV (2 v_head_dim each), dQ and dK (2 head_dim each) -- :data:`BACKWARD_FLOPS` x the
    forward where the dims are equal (MLA's 192 / 128: 2.6x)."""
    d, dv = shape.head_dim, shape.v_head_dim
    return float(shape.batch * heads * (2 * (3 * d + 2 * dv) if backward else 2 * (d + dv)))


def fresh_rows(op, first: dict | None, single: dict | None = None) -> tuple[int, int, int, int]:
    """(query rows, key/value columns) a block writes first (:meth:`~.ir.Plan.first_writes` of its
    index): copied into the accumulator, not merged into / added to it; then (query rows, key/value
    columns) of those it writes straight into the result in the inputs' dtype
    (:func:`~.single_writes.single_writes` of its index: one kernel call writes them, nothing else)."""
    if not first:
        return (0, 0, 0, 0)
    n = {key: sum(s.stop - s.start for s in sel) for key, sel in first.items()}
    m = {key: sum(b - a for a, b in sel) for key, sel in single.items()} if single else {}
    if type(op) is Attend:
        return (n.get(op.out, 0), 0, m.get(op.out, 0), 0)
    return (n.get(op.dq, 0), sum(n.get(key, 0) for key in op.dkv), m.get(op.dq, 0),
            sum(m.get(key, 0) for key in op.dkv))


def block_cost_parts(plan: Plan, op, shape: AttentionShape, topo: Topology,
                     fresh: tuple[int, ...] = (0, 0, 0, 0)) -> tuple[float, float, float]:
    """A kernel call's seconds as (FLOPs, launches, accumulator traffic): its (query, key) pairs at
    ``attention_flops``, the launch latency per call and the fp32 accumulator traffic at
    ``memory_bandwidth``. A masked block runs as the kernel calls of its mask pieces
    (:func:`~.mask.mask_pieces`): their areas, one launch per call of
    :func:`~.mask.call_groups` for ``plan.kernel_calls`` (variable-length calls group pieces).
    ``fresh``: (rows, columns) of the block's accumulators no earlier op wrote (:func:`fresh_rows`):
    the runtime copies the result there (read it, write the accumulator: 2 of a merge's or an
    add's 3 passes); then (rows, columns) of those it copies into the result itself (written once:
    the inputs' dtype, no accumulator)."""
    calls = 1
    rows = sel_len(op.rows, plan.tokens(op.q))
    cols = sum(sel_len(op.col(i), plan.tokens(k)) for i, k in enumerate(op.kv))
    if op.mask == BlockKind.MASKED:
        pairs, calls, rows, cols = masked_block(
            plan.mask, plan.positions(op.q, op.rows),
            tuple(r for i, k in enumerate(op.kv) for r in plan.positions(k, op.col(i))), topo.mask_piece,
            plan.kernel_calls)
    else:
        pairs = block_area(plan, op)
    h, g = plan.head_counts(op.q, shape.heads, shape.kv_heads)
    d, dv = shape.head_dim, shape.v_head_dim
    flops = pair_flops(shape, h, backward=type(op) is not Attend) * pairs
    fresh_q, fresh_kv = min(fresh[0], rows), min(fresh[1], cols)
    single_q, single_kv = (min(fresh[2], fresh_q), min(fresh[3], fresh_kv)) if len(fresh) > 2 else (0, 0)
    # a merge reads and writes the fp32 accumulator and reads the block result, which the kernel
    # returns in the input dtype (torch's attention ops: out, dQ, dK, dV in q's dtype; lse fp32);
    # a first write reads the result and writes the accumulator
    a, e = max(FP32, shape.itemsize), shape.itemsize  # accumulators are fp32 (fp64 for fp64 inputs)

    def traffic(n: int, first: int, single: int, width: int, stats: int = 0) -> int:
        """Bytes of ``n`` rows (``first`` of them written first, ``single`` of those into the
        result) of ``width`` elements each (+ lse, which stays in fp32)."""
        acc, result = a * (width + stats), e * width + FP32 * stats
        return (n - first) * (2 * acc + result) + (first - single) * (acc + result) + single * 2 * result

    if type(op) is Attend:  # out (the value head dim) + lse per row and head
        moved = shape.batch * h * traffic(rows, fresh_q, single_q, dv, stats=1)
    else:  # dQ per row; dK and dV per column
        moved = shape.batch * (h * traffic(rows, fresh_q, single_q, d) + g * traffic(cols, fresh_kv, single_kv, d + dv))
    return flops / topo.attention_flops, calls * topo.kernel_latency, moved / topo.memory_bandwidth


@lru_cache(maxsize=4096)
def masked_block(mask: Mask, q_runs, k_runs, piece: int, kernel_calls: KernelCalls) -> tuple[int, int, int, int]:
    """A masked block's (pairs, kernel calls, rows, columns) as its mask pieces run it. Cached: the
    placements of one problem compute the same blocks (every mode's own block of a rank), and
    cutting a block of thousands of short documents into its pieces takes a while."""
    pieces = block_pieces(mask, q_runs, k_runs, piece)
    pairs = sum((r1 - r0) * (r1 - r0 + 1) // 2 if kind == BlockKind.CAUSAL else (r1 - r0) * (c1 - c0)
                for kind, (r0, r1), (c0, c1) in pieces)
    # a variable-length call's pieces follow each other in the block: packed as a view
    calls = max(1, len(call_groups(pieces, kernel_calls)))
    # the accumulators a masked block touches are its pieces' rows and columns (the runtime
    # merges and adds each call's partial where it belongs), not its whole buffers
    rows = sum(b - a for a, b in union_intervals([r for _, r, _ in pieces]))
    cols = sum(b - a for a, b in union_intervals([c for _, _, c in pieces]))
    return pairs, calls, rows, cols


def _block_cost(plan: Plan, op, shape: AttentionShape, topo: Topology, fresh=(0, 0, 0, 0)) -> float:
    return sum(block_cost_parts(plan, op, shape, topo, fresh))


def _combine_cost(plan: Plan, op, shape: AttentionShape, topo: Topology, fresh=(0, 0, 0, 0)) -> float:
    """A merge, gradient add or row statistics: read two buffers' worth and write one, at HBM
    bandwidth; a copy reads one and writes one (of the rows it moves)."""
    if type(op) is Copy:  # the rows it moves of the source (a head slice of the destination when op.heads)
        share = sel_len(op.rows, plan.tokens(op.src)) / plan.tokens(op.src)
        if op.src.kind == op.dst.kind:
            return 2 * key_bytes(plan, op.src, shape) * share / topo.memory_bandwidth
        return _cast_bytes(plan, op.src, op.dst.kind, shape) * share / topo.memory_bandwidth
    if type(op) is RowStats:
        return 3 * key_bytes(plan, op.dout, shape) * sel_len(op.rows, plan.tokens(op.dout)) / \
            plan.tokens(op.dout) / topo.memory_bandwidth
    return 3 * key_bytes(plan, op.src, shape) / topo.memory_bandwidth


_CAST_TO = {"o": "y", "dq": "gq", "dkv": "gkv"}  # an fp32 accumulator's kind -> its result's in the input dtype


def _cast_bytes(plan: Plan, src, kind: str, shape: AttentionShape) -> float:
    """Bytes a cast of accumulator ``src`` into a ``kind`` buffer (o -> y, dq -> gq, dkv -> gkv) moves:
    it reads the accumulator's values -- not an output's row statistics -- and writes them once in
    the input dtype."""
    h, g = plan.head_counts(src, shape.heads, shape.kv_heads)
    return buffer_bytes(kind, plan.tokens(src), shape, h, g) * (1 + max(FP32, shape.itemsize) / shape.itemsize)


def result_casts(plan: Plan, rank: int, direction: str, shape: AttentionShape, topo: Topology) -> float:
    """Seconds the compute stream spends after ``rank``'s ``direction`` casting the results the plan
    leaves in fp32 accumulators -- a plain plan's output ``o`` and gradients ``dq`` / ``dkv``, which
    the executor casts into the input dtype at the end -- priced as a plan's own cast (a hybrid's
    ``Copy o -> y``): read the values, write them once; rows one kernel call wrote straight into the
    result (:func:`~.single_writes.single_writes`) need none. 0 where the plan casts inside
    (its results are ``y`` / ``gq`` / ``gkv``) or the inputs are fp32 or fp64 (no cast)."""
    if max(FP32, shape.itemsize) == shape.itemsize:
        return 0.0
    moved = 0.0
    single = single_writes(plan, rank, direction, topo.mask_piece)
    for key in result_keys(plan, rank, direction):
        done = sum(b - a for d in single.values() for a, b in d.get(key, ()))  # written into the result
        moved += _cast_bytes(plan, key, _CAST_TO[key.kind], shape) * (1 - done / plan.tokens(key))
    return moved / topo.memory_bandwidth


# seconds the compute stream spends on each op type (communication ops are timed by their rounds)
_COSTS = {Attend: _block_cost, AttendBackward: _block_cost, MergeOut: _combine_cost, AddGrad: _combine_cost,
          Copy: _combine_cost, RowStats: _combine_cost}


def compute_cost(plan: Plan, op: Op, shape: AttentionShape, topo: Topology, fresh=(0, 0, 0, 0)) -> float:
    """Seconds the compute stream spends on ``op`` (0 for comm and Free ops); ``fresh``: see
    :func:`block_cost_parts`."""
    fn = _COSTS.get(type(op))
    return 0.0 if fn is None else fn(plan, op, shape, topo, fresh)


def cost_signature(plan: Plan, op: Op) -> tuple:
    """What an op's cost depends on (buffer sizes and masks, not which chunks, unless slots differ
    per chunk): ops of a dense plan repeat a handful of signatures."""
    kind = type(op)
    per_chunk = plan.slots_vary
    if kind is Attend or kind is AttendBackward:
        if per_chunk or op.mask == BlockKind.MASKED:
            return (kind, op)
        kv = op.kv
        return (kind, op.q.slot, op.q.span, op.q.heads, op.rows, op.cols, op.mask,
                kv[0].slot if len(kv) == 1 else tuple(k.slot for k in kv))
    if kind is Copy:
        return (kind, op.src.kind, op.dst.kind, op.src.span, op.dst.span, op.rows, op.into, op.heads)
    if kind is RowStats:
        return (kind, op.dout.slot, op.dout.span, op.dout.heads, op.rows, op.dout.chunk if per_chunk else 0)
    if kind in _COSTS:
        return (kind, op.src.kind, op.src.slot, op.src.span, op.src.heads, op.src.chunk if per_chunk else 0)
    return (kind,)

"""Rows of a rank's results that one kernel call writes and nothing else: :func:`single_writes`.

A plain plan (ring, Mesh, TASP) accumulates its rank's output and gradients in fp32 and its caller
returns them in the inputs' dtype. A row that one kernel call writes and no other op touches --
a short document's rows, the first portion of a long one, a rank's own keys no peer computes
with -- needs neither: the kernel's result (in the inputs' dtype) is the row's final value, so
the runtime copies it straight into the result (:mod:`megatron_mesh.runtime.executor`) instead of
copying it into fp32 and casting it back, and the simulator prices that copy
(:func:`~.costs.block_cost_parts`) and leaves those rows out of the casts
(:func:`~.costs.result_casts`). In bf16 that is 4 bytes an element moved instead of 12. The values
are the same bits: a bf16 value copied into fp32 and cast back is itself.

A block runs as one kernel call over all its rows and columns unless it is masked, when it runs
as the calls of its mask pieces (:func:`~.mask.mask_pieces`, with the device's piece size): a row
that two pieces cover is written twice (merged). A result that any op reads -- sends, copies
from -- is left out whole: its accumulator must hold every row.

Worked example (ring, 2 ranks, causal, documents [0, 3) and [3, 8) on the zigzag; rank 0 holds
positions 0-1 and 6-7): its own block is masked -- document 0's rows 0-1 against themselves, one
causal call; document 1's rows 6-7 against keys 6-7, one causal call -- and the step's block over
rank 1's keys 2-5 writes rows 6-7 again (keys 3-5 of document 1). Rows 0-1 of the output are
written once: copied into the bf16 result; rows 6-7 twice: accumulated in fp32 and cast at the end.
"""

from __future__ import annotations

from functools import lru_cache

from .ir import Attend, AttendBackward, Key, Plan
from .mask import BlockKind, Mask, block_pieces
from .sel import Sel, minus_intervals, union_intervals

__all__ = ["single_writes", "cast_rows", "result_keys", "CAST_KINDS"]

CAST_KINDS = ("o", "dq", "dkv")  # the fp32 accumulators a caller casts into the inputs' dtype


def result_keys(plan: Plan, rank: int, direction: str) -> tuple[Key, ...]:
    """The results of ``rank``'s ``direction`` its caller casts: the output ``o``, the gradients
    ``dq`` and ``dkv`` (none where the plan casts inside: a hybrid's ``y`` / ``gq`` / ``gkv``)."""
    rp = plan.rank(rank)
    keys = (rp.output,) if direction == "forward" else (rp.grad_q, rp.grad_kv)
    return tuple(k for k in keys if k.kind in CAST_KINDS)


def single_writes(plan: Plan, rank: int, direction: str, piece: int) -> dict[int, dict[Key, Sel]]:
    """For each block of ``rank``'s ``direction`` (by op index): the rows of each result
    (:func:`result_keys`) that it writes with one kernel call and that nothing else writes
    (``piece``: the mask piece the blocks run in). Once per plan."""
    return plan.memo(("single writes", rank, direction, piece), lambda: _single(plan, rank, direction, piece))


def cast_rows(plan: Plan, rank: int, direction: str, piece: int) -> dict[Key, tuple[tuple[int, int], ...]]:
    """For each result with rows in :func:`single_writes`: the rest of its rows, which its fp32
    accumulator holds at the end and the runtime casts into the result. Once per plan."""
    def make():
        done: dict[Key, list] = {}
        for writes in single_writes(plan, rank, direction, piece).values():
            for key, sel in writes.items():
                done.setdefault(key, []).extend(sel)
        return {key: tuple(minus_intervals([(0, plan.tokens(key))], union_intervals(sel))) for key, sel in done.items()}
    return plan.memo(("cast rows", rank, direction, piece), make)


def _single(plan: Plan, rank: int, direction: str, piece: int) -> dict[int, dict[Key, Sel]]:
    rp = plan.rank(rank)
    ops = rp.ops(direction)
    results = set(result_keys(plan, rank, direction)) - set(rp.saved)  # (a kept buffer is read whole)
    for op in ops:  # a result read as a source (sent, copied from) keeps every row in fp32
        for k in op.reads():
            if k in results and k not in op.writes():
                results.discard(k)
        if not results:
            return {}
    if not results:
        return {}
    writes: dict[Key, list] = {k: [] for k in results}  # key -> [(start, stop, weight, op index)]
    for i, op in enumerate(ops):
        kind = type(op)
        if kind is Attend or kind is AttendBackward:
            _block_writes(plan, op, i, piece, writes)
        else:
            for key in op.writes():
                if key in writes:  # a merge, add, copy or receive: never single
                    into = getattr(op, "into", None)
                    for a, b in ((0, plan.tokens(key)),) if into is None or getattr(op, "heads", None) else into:
                        writes[key].append((a, b, 2, -1))
    out: dict[int, dict[Key, list]] = {}
    for key, spans in writes.items():
        for i, a, b in _once(spans):
            out.setdefault(i, {}).setdefault(key, []).append((a, b))
    return {i: {k: tuple(v) for k, v in d.items()} for i, d in out.items()}


def _once(spans: list):
    """(op index, start, stop) of the ranges one block's single call covers and nothing else:
    a sweep over the writes' ends, with the covering weight and the weighted op index."""
    events = sorted([(a, w, w * i) for a, b, w, i in spans] + [(b, -w, -w * i) for a, b, w, i in spans])
    weight = who = 0
    j, n = 0, len(events)
    while j < n:
        pos = events[j][0]
        while j < n and events[j][0] == pos:
            weight += events[j][1]
            who += events[j][2]
            j += 1
        if weight == 1 and who >= 0 and j < n:
            yield who, pos, events[j][0]


def _block_writes(plan: Plan, op, i: int, piece: int, writes: dict) -> None:
    """The weighted ranges block ``i`` writes of each result: weight 1 where one of its kernel
    calls covers them, 2 where several do."""
    targets = [(op.out, op.q, op.rows)] if type(op) is Attend else [(op.dq, op.q, op.rows)]
    if type(op) is AttendBackward:
        targets += [(key, kv, op.col(j)) for j, (key, kv) in enumerate(zip(op.dkv, op.kv))]
    if not any(key in writes for key, _, _ in targets):
        return
    if op.mask == BlockKind.MASKED:
        q_runs = tuple(plan.positions(op.q, op.rows))
        k_runs = tuple(r for j, k in enumerate(op.kv) for r in plan.positions(k, op.col(j)))
        rows, cols = _coverage(plan.mask, q_runs, k_runs, piece)
    else:
        rows = cols = None  # one call: every row and column once
    _place(writes, targets[0], rows, plan, i, 0)
    start = 0
    for key, kv, sel in targets[1:]:
        n = sum(b - a for a, b in sel) if sel is not None else plan.tokens(kv)
        _place(writes, (key, kv, sel), cols, plan, i, start, n)
        start += n


def _place(writes: dict, target, cover, plan: Plan, i: int, side_start: int, length: int | None = None) -> None:
    """Map block ``i``'s block-local (start, stop, weight) ranges ``cover`` (None: all once) of one
    side onto its buffer's rows (``sel`` of them, from block offset ``side_start``)."""
    key, buf, sel = target
    if key not in writes:
        return
    segs = sel if sel is not None else ((0, plan.tokens(buf)),)
    if length is None:
        length = sum(b - a for a, b in segs)
    local = [(0, length, 1)] if cover is None else [
        (max(a, side_start) - side_start, min(b, side_start + length) - side_start, w)
        for a, b, w in cover if a < side_start + length and b > side_start]
    # block-local offsets -> buffer rows, segment by segment
    pos = 0
    for s0, s1 in segs:
        n = s1 - s0
        for a, b, w in local:
            lo, hi = max(a, pos), min(b, pos + n)
            if lo < hi:
                writes[key].append((s0 + lo - pos, s0 + hi - pos, w, i))
        pos += n


@lru_cache(maxsize=4096)
def _coverage(mask: Mask, q_runs, k_runs, piece: int) -> tuple[tuple, tuple]:
    """A masked block's block-local (start, stop, weight) rows and columns: weight 1 where one of
    its kernel calls (:func:`~.mask.mask_pieces`) covers them, 2 where several do."""
    pieces = block_pieces(mask, q_runs, k_runs, piece)
    return (_weights([r for _, r, _ in pieces]), _weights([c for _, _, c in pieces]))


def _weights(ranges) -> tuple:
    events = sorted([(a, 1) for a, _ in ranges] + [(b, -1) for _, b in ranges])
    out, count, j = [], 0, 0
    while j < len(events):
        pos = events[j][0]
        while j < len(events) and events[j][0] == pos:
            count += events[j][1]
            j += 1
        if count and j < len(events):
            out.append((pos, events[j][0], min(count, 2)))
    return tuple(out)

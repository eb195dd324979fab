"""Which rows of its accumulators a block writes first: :func:`first_writes`, read by the executor
(it copies there instead of merging or adding) and by the simulator (it prices a copy)."""

from __future__ import annotations

from ..sel import Segment, Sel, union_intervals
from .ops import AddGrad, Attend, AttendBackward, Copy, Free, Key, MergeOut

__all__ = ["first_writes"]


def _minus(segs: list[Segment], cut: list[Segment]) -> list[Segment]:
    """The parts of ``segs`` outside ``cut`` (both sorted, disjoint)."""
    out = []
    for a, b in segs:
        for c, d in cut:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append(Segment(a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append(Segment(a, b))
    return out


def first_writes(ops, tokens) -> dict[int, dict[Key, Sel]]:
    """For each block of ``ops`` (by index): the rows of each accumulator it adds into -- an
    :class:`Attend`'s output, an :class:`AttendBackward`'s dQ rows and dK/dV columns -- that no
    earlier op wrote. There the runtime copies a kernel call's result instead of merging it into
    the accumulator's initial (0, -inf) or adding it to zeros: the same values, one pass over
    the rows less (and for an output 2 ops instead of a merge's 9); the simulator prices them so.
    ``tokens(key)``: a buffer's rows. A write this does not follow row by row (a Post's receive,
    a Copy into a head slice, any other op) counts for the whole buffer; a Free forgets it.

    Example: ``attend q1 x kv1 causal -> o1`` then ``attend q1 x kv0.5 full -> o1`` on 4 rows:
    the first writes rows [0, 4) of o1 fresh, the second none: ``{0: {o1: ((0, 4),)}}``."""
    written: dict[Key, list[Segment]] = {}
    out: dict[int, dict[Key, Sel]] = {}

    def block(i: int, key: Key, sel) -> None:
        rows = list(sel) if sel is not None else [Segment(0, tokens(key))]
        fresh = _minus(rows, written.get(key, []))
        if fresh:
            out.setdefault(i, {})[key] = tuple(fresh)
        written[key] = list(union_intervals([*written.get(key, []), *rows]))

    for i, op in enumerate(ops):
        kind = type(op)
        if kind is Free:
            written.pop(op.key, None)
        elif kind is Attend:
            block(i, op.out, op.rows)
        elif kind is AttendBackward:
            block(i, op.dq, op.rows)
            for j, key in enumerate(op.dkv):
                block(i, key, op.col(j))
        else:
            for key in op.writes():
                into = op.into if kind is MergeOut or (kind in (AddGrad, Copy) and op.heads is None) else None
                rows = list(into) if into is not None else [Segment(0, tokens(key))]
                written[key] = list(union_intervals([*written.get(key, []), *rows]))
    return out

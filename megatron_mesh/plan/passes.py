"""Lowering passes shared by every plan builder."""

from __future__ import annotations

from .ir import AddGrad, Attend, AttendBackward, Copy, Free, Key, MergeOut, Op, Post, Wait
from .sel import Segment, Sel, union_intervals

__all__ = ["reads_writes", "insert_frees", "first_writes"]


def reads_writes(op: Op) -> tuple[tuple[Key, ...], tuple[Key, ...]]:
    """Buffers an op reads and buffers it writes (a Post's sends count as reads, its receives as
    writes that land at the matching Wait)."""
    return op.reads(), op.writes()


def insert_frees(ops: list[Op], keep: set[Key]) -> tuple[Op, ...]:
    """Add a :class:`Free` after the last use of every buffer not in ``keep``.

    A buffer that is sent is in use until the Wait of its round (the transport reads it until
    then), so its Free goes after that Wait.
    """
    last: dict[Key, int] = {}
    round_wait: dict[int, int] = {op.round: i for i, op in enumerate(ops) if type(op) is Wait}
    for i, op in enumerate(ops):
        reads, writes = op.reads(), op.writes()
        for k in writes:
            last[k] = i
        if type(op) is Post:
            for k in reads:
                last[k] = round_wait.get(op.round, i)
            for k in writes:  # a received buffer exists from its Wait on
                last[k] = max(last.get(k, i), round_wait.get(op.round, i))
        else:
            for k in reads:
                last[k] = max(last.get(k, i), i)
    frees_after: dict[int, list[Key]] = {}
    for k, i in last.items():
        if k not in keep:
            frees_after.setdefault(i, []).append(k)
    out: list[Op] = []
    for i, op in enumerate(ops):
        out.append(op)
        out.extend(Free(k) for k in sorted(frees_after.get(i, ())))
    return tuple(out)


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

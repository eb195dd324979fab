"""Which rows of its accumulators a block writes first: :func:`first_writes`, read by the executor
(it copies there instead of merging or adding) and by the simulator (it prices a copy); and which
rows of a new accumulator must start from their initial values: :func:`creation_fills`, read by
the executor (it fills only those)."""

from __future__ import annotations

from bisect import bisect_left

from ..sel import Segment, Sel, minus_intervals, union_intervals
from .ops import AddGrad, Attend, AttendBackward, Copy, Free, Key, MergeOut, Wait, op_keys

__all__ = ["first_writes", "creation_fills"]


def _cover(segs: list[Segment], rows) -> None:
    """Add ``rows`` to ``segs`` (sorted, disjoint, touching ones joined: what
    :func:`~..sel.union_intervals` of both gives) in place. A few rows (a block's) each go where a
    bisection finds, so a buffer that thousands of documents' blocks write one after another costs
    O(n log n) in all, where uniting the whole list again at every block cost O(n^2) (THD with
    1-token documents: minutes); many rows at once are united with the list in one pass."""
    if len(rows) > 16:
        segs[:] = union_intervals([*segs, *rows])
        return
    for a, b in rows:
        i = bisect_left(segs, (a,))
        if i and segs[i - 1][1] >= a:
            i -= 1
        j = i
        while j < len(segs) and segs[j][0] <= b:
            a, b = min(a, segs[j][0]), max(b, segs[j][1])
            j += 1
        segs[i:j] = [Segment(a, b)]


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
        fresh = minus_intervals(rows, written.get(key, []))
        if fresh:  # (a block may name one key/value buffer for several of its column ranges)
            mine = out.setdefault(i, {})
            mine[key] = tuple(union_intervals([*mine.get(key, ()), *fresh]))
        _cover(written.setdefault(key, []), rows)

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
                _cover(written.setdefault(key, []), rows)
    return out


def creation_fills(ops, tokens, live=(), tensor_counts=None, first=None, heads_of=None) -> dict[int, dict[Key, Sel]]:
    """For each op that creates an accumulator -- a block (:class:`Attend`, :class:`AttendBackward`)
    or a :class:`Copy` writing a buffer that is not live -- the rows the runtime must set to their
    initial values (out 0, lse -inf, gradients 0) when it creates it: those that something reads
    (copies, merges or adds into, sends, ...) before a block's first write (:func:`first_writes`)
    or a copy over all heads covers them, and those nothing covers before the buffer is freed or
    the direction ends (its final output and gradients are read). A fill is a pass over the
    buffer's memory as large as a copy; most accumulators are written whole by their blocks
    first. (Rows a block's first write names but its kernel calls leave out -- a masked block's
    rows without an allowed key in it -- are the runtime's to fill after the calls.)

    ``live``: the buffers that exist when ``ops`` start (inputs, the forward's saved buffers);
    ``tensor_counts(key)``: how many tensors a buffer has (a copy from a kind with fewer, a
    finished output into a partial one, leaves the others unwritten); ``first``: the blocks' first
    writes as the runtime takes them (default :func:`first_writes` of ``ops``); ``heads_of(key)``:
    a buffer's heads, where copies into head slices (a Ulysses group's all-to-all, assembling a
    chunk's head slices) may together cover rows (None: such copies cover nothing).

    Example: ``attend q1 x kv1 causal -> o1`` writes all 4 rows of o1 first, ``post 3: send
    o1->0`` reads them: ``{0: {o1: ()}}`` (nothing to fill). Had the block been ``attend q1[0:2]
    x kv1 ...``, rows [2, 4) would be filled: ``{0: {o1: ((2, 4),)}}``."""
    fills = _Fills(tokens, live, tensor_counts, first_writes(ops, tokens) if first is None else first, heads_of)
    for i, op in enumerate(ops):
        fills.step(i, op)
    for key in list(fills.open):
        fills.close(key)
    return fills.out


class _Fills:
    """:func:`creation_fills`' walk: the buffers a block or copy created, while they live, with
    [creating op, rows covered, rows read first]; each closed into ``out`` (op -> buffer -> rows
    to fill) when freed, read whole or at the end."""

    def __init__(self, tokens, live, tensor_counts, first, heads_of):
        self.tokens, self.live, self.tensor_counts, self.first = tokens, set(live), tensor_counts, first
        self.heads_of = heads_of
        self.open: dict[Key, list] = {}
        self.out: dict[int, dict[Key, Sel]] = {}
        self.slices: dict[Key, list] = {}  # head-slice copies into an open buffer: (rows, (first head, stop))

    def slice_cover(self, key: Key, rows, heads) -> list[Segment]:
        """The rows whose every head the head-slice copies into ``key`` so far have written."""
        parts = self.slices.setdefault(key, [])
        parts.append((list(rows), heads))
        cuts = sorted({x for r, _ in parts for seg in r for x in seg})
        done = []
        for a, b in zip(cuts, cuts[1:]):
            hs = sorted(h for r, h in parts if any(s <= a and b <= e for s, e in r))
            reach = 0
            for h0, h1 in hs:
                if h0 > reach:
                    break
                reach = max(reach, h1)
            if reach >= self.heads_of(key):
                done.append(Segment(a, b))
        return done

    def every(self, key: Key) -> list[Segment]:
        return [Segment(0, self.tokens(key))]

    def close(self, key: Key) -> None:
        i, covered, read = self.open.pop(key)
        self.slices.pop(key, None)
        self.out.setdefault(i, {})[key] = tuple(union_intervals([*read, *minus_intervals(self.every(key), covered)]))

    def create(self, i: int, key: Key) -> None:
        if key not in self.live:
            self.live.add(key)
            self.open[key] = [i, [], []]

    def cover(self, key: Key, rows) -> None:
        state = self.open[key]
        state[1] = list(union_intervals([*state[1], *rows]))

    def read(self, key: Key, rows) -> None:
        """Rows something reads (or adds into) before they may be covered; None: the whole
        buffer (what is not covered now is filled)."""
        state = self.open.get(key)
        if state is None:
            return
        if rows is None:
            self.close(key)
        else:
            state[2] = list(union_intervals([*state[2], *minus_intervals(list(rows), state[1])]))

    def step(self, i: int, op) -> None:
        kind = type(op)
        if kind is Wait:  # (reads and writes nothing)
            return
        if kind in (Attend, AttendBackward):
            written = (op.out,) if kind is Attend else (op.dq, *op.dkv)
            reads = [(op.q, op.rows), *((k, op.col(j)) for j, k in enumerate(op.kv))]
            for key, rows in reads + ([(op.do, op.rows)] if kind is AttendBackward else []):
                if key not in written:
                    self.read(key, rows)  # its rows and columns (a buffer assembled in rounds: the rows in so far)
            for key in written:
                self.create(i, key)
                if key in self.open:
                    self.cover(key, self.first.get(i, {}).get(key, ()))
        elif kind is Copy:
            self.copy(i, op)
        elif kind in (MergeOut, AddGrad):
            self.read(op.src, None)
            self.read(op.dst, op.into)  # merged or added into: those rows must hold their initial values
        elif kind is Free:
            self.read(op.key, None)
            self.live.discard(op.key)
        else:  # sends, receives, row statistics: the whole buffer
            for key in op_keys(op):
                self.read(key, None)
            self.live.update(op.writes())

    def copy(self, i: int, op: Copy) -> None:
        self.read(op.src, op.rows)
        self.create(i, op.dst)
        counts = self.tensor_counts
        if op.dst in self.open and (counts is None or counts(op.src) >= counts(op.dst)):
            rows = op.into if op.into is not None else self.every(op.dst)
            if op.heads is None:
                self.cover(op.dst, rows)
            elif self.heads_of is not None:  # the rows all of whose heads such copies have written
                self.cover(op.dst, self.slice_cover(op.dst, rows, tuple(op.heads)))

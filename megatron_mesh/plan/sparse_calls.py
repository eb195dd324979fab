"""The kernel calls of a mask-aware plan (:mod:`.sparse`, step 4): a rank's blocks as calls on the
buffers it holds -- its own block as at most two masked calls over contiguous rows
(:meth:`Calls.own_calls`), the blocks with other ranks' slots fused per query rows
(:meth:`Calls.fused`), every selection in the coordinates of the buffer (:meth:`Calls.local`).

Example (the window example of :mod:`.sparse`): rank 1's block of chunk 0's columns is
``attend q1[0:2] x kv0.5 masked -> o1``: its rows [0:2) of its own chunk against the slot
``kv0.5`` (chunk 0's columns [0:2) made for rank 1, whole: no column selection).
"""

from __future__ import annotations

from .ir import Attend, AttendBackward, Key, Op
from .mask import BlockClass, BlockKind
from .sel import Segment, relative_selection, selection_index, union_intervals
from .sparse_blocks import Blocks
from .sparse_needs import Slots

__all__ = ["Calls"]


class Calls:
    """The kernel calls of every rank of one mask-aware plan (module docstring)."""

    def __init__(self, P: int, T: int, index: Blocks, slots: Slots):
        self.P, self.T, self.index, self.slots = P, T, index, slots
        self._within: dict[tuple, tuple] = {}  # slot -> (its selection, its index, its tokens)
        # (rank, blocks, backward) -> their calls: a polished plan's trials (:func:`~.sparse.reordered`,
        # which shares these Calls) lower the same blocks again in another order of the own block
        self._computed: dict[tuple, tuple[Op, ...]] = {}

    # -- keys: my own chunk's buffers are whole; a remote chunk's tokens are the slot made for me -------------
    def qkey(self, kind: str, chunk: int, x: int, incoming: bool = False) -> Key:
        return Key(kind, chunk) if chunk == x and not incoming else Key(kind, chunk, x, incoming)

    def kvkey(self, kind: str, chunk: int, x: int, incoming: bool = False) -> Key:
        return Key(kind, chunk) if chunk == x and not incoming else Key(kind, chunk, self.P + x, incoming)

    def block(self, x: int, i: int, j: int, backward: bool) -> list[Op]:
        """The kernel calls of block (i, j) on rank x (one per part, :func:`block_parts`)."""
        q = self.qkey("q", i, x)
        kv = self.kvkey("kv", j, x)
        ops: list[Op] = []
        for c in self.index.parts(i, j):
            rows = self.local(c.rows, i, x, (1, i, x))
            col = self.local(c.cols[0], j, x, (1, j, self.P + x))
            cols = None if col is None else (col,)
            if backward:
                op = AttendBackward(q, self.qkey("do", i, x), (kv,), self.qkey("dq", i, x), (self.kvkey("dkv", j, x),),
                                    rows, cols, c.kind)
            else:
                op = Attend(q, (kv,), self.qkey("o", i, x), rows, cols, c.kind)
            ops.append(op)
        return ops

    def fused(self, x: int, i: int, parts: list[tuple[int, BlockClass]], backward: bool) -> Op:
        """The kernel calls ``parts`` -- (key/value chunk j, a call of block (i, j)), all with the
        same query rows of chunk i (one document's, or the same small documents'), all slots on
        rank x -- as one call: the columns of every j, in the order of their global positions (a
        buffer's columns split where another's come between), against those rows. Runs that
        continue each other then join into long runs, and :func:`~.mask.mask_pieces` runs it as
        a few full or causal calls; the rank merges one partial result instead of one per block.
        No pair is added: the rows are one document's (or the small documents') rows with keys in
        each j, and a block's call for them holds all their allowed pairs in j.

        Example: rank x holds the zigzag portion [0, 1000) + [3000, 4000) of a document; ranks y and
        z hold [1000, 2000) and [2000, 3000). Rows [3000, 4000) see both; when one round
        brings both, the call is q_x[back] x (kv_y, kv_z): one FULL call over the joined run
        [1000, 3000), one merge -- instead of two blocks, two calls, two merges."""
        layout = self.index.layout
        runs = []  # (global start, chunk j, local start, local stop)
        for j, c in parts:
            held = layout.runs(j)
            k = 0
            # both in local order: one pass over each (a THD chunk holds two runs of every document)
            for a, b in c.cols[0]:
                while k < len(held) and held[k][0] + held[k][2] <= a:
                    k += 1
                for m in range(k, len(held)):
                    local, start, n = held[m]
                    if local >= b:
                        break
                    lo, hi = max(a, local), min(b, local + n)
                    if lo < hi:
                        runs.append((start + lo - local, j, lo, hi))
        runs.sort()
        entries: list[list] = []  # [chunk, [Segment, ...]]: consecutive runs of one chunk share an entry
        for _, j, lo, hi in runs:
            if entries and entries[-1][0] == j:
                segs = entries[-1][1]
                if segs[-1].stop == lo:
                    segs[-1] = Segment(segs[-1].start, hi)
                else:
                    segs.append(Segment(lo, hi))
            else:
                entries.append([j, [Segment(lo, hi)]])
        full = all(c.kind == BlockKind.FULL for _, c in parts)
        kind = BlockKind.FULL if full else BlockKind.MASKED
        q = self.qkey("q", i, x)
        rows = self.local(parts[0][1].rows, i, x, (1, i, x))
        kvs = tuple(self.kvkey("kv", j, x) for j, _ in entries)
        cols = tuple(self.local(tuple(segs), j, x, (1, j, self.P + x)) for j, segs in entries)
        cols = None if all(c is None for c in cols) else cols
        if backward:
            op = AttendBackward(q, self.qkey("do", i, x), kvs, self.qkey("dq", i, x),
                                tuple(self.kvkey("dkv", j, x) for j, _ in entries), rows, cols, kind)
        else:
            op = Attend(q, kvs, self.qkey("o", i, x), rows, cols, kind)
        return op

    def compute(self, x: int, blocks, backward: bool) -> list[Op]:
        """The kernel calls of ``blocks`` on rank x: the own block (x, x) as its calls (one causal
        call per document); the others' calls fused by query chunk and rows (:meth:`fused`)."""
        key = (x, tuple(blocks), backward)
        made = self._computed.get(key)
        if made is None:
            made = self._computed[key] = tuple(self._compute(x, blocks, backward))
        return list(made)

    def _compute(self, x: int, blocks, backward: bool) -> list[Op]:
        ops: list[Op] = []
        groups: dict[tuple, list] = {}
        for i, j in blocks:
            if (i, j) == (x, x):
                ops.extend(self.block(x, i, j, backward))
                continue
            for c in self.index.parts(i, j):
                groups.setdefault((i, c.rows), []).append((j, c))
        ops.extend(self.fused(x, i, parts, backward) for (i, _), parts in sorted(groups.items()))
        return ops

    def own_calls(self, x: int, before: list[Op], after: list[Op], backward: bool) -> tuple[list[Op], list[Op]]:
        """The own block's calls (one per document, in row order; ``before`` the return round is
        posted, then ``after``) as at most two calls: the rows up to the first of ``after``, and
        the rest, each against all the chunk's keys under the mask. Their documents' runs then
        run as a few variable-length kernel calls (:func:`~.mask.call_groups`) instead of a call
        each, with no copy: each call's rows are one range of the chunk. Exact because the
        documents' rows are disjoint: every allowed pair of a row is in the call holding the row.

        Example: a chunk of 2,970 tokens holding documents of 900, 40, 30 and 2,000 tokens, calls
        900 / 40 + 30 (the small ones share one) / 2,000, the first two before the return: rows
        [0, 970) and [970, 2970), each a MASKED call whose mask pieces (causal 900 and masked 40 + 30;
        causal 2,000) run as two kernel calls and one."""
        ops = before + after
        if len(ops) < 2 or any(op.rows is None for op in ops):
            return before, after
        rows = [seg for op in ops for seg in op.rows]
        if sum(b - a for a, b in rows) != sum(b - a for a, b in union_intervals([tuple(r) for r in rows])):
            return before, after  # rows shared by two calls: keep them apart
        cut = after[0].rows[0].start if after else self.T

        def call(a: int, b: int) -> list[Op]:
            if a >= b:
                return []
            sel = None if (a, b) == (0, self.T) else (Segment(a, b),)
            q, kv = self.qkey("q", x, x), self.kvkey("kv", x, x)
            if backward:
                op = AttendBackward(q, self.qkey("do", x, x), (kv,), self.qkey("dq", x, x),
                                    (self.kvkey("dkv", x, x),), sel, None, BlockKind.MASKED)
            else:
                op = Attend(q, (kv,), self.qkey("o", x, x), sel, None, BlockKind.MASKED)
            return [op]
        return call(0, cut if before else 0), call(cut if before else 0, self.T if after else 0)

    def local(self, sel, chunk: int, x: int, slot) -> tuple | None:
        """A chunk-local selection in the coordinates of the buffer x holds (None: all of it)."""
        if chunk == x:
            return None if sel == (Segment(0, self.T),) else sel
        index = self._within.get(slot[1:])  # per slot: asked once per block it holds
        if index is None:
            within = self.slots(Key("q", slot[1], slot[2]))
            index = self._within[slot[1:]] = (within, selection_index(within), sum(s.stop - s.start for s in within))
        local = relative_selection(sel, index[0], index[1])
        return None if local == (Segment(0, index[2]),) else local

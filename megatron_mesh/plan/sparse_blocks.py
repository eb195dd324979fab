"""The blocks of a mask-aware plan (:mod:`.sparse`, step 1): every (query chunk i, key/value chunk
j) with allowed pairs under the mask, trimmed to the rows and columns that have them and cut into
its kernel calls -- one call per document with enough query tokens, the block's smaller documents
together in one masked call (:class:`Blocks`, built on demand: a rank's plan asks for its own row
and column of blocks only).

Example (P = 2, zigzag, causal, one document of 8 tokens; rank 0 holds positions [0, 1, 6, 7],
rank 1 [2, 3, 4, 5]): blocks (0, 0) and (1, 1) are CAUSAL (each rank's positions increase in its
local order); block (1, 0) is rank 1's rows [0:4) against rank 0's keys [0:2) (positions 0, 1),
FULL; block (0, 1) is rank 0's rows [2:4) (positions 6, 7) against all of rank 1's keys, FULL
(``tests/plan/test_plan_sparse.py::test_sparse_blocks_worked_example``).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from functools import lru_cache

from .layout import Layout
from .mask import INF, BlockClass, BlockKind, Mask, band_pairs
from .sel import Segment, union_intervals
from .tunables import TUNABLES

__all__ = ["Blocks", "block_parts", "block_table", "blocks_of"]


@lru_cache(maxsize=16)
def block_table(P: int, mask: Mask, layout: Layout,
                own_call_tokens: int = TUNABLES.own_call_tokens) -> dict[tuple[int, int], BlockClass]:
    """{(i, j): BlockClass} of every block with allowed pairs (shared by every mode's plan of
    this mask: the planner builds dozens). The result is :func:`~.mask.classify_block` of every
    block (a test checks they agree); :func:`block_parts` splits each into its kernel calls."""
    return {ij: _join(parts, mask, layout, ij) for ij, parts in block_parts(P, mask, layout, own_call_tokens).items()}


def block_parts(P: int, mask: Mask, layout: Layout,
                own_call_tokens: int = TUNABLES.own_call_tokens) -> dict[tuple[int, int], tuple[BlockClass, ...]]:
    """{(i, j): kernel calls} of every block with allowed pairs (see :class:`Blocks`)."""
    return blocks_of(P, mask, layout, own_call_tokens).all()


@lru_cache(maxsize=16)
def blocks_of(P: int, mask: Mask, layout: Layout, own_call_tokens: int) -> "Blocks":
    return Blocks(P, mask, layout, own_call_tokens)


class Blocks:
    """The blocks of one (CP size, mask, layout), built on demand.

    An index first -- each rank's runs cut at document edges, and for each document the ranks
    holding it (linear in the layout's runs) -- then the kernel calls of a block when asked: one
    call per document with at least ``own_call_tokens`` (:class:`~.tunables.Tunables`) query tokens in the block (causal or
    full where it is), the block's smaller documents together in one masked call. Only the runs of
    one document on the ranks that hold it are paired. A rank's own plan asks for its row and
    column of blocks only (ranks sharing a document with it), so every rank builds its plan in
    time proportional to its own documents' holders, not to P^2."""

    def __init__(self, P: int, mask: Mask, layout: Layout, own_call_tokens: int):
        self.P, self.mask, self.layout, self.own_call_tokens = P, mask, layout, own_call_tokens
        self.band, self.fixed = mask.pair_band, mask.band() if mask.is_band else None  # fixed: one band for all
        self.holders: dict[int, dict[int, list]] = {}  # group -> rank -> its pieces (local, start, n, part)
        self.docs_of: list[list[int]] = [[] for _ in range(P)]  # rank -> groups (documents, chunks) it holds
        for g in range(P):
            for local, start, n, doc, part in mask.split_layout(layout.runs(g)):
                holders = self.holders.setdefault(doc, {})
                if g not in holders:
                    holders[g] = []
                    self.docs_of[g].append(doc)
                holders[g].append((local, start, n, part))
        self._parts: dict[tuple[int, int], tuple[BlockClass, ...] | None] = {}
        self._summary: dict[int, dict[int, tuple[tuple[Segment, ...], int]]] = {}  # i -> j -> summary
        self._spans: dict | None = None
        self._row_spans: dict[int, dict] = {}  # i -> row_spans(i)
        # a one-interval selection, made once: blocks have few distinct ones (seed 2 of lognormal:16384
        # at 256 ranks: 106 among 11,940 rows and columns), and a Segment costs more than the lookup
        self._sels: dict[tuple[int, int], tuple[Segment, ...]] = {}
        self._sharing: dict[int, tuple[int, ...]] = {}
        self._positions: dict[int, tuple[list, list[int], list[int]]] = {}  # group -> _by_position

    def sharing(self, x: int) -> tuple[int, ...]:
        """The ranks holding a document rank x holds (x included), sorted."""
        out = self._sharing.get(x)
        if out is None:
            out = self._sharing[x] = tuple(sorted({g for d in self.docs_of[x] for g in self.holders[d]}))
        return out

    def parts(self, i: int, j: int) -> tuple[BlockClass, ...] | None:
        """The kernel calls of block (query chunk i, key chunk j); None when nothing is allowed."""
        ij = (i, j)
        if ij in self._parts:
            return self._parts[ij]
        band, fixed = self.band, self.fixed
        sums: list[_BlockSum] = []
        for doc in self.docs_of[i]:
            k_runs = self.holders[doc].get(j)
            if k_runs is None:
                continue
            e = None
            for ql, qa, n, qp in self.holders[doc][i]:
                q_end = qa + n - 1
                for kl, ka, m, kp in k_runs:
                    (lo, hi), dmin, dmax = fixed or band(qp, kp), qa - ka - m + 1, q_end - ka  # band_relation, inlined
                    if dmax < lo or dmin > hi or lo > hi:
                        continue
                    if e is None:
                        e = _BlockSum()
                        sums.append(e)
                    e.add("all" if dmin >= lo and dmax <= hi else "some", ql, qa, n, kl, ka, m, lo, hi)
        diagonal = self.layout.runs(i) if i == j else ()
        own = [e.result(self.mask, diagonal) for e in sums if e.pairs and e.nrows >= self.own_call_tokens]
        small = [e for e in sums if e.pairs and e.nrows < self.own_call_tokens]
        if small:
            own.append(_BlockSum.merged(small).result(self.mask, diagonal))
        out = self._parts[ij] = tuple(sorted(own, key=lambda c: c.rows[0])) if own else None
        return out

    def summary(self, i: int, j: int) -> tuple[tuple[Segment, ...], int]:
        """(the columns, the allowed pairs) of block (i, j) -- those of its kernel calls (:meth:`parts`)
        together, ((), 0) when nothing is allowed -- without building the calls: a rank's plan
        reads its peers' columns and pairs (what they pull, keep and group), not their calls."""
        return self.row_summary(i).get(j, ((), 0))

    def row_summary(self, i: int) -> dict[int, tuple[tuple[Segment, ...], int]]:
        """:meth:`summary` of every block of query chunk i with allowed pairs, by key chunk."""
        got = self._summary.get(i)
        if got is None:
            got = self._summary[i] = {j: (union_intervals(cols), pairs)
                                      for j, (_, cols, pairs) in self._scan(i, rows=False).items()}
        return got

    def spans(self) -> dict[tuple[int, int], tuple[tuple[Segment, ...], tuple[Segment, ...]]]:
        """{(i, j): (rows, columns)} of every block with allowed pairs, in :meth:`all`'s order -- the
        rows and columns of :func:`block_table`'s blocks, without their kernel calls (what an owner
        map's needs read, :class:`~.sparse_needs.Needs`): every :meth:`row_spans`."""
        if self._spans is None:
            self._spans = {(i, j): span for i in range(self.P) for j, span in self.row_spans(i).items()}
        return self._spans

    def row_spans(self, i: int) -> dict[int, tuple[tuple[Segment, ...], tuple[Segment, ...]]]:
        """{j: (rows, columns)} of query chunk i's blocks with allowed pairs, by key chunk in order
        (one row of :meth:`spans`: what a floor under an owner map's bytes reads of a few ranks,
        :mod:`.sparse_compete`). The same pass keeps i's :meth:`row_summary`: the query owner's
        needs, which compete with the maps, read them."""
        got = self._row_spans.get(i)
        if got is None:
            summary, got = {}, {}
            sels = self._sels
            for j, (rows, cols, pairs) in sorted(self._scan(i, rows=True).items()):
                c = sels.get(cols[0]) if len(cols) == 1 else union_intervals(cols)
                if c is None:
                    c = sels[cols[0]] = (Segment(*cols[0]),)
                r = sels.get(rows[0]) if len(rows) == 1 else union_intervals(rows)
                if r is None:
                    r = sels[rows[0]] = (Segment(*rows[0]),)
                summary[j] = (c, pairs)
                got[j] = (r, c)
            self._summary.setdefault(i, summary)
            self._row_spans[i] = got
        return got

    def _scan(self, i: int, rows: bool) -> dict[int, list]:
        """Key chunk -> [row intervals (``rows``; else none), column intervals, pairs] of query chunk
        i's blocks: one pass over i's documents and the pieces of them in reach (the loop of
        :meth:`parts`, as _BlockSum.add counts; the intervals in another order, which their unions
        drop). Not kept: a plan of thousands of blocks keeps only their unions."""
        band, fixed = self.band, self.fixed
        acc: dict[int, list] = {}
        for doc in self.docs_of[i]:
            keys, firsts, lasts = self._by_position(doc)
            for ql, qa, n, qp in self.holders[doc][i]:
                q_end = qa + n - 1
                if fixed:  # one band for all: the key runs it reaches are consecutive in position
                    lo, hi = fixed
                    near = keys[bisect_left(lasts, qa - hi):bisect_right(firsts, q_end - lo)]
                else:
                    near = keys
                for j, kl, ka, m, kp in near:
                    lo, hi = fixed or band(qp, kp)
                    dmin, dmax = qa - ka - m + 1, q_end - ka
                    if dmax < lo or dmin > hi or lo > hi:
                        continue
                    a = acc.get(j)
                    if a is None:
                        a = acc[j] = [[], [], 0]
                    if dmin >= lo and dmax <= hi:  # every pair
                        if rows:
                            a[0].append((ql, ql + n))
                        a[1].append((kl, kl + m))
                        a[2] += n * m
                    else:
                        if rows:
                            a[0].append((ql + int(max(qa, ka + lo) if lo != -INF else qa) - qa,
                                         ql + int(min(qa + n, ka + m + hi) if hi != INF else qa + n) - qa))
                        a[1].append((kl + int(max(ka, qa - hi) if hi != INF else ka) - ka,
                                     kl + int(min(ka + m, qa + n - lo) if lo != -INF else ka + m) - ka))
                        a[2] += band_pairs(qa, n, ka, m, lo, hi)
        return acc

    def _by_position(self, doc: int) -> tuple[list, list[int], list[int]]:
        """The pieces of document (group) ``doc`` on every rank holding it, in position order --
        (rank, local, start, n, part) -- with their first and last positions: the pieces a query
        piece reaches under one band are a slice of them (a causal query piece reaches none after
        it: half the pairs of a zigzag's long document)."""
        got = self._positions.get(doc)
        if got is None:
            keys = sorted(((j, *piece) for j, pieces in self.holders[doc].items() for piece in pieces),
                          key=lambda k: k[2])
            got = self._positions[doc] = (keys, [k[2] for k in keys], [k[2] + k[3] - 1 for k in keys])
        return got

    def all(self) -> dict[tuple[int, int], tuple[BlockClass, ...]]:
        out = {}
        for i in range(self.P):
            for j in self.sharing(i):
                parts = self.parts(i, j)
                if parts:
                    out[(i, j)] = parts
        return out


def _join(parts: tuple[BlockClass, ...], mask: Mask, layout: Layout, ij: tuple[int, int]) -> BlockClass:
    """The whole block of its parts: rows and columns united, pairs summed, one kind for all."""
    if len(parts) == 1:
        return parts[0]
    e = _BlockSum()
    e.rows = [tuple(r) for c in parts for r in c.rows]
    e.cols = [tuple(r) for c in parts for r in c.cols[0]]
    e.rows_sorted = e.cols_sorted = False
    e.pairs = sum(c.pairs for c in parts)
    e.relations = {"all" if c.kind == BlockKind.FULL else "some" for c in parts}
    e.documents = 2  # several parts: never one causal call
    return e.result(mask, ())


class _BlockSum:
    """The allowed pairs of one block (or of one document in it), summed over its pairs of runs."""

    __slots__ = ("rows", "cols", "pairs", "relations", "documents", "rows_sorted", "cols_sorted", "causal_only")

    def __init__(self):
        self.rows: list[tuple[int, int]] = []
        self.cols: list[tuple[int, int]] = []
        self.pairs, self.relations, self.documents, self.causal_only = 0, set(), 1, True
        self.rows_sorted = self.cols_sorted = True

    @property
    def nrows(self) -> int:
        return sum(b - a for a, b in (self.rows if self.rows_sorted else union_intervals(self.rows)))

    @classmethod
    def merged(cls, sums: list["_BlockSum"]) -> "_BlockSum":
        if len(sums) == 1:
            return sums[0]
        e = cls()
        for x in sums:
            e.rows += x.rows
            e.cols += x.cols
            e.pairs += x.pairs
            e.relations |= x.relations
        e.rows_sorted = e.cols_sorted = False
        e.documents = len(sums)
        return e

    def add(self, relation: str, ql: int, qa: int, n: int, kl: int, ka: int, m: int, lo: float, hi: float) -> None:
        self.relations.add(relation)
        self.causal_only &= lo >= 0  # every pair added on or below the diagonal (i >= j): a causal call can run it
        if relation == "all":
            r0, r1, c0, c1 = ql, ql + n, kl, kl + m
            self.pairs += n * m
        else:  # rows with a key in the band, keys of a row in it
            r0 = ql + int(max(qa, ka + lo) if lo != -INF else qa) - qa
            r1 = ql + int(min(qa + n, ka + m + hi) if hi != INF else qa + n) - qa
            c0 = kl + int(max(ka, qa - hi) if hi != INF else ka) - ka
            c1 = kl + int(min(ka + m, qa + n - lo) if lo != -INF else ka + m) - ka
            self.pairs += band_pairs(qa, n, ka, m, lo, hi)
        self.rows_sorted &= _append_interval(self.rows, r0, r1)
        self.cols_sorted &= _append_interval(self.cols, c0, c1)

    def result(self, mask: Mask, diagonal_runs) -> BlockClass:
        rows = tuple(Segment(a, b) for a, b in self.rows) if self.rows_sorted else union_intervals(self.rows)
        cols = tuple(Segment(a, b) for a, b in self.cols) if self.cols_sorted else union_intervals(self.cols)
        nrows = sum(b - a for a, b in rows)
        ncols = sum(b - a for a, b in cols)
        if self.relations == {"all"} and self.pairs == nrows * ncols:
            kind = BlockKind.FULL
        elif diagonal_runs and self.documents == 1 and rows == cols and self.causal_only and \
                self.pairs == nrows * (nrows + 1) // 2 and _increasing(diagonal_runs, rows):
            kind = BlockKind.CAUSAL  # one document's own tokens, in order, the band not cutting inside
        else:
            kind = BlockKind.MASKED
        return BlockClass(kind, rows, (cols,), self.pairs)


def _append_interval(ivs: list, a: int, b: int) -> bool:
    """Append [a, b) to sorted intervals, joined with the last when they touch; False when it
    comes before the last (the list then needs sorting)."""
    if ivs:
        la, lb = ivs[-1]
        if a < la:
            ivs.append((a, b))
            return False
        if a <= lb:
            if b > lb:
                ivs[-1] = (la, b)
            return True
    ivs.append((a, b))
    return True


def _increasing(runs, rows) -> bool:
    """The global positions of the local ``rows`` of a chunk with ``runs`` increase."""
    last = -1
    for r in rows:
        for local, start, n in runs:
            a, b = max(r.start, local), min(r.stop, local + n)
            if a < b:
                if start + a - local <= last:
                    return False
                last = start + b - local - 1
    return True

"""Mask-aware plans: every mode under documents, sliding windows or the THD layout.

A dense plan (ring, Mesh, TASP over causal or full attention) forwards whole chunks around rings,
because every rank needs (part of) every chunk on its rings. A mask breaks that: with a window
shorter than a chunk, a rank needs only the halo of its two zigzag neighbours; with short
documents, only the chunks that share one of its documents. This module builds those plans
from the mask itself, for every mode:

1. **Blocks.** Every (query chunk i, key/value chunk j) is classified under the mask
   (:func:`~.mask.classify_block`): empty blocks are dropped, the others trimmed to the rows and
   columns that have allowed pairs.
2. **Assignment** (which rank computes each block) -- the mode's identity: ring and TASP give
   block (i, j) to the query owner i (ship K/V, keep Q home); Mesh gives it to its tile owner, or
   -- when the mask leaves the tile nothing to gain -- to the query owner too: of the two
   assignments it takes the one whose busiest rank moves fewer bytes (so a windowed Mesh plan
   degenerates to the halo exchange, instead of shipping Q chunks and partial outputs to other
   ranks for blocks next to the diagonal).
3. **Transfers.** Each rank receives exactly the tokens its blocks read, straight from their
   owner, once: a *slot* of chunk x for needer y holds the rows (or columns) of chunk x that y's
   blocks use. No chunk reaches a rank none of whose blocks needs it; partial outputs and
   gradients go back only for those tokens and are merged into the owner's rows (``into`` = the
   slot's segments). Rounds: ring and Mesh pull by *shift* -- in round d, rank x receives from
   x - d and sends to x + d, so every round is a permutation and blocks start as soon as their
   slots arrive; every pull is posted up front, and the partials of shift d go home in round
   P + d as soon as the blocks writing them ran. TASP pulls over all links at once, in
   ``burst_groups`` rounds (:class:`~.tunables.Tunables`: groups of a rank's remote slots of
   about equal work), and returns each group's partials in a round of its own while the next group computes (a long
   document's blocks start before all its slots are in, and its fp32 dK/dV return hides behind
   the rank's remaining work instead of following its last block).
4. **Kernel calls.** The rank's own block runs as at most two masked calls over contiguous rows
   (:meth:`_SparseLowering._own_calls`), each cut into one causal mask piece per document, which a
   variable-length kernel runs together (:func:`~.mask.call_groups`); the blocks with other
   ranks' slots that are ready in the same round are fused per query rows: one call over their
   columns in position order (runs of a document that continue each other join into long runs,
   which :func:`~.mask.mask_pieces` runs as a few full calls), and one merge instead of one per
   block. Where a return round follows, the own block is split to hide both transfers: the
   pulls' share of the bytes runs before the pulls' wait, the rest after the return is posted.
5. **Backward chunks.** Under ``backward_chunks="auto"`` a rank keeps the slots it pulled for
   the backward where they are at most its own Q, K and V (:class:`_Keeps`), so its backward
   pulls only dO; rounds in which a rank only sends are posted before its compute.

Slot names: ``q{x}.{y}`` are the rows of chunk x rank y needs (also ``do``, ``o``, ``dq`` of those
rows), ``kv{x}.{P+y}`` the columns (also ``dkv``).

Worked example (P = 4, zigzag, causal, window (2, 0), S = 16: halves of 2 tokens; rank 1 holds
positions [2, 3, 12, 13]): its rows [2, 3] need keys [0, 1] of rank 0's front half, its rows
[12, 13] need keys [10, 11] of rank 2's back half. Ring attention's plan for rank 1 therefore::

    post 1: send kv1.6->2 | recv kv0.5<-0          # shift 1: rank 0's columns [0:2]; rank 2 needs ours
    post 3: send kv1.4->0 | recv kv2.5<-2          # shift 3 (= -1): rank 2's columns [2:4]
    attend q1 x kv1 masked -> o1                   # the local block (a window cuts it)
    wait 1
    attend q1[0:2] x kv0.5 masked -> o1
    wait 3
    attend q1[2:4] x kv2.5 masked -> o1

moving 2 of the 12 tokens ring attention would move. Its backward (the slots kept) returns each
dK/dV partial in its shift's return round, and its own block runs while they travel::

    attend_bwd q1[0:2] do1 x kv0.5 masked -> dq1 | dkv0.5
    attend_bwd q1[2:4] do1 x kv2.5 masked -> dq1 | dkv2.5
    post 5: send dkv0.5->0 | recv dkv1.6'<-2       # shift 1: to rank 0; rank 2's partial of mine
    post 7: send dkv2.5->2 | recv dkv1.4'<-0       # shift 3
    attend_bwd q1 do1 x kv1 masked -> dq1 | dkv1
    wait 5
    add dkv1.6' -> dkv1[0:2]
    wait 7
    add dkv1.4' -> dkv1[2:4]
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from .accounting import buffer_bytes
from .ir import AddGrad, Attend, AttendBackward, Key, MergeOut, Op, Plan, Post, RankPlan, Transfer, Wait
from .layout import Layout
from .mask import INF, BlockClass, BlockKind, Mask, band_pairs
from .passes import insert_frees
from .sel import Segment, relative_selection, selection_index, union_intervals
from .shape import AttentionShape
from .tunables import TUNABLES, Tunables

__all__ = ["build_sparse_plan", "block_table", "block_parts", "Assignment", "QUERY_OWNER"]

QUERY_OWNER = "query owner"


@dataclass(frozen=True)
class Assignment:
    """How a mode places the blocks of a mask-aware plan -- its identity under a mask:

    * ``owners``: candidate maps (name, owner(q_chunk, kv_chunk) -> rank); the plan takes the one
      whose busiest rank moves the fewest bytes, the query owner (ship K/V, keep Q home) always
      among them (ring, TASP: only it; Mesh: its tile map too);
    * ``rounds``: "shift" (round d: receive from rank - d, send to rank + d: every round a
      permutation, blocks start as their slots arrive) or "burst" (each group of a rank's slots
      in one round over every link at once, TASP's way: ``burst_groups``);
    * ``tile`` / ``contiguous``: the Mesh tile map the "tile" owner comes from (plan facts);
    * ``tiles``: where several tile maps compete (Mesh's ``auto`` tile under a mask), the
      (tile, contiguous) of each owner map, in the order of ``owners``: the plan's tile facts are
      the chosen map's;
    * ``compete``: False -- the one map in ``owners`` is used as it is, without the query owner
      competing (a layout that names its blocks' owners balances work with them:
      :class:`~.balance.BalancedLayout`).
    """

    owners: tuple[tuple[str, Callable[[int, int], int]], ...] = ()
    rounds: str = "shift"
    tile: tuple[int, int] | None = None
    contiguous: str | None = None
    tiles: tuple[tuple[tuple[int, int], str], ...] = ()
    compete: bool = True

    def __post_init__(self) -> None:
        if self.rounds not in ("shift", "burst"):
            raise ValueError(f"rounds must be 'shift' or 'burst', got {self.rounds!r}")
        if not self.compete and len(self.owners) != 1:
            raise ValueError(f"compete=False uses one owner map as it is, got {len(self.owners)}")
        if self.tiles and len(self.tiles) != len(self.owners):
            raise ValueError(f"tiles must name the tile of each of the {len(self.owners)} owner maps, "
                             f"got {self.tiles!r}")


@lru_cache(maxsize=16)
def block_table(P: int, mask: Mask, layout: Layout,
                own_call_tokens: int = TUNABLES.own_call_tokens) -> dict[tuple[int, int], BlockClass]:
    """{(i, j): BlockClass} of every block with allowed pairs (shared by every mode's plan of
    this mask: the planner builds dozens). The result is :func:`~.mask.classify_block` of every
    block (a test checks they agree); :func:`block_parts` splits each into its kernel calls."""
    return {ij: _join(parts, mask, layout, ij) for ij, parts in block_parts(P, mask, layout, own_call_tokens).items()}


def block_parts(P: int, mask: Mask, layout: Layout,
                own_call_tokens: int = TUNABLES.own_call_tokens) -> dict[tuple[int, int], tuple[BlockClass, ...]]:
    """{(i, j): kernel calls} of every block with allowed pairs (see :class:`_Blocks`)."""
    return _blocks(P, mask, layout, own_call_tokens).all()


@lru_cache(maxsize=16)
def _blocks(P: int, mask: Mask, layout: Layout, own_call_tokens: int) -> "_Blocks":
    return _Blocks(P, mask, layout, own_call_tokens)


class _Blocks:
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
        self._sharing: dict[int, tuple[int, ...]] = {}

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


def _union(sels) -> tuple[Segment, ...]:
    return union_intervals([tuple(seg) for sel in sels for seg in sel])


class _Needs:
    """For one assignment: which rows / columns of which chunk each rank reads from others, and
    which blocks it computes -- computed for every rank at once from the whole block table (an
    assignment other than the query owner: the bytes of every rank decide between them)."""

    def __init__(self, P: int, table: dict, owner):
        self.P = P
        self._blocks: list[list[tuple[int, int]]] = [[] for _ in range(P)]
        rows: dict[tuple[int, int], list] = {}  # (needer, chunk) -> row selections
        cols: dict[tuple[int, int], list] = {}
        for (i, j), c in table.items():
            x = owner(i, j)
            self._blocks[x].append((i, j))
            if i != x:
                rows.setdefault((x, i), []).append(c.rows)
            if j != x:
                cols.setdefault((x, j), []).append(c.cols[0])
        self._rows = [dict() for _ in range(P)]
        self._cols = [dict() for _ in range(P)]
        self._row_needers: list[list[int]] = [[] for _ in range(P)]
        self._col_needers: list[list[int]] = [[] for _ in range(P)]
        for (x, c), sels in sorted(rows.items()):
            self._rows[x][c] = _union(sels)
            self._row_needers[c].append(x)
        for (x, c), sels in sorted(cols.items()):
            self._cols[x][c] = _union(sels)
            self._col_needers[c].append(x)

    def blocks(self, x: int) -> list[tuple[int, int]]:
        return self._blocks[x]

    def rows(self, x: int) -> dict[int, tuple[Segment, ...]]:
        """Chunk -> the rows of it rank x reads (chunks other than x's own)."""
        return self._rows[x]

    def cols(self, x: int) -> dict[int, tuple[Segment, ...]]:
        return self._cols[x]

    def row_needers(self, c: int) -> list[int]:
        """The ranks that read rows of chunk c (sorted)."""
        return self._row_needers[c]

    def col_needers(self, c: int) -> list[int]:
        return self._col_needers[c]

    def bytes_per_rank(self, shape: AttentionShape, keeps: Callable[[int], bool]) -> list[int]:
        """Sent + received bytes of each rank, forward and backward; ``keeps(x)``: whether rank x
        keeps what it pulled for the backward (:class:`_Keeps`)."""
        per_row = {k: buffer_bytes(k, 1, shape) for k in ("q", "kv", "o", "do", "dq", "dkv")}
        # forward: pull q / kv, return o; backward: pull (q,) do / (kv), return dq / dkv
        kinds = {(table, keep): base + (() if keep else again)
                 for table, base, again in (("rows", ("q", "o", "do", "dq"), ("q",)), ("cols", ("kv", "dkv"), ("kv",)))
                 for keep in (False, True)}
        traffic = [0] * self.P
        for name, table in (("rows", self._rows), ("cols", self._cols)):
            for x, needs in enumerate(table):
                row_bytes = sum(per_row[k] for k in kinds[name, keeps(x)])
                for c, sel in needs.items():
                    b = sum(s.stop - s.start for s in sel) * row_bytes
                    traffic[x] += b
                    traffic[c] += b
        return traffic


class _QueryOwnerNeeds:
    """The query owner's needs (every block computed where its queries live), rank by rank on
    demand from the block index: a rank's plan reads only its own row and column of blocks."""

    def __init__(self, blocks: _Blocks):
        self.index, self.P = blocks, blocks.P
        self._cols: dict[int, dict] = {}

    def blocks(self, x: int) -> list[tuple[int, int]]:
        return [(x, j) for j in self.index.sharing(x) if self.index.parts(x, j)]

    def rows(self, x: int) -> dict:
        return {}

    def cols(self, x: int) -> dict[int, tuple[Segment, ...]]:
        out = self._cols.get(x)
        if out is None:
            out = self._cols[x] = {j: union_intervals([tuple(seg) for c in parts for seg in c.cols[0]])
                                   for j in self.index.sharing(x) if j != x
                                   for parts in (self.index.parts(x, j),) if parts}
        return out

    def row_needers(self, c: int) -> list[int]:
        return []

    def col_needers(self, c: int) -> list[int]:
        return [i for i in self.index.sharing(c) if i != c and self.index.parts(i, c)]


class _Slots:
    """Slot key -> its segments: ``q{c}.{x}`` the rows of chunk c rank x reads, ``kv{c}.{P+x}`` the
    columns. The segments differ per chunk (sizes are not cached by slot alone: ``vary``)."""

    vary = True

    def __init__(self, needs, P: int):
        self.needs, self.P = needs, P

    def __call__(self, key: Key):
        if key.span != 1:
            return None
        if key.slot < self.P:
            return self.needs.rows(key.slot).get(key.chunk)
        return self.needs.cols(key.slot - self.P).get(key.chunk)


def build_sparse_plan(mode: str, P: int, shape: AttentionShape, mask: Mask, layout: Layout, assignment: Assignment,
                      *, backward_chunks: str = "refetch", ranks_per_node: int | None = None,
                      tunables: Tunables = TUNABLES) -> Plan:
    """The mask-aware plan of ``mode`` (its name) placed by ``assignment`` -- see the module
    docstring. ``mask`` and ``layout`` are normalised (:func:`~.problem.normalize`)."""
    T = shape.seq_local
    own_calls = tunables.own_call_tokens
    index = _blocks(P, mask, layout, own_calls)
    if backward_chunks not in ("refetch", "keep", "auto"):
        raise ValueError(f"backward_chunks must be one of refetch, keep, auto, got {backward_chunks!r}")
    notes: list[str] = []
    needs: object = _QueryOwnerNeeds(index)
    assigned = QUERY_OWNER
    tile, contiguous = assignment.tile, assignment.contiguous
    token_bytes = {k: buffer_bytes(k, 1, shape) for k in ("q", "kv", "do", "o", "dq", "dkv")}
    if not assignment.compete:  # the map is the layout's: its work balance rests on it
        assigned, owner = assignment.owners[0]
        needs = _Needs(P, block_table(P, mask, layout, own_calls), owner)
        notes.append(f"every block is computed where the {assigned} map names (the layout's balance rests on it)")
    elif assignment.owners:  # compare the mode's maps with the query owner by the busiest rank's bytes
        table = block_table(P, mask, layout, own_calls)
        candidates = [(QUERY_OWNER, _Needs(P, table, lambda i, j: i))]
        candidates += [(name, _Needs(P, table, owner)) for name, owner in assignment.owners]
        # each map with the ranks that would keep their slots under it ("auto" decides per map)
        costs = [max(n.bytes_per_rank(shape, _Keeps(backward_chunks, n, T, token_bytes, tunables.keep_limit)))
                 for _, n in candidates]
        best = min(range(len(candidates)), key=lambda k: (costs[k], -k))  # ties: the mode's own map (last)
        assigned, needs = candidates[best]
        if assigned == QUERY_OWNER:
            names = ", ".join(dict.fromkeys(n for n, _ in assignment.owners))
            notes.append(f"the mask leaves the {names} assignment nothing to gain: every block is computed by its "
                         "query chunk's owner (fewer bytes on the busiest rank)")
        elif assignment.tiles:
            tile, contiguous = assignment.tiles[best - 1]
            notes.append(f"tile {tile[0]}x{tile[1]} (contiguous {contiguous}): of the {len(assignment.tiles)} tile "
                         "maps and the query owner, the fewest bytes on the busiest rank under this mask")
    burst = assignment.rounds == "burst"
    keeps = _Keeps(backward_chunks, needs, T, token_bytes, tunables.keep_limit)
    lowering = _SparseLowering(P, T, needs, index, keeps, burst, token_bytes, tunables)
    notes.append(f"mask {mask.summary()}: each rank computes only the blocks with allowed pairs and receives only the "
                 f"tokens they read, from their owner ({'over all links at once, in groups' if burst else 'one round per shift'})")
    return Plan(mode=mode, world_size=P, seq_local=T, mask=mask, layout=layout, build_rank=lowering.rank_plan,
                build_rounds=lowering.round_ops, slots=lowering.slots, tile=tile, schedule=assignment.rounds,
                backward_chunks=backward_chunks, contiguous=contiguous, assignment=assigned, direct=True,
                last_round=lowering.final_round, ranks_per_node=ranks_per_node, notes=tuple(notes))


class _Keeps:
    """Which ranks keep the slots they pulled in the forward for the backward (no second pull
    of Q / K / V; only dO and the returns move): every rank ("keep"), none ("refetch"), or each
    rank whose pulled rows and columns take at most ``keep_limit`` (:class:`~.tunables.Tunables`) x its own chunk's Q + K + V
    bytes ("auto", decided per rank from the needs, so sender and receiver agree).

    Example: rank x of a query-owner plan reads 3,000 columns of K/V from other ranks and holds
    T = 4,096 tokens of its own: 3,000 x kv <= 4,096 x (q + kv) -> it keeps them; a rank reading
    20,000 columns of a long document refetches them in the backward instead."""

    def __init__(self, policy: str, needs, T: int, token_bytes: dict, limit: float):
        self.policy, self.needs, self.T, self.token_bytes, self.limit = policy, needs, T, token_bytes, limit
        self._memo: dict[int, bool] = {}

    def __call__(self, x: int) -> bool:
        if self.policy != "auto":
            return self.policy == "keep"
        got = self._memo.get(x)
        if got is None:
            tb = self.token_bytes
            rows = sum(s.stop - s.start for sel in self.needs.rows(x).values() for s in sel)
            cols = sum(s.stop - s.start for sel in self.needs.cols(x).values() for s in sel)
            got = self._memo[x] = rows * tb["q"] + cols * tb["kv"] <= self.limit * self.T * (tb["q"] + tb["kv"])
        return got


class _SparseLowering:
    def __init__(self, P: int, T: int, needs, index: _Blocks, keeps: _Keeps, burst: bool, token_bytes: dict,
                 tunables: Tunables):
        self.P, self.T, self.needs, self.index, self.keeps, self.burst = P, T, needs, index, keeps, burst
        self.token_bytes, self.group_tokens = token_bytes, tunables.group_tokens  # kind -> bytes per token
        self.slots = _Slots(needs, P)
        # burst: pulls in rounds 1 .. G, returns in G+1 .. 2G (one per group, :meth:`_groups`);
        # shifts: pulls in rounds 1 .. P-1, returns in P+1 .. 2P-1 (one per shift)
        self.groups, self.final_round = (tunables.burst_groups, 2 * tunables.burst_groups) if burst else (1, 2 * P - 1)
        self._group_memo: dict[int, dict[int, int]] = {}
        self._moves_memo: dict[str, bool] = {}
        self._pairs: dict[Op, int] = {}  # allowed pairs of each block op (where to cut the local work)

    # -- keys: my own chunk's buffers are whole; a remote chunk's tokens are the slot made for me -------------
    def qkey(self, kind: str, chunk: int, x: int, incoming: bool = False) -> Key:
        return Key(kind, chunk) if chunk == x and not incoming else Key(kind, chunk, x, incoming)

    def kvkey(self, kind: str, chunk: int, x: int, incoming: bool = False) -> Key:
        return Key(kind, chunk) if chunk == x and not incoming else Key(kind, chunk, self.P + x, incoming)

    def _shift(self, x: int, peer: int, sending: bool) -> int:
        """Round of a pull between x and ``peer``: the shift d with peer = x + d (x sends) or
        x - d (x receives); in burst mode 1 + the receiver's group of the sender's chunk."""
        if self.burst:  # the receiver's group of the sender's chunk (:meth:`_groups`)
            return 1 + (self._groups(peer)[x] if sending else self._groups(x)[peer])
        return (peer - x) % self.P if sending else (x - peer) % self.P

    def _moves(self, direction: str) -> bool:
        """Whether any rank moves anything in ``direction``: where none does (every document inside
        one rank), the collective rounds would be posted empty on every rank -- so none are."""
        got = self._moves_memo.get(direction)
        if got is None:
            got = self._moves_memo[direction] = any(
                r[0] or r[1] for y in range(self.P)
                for r in (*self._pulls(y, direction).values(), *self._returns(y, direction).values()))
        return got

    def _pulls(self, x: int, direction: str) -> dict[int, tuple[list, list]]:
        """Round -> (sends, recvs) of the pulls of ``direction``."""
        backward = direction == "backward"

        def row_kinds(reader: int) -> tuple[str, ...]:  # what moves of the rows ``reader`` needs
            return (("do",) if self.keeps(reader) else ("q", "do")) if backward else ("q",)

        def col_kinds(reader: int) -> tuple[str, ...]:
            return (() if self.keeps(reader) else ("kv",)) if backward else ("kv",)
        rounds: dict[int, tuple[list, list]] = {}
        for y in self.needs.row_needers(x):  # my rows others need
            for kind in row_kinds(y):
                rounds.setdefault(self._shift(x, y, True), ([], []))[0].append(Transfer(y, Key(kind, x, y)))
        for y in self.needs.col_needers(x):
            for kind in col_kinds(y):
                rounds.setdefault(self._shift(x, y, True), ([], []))[0].append(Transfer(y, Key(kind, x, self.P + y)))
        for c in sorted(self.needs.rows(x)):
            for kind in row_kinds(x):
                rounds.setdefault(self._shift(x, c, False), ([], []))[1].append(Transfer(c, Key(kind, c, x)))
        for c in sorted(self.needs.cols(x)):
            for kind in col_kinds(x):
                rounds.setdefault(self._shift(x, c, False), ([], []))[1].append(Transfer(c, Key(kind, c, self.P + x)))
        return rounds

    def _groups(self, x: int) -> dict[int, int]:
        """Burst mode: the group (0 .. groups-1) of each chunk rank x computes blocks of (other
        than its own) -- the round its slots come in and its partials go home: chunks by shift
        (x - c) mod P, cut into groups of about equal work (allowed pairs of their blocks). Both
        sides of a transfer derive it from the needs."""
        got = self._group_memo.get(x)
        if got is None:
            work: dict[int, int] = {}
            for i, j in self.needs.blocks(x):
                pairs = sum(c.pairs for c in self.index.parts(i, j))
                for c in {i, j} - {x}:
                    work[c] = work.get(c, 0) + pairs
            # groups of at least group_tokens pulled tokens: a round's latency and a call's merge
            # are then small against the transfer and the compute they overlap
            pulled = sum(b - a for sel in self.needs.rows(x).values() for a, b in sel) + \
                sum(b - a for sel in self.needs.cols(x).values() for a, b in sel)
            n = max(1, min(self.groups, pulled // self.group_tokens))
            chunks = sorted(work, key=lambda c: (x - c) % self.P)
            total, acc, got = sum(work.values()), 0, {}
            for c in chunks:  # a chunk's group: where the work before it (and half its own) falls
                got[c] = min(n - 1, int(n * (acc + work[c] / 2) / max(1, total)))
                acc += work[c]
            self._group_memo[x] = got
        return got

    def _block_group(self, x: int, b: tuple[int, int]) -> int:
        """A block's return group on rank x: the latest of its remote chunks'."""
        groups = self._groups(x)
        return max((groups[c] for c in b if c != x), default=0)

    def _return_round(self, sender: int, owner: int) -> int:
        """Round in which ``sender`` returns its partials of chunk ``owner``'s tokens: in burst
        mode one per return group (:meth:`_groups`), after the pull round; else one per shift
        d = sender - owner, after every pull round. Each goes home as soon as the blocks writing it
        ran, and sender and owner agree on it."""
        if self.burst:
            return 1 + self.groups + self._groups(sender)[owner]
        return self.P + (sender - owner) % self.P

    def _returns(self, x: int, direction: str) -> dict[int, tuple[list, list, list, set]]:
        """Return round -> (sends, recvs, merges, chunks): my partials of others' tokens go home;
        theirs of mine arrive (and are merged / added at the listed segments); ``chunks``: the
        owners of what I send (its blocks must have run before the round is posted)."""
        backward = direction == "backward"
        kind = "dq" if backward else "o"
        rounds: dict[int, tuple[list, list, list, set]] = {}

        def at(t: int) -> tuple[list, list, list, set]:
            return rounds.setdefault(t, ([], [], [], set()))
        for c in sorted(self.needs.rows(x)):
            r = at(self._return_round(x, c))
            r[0].append(Transfer(c, Key(kind, c, x)))
            r[3].add(c)
        if backward:
            for c in sorted(self.needs.cols(x)):
                r = at(self._return_round(x, c))
                r[0].append(Transfer(c, Key("dkv", c, self.P + x)))
                r[3].add(c)
        for y in self.needs.row_needers(x):
            k = Key(kind, x, y, incoming=True)
            r = at(self._return_round(y, x))
            r[1].append(Transfer(y, k))
            r[2].append((AddGrad if backward else MergeOut)(k, Key(kind, x), self.needs.rows(y)[x]))
        if backward:
            for y in self.needs.col_needers(x):
                k = Key("dkv", x, self.P + y, incoming=True)
                r = at(self._return_round(y, x))
                r[1].append(Transfer(y, k))
                r[2].append(AddGrad(k, Key("dkv", x), self.needs.cols(y)[x]))
        return rounds

    def _blocks(self, x: int, i: int, j: int, backward: bool) -> list[Op]:
        """The kernel calls of block (i, j) on rank x (one per part, :func:`block_parts`)."""
        q = self.qkey("q", i, x)
        kv = self.kvkey("kv", j, x)
        ops: list[Op] = []
        for c in self.index.parts(i, j):
            rows = self._local(c.rows, i, x, (1, i, x))
            col = self._local(c.cols[0], j, x, (1, j, self.P + x))
            cols = None if col is None else (col,)
            if backward:
                op = AttendBackward(q, self.qkey("do", i, x), (kv,), self.qkey("dq", i, x), (self.kvkey("dkv", j, x),),
                                    rows, cols, c.kind)
            else:
                op = Attend(q, (kv,), self.qkey("o", i, x), rows, cols, c.kind)
            self._pairs[op] = c.pairs
            ops.append(op)
        return ops

    def _fused(self, x: int, i: int, parts: list[tuple[int, BlockClass]], backward: bool) -> Op:
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
        rows = self._local(parts[0][1].rows, i, x, (1, i, x))
        kvs = tuple(self.kvkey("kv", j, x) for j, _ in entries)
        cols = tuple(self._local(tuple(segs), j, x, (1, j, self.P + x)) for j, segs in entries)
        cols = None if all(c is None for c in cols) else cols
        if backward:
            op = AttendBackward(q, self.qkey("do", i, x), kvs, self.qkey("dq", i, x),
                                tuple(self.kvkey("dkv", j, x) for j, _ in entries), rows, cols, kind)
        else:
            op = Attend(q, kvs, self.qkey("o", i, x), rows, cols, kind)
        self._pairs[op] = sum(c.pairs for _, c in parts)
        return op

    def _compute(self, x: int, blocks, backward: bool) -> list[Op]:
        """The kernel calls of ``blocks`` on rank x: the own block (x, x) as its calls (one causal
        call per document); the others' calls fused by query chunk and rows (:meth:`_fused`)."""
        ops: list[Op] = []
        groups: dict[tuple, list] = {}
        for i, j in blocks:
            if (i, j) == (x, x):
                ops.extend(self._blocks(x, i, j, backward))
                continue
            for c in self.index.parts(i, j):
                groups.setdefault((i, c.rows), []).append((j, c))
        ops.extend(self._fused(x, i, parts, backward) for (i, _), parts in sorted(groups.items()))
        return ops

    def _own_calls(self, x: int, before: list[Op], after: list[Op], backward: bool) -> tuple[list[Op], list[Op]]:
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

    def _bytes(self, transfers) -> int:
        """Bytes of ``transfers`` (their slots' tokens x the bytes per token of their kind)."""
        return sum(self.token_bytes[t.key.kind] * sum(b - a for a, b in self.slots(t.key))
                   for t in transfers)

    def _local(self, sel, chunk: int, x: int, slot) -> tuple | None:
        """A chunk-local selection in the coordinates of the buffer x holds (None: all of it)."""
        if chunk == x:
            return None if sel == (Segment(0, self.T),) else sel
        within = self.slots(Key("q", slot[1], slot[2]))
        known = self.__dict__.setdefault("_within", {})  # per slot: asked once per block it holds
        index = known.get(slot[1:])
        if index is None:
            index = known[slot[1:]] = (selection_index(within), sum(s.stop - s.start for s in within))
        local = relative_selection(sel, within, index[0])
        return None if local == (Segment(0, index[1]),) else local

    def lower(self, x: int, direction: str, blocks: bool = True) -> list[Op]:
        backward = direction == "backward"
        pulls = self._pulls(x, direction)
        if self.burst and self._moves(direction):  # every rank posts every pull round, empty or not: TASP's
            for g in range(self.groups):  # all-to-all transport is a collective, and ranks keeping their slots pull nothing
                pulls.setdefault(1 + g, ([], []))
        order = sorted(pulls)
        mine = sorted(self.needs.blocks(x), key=lambda b: (b != (x, x), b))
        # a block is ready once the rounds bringing its remote slots have completed (rows always
        # travel: q and/or do; columns not in a backward that kept them from the forward)
        def ready_round(b: tuple[int, int]) -> int:
            i, j = b
            r = self._shift(x, i, False) if i != x else 0
            if j != x and not (backward and self.keeps(x)):
                r = max(r, self._shift(x, j, False))
            return r
        returns = self._returns(x, direction)
        # a step: (the pull round a block waits for, its return group); blocks run step by step,
        # and a return round is posted once every block writing what it sends has run (a rank that
        # sends no partials -- the query owner's forward -- fuses the calls of each pull round)
        grouped = self.burst and any(r[0] for r in returns.values())

        def step(b: tuple[int, int]) -> tuple[int, int]:
            return ready_round(b), self._block_group(x, b) if grouped else 0
        by_step: dict[tuple[int, int], list] = {}
        for b in mine:
            if b != (x, x):
                by_step.setdefault(step(b), []).append(b)
        ops: list[Op] = []

        def compute(bs) -> None:
            if blocks:
                ops.extend(self._compute(x, bs, backward))

        moves = any(r[0] or r[1] for r in returns.values())
        if self.burst and self._moves(direction):  # every rank posts every return round, empty or not (a collective)
            for g in range(self.groups):
                returns.setdefault(1 + self.groups + g, ([], [], [], set()))
        own = self._blocks(x, x, x, backward) if blocks and (x, x) in mine else []
        later: list[Op] = []
        if moves:
            # the own block hides both transfers: the share of its calls (by pairs) that runs before
            # the pulls' wait is the pulls' share of the bytes, the rest runs once the returns are
            # posted (a backward pulls K/V in bf16 and returns dK/dV in fp32: a third before)
            pulled = self._bytes(t for r in order for ts in pulls[r] for t in ts)
            returned = self._bytes(t for sends, recvs, _, _ in returns.values() for t in (*sends, *recvs))
            share = pulled / max(1, pulled + returned)
            total, acc = sum(self._pairs[op] for op in own), 0
            own, later = [], own
            while later and acc < share * total:
                acc += self._pairs[later[0]]
                own.append(later.pop(0))
        own, later = self._own_calls(x, own, later, backward)
        # every pull up front, in round order on every rank (so no rank waits on a round its peer
        # posts later): a rank's sends go out before its compute, and the return rounds, numbered
        # after every pull, can be posted as soon as their partials are written
        for t in order:
            ops.append(Post(t, tuple(pulls[t][0]), tuple(pulls[t][1])))
        last_use: dict[int, tuple[int, int]] = {}
        for b, st in ((b, step(b)) for b in mine if b != (x, x)):
            for c in set(b) - {x}:
                last_use[c] = max(last_use.get(c, st), st)
        pending = sorted(returns)
        done: set = set()

        def post_returns(final: bool = False) -> None:
            while pending and (final or all(c not in last_use or last_use[c] in done for c in returns[pending[0]][3])):
                t = pending.pop(0)
                ops.append(Post(t, tuple(returns[t][0]), tuple(returns[t][1])))

        def run(r: int) -> None:  # the blocks waiting for pull round r, group by group
            for st in sorted(k for k in by_step if k[0] == r):
                compute(by_step.pop(st))
                done.add(st)
                post_returns()
        ops.extend(own)
        run(0)
        for t in order:
            ops.append(Wait(t))
            run(t)
        for r in sorted({k[0] for k in by_step}):  # blocks whose slots came in rounds with nothing else
            run(r)
        post_returns(final=True)
        ops.extend(later)
        for t in sorted(returns):
            ops.append(Wait(t))
            if blocks:
                ops.extend(returns[t][2])
        return ops

    def round_ops(self, x: int, direction: str) -> tuple[Op, ...]:
        return tuple(self.lower(x, direction, blocks=False))

    def rank_plan(self, x: int) -> RankPlan:
        P = self.P
        whole = (Segment(0, self.T),)
        q, kv, do = Key("q", x), Key("kv", x), Key("do", x)
        fwd_in = {q: whole, kv: whole}
        bwd_in = {q: whole, kv: whole, do: whole}
        for y in self.needs.row_needers(x):
            rows = self.needs.rows(y)[x]
            fwd_in[Key("q", x, y)] = rows
            bwd_in[Key("do", x, y)] = rows
            if not self.keeps(y):
                bwd_in[Key("q", x, y)] = rows
        for y in self.needs.col_needers(x):
            cols = self.needs.cols(y)[x]
            fwd_in[Key("kv", x, P + y)] = cols
            if not self.keeps(y):
                bwd_in[Key("kv", x, P + y)] = cols
        saved: tuple[Key, ...] = ()
        if self.keeps(x):
            saved = tuple(Key("q", c, x) for c in sorted(self.needs.rows(x))) + \
                tuple(Key("kv", c, P + x) for c in sorted(self.needs.cols(x)))
        output, grad_q, grad_kv = Key("o", x), Key("dq", x), Key("dkv", x)
        forward = insert_frees(self.lower(x, "forward"), keep={output, q, kv, *saved})
        backward = insert_frees(self.lower(x, "backward"), keep={grad_q, grad_kv})
        return RankPlan(rank=x, seq_local=self.T, forward=forward, backward=backward, forward_inputs=fwd_in,
                        backward_inputs=bwd_in, output=output, grad_q=grad_q, grad_kv=grad_kv, saved=saved)

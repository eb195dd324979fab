"""What each rank of a mask-aware plan reads from the others (:mod:`.sparse`, step 3): for one
assignment of blocks to ranks, the rows and columns of each chunk a rank's blocks use
(:class:`Needs` for any owner map, :class:`QueryOwnerNeeds` rank by rank for the query owner), the
bytes each rank moves under them (:func:`bytes_per_rank`: a Mesh plan's maps compete by the
busiest rank's), the slots they travel in (:class:`Slots`), and which ranks keep their pulled
slots for the backward (:class:`Keeps`, step 5).

Example (the window example of :mod:`.sparse`: P = 4, causal, window (2, 0), S = 16, the query
owner): rank 1 reads columns [0:2) of chunk 0 and [2:4) of chunk 2 (``cols(1) == {0: [0:2), 2:
[2:4)}``), nothing of anyone's rows; ``col_needers(1) == [0, 2]``: ranks 0 and 2 read its columns.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate
import math

from .accounting import buffer_bytes
from .ir import Key
from .sel import Segment, sel_len, union_intervals
from .shape import AttentionShape
from .sparse_blocks import Blocks

__all__ = ["Keeps", "Needs", "QueryOwnerNeeds", "Slots", "bytes_per_rank", "read_bytes", "read_prices",
           "token_bytes", "kept_chunks", "kept_of", "KEEP_LIMIT",
           "ONE_CALL_LIMIT", "ASSIGNMENT_KEEP_LIMIT",
           "check_keep_limit", "keep_limit_of"]

# ``backward_chunks="auto"``: a rank keeps pulled chunks for the backward up to this many times the
# bytes of its own Q, K and V chunk -- the inputs its backward saves anyway -- so keeping at most
# triples them. Planner, 256 GPUs (32 x 8), 1M tokens, GQA 32/8, ``a2a+tasp`` U 8 on the balanced
# layout, ``lognormal:16384`` seeds 0-2: keeping all or nothing per rank 15.66 / 9.59 / 18.72 ms,
# keeping what fits of one chunk's worth 14.38 / 9.59 / 16.07, of two 13.62 / 9.59 / 15.69 ms, for up
# to 20 % more saved memory on the busiest rank (seed 0: 128 -> 154 MiB per layer). 1.0 until stop
# 69, when a rank keeping more than a chunk's worth stopped running those blocks as one call
# (ONE_CALL_LIMIT) and Mesh stopped choosing its assignment by what a larger limit keeps
# (ASSIGNMENT_KEEP_LIMIT): with both, 2.0 is as fast or faster than 1.0 on every row of the 8-, 16-
# and 256-GPU tables but two per 256-GPU mix, by <= 0.3 % (the CPU problem's: six balanced-layout
# rows by <= 1.4 %; docs/performance.md, "Keeping two chunks' worth by default"). A
# memory-for-time choice, so a user setting (the modes' ``backward_keep_limit``, Megatron's
# ``--mesh-backward-keep-limit`` / ``--tasp-backward-keep-limit``: 1 keeps at most one chunk's
# worth, 0 nothing); this is its default.
KEEP_LIMIT = 2.0
# a rank keeping all it pulled runs the blocks over them as one call per query rows only where that is
# at most this many times its own Q, K and V (:meth:`Keeps.one_call`); else one call per shift
ONE_CALL_LIMIT = 1.0
# Mesh compares its tile maps with the query owner by the busiest rank's bytes as kept under at most
# this limit (:func:`~.sparse.build_sparse_plan`): the bytes say nothing of the work, and what a larger
# limit keeps favours the query owner, whose work on the zigzag is less even -- 16 GPUs, seed 2 of
# ``lognormal:4096``: at 2.0 compared as kept, Mesh took the query owner, 6.6 % slower than its 4x4
# tile, which it keeps when compared at 1.0 (then as fast as at 1.0)
ASSIGNMENT_KEEP_LIMIT = 1.0


def check_keep_limit(name: str, value) -> None:
    """ValueError naming ``value`` unless it is a keep limit: a number >= 0 (0 keeps nothing, like
    "refetch"; ``math.inf`` keeps everything, like "keep")."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise ValueError(f"{name} must be a number >= 0 (times the bytes of a rank's own Q, K and V chunk it may "
                         f"keep of what it pulled; 0 keeps nothing, inf everything), got {value!r}")


def keep_limit_of(backward_chunks: str, keep_limit: float = KEEP_LIMIT) -> float:
    """The keep limit a plan with ``backward_chunks`` acts by: ``keep_limit`` under "auto",
    everything under "keep" (inf), nothing under "refetch" (0) -- what a price of the backward reads."""
    return {"keep": math.inf, "refetch": 0.0}.get(backward_chunks, keep_limit)


def _union(sels) -> tuple[Segment, ...]:
    """The union of selections that are each a union already (:meth:`~.sparse_blocks.Blocks.spans`):
    one is its own union (most keys of a map hold one block's rows or columns)."""
    return sels[0] if len(sels) == 1 else union_intervals([seg for sel in sels for seg in sel])


def _tokens(needs: dict) -> dict[int, int]:
    """Chunk -> how many of its tokens a rank reads (``needs``: chunk -> its selection)."""
    return {c: sel_len(sel, 0) for c, sel in needs.items()}


def _gather(needs: list[dict[int, list]]) -> tuple[list[dict], list[list[int]], list[dict[int, int]]]:
    """From each rank's selections of each chunk (``needs``): each rank's union of them by chunk,
    in chunk order; the ranks reading each chunk, in order; each rank's tokens by chunk."""
    return _indexed([{c: _union(got[c]) for c in sorted(got)} for got in needs])


def _indexed(unions: list[dict]) -> tuple[list[dict], list[list[int]], list[dict[int, int]]]:
    """:func:`_gather` of selections united already (each rank's, in chunk order)."""
    readers: list[list[int]] = [[] for _ in unions]
    for x, got in enumerate(unions):
        for c in got:
            readers[c].append(x)
    return unions, readers, [_tokens(got) for got in unions]


def token_bytes(shape: AttentionShape) -> dict[str, int]:
    """The bytes of one token of each buffer kind a mask-aware plan moves (q, kv, do, o, dq, dkv)."""
    return {k: buffer_bytes(k, 1, shape) for k in ("q", "kv", "do", "o", "dq", "dkv")}


def read_prices(shape: AttentionShape) -> dict[tuple[str, bool], int]:
    """The bytes a token a rank reads moves, there and back, forward and backward: ("rows" | "cols",
    kept) -> bytes. Forward: pull q / kv, return o; backward: pull (q,) do / (kv), return dq / dkv --
    Q / K / V again unless kept."""
    per_row = token_bytes(shape)
    kinds = {(table, keep): base + (() if keep else again)
             for table, base, again in (("rows", ("q", "o", "do", "dq"), ("q",)), ("cols", ("kv", "dkv"), ("kv",)))
             for keep in (False, True)}
    return {key: sum(per_row[k] for k in ks) for key, ks in kinds.items()}


def read_bytes(rows: dict[int, int], cols: dict[int, int], kept: frozenset, prices: dict) -> int:
    """What a rank's reads move (``rows`` / ``cols``: chunk -> tokens; ``kept``: the chunks it keeps;
    ``prices``: :func:`read_prices`) -- its share of :func:`bytes_per_rank`, and as much again on
    the ranks it reads from."""
    out = 0
    for name, tokens in (("rows", rows), ("cols", cols)):
        kept_bytes, again_bytes = prices[name, True], prices[name, False]
        out += sum(n * (kept_bytes if c in kept else again_bytes) for c, n in tokens.items())
    return out


def bytes_per_rank(needs, shape: AttentionShape, keeps: Keeps) -> list[int]:
    """Sent + received bytes of each rank under ``needs`` (:class:`Needs` or :class:`QueryOwnerNeeds`),
    forward and backward; ``keeps``: what each rank keeps of what it pulled for the backward
    (:class:`Keeps`)."""
    prices = read_prices(shape)
    traffic = [0] * needs.P
    for x in range(needs.P):
        kept, mine = keeps.kept(x), 0
        for name, tokens in (("rows", needs.row_tokens(x)), ("cols", needs.col_tokens(x))):
            kept_bytes, again_bytes = prices[name, True], prices[name, False]
            for c, n in tokens.items():
                moved = n * (kept_bytes if c in kept else again_bytes)
                mine += moved
                traffic[c] += moved
        traffic[x] += mine
    return traffic


class Needs:
    """For one assignment: which rows / columns of which chunk each rank reads from others, and
    which blocks it computes -- computed for every rank at once from every block's rows and columns (an
    assignment other than the query owner: the bytes of every rank decide between them)."""

    def __init__(self, P: int, spans: dict, owner):
        self.P = P
        self._blocks: list[list[tuple[int, int]]] = [[] for _ in range(P)]
        rows: list[dict[int, list]] = [{} for _ in range(P)]  # needer -> chunk -> row selections
        cols: list[dict[int, list]] = [{} for _ in range(P)]
        for ij, (r, c) in spans.items():  # (rows, columns) of each block (Blocks.spans)
            i, j = ij
            x = owner(i, j)
            self._blocks[x].append(ij)
            if i != x:
                rows[x].setdefault(i, []).append(r)
            if j != x:
                cols[x].setdefault(j, []).append(c)
        self._rows, self._row_needers, self._row_tokens = _gather(rows)
        self._cols, self._col_needers, self._col_tokens = _gather(cols)

    @classmethod
    def of(cls, blocks: list[list[tuple[int, int]]], rows: list[dict], cols: list[dict]) -> "Needs":
        """The needs whose ranks compute ``blocks`` (rank -> its (i, j), in the order of
        :meth:`~.sparse_blocks.Blocks.spans`) and read ``rows`` / ``cols`` (rank -> chunk -> the
        selection, united already) -- what :func:`~.sparse_compete.compete` gives its winner from
        the bit sets it counted."""
        needs = cls.__new__(cls)
        needs.P, needs._blocks = len(blocks), blocks
        in_order = [[{c: got[c] for c in sorted(got)} for got in table] for table in (rows, cols)]
        needs._rows, needs._row_needers, needs._row_tokens = _indexed(in_order[0])
        needs._cols, needs._col_needers, needs._col_tokens = _indexed(in_order[1])
        return needs

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

    def row_tokens(self, x: int) -> dict[int, int]:
        """Chunk -> how many of its rows rank x reads (:meth:`rows`, counted)."""
        return self._row_tokens[x]

    def col_tokens(self, x: int) -> dict[int, int]:
        return self._col_tokens[x]


class QueryOwnerNeeds:
    """The query owner's needs (every block computed where its queries live), rank by rank on
    demand from the block index: a rank's plan reads only its own row and column of blocks. Where
    it competes with a Mesh tile map, the bytes of every rank read only their column tokens (the
    index's summaries, which :meth:`~.sparse_blocks.Blocks.spans` keeps): the same as
    :class:`Needs` of the map (i, j) -> i, without gathering every rank's selections."""

    def __init__(self, blocks: Blocks):
        self.index, self.P = blocks, blocks.P
        self._cols: dict[int, dict] = {}
        self._col_tokens: dict[int, dict[int, int]] = {}

    def blocks(self, x: int) -> list[tuple[int, int]]:
        return [(x, j) for j in self.index.sharing(x) if self.index.summary(x, j)[1]]

    def rows(self, x: int) -> dict:
        return {}

    def cols(self, x: int) -> dict[int, tuple[Segment, ...]]:
        out = self._cols.get(x)
        if out is None:
            out = self._cols[x] = {j: cols for j in self.index.sharing(x) if j != x
                                   for cols, pairs in (self.index.summary(x, j),) if pairs}
        return out

    def row_tokens(self, x: int) -> dict[int, int]:
        return {}

    def col_tokens(self, x: int) -> dict[int, int]:
        """:meth:`cols`, counted -- straight from the block index (the bytes of every rank read
        every rank's: their selections need not be gathered)."""
        out = self._col_tokens.get(x)
        if out is None:
            out = self._col_tokens[x] = {j: sel_len(cols, 0) for j, (cols, pairs) in self.index.row_summary(x).items()
                                         if j != x and pairs}
        return out

    def row_needers(self, c: int) -> list[int]:
        return []

    def col_needers(self, c: int) -> list[int]:
        return [i for i in self.index.sharing(c) if i != c and self.index.summary(i, c)[1]]


class Slots:
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


def kept_chunks(x: int, P: int, pulled: dict[int, int], budget: float) -> frozenset:
    """The chunks whose pulled bytes rank ``x`` keeps for the backward (``pulled``: chunk -> its
    bytes): in the order the backward reads them -- by shift, (x - c) mod P, the order of the
    pull rounds and burst groups -- each that still fits in ``budget`` bytes. So a rank keeps
    what fits and pulls again only the rest: the chunks its backward reaches first need no
    round at all, the later ones come in while those compute.

    Example: P = 4, rank 0 pulled 3,000 bytes of chunk 3, 2,000 of chunk 2 and 500 of chunk 1,
    budget 4,000: shift order 3, 2, 1 -- chunk 3 fits (3,000), chunk 2 does not (5,000), chunk 1
    does (3,500): it keeps chunks 3 and 1 and pulls chunk 2 again."""
    if sum(pulled.values()) <= budget:  # all of it fits, in any order
        return frozenset(pulled)
    ordered = sorted(pulled)
    at = bisect_right(ordered, x)  # by shift: the chunks up to x downwards, then those above it downwards
    order = ordered[at - 1::-1] + ordered[:at - 1:-1]
    return first_fits(order, [pulled[c] for c in order], math.floor(budget))  # whole bytes fit where <= its floor


def first_fits(order: list, sizes: list[int], cap: int) -> frozenset:
    """The items of ``order`` (``sizes``: theirs) kept in turn where each still fits in ``cap``
    beside those kept before it, all whole numbers -- :func:`kept_chunks`' walk: the run that fits
    found by bisecting the running sums, then the rest walked while the smallest item could still fit."""
    first = bisect_right(list(accumulate(sizes)), cap)  # the first item that does not fit
    kept, left, smallest = order[:first], cap - sum(sizes[:first]), min(sizes, default=0)
    for i in range(first + 1, len(order)):
        if left < smallest:
            break
        if sizes[i] <= left:
            left -= sizes[i]
            kept.append(order[i])
    return frozenset(kept)


class Keeps:
    """What each rank keeps of the slots it pulled in the forward for the backward (no second
    pull of their Q / K / V; only dO and the returns move): everything ("keep"), nothing
    ("refetch"), or per rank what fits in ``limit`` (:data:`KEEP_LIMIT` unless the mode's
    ``backward_keep_limit`` says otherwise) x its own
    chunk's Q + K + V bytes ("auto", :func:`kept_chunks`: chunk by chunk in the order its backward
    reads them), decided from the needs, so sender and receiver agree. ``keeps(x, c)``: whether
    rank x keeps what it pulled of chunk c.

    Example (limit 1): rank x of a query-owner plan reads 3,000 columns of K/V from other ranks and
    holds T = 4,096 tokens of its own: 3,000 x kv <= 4,096 x (q + kv) -> it keeps them all (and runs
    those blocks as one call: :meth:`one_call`); a rank reading 20,000 columns of a long document
    keeps the chunks its backward reads first, up to 4,096 x (q + kv) bytes, and pulls the rest
    again (at the default limit, 2, up to twice that)."""

    def __init__(self, policy: str, needs, T: int, token_bytes: dict, limit: float):
        self.policy, self.needs, self.T, self.token_bytes, self.limit = policy, needs, T, token_bytes, limit
        # rank -> (chunks kept, whether that is all it pulled, the bytes it pulled)
        self._memo: dict[int, tuple[frozenset, bool, int]] = {}

    def __call__(self, x: int, c: int) -> bool:
        return c in self.kept(x)

    def one_call(self, x: int) -> bool:
        """Whether rank x's backward runs its blocks over kept columns as one call per query rows:
        where it keeps all it pulled and that is at most its own chunk's Q + K + V
        (:data:`ONE_CALL_LIMIT`). One call holds every return round of those blocks back until its
        end, while the ranks the partials go to wait for them; that costs little where the kept
        blocks are at most a chunk's worth, and more the more they are -- with a keep limit above
        1 a rank keeping two chunks' worth in one call made ring 27 % slower at 256 GPUs
        (docs/performance.md, "A keep limit of the user's"). Else one call per shift."""
        _, every, pulled = self._kept(x)
        return every and pulled <= ONE_CALL_LIMIT * self.T * (self.token_bytes["q"] + self.token_bytes["kv"])

    def kept(self, x: int) -> frozenset:
        """The chunks rank x keeps what it pulled of (under "keep" every one, under "refetch" none)."""
        return self._kept(x)[0]

    def _kept(self, x: int) -> tuple[frozenset, bool, int]:
        got = self._memo.get(x)
        if got is None:
            got = self._memo[x] = kept_of(x, self.needs.row_tokens(x), self.needs.col_tokens(x), self.needs.P,
                                          self.token_bytes, self.policy, self.limit * self.T)
        return got


def kept_of(x: int, rows: dict[int, int], cols: dict[int, int], P: int, per_token: dict, policy: str,
            limit_tokens: float) -> tuple[frozenset, bool, int]:
    """What rank x keeps under ``policy`` (:class:`Keeps`) of the ``rows`` and ``cols`` it reads
    (chunk -> tokens; ``per_token``: :func:`token_bytes`), its budget ``limit_tokens`` x its own Q + K
    + V bytes a token: (the chunks
    kept, whether that is every chunk it pulled, the bytes it pulled). Where everything fits no
    chunk is priced alone."""
    q, kv = per_token["q"], per_token["kv"]
    total = q * sum(rows.values()) + kv * sum(cols.values())
    if policy == "keep" or (policy == "auto" and total <= limit_tokens * (q + kv)):
        return frozenset(rows.keys() | cols.keys()), True, total
    pulled = {c: n * q for c, n in rows.items()}
    for c, n in cols.items():
        pulled[c] = pulled[c] + n * kv if c in pulled else n * kv
    kept = kept_chunks(x, P, pulled, limit_tokens * (q + kv)) if policy == "auto" else frozenset()
    return kept, len(kept) == len(pulled), total

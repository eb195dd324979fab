"""How a mask-aware plan's owner maps compete with the query owner (:mod:`.sparse`, step 2): the
map whose busiest rank moves the fewest bytes (:func:`~.sparse_needs.bytes_per_rank`) wins, ties
to the last map (the mode's own) -- decided without building every map's selections.

Mesh's ``auto`` tile on a document mask at 256 ranks puts 15 tile maps against the query owner;
building each map's :class:`~.sparse_needs.Needs` (every rank's row and column selections, gathered
and sorted) took ~15 ms a map: Mesh's plan of a sample (1M tokens, seeds 0-2) took 213-267 ms
on ``lognormal:16384`` and 67-81 ms on ``lognormal:4096``; 28-53 and 19-30 ms now over seeds 0-9
(81-87 on seed 8 of ``lognormal:16384``, whose one 329K-token document has every pair of ranks share
blocks), the same plans (docs/performance.md, "Build time with the choice"). The bytes only read
how many tokens each rank reads of each chunk, so :func:`compete` goes in three steps, each exact
in what it decides:

1. **The query owner's bytes**, from the block index's column summaries
   (:class:`~.sparse_needs.QueryOwnerNeeds`).
2. **A floor under each map's busiest rank**: a rank sends, of its own chunk, the rows and the
   columns of each block of its row and its column of blocks that the map computes on another
   rank, to that rank (:func:`sent_tokens`), each token at least what it costs when everything is
   kept (Q, O, dO and dQ a row; K/V and dK/dV a column); under a tile map it reads the rows and
   columns of its own blocks' other chunks (:func:`read_tokens`), priced exactly as the map's count
   would (what it keeps is decided by what it reads alone). Priced on the :data:`FLOOR_RANKS` ranks
   busiest under the query owner (those holding long documents, which every map must ship
   somewhere), what they send first (a few dozen blocks each), what they read where that does not
   decide; a map whose floor is above the fewest bytes found so far cannot win and is not counted.
3. **The maps left, counted** in the order of their first floors (:class:`NeedCounts`: each block's
   rows and columns as bit sets, :class:`BlockBits`, united per rank and chunk -- a ``|`` only where
   the block's set is not the one its rank holds already); the winner's selections are its bit sets
   cut into runs.

Worked example (``tests/plan/test_sparse_compete.py``): 4 ranks of the zigzag, 64 tokens (rank 1
holds positions [8, 16) and [48, 56)), causal, documents [0, 24) and [24, 64), GQA 32/8 heads of 128
in bf16 -- a row moves at least 49,536 bytes (Q, O, dO, dQ), a column 12,288 (K/V, dK/dV). Under
the query owner every rank moves 589,824 bytes. Mesh's 2x2 tile map (contiguous q) computes blocks
(1, 0) and (1, 2) on rank 0, which reads all 16 of rank 1's rows, and (2, 1) on rank 3, which reads 8
of its columns: what rank 1 sends alone floors the map at 16 x 49,536 + 8 x 12,288 = 890,880 bytes,
above 589,824, so the map is never counted (what rank 1 reads as well makes 1,483,776, the map's
busiest rank's bytes) and the query owner wins.
"""

from __future__ import annotations

from typing import Callable

from .mesh import TileMap
from .shape import AttentionShape
from .sel import Segment
from .sparse_blocks import Blocks
from .sparse_needs import Keeps, Needs, QueryOwnerNeeds, bytes_per_rank, kept_of, read_bytes, read_prices, token_bytes

__all__ = ["compete", "sent_tokens", "read_tokens", "NeedCounts", "BlockBits", "FLOOR_RANKS"]

# the ranks whose bytes floor each map: the busiest under the query owner. At 256 ranks (Mesh's 15
# maps, lognormal:16384 seeds 0-2 and lognormal:4096 seeds 0-1) what the 8 busiest send floors a map
# at 0.16-2.45x the query owner's bytes where the map's own are 0.68-4.90x -- it rules out the maps
# that ship every long document's rows far (the tall tiles) --, and with what they read 1-5 of the
# 15 maps are left to count (seeds 0-9 of both mixes, 3 on average; 2-6 with those reads priced at
# the least, stop 75); 16 ranks left 10 % fewer, for more time, and adding the busiest ranks of
# each map counted none (the maps left are within a few per cent of the winner)
FLOOR_RANKS = 8


class BlockBits:
    """The blocks of a :class:`~.sparse_blocks.Blocks` (its :meth:`~.sparse_blocks.Blocks.row_spans`)
    with their rows and columns as bit sets (bit t: local token t), built as asked: ``row(i)`` /
    ``col(j)``, query chunk i's / key chunk j's blocks, and ``blocks``, every one as (i, j, rows,
    columns) in :meth:`~.sparse_blocks.Blocks.spans`' order -- what :class:`NeedCounts` unites for a
    map and the floors for a few ranks (a union's tokens are its bits counted). Each selection's bits
    made once: blocks have few distinct selections (on the zigzag most are a chunk's halves; seed 2
    of ``lognormal:16384`` at 256 ranks: 106 among 11,940 rows and columns, 11 -> 3.5 ms)."""

    def __init__(self, index: Blocks):
        self.index, self.P = index, index.P
        self._made: dict[tuple, int] = {}  # selection -> its bits
        self._rows: dict[int, dict[int, tuple[int, int]]] = {}
        self._cols: list[list] | None = None
        self._blocks: list[tuple[int, int, int, int]] | None = None

    def _bits(self, sel) -> int:
        got = self._made.get(sel)
        if got is None:
            got = self._made[sel] = sum(((1 << (s.stop - s.start)) - 1) << s.start for s in sel)  # disjoint: | is +
        return got

    def row(self, i: int) -> dict[int, tuple[int, int]]:
        """j -> (rows, columns) of query chunk i's blocks."""
        got = self._rows.get(i)
        if got is None:
            bits = self._bits
            got = self._rows[i] = {j: (bits(r), bits(c)) for j, (r, c) in self.index.row_spans(i).items()}
        return got

    def blocks(self) -> list[tuple[int, int, int, int]]:
        if self._blocks is None:
            self._blocks = [(i, j, r, c) for i in range(self.P) for j, (r, c) in self.row(i).items()]
        return self._blocks

    def col_columns(self, j: int) -> list[tuple[int, int]]:
        """(i, columns) of key chunk j's blocks: where not every block is built (a map floored alone),
        from the summaries of the ranks sharing a document with j -- their columns, not their rows."""
        if self._blocks is not None:
            return [(i, c) for i, _, c in self.col(j)]
        bits, index = self._bits, self.index
        return [(i, bits(cols)) for i in index.sharing(j) for cols, pairs in (index.summary(i, j),) if pairs]

    def col(self, j: int) -> list[tuple[int, int, int]]:
        """(i, rows, columns) of key chunk j's blocks: from every block once all are built, else from
        the rows of the ranks sharing a document with j (a map floored alone: a few ranks' blocks)."""
        if self._cols is None and self._blocks is not None:
            self._cols = [[] for _ in range(self.P)]
            for i, j_, r, c in self._blocks:
                self._cols[j_].append((i, r, c))
        if self._cols is not None:
            return self._cols[j]
        return [(i, *got) for i in self.index.sharing(j) for got in (self.row(i).get(j),) if got]


class NeedCounts:
    """:class:`~.sparse_needs.Needs`' token counts for one owner map -- what
    :func:`~.sparse_needs.bytes_per_rank` and :class:`~.sparse_needs.Keeps` read -- without its
    selections: every block's rows and columns as bit sets (:class:`BlockBits`), united per (rank,
    chunk) and counted."""

    def __init__(self, bits: BlockBits, owner: Callable[[int, int], int]):
        self.P = P = bits.P
        rows: list[dict[int, int]] = [{} for _ in range(P)]  # needer -> chunk -> its rows read, a bit set
        cols: list[dict[int, int]] = [{} for _ in range(P)]
        # a tile map's owner by two lookups (owner_parts) instead of a call a block
        qs, ks = owner.owner_parts(P) if isinstance(owner, TileMap) else (None, None)
        self._bits, self._owner, self._parts = bits, owner, (qs, ks)
        for i, j, r, c in bits.blocks():
            x = owner(i, j) if qs is None else qs[i] + ks[j]
            # a union only where the block's set is not the one held already: blocks share their
            # selections' bit sets (BlockBits), and a union of 4,096-bit sets makes a new one
            if i != x:
                got = rows[x]
                old = got.get(i)
                got[i] = r if old is None or old is r else old | r
            if j != x:
                got = cols[x]
                old = got.get(j)
                got[j] = c if old is None or old is c else old | c
        self._rows, self._cols = rows, cols
        self._row_tokens = [{c: s.bit_count() for c, s in got.items()} for got in rows]
        self._col_tokens = [{c: s.bit_count() for c, s in got.items()} for got in cols]

    def row_tokens(self, x: int) -> dict[int, int]:
        return self._row_tokens[x]

    def col_tokens(self, x: int) -> dict[int, int]:
        return self._col_tokens[x]

    def needs(self) -> Needs:
        """The map's :class:`~.sparse_needs.Needs`, its selections from the bit sets united here: each
        distinct set cut into its runs once."""
        blocks: list[list[tuple[int, int]]] = [[] for _ in range(self.P)]
        owner, (qs, ks) = self._owner, self._parts
        for i, j, _, _ in self._bits.blocks():
            blocks[owner(i, j) if qs is None else qs[i] + ks[j]].append((i, j))
        made: dict[int, tuple[Segment, ...]] = {}

        def sel(b: int) -> tuple[Segment, ...]:
            got = made.get(b)
            if got is None:
                got = made[b] = _runs(b)
            return got
        return Needs.of(blocks, [{c: sel(b) for c, b in got.items()} for got in self._rows],
                        [{c: sel(b) for c, b in got.items()} for got in self._cols])


class _QueryOwnerCounts:
    """:class:`~.sparse_needs.QueryOwnerNeeds`' token counts from the bit sets: a rank reads the
    columns of its row of blocks (every block of :class:`BlockBits` has allowed pairs)."""

    def __init__(self, bits: BlockBits):
        self.P = bits.P
        self._col_tokens = [{j: c.bit_count() for j, (_, c) in bits.row(x).items() if j != x} for x in range(bits.P)]

    def row_tokens(self, x: int) -> dict[int, int]:
        return {}

    def col_tokens(self, x: int) -> dict[int, int]:
        return self._col_tokens[x]


def _runs(b: int) -> tuple[Segment, ...]:
    """The runs of set bits of ``b``, as segments in order (0b1110110: (1, 3), (4, 7)): adding a
    run's lowest bit carries past its last, whose position is the run's stop."""
    out = []
    while b:
        low = b & -b
        carried = b + low
        stop = (carried & -carried).bit_length() - 1
        out.append(Segment(low.bit_length() - 1, stop))
        b = carried ^ (1 << stop)
    return tuple(out)


def sent_tokens(bits: BlockBits, owner: Callable[[int, int], int], h: int) -> tuple[int, int]:
    """(rows, columns) of rank h's chunk that the other ranks read when ``owner`` places the blocks
    (``bits``) -- for each rank computing blocks of h's row (column), the union of their rows
    (columns): what :class:`~.sparse_needs.Needs` of the map counts as h's chunk read by others."""
    rows: dict[int, int] = {}  # the rank computing blocks of h's row -> their rows of h's chunk
    for j, (r, _) in bits.row(h).items():
        y = owner(h, j)
        if y != h:
            old = rows.get(y)
            rows[y] = r if old is None or old is r else old | r
    cols: dict[int, int] = {}
    for i, c in bits.col_columns(h):
        y = owner(i, h)
        if y != h:
            old = cols.get(y)
            cols[y] = c if old is None or old is c else old | c
    return sum(s.bit_count() for s in rows.values()), sum(s.bit_count() for s in cols.values())


def read_tokens(bits: BlockBits, tiles: TileMap, h: int) -> tuple[dict[int, int], dict[int, int]]:
    """(rows, columns) rank h reads of each other chunk under tile map ``tiles`` (chunk -> tokens) --
    its :class:`~.sparse_needs.Needs` row and column tokens: its blocks are its Q group's chunks x
    its KV group's (:meth:`~.mesh.TileMap.blocks`), walked from the shorter side (a 2 x 128 tile: the
    blocks of 2 query chunks' rows, not of 128 columns)."""
    qs, ks = set(tiles.q_group(h)), set(tiles.kv_group(h))
    rows: dict[int, int] = {}  # chunk -> the rows of it rank h's blocks read
    cols: dict[int, int] = {}
    if len(qs) <= len(ks):
        blocks = ((i, j, r, c) for i in qs for j, (r, c) in bits.row(i).items() if j in ks)
    else:
        blocks = ((i, j, r, c) for j in ks for i, r, c in bits.col(j) if i in qs)
    for i, j, r, c in blocks:
        if i != h:
            old = rows.get(i)
            rows[i] = r if old is None or old is r else old | r
        if j != h:
            old = cols.get(j)
            cols[j] = c if old is None or old is c else old | c
    return {i: s.bit_count() for i, s in rows.items()}, {j: s.bit_count() for j, s in cols.items()}


def compete(index: Blocks, owners, shape: AttentionShape, backward_chunks: str, limit: float) -> tuple[int, object]:
    """(k, needs): of the query owner (k = 0) and ``owners`` ((name, owner(i, j) -> rank), k = 1 ...;
    a :class:`~.mesh.TileMap` is floored by what its ranks read too), the map whose busiest rank
    moves the fewest bytes, each rank keeping what ``backward_chunks`` / ``limit`` keep
    (:class:`~.sparse_needs.Keeps`); ties to the last map; with its needs (module docstring)."""
    T = shape.seq_local
    tb = token_bytes(shape)  # what bytes_per_rank prices a token at

    def busiest(needs) -> int:
        return max(bytes_per_rank(needs, shape, Keeps(backward_chunks, needs, T, tb, limit)))

    def priced(tokens: tuple[int, int]) -> int:  # at the least a row and a column cost: everything kept
        return tokens[0] * (tb["q"] + tb["o"] + tb["do"] + tb["dq"]) + tokens[1] * (tb["kv"] + tb["dkv"])

    prices = read_prices(shape)

    def reads(tiles: TileMap, h: int) -> int:  # what rank h's reads move under the map: exactly, as counted
        rows, cols = read_tokens(bits, tiles, h)
        return read_bytes(rows, cols, kept_of(h, rows, cols, index.P, tb, backward_chunks, limit * T)[0], prices)

    bits = BlockBits(index)  # the floors count from them, and so does every map counted
    query_owner = QueryOwnerNeeds(index)
    counted = query_owner
    if len(owners) > 1:  # several maps, most likely some counted: one pass for every block and the summaries
        bits.blocks()
        counted = _QueryOwnerCounts(bits)  # its columns' bits counted, not their segments
    traffic = bytes_per_rank(counted, shape, Keeps(backward_chunks, counted, T, tb, limit))
    best, fewest = 0, max(traffic)
    ranks = sorted(range(index.P), key=lambda x: (-traffic[x], x))[:FLOOR_RANKS]
    # each map's floor from what the ranks send (cheap), then, for the maps it does not rule out,
    # from what they read too; the maps left counted in the order of their first floors
    sent = {k: [priced(sent_tokens(bits, owner, h)) for h in ranks] for k, (_, owner) in enumerate(owners, 1)}
    counts = None  # the winning map's
    for floor, k in sorted((max(v, default=0), k) for k, v in sent.items()):
        if floor > fewest:
            break  # this map and every one after it move more than the fewest on one of ``ranks``
        owner = owners[k - 1][1]
        if isinstance(owner, TileMap) and \
                max(v + reads(owner, h) for v, h in zip(sent[k], ranks)) > fewest:
            continue  # what the ranks read as well
        counted = NeedCounts(bits, owner)
        cost = busiest(counted)
        if (cost, -k) < (fewest, -best):
            best, fewest, counts = k, cost, counted
    return best, (query_owner if best == 0 else counts.needs())

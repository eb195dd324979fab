"""Blocks under a mask: the classification of a block (some query tokens x some key tokens), and
how a masked block runs as kernel calls (mask pieces).

The mask itself is a *mask kind* (:mod:`.maskkinds`): :class:`Mask` -- documents, causality and a
sliding window, re-exported here -- or chunked, prefix, or a kind registered elsewhere. Tokens in
no document (the padding of Transformer Engine's THD layout) attend nothing and are attended by
nothing: their output is 0. Every kind cuts a buffer's position runs into pieces (same group,
same part: :meth:`~.maskkinds.MaskKind.split`); a pair of pieces of one group (q positions
[qa, qa+n), k positions [ka, ka+m)) allows exactly the pairs with i - j in the pair's band
[lo, hi] (the band mask: lo = 0 if causal else -right, hi = left), so it keeps none, all or some
of its pairs, decided from its corners (:func:`band_relation`).

Worked example (S = 16, documents [0, 6) and [6, 16), causal, window (3, None)); rank 1 of the
zigzag over P = 4 holds positions [2, 3, 12, 13]::

    query 13 may attend keys [10, 13]  (document [6, 16), window 3)
    query  3 may attend keys [0, 3]
    block q = rank 1's tokens x k = rank 0's [0, 1, 14, 15]:
        (q 2..3, k 0..1)   same document, i - j in [1, 3] within [0, 3]: full
        (q 12..13, k 0..1) other document: empty
        (q .., k 14..15)   keys after every query: empty
    -> rows [0:2] x cols [0:2] of the block, full: the plan computes only that.
"""

from __future__ import annotations

import typing
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from typing import Literal, NamedTuple

from .maskkinds import INF, MaskKind
from .maskkinds.band import Mask, documents_of
from .maskkinds.pairs import band_pairs, band_relation
from .sel import Segment, first_at, merge_runs, union_intervals

__all__ = ["Mask", "BlockKind", "BlockClass", "classify_block", "band_relation", "band_pairs", "CAUSAL", "FULL",
           "union_intervals", "documents_of", "INF", "MASK_PIECE", "cut_runs", "mask_pieces", "block_pieces", "call_groups",
           "KERNEL_CALLS", "KernelCalls"]


class BlockKind(StrEnum):
    """How a kernel call masks one block -- the one vocabulary of the plan (``Attend.mask``), the
    kernels (``BlockMask.kind``) and the runtime's mask pieces."""

    FULL = "full"  # every (query, key) pair of the block attends
    CAUSAL = "causal"  # top-left causal on identical query and key tokens
    MASKED = "masked"  # the plan's Mask, applied to the tokens' global positions


CAUSAL = Mask(True)
FULL = Mask(False)


@lru_cache(maxsize=64)
def _bounds(mask: Mask) -> tuple[list[int], list[int]]:
    """The documents' starts and stops as plain lists (bisection over them)."""
    return [a for a, _ in mask.documents], [b for _, b in mask.documents]


# -- blocks ----------------------------------------------------------------------------------------
class BlockClass(NamedTuple):
    """What a plan computes of a block: ``rows`` (selection of the query buffer) x ``cols`` (one
    selection per key/value buffer), all empty-free, with kernel mask ``kind`` ("full",
    "causal" or "masked"); ``pairs`` = allowed (query, key) pairs (the work)."""

    kind: str
    rows: tuple
    cols: tuple
    pairs: int


@lru_cache(maxsize=65536)
def classify_block(mask: Mask, q_runs: tuple, kv_runs: tuple) -> BlockClass | None:
    """The part of block (query tokens ``q_runs`` x key tokens ``kv_runs[i]`` of the i-th key/value
    buffer) that has allowed pairs, and the kernel mask for it; None when it has none.

    Runs are (global start, length) in buffer order. Rows and columns with no allowed pair are
    trimmed away (a window needs only the halo of a neighbouring chunk). The result is "full"
    when every remaining pair is allowed, "causal" when the remaining query and key tokens are
    the same positions in increasing order inside one document and the band does not cut within
    them (top-left causal on the block), else "masked" (the kernel masks by position)."""
    qs = mask.split(q_runs)
    kvs = [mask.split(r) for r in kv_runs]
    rows: list[tuple[int, int]] = []
    cols: list[list[tuple[int, int]]] = [[] for _ in kvs]
    pairs = 0
    kinds = set()
    causal_only = True  # every pair kept lies on or below the diagonal (i >= j)
    by_group: list[dict] = []  # per key/value buffer: group -> its pieces (pairs of one group only)
    for ks in kvs:
        d: dict = {}
        for run in ks:
            d.setdefault(run[3], []).append(run)
        by_group.append(d)
    for ql, qa, n, qg, qp in qs:
        if qg is None:
            continue
        for b, ks in enumerate(by_group):
            for kl, ka, m, _, kp in ks.get(qg, ()):
                lo, hi = mask.pair_band(qp, kp)
                kind = band_relation(qa, n, ka, m, lo, hi)
                if kind == "none":
                    continue
                kinds.add(kind)
                causal_only &= lo >= 0
                if kind == "all":
                    rows.append((ql, ql + n))
                    cols[b].append((kl, kl + m))
                    pairs += n * m
                else:
                    # rows with a key in range: i in [ka + lo, ka + m - 1 + hi]; keys: j in [qa - hi, qa + n - 1 - lo]
                    r0 = max(qa, ka + lo) if lo != -INF else qa
                    r1 = min(qa + n, ka + m + hi) if hi != INF else qa + n
                    c0 = max(ka, qa - hi) if hi != INF else ka
                    c1 = min(ka + m, qa + n - lo) if lo != -INF else ka + m
                    rows.append((ql + int(r0) - qa, ql + int(r1) - qa))
                    cols[b].append((kl + int(c0) - ka, kl + int(c1) - ka))
                    pairs += band_pairs(qa, n, ka, m, lo, hi)
    if pairs == 0:
        return None
    row_sel = union_intervals(rows)
    col_sels = tuple(union_intervals(c) for c in cols)
    kind = _kernel_kind(causal_only, kinds, qs, kvs, row_sel, col_sels, pairs)
    return BlockClass(kind, row_sel, col_sels, pairs)


def _positions(subruns, sel: tuple[Segment, ...]) -> list[tuple[int, int, object]]:
    """(global start, length, group) runs of the selected local tokens of a split buffer (pieces
    in local order: a bisection finds a segment's first one)."""
    out = []
    offsets = [local for local, *_ in subruns]
    for s in sel:
        for n in range(first_at(offsets, s.start), len(subruns)):
            local, start, length, doc, _ = subruns[n]
            if local >= s.stop:
                break
            a, b = max(s.start, local), min(s.stop, local + length)
            if a < b:
                out.append((start + a - local, b - a, doc))
    return out


def _kernel_kind(causal_only: bool, kinds: set, qs, kvs, rows, cols, pairs: int) -> str:
    nrows = sum(s.stop - s.start for s in rows)
    ncols = sum(s.stop - s.start for sel in cols for s in sel)
    if kinds == {"all"} and pairs == nrows * ncols:
        return BlockKind.FULL
    # causal: the kept query and key tokens are the same positions, increasing, in one group, every
    # kept pair has i >= j and there are n (n + 1) / 2 of them: so every i >= j is allowed
    used = [b for b, sel in enumerate(cols) if sel]
    if causal_only and len(used) == 1 and nrows == ncols:
        qp = _positions(qs, rows)
        kp = _positions(kvs[used[0]], cols[used[0]])
        flat_q = [(s, l) for s, l, _ in qp]
        if merge_runs(flat_q) == merge_runs([(s, l) for s, l, _ in kp]) and len({d for *_, d in qp}) == 1:
            increasing = all(a[0] + a[1] <= b[0] for a, b in zip(flat_q, flat_q[1:]))
            if increasing and pairs == nrows * (nrows + 1) // 2:
                return BlockKind.CAUSAL
    return BlockKind.MASKED


# -- how a masked block runs: mask pieces ---------------------------------------------------------------
# tokens per side of a mask piece: what the runtime cuts a masked block into, per device (the
# simulator's machine is a GPU); MEGATRON_MESH_MASK_PIECE overrides it at run time
MASK_PIECE = {"cpu": 512, "cuda": 2048}


def cut_runs(runs, piece: int) -> list[tuple[int, tuple[tuple[int, int], ...], int]]:
    """A buffer made of position runs (start, length), cut into consecutive pieces of at most
    ``piece`` tokens: (block-local offset, the piece's runs, its length). A piece may span several
    runs, so a buffer of many short documents is a few pieces, not one per run (THD with 3-token
    documents would otherwise make ~10^7 kernel calls of one block).

    >>> cut_runs(((10, 5), (40, 3)), 2)
    [(0, ((10, 2),), 2), (2, ((12, 2),), 2), (4, ((14, 1), (40, 1)), 2), (6, ((41, 2),), 2)]
    """
    out: list = []
    cur: list[tuple[int, int]] = []
    local = filled = 0
    for start, n in runs:
        while n:
            take = min(n, piece - filled)
            cur.append((start, take))
            start, n, filled = start + take, n - take, filled + take
            if filled == piece:
                out.append((local, tuple(cur), filled))
                local, cur, filled = local + filled, [], 0
    if filled:
        out.append((local, tuple(cur), filled))
    return out


def _document_runs(mask: Mask, runs) -> list[tuple[int, int]]:
    """``runs`` (position runs, buffer order) cut where a document of ``mask`` starts or ends: a
    run that holds several documents becomes one run per document (and per gap between them).

    >>> _document_runs(Mask(True, documents=((0, 5), (5, 9), (12, 20))), [(3, 12)])
    [(3, 2), (5, 4), (9, 3), (12, 3)]
    """
    if mask.documents is None:
        return list(runs)
    starts, stops = _bounds(mask)
    out = []
    for start, n in runs:
        end = start + n
        cuts = sorted(set(starts[bisect_right(starts, start):bisect_left(starts, end)]) |
                      set(stops[bisect_right(stops, start):bisect_left(stops, end)]))
        for c in cuts:
            out.append((start, c - start))
            start = c
        out.append((start, end - start))
    return out


def _segments(runs, piece: int, mask: Mask | None = None) -> list[tuple[int, tuple[tuple[int, int], ...], int]]:
    """A buffer's runs as the segments :func:`mask_pieces` pairs up: runs joined where their
    positions continue and cut where a document ends; a run of at least ``piece // 16`` tokens is
    a segment of its own (so the empty and full quadrants between two zigzag portions of a document
    are never computed densely together, and two documents side by side are two causal calls,
    not one masked rectangle); the shorter runs between them packed into segments of at most
    ``piece`` tokens (:func:`cut_runs`: many short documents make few kernel calls). (block-local
    offset, runs, length), as :func:`cut_runs`."""
    long_run = max(1, piece // 16)
    joined = merge_runs(runs)
    if mask is not None:
        joined = _document_runs(mask, joined)
    out: list = []
    local, short = 0, []

    def flush() -> None:
        nonlocal local, short
        for off, rs, n in cut_runs(short, piece):
            out.append((local + off, rs, n))
        local += sum(n for _, n in short)
        short = []

    for start, n in joined:
        if n >= long_run:
            flush()
            out.append((local, ((start, n),), n))
            local += n
        else:
            short.append((start, n))
    flush()
    return out


def _segment_documents(segments, docs_of) -> tuple[list[int], dict[int, list]]:
    """Group ids of ``segments`` (:func:`_segments`): consecutive segments that lie in one and the
    same document share an id; a segment of several documents has one of its own (``docs_of``:
    each segment's documents, :func:`_documents_of`; None: the mask has none, one document). And
    every group: id -> [its document (None: several), first offset, end, runs, segment count]."""
    ids, last, gid = [], None, -1
    groups: dict[int, list] = {}
    for (off, runs, n), docs in zip(segments, docs_of):
        docs = {0} if docs is None else docs
        doc = next(iter(docs)) if len(docs) == 1 else None
        if doc is None or doc != last:
            gid += 1
            groups[gid] = [doc, off, off, [], 0]
        got = groups[gid]
        got[2], got[4] = off + n, got[4] + 1
        got[3].extend(runs)
        ids.append(gid)
        last = doc
    return ids, groups


def _whole_documents(mask: Mask, rows, cols, row_docs, col_docs) -> tuple[list[int], list[int], dict]:
    """Where :func:`mask_pieces` makes one call of several segment pairs: the group ids of the
    query and key segments (:func:`_segment_documents`) and, for each pair of groups of one
    document with more than two segments between them whose whole rectangle is FULL or CAUSAL
    (:func:`classify_block`, nothing trimmed), that call (kind, rows, columns). The call computes
    exactly the rectangle's allowed pairs, so every segment pair of the two groups is skipped."""
    q_group, q_spans = _segment_documents(rows, row_docs)
    k_group, k_spans = _segment_documents(cols, col_docs)
    by_doc: dict = {}
    for kg, span in k_spans.items():
        if span[0] is not None:
            by_doc.setdefault(span[0], []).append((kg, span))
    whole: dict = {}
    for qg, (doc, r0, r1, q_runs, q_count) in q_spans.items():
        for kg, (_, c0, c1, k_runs, k_count) in by_doc.get(doc, ()) if doc is not None else ():
            if q_count + k_count < 3:  # one segment pair: mask_pieces' own rule
                continue
            c = classify_block(mask, tuple(q_runs), (tuple(k_runs),))
            if c is not None and c.kind != BlockKind.MASKED and c.rows == ((0, r1 - r0),) and \
                    c.cols[0] == ((0, c1 - c0),):
                whole[qg, kg] = (c.kind, (r0, r1), (c0, c1))
    return q_group, k_group, whole


# how a masked block's pieces run as kernel calls (a plan's ``kernel_calls``; see call_groups)
KernelCalls = Literal["varlen", "piece", "block"]
KERNEL_CALLS = typing.get_args(KernelCalls)


def call_groups(pieces, kernel_calls: KernelCalls = "varlen") -> list[tuple[int, ...]]:
    """Which pieces of a masked block (:func:`mask_pieces`) one kernel call runs together, as
    tuples of their indices, in the order of their first piece:

    * "varlen" (this package's kernels): FULL pieces that follow each other -- the next one's
      rows and columns start where the last one's end, as consecutive documents' pieces do --
      in one variable-length call, and CAUSAL ones likewise: each piece a sequence of its own,
      its rows against its columns, as flash-attention's varlen kernels take them, packed
      without a copy; each MASKED piece alone (it needs its allowed matrix);
    * "piece": every piece alone (a kernel without variable-length calls);
    * "block": all in one call (Transformer Engine's THD attention: per-document masks from
      cu_seqlens, whatever the pieces).

    Worked example: a rank's own block with documents of 900, 2,000, 40, 30 and 500 tokens
    (piece 2048, so runs of 128 tokens or more are segments of their own): causal 900, causal
    2,000, masked (40 + 30 packed together), causal 500 -> "varlen": three calls, (0, 1), (2,)
    and (3,); "piece": four; "block": one."""
    if kernel_calls not in KERNEL_CALLS:
        raise ValueError(f"kernel_calls must be one of {', '.join(KERNEL_CALLS)}, got {kernel_calls!r}")
    if kernel_calls == "block":
        return [tuple(range(len(pieces)))] if pieces else []
    if kernel_calls == "piece":
        return [(i,) for i in range(len(pieces))]
    groups: list[list[int]] = []
    for i, (kind, rows, cols) in enumerate(pieces):
        if groups and kind != BlockKind.MASKED:
            last_kind, last_rows, last_cols = pieces[groups[-1][-1]]
            if last_kind == kind and last_rows[1] == rows[0] and last_cols[1] == cols[0]:
                groups[-1].append(i)
                continue
        groups.append([i])
    return [tuple(g) for g in groups]


def _documents_of(mask: Mask, runs) -> set[int]:
    """Indices of the documents of ``mask`` that position ``runs`` overlap."""
    starts, stops = _bounds(mask)
    out: set[int] = set()
    for start, n in runs:
        i = max(0, bisect_right(starts, start) - 1)
        while i < len(starts) and starts[i] < start + n:
            if stops[i] > start:
                out.add(i)
            i += 1
    return out


def _partners(mask: Mask, cols, col_docs):
    """For a query segment's documents, the indices (ascending) of the key segments ``cols`` (their
    documents ``col_docs``) that can hold a key it attends: with documents, only those sharing a
    document with it (found through the documents, so a block of many documents is cut in time
    linear in them, not quadratic); without, every one."""
    if mask.documents is None:
        every = range(len(cols))
        return lambda docs: every
    by_doc: dict[int, list[int]] = {}
    for i, docs in enumerate(col_docs):
        for d in docs:
            by_doc.setdefault(d, []).append(i)
    return lambda docs: sorted({i for d in docs for i in by_doc.get(d, ())})


def mask_pieces(mask: Mask, q_runs, k_runs, piece: int) -> list[tuple[BlockKind, tuple[int, int], tuple[int, int]]]:
    """How a "masked" block runs: its query and key buffers (global runs (start, length), in buffer
    order) as segments (:func:`_segments`: long runs alone, short ones packed); every pair of
    segments with an allowed pair is one kernel call (kind, block-local rows [r0, r1), columns
    [c0, c1)) -- FULL or CAUSAL, at any size, when the classification says the whole pair is --
    else the pair is cut into pieces of at most ``piece`` tokens a side (:func:`cut_runs`), each
    with an allowed pair one MASKED call (the kernel gets the piece's allowed matrix), or FULL /
    CAUSAL when the whole piece is. The runtime executes exactly these calls and the simulator
    prices them (one owner of the cut).

    Full calls side by side on the same rows, or one above the other on the same columns, are
    joined into one (a full call needs no mask).
    Consecutive segments of one document against consecutive segments of the same document are
    one call when the whole rectangle they make is FULL or CAUSAL (:func:`_whole_documents`):
    the zigzag portions of a document against themselves are one causal call, not three.

    Worked example (causal, one document [0, 4000) cut into two zigzag portions, piece 2048): the
    query runs [0, 1000) + [3000, 4000) against the key runs [1000, 2000) + [2000, 3000) (joined:
    one run of 2000). Its front run sees none of those keys, its back run all of them: one FULL
    call of 1000 x 2000 pairs, where one masked call over the whole block computed 2000 x 2000.
    Against itself it is one CAUSAL call of 2000 x 2000: the positions increase along the buffer,
    so "key position <= query position" is the lower triangle (front x back is empty, back x
    front full), and a causal kernel skips the empty half as it does for one run."""
    out: list = []
    cols = _segments(k_runs, piece, mask)
    rows = _segments(q_runs, piece, mask)
    # each segment's documents, found once (the partners and the whole-document calls use them)
    row_docs, col_docs = ([None] * len(x) if mask.documents is None else [_documents_of(mask, r) for _, r, _ in x]
                          for x in (rows, cols))
    partners = _partners(mask, cols, col_docs)
    q_group, k_group, documents = _whole_documents(mask, rows, cols, row_docs, col_docs)
    for qi, (r0, qr, n) in enumerate(rows):
        for ki in partners(row_docs[qi]):
            c0, kr, m = cols[ki]
            joined = documents.get((q_group[qi], k_group[ki]))
            if joined is not None:  # one call for the documents' rectangle, at its first pair
                if joined:
                    _add_call(out, *joined)
                    documents[q_group[qi], k_group[ki]] = ()
                continue
            for call in _segment_calls(mask, (r0, qr, n), (c0, kr, m), piece):
                _add_call(out, *call)
    return out


@lru_cache(maxsize=4096)
def block_pieces(mask: Mask, q_runs: tuple, k_runs: tuple, piece: int) -> tuple:
    """:func:`mask_pieces` of a block, made once: the simulator prices a block's calls
    (:func:`~.costs.masked_block`) and finds the rows two of them write
    (:func:`~.single_writes.single_writes`) from the same pieces."""
    return tuple(mask_pieces(mask, q_runs, k_runs, piece))


def _add_call(out: list, kind: BlockKind, rows: tuple[int, int], cols: tuple[int, int]) -> None:
    """Append a call to ``out``; full calls side by side (or one above the other) are one call."""
    last = out[-1] if out else None
    if kind == BlockKind.FULL and last is not None and last[0] == BlockKind.FULL and last[1] == rows and \
            last[2][1] == cols[0]:
        out[-1] = (kind, rows, (last[2][0], cols[1]))
    elif kind == BlockKind.FULL and last is not None and last[0] == BlockKind.FULL and last[2] == cols and \
            last[1][1] == rows[0]:
        out[-1] = (kind, (last[1][0], rows[1]), cols)
    else:
        out.append((kind, rows, cols))


def _segment_calls(mask: Mask, row, col, piece: int):
    """The calls of one pair of segments (block-local offset, global runs, tokens): one FULL or
    CAUSAL call when the whole pair is, else its pieces of at most ``piece`` tokens a side with
    an allowed pair (:func:`mask_pieces`)."""
    (r0, qr, n), (c0, kr, m) = row, col
    c = classify_block(mask, qr, (kr,))
    if c is None:
        return
    if c.kind != BlockKind.MASKED and c.rows == ((0, n),) and c.cols[0] == ((0, m),):
        yield c.kind, (r0, r0 + n), (c0, c0 + m)
        return
    for r1, qp, n1 in cut_runs(qr, piece):
        for c1, kp, m1 in cut_runs(kr, piece):
            cp = classify_block(mask, qp, (kp,))
            if cp is None:
                continue
            whole = cp.rows == ((0, n1),) and cp.cols[0] == ((0, m1),)
            kind = cp.kind if whole and cp.kind != BlockKind.MASKED else BlockKind.MASKED
            yield kind, (r0 + r1, r0 + r1 + n1), (c0 + c1, c0 + c1 + m1)

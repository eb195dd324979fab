"""The executor's scratch memory of one rank and direction, laid out once per plan and shape.

Every buffer the executor makes for itself in one direction -- the receive buffers of each round,
the partial outputs and gradient partials, the input cuts of several token ranges or of one head
slice -- gets a fixed place in one block of bytes (the *arena*), chosen here by walking the rank's
ops once: a buffer takes its place when an op creates it and gives it back at its ``Free``
(first fit, lowest address). The runtime allocates the arena once and keeps it from call to call
(:mod:`megatron_mesh.runtime.storage`), so a step allocates nothing but what it returns (the
rank's output and gradients) and what outlives the call (the buffers the forward keeps for the
backward); the same addresses every call are also what a CUDA graph replays.

Storage of a buffer's tensors: a tensor of a head dim is kept token-major, [T, B, H, W] (the
caller's layout), a row statistic (lse, delta) as [B, H, T]; each is contiguous, so it is sent and
received as it is (its bytes are the buffer's bytes: :func:`~.accounting.key_bytes`).

Buffers that arrive in one round, and the input cuts, are placed *together*: for each tensor of
a kind (k, then v, ...), the round's buffers one after another in the order the blocks read them.
So a block that reads several whole buffers of one round (a TASP step's slots of one kind of
block) reads one run of memory: :attr:`ScratchLayout.spans` names it and the kernel gets a view,
not a concatenated copy; and the input cuts of a rank (TASP's seven slots of its own chunk) are
made by one gather per tensor.

Worked example (ring attention, P = 4, backward of rank 0, one KV chunk of n bytes, its fp32
gradient partial 2n): round 1 receives kv3 (offset 0, n bytes); the block over kv3 creates dkv3
(n .. 3n); round 2 sends dkv3 and receives kv2 and dkv2' -- kv3 was freed, so kv2 reuses offset 0
and dkv2' goes to 3n .. 5n; and so on: the arena settles at the live peak of the walk, plus
whatever first fit leaves between (``size`` >= :func:`~.memory.buffer_memory`'s backward peak).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .accounting import FP32
from .ir import KINDS, AddGrad, Attend, AttendBackward, Copy, Free, Key, MergeOut, Plan, Post, RowStats
from . import arena_runs
from .arena_runs import CopyRun, copied_only, copy_run_candidates, cut_groups, cut_keys  # noqa: F401 (re-exported)
from .shape import AttentionShape

__all__ = ["ScratchLayout", "TensorPlace", "CopyRun", "copy_run_candidates", "cut_groups", "scratch_layout", "copied_only",
           "cut_keys", "tensor_shapes", "ALIGN"]

ALIGN = 256  # bytes: every run of storage starts at a multiple (vectorised loads, the CUDA allocator's own rule)


@dataclass(frozen=True)
class TensorPlace:
    """Where one tensor of a buffer lies in the arena: its byte ``offset``, its ``tokens``, the
    batch, its heads and last dim (``width``; 0 for a row statistic) and element size."""

    offset: int
    tokens: int
    batch: int
    heads: int
    width: int
    itemsize: int

    @property
    def row(self) -> int:
        """Bytes of one token (all samples and heads): a token-major tensor's stride in bytes."""
        return self.batch * self.heads * max(self.width, 1) * self.itemsize

    @property
    def nbytes(self) -> int:
        return self.tokens * self.row


@dataclass(frozen=True, eq=False)
class ScratchLayout:
    """The arena of one rank and direction of a plan for one shape.

    * ``size`` -- bytes of the arena;
    * ``places`` -- (op index, key) -> each tensor's :class:`TensorPlace` (index -1: the input
      cuts made at the start of the direction), for every buffer the arena holds;
    * ``spans`` -- op index -> per key/value tensor (k, v) the :class:`TensorPlace` of the one run
      of memory a block's several key/value pieces make together;
    * ``gathers`` -- op index -> (k window, bytes from a k row to its v row, the window rows read)
      where a block's pieces do not follow each other but k and v can be gathered together;
    * ``grad_spans`` -- op index -> the run of each of dK, dV that a backward block's new gradient
      partials make together (it writes all their columns: one copy per tensor);
    * ``cuts`` -- the input cuts, per group (:func:`cut_groups`): (keys in order, each tensor's
      run, head slices);
    * ``copy_runs`` -- op index -> the :class:`CopyRun` each op of a run belongs to.
    """

    size: int
    places: dict
    spans: dict
    gathers: dict
    grad_spans: dict
    cuts: tuple
    copy_runs: dict = field(default_factory=dict)

    def overlap(self, a: tuple, b: tuple) -> bool:
        """Whether buffers ``a`` and ``b`` ((op index, key) of :attr:`places`) share bytes."""
        return any(p.offset < q.offset + q.nbytes and q.offset < p.offset + p.nbytes
                   for p in self.places[a] for q in self.places[b])


def tensor_shapes(plan: Plan, key: Key, shape: AttentionShape) -> tuple[tuple[int, int, int, int], ...]:
    """(tokens, heads, width, itemsize) of each tensor of buffer ``key`` (width 0: a row statistic)."""
    h, g = plan.head_counts(key, shape.heads, shape.kv_heads)
    tokens = plan.tokens(key)
    acc = max(FP32, shape.itemsize)
    return tuple((tokens, h if side == "q" else g, shape.dim(dim) if dim else 0,
                  shape.itemsize if dtype == "input" else acc) for side, dim, dtype in KINDS[key.kind].tensors)


class _Space:
    """First fit over a line of bytes: the lowest free range that holds a request."""

    def __init__(self):
        self.free: list[list[int]] = []  # sorted, disjoint [start, stop) below ``top``
        self.top = self.high = 0

    def take(self, n: int) -> int:
        n = -(-n // ALIGN) * ALIGN
        for i, (a, b) in enumerate(self.free):
            if b - a >= n:
                if b - a == n:
                    self.free.pop(i)
                else:
                    self.free[i][0] = a + n
                return a
        self.top += n
        self.high = max(self.high, self.top)
        return self.top - n

    def give(self, start: int, n: int) -> None:
        n = -(-n // ALIGN) * ALIGN
        self.free.append([start, start + n])
        self.free.sort()
        merged: list[list[int]] = []
        for a, b in self.free:
            if merged and merged[-1][1] == a:
                merged[-1][1] = b
            else:
                merged.append([a, b])
        if merged and merged[-1][1] == self.top:  # the top range goes back to the end
            self.top = merged.pop()[0]
        self.free = merged


class _Walk:
    def __init__(self, plan: Plan, shape: AttentionShape, ops):
        self.plan, self.shape, self.ops = plan, shape, ops
        self.space = _Space()
        self.places: dict = {}
        self.current: dict[Key, tuple] = {}  # key -> (op index, key) of its live arena buffer
        self.blocks: dict[tuple, list] = {}  # buffer -> [block start, block bytes, live members]
        self.reads: dict | None = None  # key -> the indices of the ops that read it (made on first use)

    def first_read(self, key: Key, start: int) -> int:
        """The first op from ``start`` on that reads ``key`` (a send aside)."""
        if self.reads is None:
            self.reads = {}
            for j, op in enumerate(self.ops):
                if type(op) is not Post:
                    for k in op.reads():
                        self.reads.setdefault(k, []).append(j)
        at = self.reads.get(key, ())
        i = bisect.bisect_left(at, start)
        return at[i] if i < len(at) else len(self.ops)

    def place(self, i: int, keys: list[Key], at: dict | None = None, ordered: bool = False) -> None:
        """One block for ``keys`` (created together by op ``i``, or each by op ``at[key]``): per
        kind and tensor, the buffers in the order ops read them (``ordered``: as given), each run
        aligned."""
        if not ordered:
            keys = sorted(keys, key=lambda k: (list(KINDS).index(k.kind), self.first_read(k, i + 1)))
        shapes = {k: tensor_shapes(self.plan, k, self.shape) for k in keys}
        runs, size = [], 0
        for kind in dict.fromkeys(k.kind for k in keys):
            members = [k for k in keys if k.kind == kind]
            for t in range(len(KINDS[kind].tensors)):
                run = sum(_nbytes(shapes[k][t]) for k in members) * self.shape.batch
                runs.append((members, t, size))
                size += -(-run // ALIGN) * ALIGN
        start = self.space.take(size)
        block = [start, size, len(keys)]
        places = {k: [None] * len(KINDS[k.kind].tensors) for k in keys}
        for members, t, off in runs:
            pos = start + off
            for k in members:
                tokens, heads, width, item = shapes[k][t]
                places[k][t] = TensorPlace(pos, tokens, self.shape.batch, heads, width, item)
                pos += _nbytes(shapes[k][t]) * self.shape.batch
        for k in keys:
            ident = (i if at is None else at[k], k)
            self.replace(k)
            self.places[ident] = tuple(places[k])
            self.current[k] = ident
            self.blocks[ident] = block

    def replace(self, key: Key) -> None:
        """``key`` is made again without a ``Free``: its earlier buffer is given back first."""
        if key in self.current:
            self.free(key)

    def free(self, key: Key) -> None:
        ident = self.current.pop(key, None)
        if ident is None:
            return
        block = self.blocks[ident]
        block[2] -= 1
        if block[2] == 0:
            self.space.give(block[0], block[1])

    def pieces(self, op) -> list | None:
        """(tensor places, first token, stop token) of each key/value piece a block reads, where
        every piece is in the arena."""
        out = []
        for i, key in enumerate(op.kv):
            ident = self.current.get(key)
            if ident is None:
                return None
            sel = op.col(i) or ((0, self.plan.tokens(key)),)
            out += [(self.places[ident], a, b) for a, b in sel]
        return out

    def span(self, pieces) -> tuple | None:
        """The runs of memory a block's key/value pieces make, where they follow each other."""
        out = []
        for t in range(len(pieces[0][0])):
            first, a0, _ = pieces[0]
            place = first[t]
            end, tokens = None, 0
            for places, a, b in pieces:
                p = places[t]
                if p.row != place.row or p.width != place.width:
                    return None
                if end is not None and p.offset + a * p.row != end:
                    return None
                end, tokens = p.offset + b * p.row, tokens + b - a
            out.append(TensorPlace(place.offset + a0 * place.row, tokens, place.batch, place.heads, place.width,
                                   place.itemsize))
        return tuple(out)

    @staticmethod
    def gather(pieces) -> tuple | None:
        """Where a block's pieces do not follow each other but each piece's v lies the same
        number of bytes after its k, in rows of one size: (the k window from the first piece's
        first row to the last one's end, that distance, the window rows the block reads in
        order) -- one gather of k and v together instead of a copy of each."""
        k0, v0 = pieces[0][0][0], pieces[0][0][1]
        delta, row = v0.offset - k0.offset, k0.row
        if len(pieces[0][0]) != 2 or v0.row != row or v0.width != k0.width or delta <= 0:
            return None
        starts = [places[0].offset + a * row for places, a, _ in pieces]
        base = min(starts)
        end = max(places[0].offset + b * row for places, _, b in pieces)
        for places, a, b in pieces:
            k, v = places
            if (v.offset - k.offset, k.row, v.row, k.width, v.width) != (delta, row, row, k0.width, k0.width) \
                    or (k.offset - base) % row:
                return None
        if base + delta < end:  # the v window would overlap the k window's rows
            return None
        rows = tuple(i for places, a, b in pieces for i in range((places[0].offset - base) // row + a,
                                                                   (places[0].offset - base) // row + b))
        window = TensorPlace(base, (end - base) // row, k0.batch, k0.heads, k0.width, k0.itemsize)
        return window, delta, rows


def _nbytes(t: tuple[int, int, int, int]) -> int:
    tokens, heads, width, item = t
    return tokens * heads * max(width, 1) * item


def scratch_layout(plan: Plan, rank: int, direction: str, shape: AttentionShape) -> ScratchLayout:
    """The arena of ``rank``'s ``direction`` of ``plan`` for ``shape`` (made once per plan and
    shape: the executor and :func:`~.memory.buffer_memory` read the same one)."""
    return plan.memo(("scratch", rank, direction, shape), lambda: _layout(plan, rank, direction, shape))


def _layout(plan: Plan, rank: int, direction: str, shape: AttentionShape) -> ScratchLayout:
    rp = plan.rank(rank)
    ops = rp.ops(direction)
    walk = _Walk(plan, shape, ops)
    own = {rp.output} if direction == "forward" else {rp.grad_q, rp.grad_kv}
    keep = set(rp.saved) if direction == "forward" else set()  # they outlive the call: made per call
    inputs = rp.forward_inputs if direction == "forward" else rp.backward_inputs
    live = set(inputs) | (set() if direction == "forward" else set(rp.saved))
    cuts = _place_cuts(walk, plan, rp, direction, shape, keep)
    spans, gathers, grad_spans = {}, {}, {}
    candidates = arena_runs.rank_copy_runs(plan, rank, direction)
    scatters = {run[0]: run for way, run in candidates if way == "scatter"}
    copies: dict[int, tuple] = {}  # Copy op index -> (its source's places, its destination's) in the arena, or None
    for i, op in enumerate(ops):
        kind = type(op)
        if kind is Copy:
            if i in scatters:  # the buffers a run of copies makes, placed together in its order
                new = {ops[j].dst: j for j in scatters[i]}
                if not any(k in live or k in own or k in keep for k in new):
                    walk.place(i, list(new), at=new, ordered=True)
                    live.update(new)
            src = walk.current.get(op.src)
            copies[i] = (walk.places[src] if src is not None else None, None)
        if kind is Post:
            arriving = [t.key for t in op.recvs if t.key not in keep]
            live.update(t.key for t in op.recvs)
            if arriving:
                walk.place(i, arriving)
        elif kind is Free:
            walk.free(op.key)
            live.discard(op.key)
        elif kind in (Attend, AttendBackward, MergeOut, AddGrad, Copy, RowStats):
            if kind in (Attend, AttendBackward):
                _block_pieces(walk, i, op, spans, gathers)
            made = [key for key in dict.fromkeys(op.writes()) if key not in live]
            live.update(made)
            placed = [key for key in made if key not in own and key not in keep]
            if kind is AttendBackward:
                _place_grads(walk, plan, i, op, placed, grad_spans)
            else:
                for key in placed:
                    walk.place(i, [key])
            if kind is Copy:
                dst = walk.current.get(op.dst)
                copies[i] = (copies[i][0], walk.places[dst] if dst is not None else None)
    return ScratchLayout(walk.space.high, walk.places, spans, gathers, grad_spans, cuts,
                         arena_runs.copy_runs(plan, ops, candidates, copies))


def _place_cuts(walk: _Walk, plan: Plan, rp, direction: str, shape: AttentionShape, keep: set) -> tuple:
    """The input cuts' places, group by group (:func:`~.arena_runs.cut_groups`): (keys, each
    tensor's run, head slices) per group."""
    cuts = []
    for keys, slices in arena_runs.cut_groups(plan, rp, direction, shape.heads, shape.kv_heads, keep,
                                              order=lambda k: walk.first_read(k, 0)):
        walk.place(-1, list(keys), ordered=True)
        first = walk.places[(-1, keys[0])]
        runs = tuple(TensorPlace(p.offset, sum(plan.tokens(k) for k in keys), p.batch, p.heads, p.width, p.itemsize)
                     for p in first)
        cuts.append((keys, runs, slices))
    return tuple(cuts)


def _block_pieces(walk: _Walk, i: int, op, spans: dict, gathers: dict) -> None:
    """Where block ``i``'s key/value pieces are one run of the arena (``spans``) or gathered
    together (``gathers``)."""
    pieces = walk.pieces(op)
    if pieces is not None and len(pieces) > 1:
        got = walk.span(pieces)
        if got is not None:
            spans[i] = got
        elif (pair := walk.gather(pieces)) is not None:
            gathers[i] = pair


def _place_grads(walk: _Walk, plan: Plan, i: int, op, placed: list, grad_spans: dict) -> None:
    """A backward block's new buffers: its new dK/dV partials together, in the block's column order
    (one run where they are all its columns: ``grad_spans``), the others each on its own."""
    grads = [key for key in placed if key in op.dkv]
    for key in placed:
        if key not in grads:
            walk.place(i, [key])
    if grads:
        walk.place(i, grads)
        if grads == list(op.dkv) and all(op.col(j) is None for j in range(len(op.dkv))):
            got = walk.span([(walk.places[(i, key)], 0, plan.tokens(key)) for key in grads]) \
                if len(grads) > 1 else None
            if got is not None:
                grad_spans[i] = got

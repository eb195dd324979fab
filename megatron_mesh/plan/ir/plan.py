"""Plans: what every rank of a CP group does in one attention call, as data -- and its text form.

A :class:`Plan` holds one :class:`RankPlan` per rank. A rank plan is two op lists (forward,
backward) that the torch executor walks in order and that the validator, the simulator and the
byte and memory accounting read without torch. Everything rank-dependent -- which token ranges a
rank holds, which blocks it computes with which mask, whom it sends what -- is decided by the
builder that made the plan, so the executor contains no rank logic.

Text form (:mod:`.plan_text`). :meth:`Plan.to_text` prints *everything* a consumer reads -- the facts of the header
(mode, sizes, tile, schedule, assignment, Ulysses degree, ...), the mask, the layout, the rings,
the notes, the slots, every rank's inputs and ops, and a hybrid's inner plan -- and
:meth:`Plan.from_text` reads it back, so a parsed plan validates and simulates exactly like the
original (tested on dense, masked, THD and hybrid plans), and a plan can be written by hand and
executed before any builder exists. Example (ring attention over 2 ranks)::

    plan ring P=2 seq_local=4 tile=1x2 schedule=greedy backward_chunks=refetch assignment=tile ...
    mask causal
    layout zigzag P=2 S=8
    ring q (0) (1)
    ring kv (0 1)
    rank 0: output o0 grad_q dq0 grad_kv dkv0
      forward_input q0
      ...
      forward:
        post 1: send kv0->1 | recv kv1<-1
        attend q0 x kv0 causal -> o0
        wait 1
        attend q0[2:4] x kv1 full -> o0
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from ..layout import Layout, ZigzagLayout, head_slice
from ..mask import KernelCalls, Mask
from ..sel import Segment, Sel, map_runs, segment_begins, sub_selection
from .facts import BackwardChunks, Facts
from .ops import KINDS, Key, Op, Post, Wait
from .plan_text import describe_plan, parse_plan, plan_header, plan_text
from .rank import RankPlan
from .writes import creation_fills, first_writes

__all__ = ["Plan", "SlotTable", "carry"]

# (span, chunk, slot) -> token segments of that slot within its chunk; or a function of the key
SlotTable = dict | Callable[[Key], Sel] | None


@dataclass(frozen=True, eq=False)
class Plan:
    """The plan of one attention call over a CP group of ``world_size`` ranks.

    What was computed where:

    * ``mode`` -- the CP mode that built it ("mesh", "ring", "tasp", "a2a+mesh", ...);
    * ``mask`` -- which (query, key) pairs of the global sequence attend (default causal);
    * ``layout`` -- which global positions each rank holds (default Megatron's zigzag);
    * ``slots`` -- the token segments of each slot buffer within its chunk (:meth:`segments`).

    Facts a consumer reads (typed, and printed by :meth:`to_text`):

    * ``facts`` -- what the builder decided, typed per mode family (:mod:`.facts`): the Mesh tile
      and its rank order, the schedule, who computes a block, a Ulysses degree and inner plan, ...;
    * ``backward_chunks``, ``kernel_calls`` -- every plan's: what its backward reads again or keeps,
      how a masked block's pieces run as kernel calls (:data:`~.facts.BackwardChunks`,
      :data:`~..mask.KernelCalls`, :func:`~..mask.call_groups`);
    * ``rings`` -- the rings the plan moves data on (family -> rank tuples in ring order);
      ``notes`` -- human-readable facts.

    Rank plans are built on first access by ``build_rank`` (a plan over 256 ranks holds 65,536
    blocks; most users touch one rank). ``build_rounds``, when given, returns just the Post/Wait
    ops of a rank -- what the matching and deadlock checks need -- without building its blocks.
    """

    mode: str
    world_size: int
    seq_local: int
    build_rank: Callable[[int], RankPlan] = field(repr=False)
    mask: Mask = None  # type: ignore[assignment]  # None: causal
    layout: Layout = None  # type: ignore[assignment]  # None: ZigzagLayout(world_size, world_size * seq_local)
    slots: SlotTable = None
    facts: Facts = Facts()
    backward_chunks: BackwardChunks = "refetch"
    kernel_calls: KernelCalls = "varlen"
    rings: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    build_rounds: Callable[[int, str], tuple[Op, ...]] | None = field(default=None, repr=False)
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.mask is None:
            object.__setattr__(self, "mask", Mask())
        if self.layout is None:
            object.__setattr__(self, "layout", ZigzagLayout(self.world_size, self.world_size * self.seq_local))

    @property
    def causal(self) -> bool:
        return self.mask.causal

    def rank(self, r: int) -> RankPlan:
        if not 0 <= r < self.world_size:
            raise ValueError(f"rank {r} out of range for a plan over {self.world_size} ranks")
        rp = self._cache.get(r)
        if rp is None:
            rp = self._cache[r] = self.build_rank(r)
        return rp

    def first_writes(self, r: int, direction: str) -> dict:
        """:func:`~.writes.first_writes` of rank ``r``'s ops in ``direction`` (once per plan: the
        executor and the simulator both read it)."""
        ck = ("first", r, direction)
        hit = self._cache.get(ck)
        if hit is None:
            hit = self._cache[ck] = first_writes(self.rank(r).ops(direction), self.tokens)
        return hit

    def memo(self, key: tuple, make: Callable[[], object]):
        """``make()``, made once per plan and ``key``: facts a runtime derives from a rank's ops
        (the executor's, per call otherwise), kept with the plan's other per-rank caches. A key is
        (what, the rank whose ops it reads, ...): :func:`carry` reads the rank there."""
        ck = ("memo", *key)
        if ck not in self._cache:
            self._cache[ck] = make()
        return self._cache[ck]

    def creation_fills(self, r: int, direction: str, heads: int | None = None, kv_heads: int | None = None) -> dict:
        """:func:`~.writes.creation_fills` of rank ``r``'s ops in ``direction``: which rows of an
        accumulator the executor fills when a block or copy creates it (once per plan and heads;
        with ``heads`` / ``kv_heads`` given, copies of head slices that together write all heads
        of rows cover them)."""
        ck = ("fills", r, direction, heads, kv_heads)
        hit = self._cache.get(ck)
        if hit is None:
            rp = self.rank(r)
            live = [*rp.forward_inputs] if direction == "forward" else [*rp.backward_inputs, *rp.saved]

            def heads_of(key: Key) -> int:
                h, g = self.head_counts(key, heads, kv_heads)
                return h if KINDS[key.kind].side == "q" else g

            hit = self._cache[ck] = creation_fills(rp.ops(direction), self.tokens, live,
                                                   lambda key: len(KINDS[key.kind].tensors),
                                                   self.first_writes(r, direction),
                                                   None if heads is None else heads_of)
        return hit

    @property
    def ranks(self) -> tuple[RankPlan, ...]:
        return tuple(self.rank(r) for r in range(self.world_size))

    def round_ops(self, r: int, direction: str) -> tuple[Op, ...]:
        """Only the Post and Wait ops of rank ``r`` (cheap when the builder supports it)."""
        ck = ("rounds", r, direction)
        if ck not in self._cache:
            if self.build_rounds is not None and r not in self._cache:
                self._cache[ck] = self.build_rounds(r, direction)
            else:
                self._cache[ck] = tuple(op for op in self.rank(r).ops(direction) if type(op) in (Post, Wait))
        return self._cache[ck]

    def max_round(self, direction: str) -> int:
        """The highest round any rank posts in ``direction`` (``last_round`` when the builder
        states it, else rank 0's: every rank of a ring plan posts the same rounds)."""
        if self.facts.last_round is not None:
            return self.facts.last_round
        return max((op.round for op in self.round_ops(0, direction) if type(op) is Post), default=0)

    # -- buffers ---------------------------------------------------------------------------------
    def segments(self, key: Key) -> Sel:
        """Token segments of buffer ``key`` within its (span) chunk."""
        if key.slot < 0:
            return (Segment(0, self.seq_local * key.span),)
        slots = self.slots
        segs = slots(key) if callable(slots) else (slots or {}).get((key.span, key.chunk, key.slot))
        if segs is None:
            raise KeyError(f"plan has no slot {key.base}")
        return segs

    @property
    def slots_vary(self) -> bool:
        """Whether a slot's tokens depend on its chunk (mask-aware plans), so sizes cannot be
        cached by (kind, slot) alone."""
        if self.facts.inner is not None:
            return self.facts.inner.slots_vary
        if callable(self.slots):  # a slot function says whether its segments differ per chunk
            return getattr(self.slots, "vary", False)
        return bool(self.slots)

    def tokens(self, key: Key) -> int:
        """Token count of buffer ``key``."""
        if key.slot < 0:
            return self.seq_local * key.span
        ck = ("tokens", key.span, key.chunk, key.slot)  # a slot of thousands of documents' segments
        n = self._cache.get(ck)
        if n is None:
            n = self._cache[ck] = sum(s.stop - s.start for s in self.segments(key))
        return n

    def positions(self, key: Key, sel: Sel | None = None) -> tuple[tuple[int, int], ...]:
        """Global position runs (start, length) of buffer ``key``'s tokens (``sel`` of them), in
        buffer order."""
        ck = ("pos", key.span, key.chunk, key.slot, sel)
        hit = self._cache.get(ck)
        if hit is None:
            # the buffer's segments and its chunk's runs, indexed once per buffer (not once per
            # selection: a THD chunk holds two runs of every document, and each block selects some)
            bk = ("pos-index", key.span, key.chunk, key.slot)
            index = self._cache.get(bk)
            if index is None:
                segs, runs = self.segments(key), tuple(self.layout.runs(key.chunk, key.span))
                index = self._cache[bk] = (segs, segment_begins(segs), runs, [local for local, _, _ in runs])
            segs, begins, runs, locals_ = index
            hit = self._cache[ck] = map_runs(runs, sub_selection(segs, sel, begins), locals_)
        return hit

    def head_range(self, key: Key, heads: int, kv_heads: int) -> tuple[int, int] | None:
        """The heads [start, stop) of ``key``'s side that its head slice holds (None: the key names
        no head slice)."""
        if key.heads < 0:
            return None
        return head_slice(KINDS[key.kind].side, key.heads, self.facts.ulysses, heads, kv_heads)

    def head_counts(self, key: Key, heads: int, kv_heads: int) -> tuple[int, int]:
        """(query heads, key/value heads) of buffer ``key`` for a problem of ``heads`` / ``kv_heads``."""
        U = self.facts.ulysses
        if key.heads < 0 or U == 1:
            return heads, kv_heads
        q0, q1 = head_slice("q", key.heads, U, heads, kv_heads)
        k0, k1 = head_slice("kv", key.heads, U, heads, kv_heads)
        return q1 - q0, k1 - k0

    # -- text (:mod:`.plan_text`) ---------------------------------------------------------------------
    def header(self) -> str:
        """The first line of :meth:`to_text`: mode, sizes and every fact of the header."""
        return plan_header(self)

    def describe(self, ranks: Iterable[int] | None = None) -> str:
        """A compact text form of the ops of ``ranks`` (default all; Free ops left out)."""
        return describe_plan(self, ranks)

    def to_text(self) -> str:
        """The whole plan as text (see the module docstring); :meth:`from_text` reads it back."""
        return plan_text(self)

    @classmethod
    def from_text(cls, text: str) -> "Plan":
        """Parse :meth:`to_text` output -- or a hand-written plan in that form -- into a Plan.
        Lines may be left out: the header's facts, mask, layout, rings have defaults."""
        return parse_plan(text, cls)


def carry(plan: Plan, other: Plan, ranks: Iterable[int]) -> None:
    """Give ``plan`` what ``other`` has made of its ranks' ops -- rank plans, the facts derived
    from them, the buffers' tokens and positions -- except what is about ``ranks``: for a plan that
    differs from ``other`` only in those ranks' ops (:mod:`..polish` tries one rank's change at a
    time, and the rest of a plan's ~10 ms of derived facts at 8 ranks is the same). Only entries
    known to be one rank's, or the buffers', are carried; anything else is made again."""
    ranks = set(ranks)
    for key, value in other._cache.items():
        if key not in plan._cache and _carries(key, ranks):
            plan._cache[key] = value


def _carries(key, ranks: set) -> bool:
    """Whether the plan cache's entry ``key`` holds for a plan whose ops differ only on ``ranks``:
    a rank plan, a rank's first writes, fills or rounds (rank second) or memo (rank third, after
    what it is) of another rank; the buffers' tokens and positions (the plan's slots and layout,
    whatever its ops). Not: a memo without a rank there (a digest of the whole plan)."""
    if isinstance(key, int):
        return key not in ranks
    if key[0] in ("first", "fills", "rounds"):
        return key[1] not in ranks
    if key[0] == "memo":
        return len(key) > 2 and type(key[2]) is int and key[2] not in ranks
    return key[0] in ("tokens", "pos", "pos-index")

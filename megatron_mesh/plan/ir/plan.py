"""Plans: what every rank of a CP group does in one attention call, as data -- and its text form.

A :class:`Plan` holds one :class:`RankPlan` per rank. A rank plan is two op lists (forward,
backward) that the torch executor walks in order and that the validator, the simulator and the
byte and memory accounting read without torch. Everything rank-dependent -- which token ranges a
rank holds, which blocks it computes with which mask, whom it sends what -- is decided by the
builder that made the plan, so the executor contains no rank logic.

Text form. :meth:`Plan.to_text` prints *everything* a consumer reads -- the facts of the header
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

import re
from dataclasses import dataclass, field, fields
from typing import Callable, Iterable, Iterator

from ..layout import Layout, ZigzagLayout, head_slice, layout_from_text
from ..mask import Mask
from ..sel import Segment, Sel, map_runs, parse_sel, segment_begins, sel_text, sub_selection
from .ops import KINDS, Attend, AttendBackward, Free, Key, Op, Post, Wait, _parse_keys, op_keys, parse_op
from .writes import creation_fills, first_writes

__all__ = ["RankPlan", "Plan", "SlotTable"]

# (span, chunk, slot) -> token segments of that slot within its chunk; or a function of the key
SlotTable = dict | Callable[[Key], Sel] | None


@dataclass(frozen=True)
class RankPlan:
    """Everything one rank does in one attention call.

    ``forward_inputs`` / ``backward_inputs`` say how the executor builds the initial buffers from
    the local tensors: each key maps to the token segments of the local chunk it is made of
    (concatenated; a key with a head slice takes that slice of the heads). Forward inputs are
    cut from (q,) or (k, v); backward inputs also from (dout, lse, delta) for kind ``do``.
    ``saved`` are forward buffers that the backward reads (kept instead of re-communicated).
    ``output`` is the final (out, lse) buffer; ``grad_q`` and ``grad_kv`` the final gradient
    buffers (all of the rank's own chunk and every head).
    """

    rank: int
    seq_local: int
    forward: tuple[Op, ...]
    backward: tuple[Op, ...]
    forward_inputs: dict[Key, Sel]
    backward_inputs: dict[Key, Sel]
    output: Key
    grad_q: Key
    grad_kv: Key
    saved: tuple[Key, ...] = ()

    def ops(self, direction: str) -> tuple[Op, ...]:
        if direction not in ("forward", "backward"):
            raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
        return self.forward if direction == "forward" else self.backward

    def rounds(self, direction: str) -> Iterator[Post]:
        return (op for op in self.ops(direction) if type(op) is Post)

    def blocks(self, direction: str = "forward") -> Iterator[Attend | AttendBackward]:
        return (op for op in self.ops(direction) if type(op) in (Attend, AttendBackward))

    def to_text(self) -> str:
        lines = [f"rank {self.rank}: output {self.output} grad_q {self.grad_q} grad_kv {self.grad_kv}"]
        for name, table in (("forward_input", self.forward_inputs), ("backward_input", self.backward_inputs)):
            lines += [f"  {name} {k}{sel_text(v)}" for k, v in table.items()]
        lines += [f"  saved {k}" for k in self.saved]
        for direction in ("forward", "backward"):
            lines.append(f"  {direction}:")
            lines += [f"    {op}" for op in self.ops(direction)]
        return "\n".join(lines)


@dataclass(frozen=True, eq=False)
class Plan:
    """The plan of one attention call over a CP group of ``world_size`` ranks.

    What was computed where:

    * ``mode`` -- the CP mode that built it ("mesh", "ring", "tasp", "a2a+mesh", ...);
    * ``mask`` -- which (query, key) pairs of the global sequence attend (default causal);
    * ``layout`` -- which global positions each rank holds (default Megatron's zigzag);
    * ``slots`` -- the token segments of each slot buffer within its chunk (:meth:`segments`).

    Facts a consumer reads (typed, and printed by :meth:`to_text`):

    * ``tile`` -- the Mesh tile the blocks were assigned by (ring: (1, P)); None for other modes;
    * ``schedule`` -- how the rounds are ordered: "greedy" / "lockstep" (Mesh's pull order),
      "rings" (TASP's ring steps), "shift" / "burst" (a mask-aware plan: one round per rank
      distance, or each group of a rank's slots in one round over all links);
    * ``backward_chunks`` -- "refetch", "keep" (the forward keeps what the backward reads) or
      "auto" (a mask-aware plan: each rank keeps where that is at most its own Q, K and V);
    * ``contiguous`` -- which Mesh ring holds consecutive ranks ("q" / "kv"; None otherwise);
    * ``assignment`` -- who computes a block: "tile" (the Mesh tile map), "rings" (the query
      owner, chunks travelling around rings), "query owner" (straight from each block's owner),
      "layout" (where the layout's ``owners`` name: :class:`~..balance.BalancedLayout`);
    * ``direct`` -- transfers go straight between the ranks that need them: ranks post different
      rounds and do different work, so analyses read every rank (a mask-aware plan);
    * ``last_round`` -- the highest round number any rank posts (a hybrid's return all-to-all
      comes after its inner plan's last round);
    * ``ranks_per_node`` -- the consecutive CP ranks per node the rings were built for;
    * ``ulysses`` -- the number of head slices keys may name (a Ulysses degree; 1 otherwise);
      ``heads`` -- the (query, key/value) head counts the slices were cut from;
    * ``rings`` -- the rings the plan moves data on (family -> rank tuples in ring order);
    * ``kernel_calls`` -- how a masked block's mask pieces (:func:`~..mask.mask_pieces`) run as
      kernel calls (:func:`~..mask.call_groups`): "varlen" (this package's kernels: its full
      pieces in one variable-length call, its causal ones in another, each masked piece alone),
      "piece" (one call each) or "block" (one call for all: Transformer Engine's THD attention,
      which the planner's TE rows model);
    * ``inner`` -- a hybrid's inner plan over world_size / ulysses ranks (its traffic is what the
      simulator prices); ``notes`` -- human-readable facts.

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
    tile: tuple[int, int] | None = None
    schedule: str = ""
    backward_chunks: str = "refetch"
    contiguous: str | None = None
    assignment: str = ""
    direct: bool = False
    last_round: int | None = None
    ranks_per_node: int | None = None
    ulysses: int = 1
    heads: tuple[int, int] | None = None
    kernel_calls: str = "varlen"
    rings: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    inner: "Plan | None" = field(default=None, repr=False)
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
        (the executor's, per call otherwise), kept with the plan's other per-rank caches."""
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
        if self.last_round is not None:
            return self.last_round
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
        if self.inner is not None:
            return self.inner.slots_vary
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
        return head_slice(KINDS[key.kind].side, key.heads, self.ulysses, heads, kv_heads)

    def head_counts(self, key: Key, heads: int, kv_heads: int) -> tuple[int, int]:
        """(query heads, key/value heads) of buffer ``key`` for a problem of ``heads`` / ``kv_heads``."""
        if key.heads < 0 or self.ulysses == 1:
            return heads, kv_heads
        q0, q1 = head_slice("q", key.heads, self.ulysses, heads, kv_heads)
        k0, k1 = head_slice("kv", key.heads, self.ulysses, heads, kv_heads)
        return q1 - q0, k1 - k0

    # -- text -------------------------------------------------------------------------------------
    def header(self) -> str:
        """The first line of :meth:`to_text`: mode, sizes and every fact of the header."""
        return _header(self)

    def describe(self, ranks: Iterable[int] | None = None) -> str:
        """A compact text form of the ops of ``ranks`` (default all; Free ops left out)."""
        lines = [_header(self)]
        lines += [f"  note: {n}" for n in self.notes]
        for r in range(self.world_size) if ranks is None else ranks:
            rp = self.rank(r)
            for direction in ("forward", "backward"):
                lines.append(f"rank {rp.rank} {direction}:")
                lines += ["  " + str(op) for op in rp.ops(direction) if type(op) is not Free]
        return "\n".join(lines)

    def to_text(self) -> str:
        """The whole plan as text (see the module docstring); :meth:`from_text` reads it back."""
        lines = [_header(self), f"mask {self.mask.text()}", f"layout {self.layout.text()}"]
        for family, rings in self.rings.items():
            lines.append(f"ring {family} " + " ".join("(" + " ".join(map(str, r)) + ")" for r in rings))
        lines += [f"note {n}" for n in self.notes]
        for (span, chunk, slot), segs in sorted(self._used_slots().items()):
            lines.append(f"slot {Key('q', chunk, slot, span=span)}{sel_text(segs)}".replace("slot q", "slot ", 1))
        lines += [rp.to_text() for rp in self.ranks]
        if self.inner is not None:
            lines += ["begin inner", self.inner.to_text().rstrip("\n"), "end inner"]
        return "\n".join(lines) + "\n"

    def _used_slots(self) -> dict:
        slots = {}
        for rp in self.ranks:
            keys = [k for op in (*rp.forward, *rp.backward) for k in op_keys(op)]
            keys += [*rp.forward_inputs, *rp.backward_inputs]
            for k in keys:
                if k.slot >= 0:
                    slots[(k.span, k.chunk, k.slot)] = self.segments(k)
        return slots

    @classmethod
    def from_text(cls, text: str) -> "Plan":
        """Parse :meth:`to_text` output -- or a hand-written plan in that form -- into a Plan.
        Lines may be left out: the header's facts, mask, layout, rings have defaults."""
        lines = [ln.rstrip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
        return _Parser(lines).plan()


# -- header facts --------------------------------------------------------------------------------------
def _tile_text(tile) -> str:
    return "-" if tile is None else f"{tile[0]}x{tile[1]}"


def _none_text(v) -> str:
    return "-" if v is None or v == "" else str(v)


_HEADER = {  # field -> (to text, from text)
    "tile": (_tile_text, lambda s: None if s == "-" else tuple(int(x) for x in s.split("x"))),
    "schedule": (_none_text, lambda s: "" if s == "-" else s),
    "backward_chunks": (str, str),
    "contiguous": (_none_text, lambda s: None if s == "-" else s),
    "assignment": (lambda v: _none_text(v).replace(" ", "_"), lambda s: "" if s == "-" else s.replace("_", " ")),
    "direct": (lambda v: "yes" if v else "no", lambda s: s == "yes"),
    "last_round": (_none_text, lambda s: None if s == "-" else int(s)),
    "ranks_per_node": (_none_text, lambda s: None if s == "-" else int(s)),
    "ulysses": (str, int),
    "heads": (lambda v: "-" if v is None else f"{v[0]}/{v[1]}",
              lambda s: None if s == "-" else tuple(int(x) for x in s.split("/"))),
    "kernel_calls": (str, str),
}
# the Plan fields that are neither text sections nor the builder's callables
assert set(_HEADER) | {"mode", "world_size", "seq_local", "build_rank", "mask", "layout", "slots", "rings", "notes",
                       "inner", "build_rounds", "_cache"} == {f.name for f in fields(Plan)}


def _header(plan: Plan) -> str:
    facts = " ".join(f"{name}={fmt(getattr(plan, name))}" for name, (fmt, _) in _HEADER.items())
    return f"plan {plan.mode} P={plan.world_size} seq_local={plan.seq_local} {facts}"


class _Parser:
    """Reads the lines of :meth:`Plan.to_text` (a hybrid's inner plan recursively)."""

    def __init__(self, lines: list[str]):
        self.lines, self.i = lines, 0

    def plan(self) -> Plan:
        if self.i >= len(self.lines) or not self.lines[self.i].startswith("plan "):
            raise ValueError("a plan text starts with 'plan MODE P=.. seq_local=.. ...'")
        words = self.lines[self.i].split()
        self.i += 1
        head = dict(item.split("=", 1) for item in words[2:])
        unknown = set(head) - set(_HEADER) - {"P", "seq_local"}
        if unknown:
            raise ValueError(f"unknown plan header fields {sorted(unknown)} in {' '.join(words)!r}; known: "
                             f"P, seq_local, {', '.join(_HEADER)}")
        P, T = int(head["P"]), int(head["seq_local"])
        facts = {name: parse(head[name]) for name, (_, parse) in _HEADER.items() if name in head}
        mask, layout, rings, notes, slots = Mask(), None, {}, [], {}
        ranks: dict[int, dict] = {}
        section: dict = {"rank": None, "direction": None}  # the rank section and direction being read
        inner = None
        while self.i < len(self.lines):
            ln = self.lines[self.i]
            s = ln.strip()
            if s == "end inner":
                break
            self.i += 1
            if s.startswith("plan "):
                raise ValueError(f"a second plan header {s!r} (an inner plan goes between 'begin inner' / 'end inner')")
            if s == "begin inner":
                inner = self.plan()
                if self.i >= len(self.lines) or self.lines[self.i].strip() != "end inner":
                    raise ValueError("'begin inner' without 'end inner'")
                self.i += 1
            elif s.startswith("mask "):
                mask = Mask.from_text(s[5:])
            elif s.startswith("layout "):
                layout = layout_from_text(s[7:])
            elif s.startswith("ring "):
                _, family, rest = s.split(" ", 2)
                rings[family] = tuple(tuple(int(x) for x in r.split()) for r in re.findall(r"\(([^)]*)\)", rest))
            elif s.startswith("note "):
                notes.append(s[5:])
            elif s.startswith("slot "):
                m = re.match(r"^slot (\d+)(?:\*(\d+))?\.(\d+)(\[.*\])$", s)
                if m is None:
                    raise ValueError(f"bad slot line {ln!r} (e.g. 'slot 3.1[0:2,6:8]')")
                slots[(int(m.group(2) or 1), int(m.group(1)), int(m.group(3)))] = parse_sel(m.group(4))
            else:
                _rank_line(s, ln, ranks, section, T)
        if sorted(ranks) != list(range(P)):
            raise ValueError(f"plan text for P={P} ranks has rank sections {sorted(ranks)}")
        built = {r: RankPlan(r, T, tuple(d["forward"]), tuple(d["backward"]), d["forward_inputs"],
                             d["backward_inputs"], d["output"], d["grad_q"], d["grad_kv"], tuple(d["saved"]))
                 for r, d in ranks.items()}
        return Plan(mode=words[1], world_size=P, seq_local=T, build_rank=built.__getitem__, mask=mask, layout=layout,
                    slots=slots, rings=rings, notes=tuple(notes), inner=inner, **facts)


def _rank_line(s: str, ln: str, ranks: dict[int, dict], section: dict, T: int) -> None:
    """One line of a rank's section of the plan text: its header, a direction, an input, a saved
    buffer or an op (``section``: the rank and direction being read, updated here)."""
    cur = section["rank"]
    if s.startswith("rank "):
        m = re.match(r"^rank (\d+): output (\S+) grad_q (\S+) grad_kv (\S+)$", s)
        if m is None:
            raise ValueError(f"bad rank line {ln!r}")
        section["rank"] = ranks[int(m.group(1))] = dict(
            output=Key.parse(m.group(2)), grad_q=Key.parse(m.group(3)), grad_kv=Key.parse(m.group(4)), forward=[],
            backward=[], forward_inputs={}, backward_inputs={}, saved=[])
        section["direction"] = None
    elif cur is None:
        raise ValueError(f"line {ln!r} comes before any 'rank N:' line")
    elif s in ("forward:", "backward:"):
        section["direction"] = s[:-1]
    elif s.startswith(("forward_input ", "backward_input ")):
        word, rest = s.split(" ", 1)
        (k,), (sel,) = _parse_keys(rest)
        cur[word + "s"][k] = sel if sel is not None else (Segment(0, T * k.span),)
    elif s.startswith("saved "):
        cur["saved"].append(Key.parse(s.split(" ", 1)[1]))
    elif section["direction"] is None:
        raise ValueError(f"op {ln!r} outside a 'forward:' / 'backward:' section")
    else:
        cur[section["direction"]].append(parse_op(s))

"""Sequence layouts: which global token positions each CP rank holds -- Megatron's zigzag, and
Transformer Engine's THD layout (each packed sequence padded and zigzag-split on its own).

**Zigzag** (Megatron-Core ``get_batch_on_this_cp_rank``): every sequence of S tokens is cut into
2P equal *halves*; CP rank r holds halves r and 2P-1-r, concatenated: rank r's *chunk*. RoPE
positions are sliced the same way, so the attention plugins accept this layout as is.

Worked example (P = 4, S = 16, halves of 2 tokens)::

    halves:    h0   h1   h2   h3   h4   h5   h6   h7
    tokens:   0,1  2,3  4,5  6,7  8,9 10,11 12,13 14,15
    rank 0 holds h0 + h7 = tokens [0, 1, 14, 15]
    rank 1 holds h1 + h6 = tokens [2, 3, 12, 13]
    rank 2 holds h2 + h5 = tokens [4, 5, 10, 11]
    rank 3 holds h3 + h4 = tokens [6, 7,  8,  9]

Why it balances causal work: for query chunk i and key/value chunk j, a block (i, j != i) has
exactly half its pairs allowed -- j < i: all queries x the front half of chunk j; j > i: the back
half of the queries x all of chunk j -- and (i, i) is an ordinary causal block; so every rank
does the same work whatever blocks it is given. :func:`~.mask.classify_block` derives those
halves from the positions (no separate rule).

**Span-u chunks.** The union of the chunks of ranks m*u .. m*u+u-1, front halves in rank order
then back halves in reverse, is exactly chunk m of the zigzag over P/u ranks (its halves are u
times longer). A Ulysses all-to-all over u consecutive ranks therefore hands every rank a
zigzag chunk of the smaller CP group, and the inner plan's causal balance holds unchanged.

**THD** (Transformer Engine's CP layout for packed sequences, ``thd_get_partitioned_indices``):
sequence k occupies [cu_padded[k], cu_padded[k+1]) of the packed tensor, padded to a multiple
of 2P; it is zigzag-split on its own, and rank r's local tokens are, sequence after sequence,
its two halves of each. The padding tokens belong to no document (see :class:`~.mask.Mask`).

Every layout subclasses :class:`Layout`: :meth:`~Layout.runs` -- (local offset, global start,
length) of the runs of consecutive positions that make up a (span) chunk, in local order --,
:meth:`~Layout.documents` (the documents the layout itself defines, None when the mask brings
them), a one-line :meth:`~Layout.text` that :func:`layout_from_text` reads back, and what it may
also declare, with defaults (:attr:`~Layout.owners`, :attr:`~Layout.group` and
:meth:`~Layout.set_tokens`). Plans, the validator, the simulator, the byte accounting and the
executor read layouts only through this protocol, so a new layout is one more class; how users
choose one by name (Megatron's ``--cp-layout``, the planner's ``--layout``) is its kind in
:mod:`.layouts`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .sel import Segment
from .units import as_int

__all__ = ["Layout", "ZigzagLayout", "ThdLayout", "SpanLayout", "layout_from_text", "register_layout", "match_text",
           "positions", "split_evenly", "slot_segments", "head_slice", "check_ulysses_heads"]


@runtime_checkable
class Layout(Protocol):
    """Which global positions each CP rank holds (see the module docstring)."""

    world_size: int
    seq_len: int  # tokens of the global sequence (padding included)
    seq_local: int  # tokens each rank holds (the same on every rank: Megatron shards activations evenly)

    def runs(self, chunk: int, span: int = 1) -> tuple[tuple[int, int, int], ...]:
        """(local offset, global start, length), in local order, of chunk ``chunk`` of this layout
        seen in span-``span`` chunks (span 1: rank ``chunk``'s tokens; span u: the tokens of ranks chunk*u .. chunk*u+u-1,
        what a Ulysses group of u ranks gathers)."""

    def documents(self) -> tuple[tuple[int, int], ...] | None:
        """The documents this layout defines, as global (start, stop); None: it defines none."""

    def text(self) -> str:
        """One line that :func:`layout_from_text` turns back into an equal layout."""

    # What a layout may also declare, with the defaults most have (a layout subclasses Layout to
    # get them; the builders read these members, never probe for them).
    group: int = 1
    """The Ulysses degree whose groups this layout holds in all-to-all set order (:meth:`set_tokens`);
    1: none (the hybrids then run their all-to-all as one round)."""

    owners: tuple[tuple[int, int, int], ...] = ()
    """((i, j, h), ...): rank h computes the block of rank i's queries and rank j's keys -- a layout
    whose work balance rests on where its blocks are computed names them (Mesh computes them there,
    every other mode refuses the layout: ``Mode.check_layout``); (): every block on its query owner."""

    def owner(self, i: int, j: int) -> int:
        """The rank that computes the block of rank i's queries and rank j's keys (:attr:`owners`, else i)."""
        return i

    def set_tokens(self, chunk: int) -> tuple[int, ...]:
        """Tokens of Ulysses group ``chunk`` (span :attr:`group`) in each all-to-all round, in the order
        its span chunk holds them; only for a layout whose :attr:`group` is above 1."""
        raise ValueError(f"{type(self).__name__} holds no Ulysses group in all-to-all set order (group {self.group})")


def positions(layout: Layout, rank: int, span: int = 1) -> list[int]:
    """Global token positions of (span) chunk ``rank``, in local order."""
    return [p for _, start, n in layout.runs(rank, span) for p in range(start, start + n)]


_PARSERS: dict[str, object] = {}


def register_layout(word: str):
    """Class decorator: ``cls.parse(rest_of_line)`` reads the text of layouts starting with ``word``."""
    def deco(cls):
        _PARSERS[word] = cls.parse
        return cls
    return deco


def layout_from_text(text: str) -> Layout:
    """The layout of a :meth:`Layout.text` line (e.g. ``zigzag P=4 S=16``)."""
    word, _, rest = text.strip().partition(" ")
    parse = _PARSERS.get(word)
    if parse is None:
        raise ValueError(f"unknown layout {word!r} in {text!r}; known: {', '.join(sorted(_PARSERS))}")
    return parse(rest)


def match_text(pattern: str, rest: str, example: str) -> re.Match:
    """``rest`` of a layout's text line against ``pattern``; ValueError quoting it and ``example``."""
    m = re.match(pattern, rest.strip())
    if m is None:
        raise ValueError(f"not a {example.split()[0]} layout: {rest!r} (e.g. {example!r})")
    return m


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",")) if text else ()


@register_layout("zigzag")
@dataclass(frozen=True)
class ZigzagLayout(Layout):
    """Megatron's zigzag CP layout of a sequence of ``seq_len`` tokens over ``world_size`` ranks.

    The one owner of this permutation: :meth:`positions` / :meth:`runs` give rank r's tokens, and
    the torch helpers ``megatron_mesh.zigzag_shard`` / ``zigzag_unshard`` apply it to tensors.
    """

    world_size: int
    seq_len: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "world_size", _integer("world_size", self.world_size, 1))
        object.__setattr__(self, "seq_len", _integer("seq_len", self.seq_len, 0))
        if self.seq_len % (2 * self.world_size):
            raise ValueError(
                f"sequence length {self.seq_len} must be divisible by 2 * CP size = "
                f"{2 * self.world_size} (Megatron's zigzag layout cuts it into 2P equal halves)"
            )

    @property
    def half_len(self) -> int:
        return self.seq_len // (2 * self.world_size)

    @property
    def seq_local(self) -> int:
        return 2 * self.half_len

    def runs(self, chunk: int, span: int = 1) -> tuple[tuple[int, int, int], ...]:
        """(local offset, global start, length) of chunk ``chunk`` of the zigzag over P/span ranks."""
        P = self.world_size // span
        if span < 1 or self.world_size % span or not 0 <= chunk < P:
            raise ValueError(f"chunk {chunk} of span {span} does not exist over CP size {self.world_size}")
        h = self.seq_len // (2 * P)
        return ((0, chunk * h, h), (h, (2 * P - 1 - chunk) * h, h))

    def documents(self) -> None:
        return None

    def text(self) -> str:
        return f"zigzag P={self.world_size} S={self.seq_len}"

    @classmethod
    def parse(cls, rest: str) -> "ZigzagLayout":
        m = match_text(r"^P=(\d+) S=(\d+)$", rest, "zigzag P=4 S=16")
        return cls(int(m.group(1)), int(m.group(2)))


def _integer(name: str, value, low: int) -> int:
    """``value`` as an int >= ``low``; anything else is a ValueError naming it."""
    v = as_int(value)
    if v is None or v < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return v


def _integers(name: str, values) -> tuple[int, ...]:
    """``values`` as ints; anything not an integer (16.5, 16.0, True) is a ValueError naming it."""
    items = list(values)  # a generator is read once
    out = tuple(as_int(v) for v in items)
    for v, got in zip(items, out):
        if got is None:
            raise ValueError(f"{name} must hold integers, got {v!r} in {values!r}")
    return out


@register_layout("thd")
@dataclass(frozen=True)
class ThdLayout(Layout):
    """Transformer Engine's THD CP layout (see the module docstring).

    ``cu_seqlens_padded``: 0 = c0 < c1 < ... < cn, every length c(k+1) - ck divisible by 2P
    (Megatron's ``cu_seqlens_q_padded``); ``seq_lens``: the real (unpadded) length of each
    sequence, <= its padded length (default: no padding). Both hold integers (a float such as
    16.5 or 16.0 is a ValueError, never truncated). :meth:`documents` are the real tokens.

    Example (P = 2, two sequences of 8 and 4 tokens, the second with 3 real tokens): rank 0 holds
    positions [0, 1, 6, 7, 8, 11], rank 1 [2, 3, 4, 5, 9, 10]; documents (0, 8), (8, 11).
    """

    world_size: int
    cu_seqlens_padded: tuple[int, ...]
    seq_lens: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        P, cu = _integer("world_size", self.world_size, 1), _integers("cu_seqlens_padded", self.cu_seqlens_padded)
        object.__setattr__(self, "world_size", P)
        object.__setattr__(self, "cu_seqlens_padded", cu)
        if len(cu) < 2 or cu[0] != 0 or any(b <= a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens_padded must be strictly increasing from 0, got {self.cu_seqlens_padded!r}")
        bad = [b - a for a, b in zip(cu, cu[1:]) if (b - a) % (2 * P)]
        if bad:
            raise ValueError(f"THD layout: every padded sequence length must be divisible by 2 * CP size = {2 * P} "
                             f"(Transformer Engine pads each sequence so); got lengths {bad} in cu_seqlens_padded {cu}")
        lens = self.seq_lens
        if lens is None:
            lens = tuple(b - a for a, b in zip(cu, cu[1:]))
        lens = _integers("seq_lens", lens)
        if len(lens) != len(cu) - 1 or any(not 0 <= n <= b - a for n, a, b in zip(lens, cu, cu[1:])):
            raise ValueError(f"seq_lens {self.seq_lens!r} must give one length per sequence, each between 0 and its "
                             f"padded length {[b - a for a, b in zip(cu, cu[1:])]}")
        object.__setattr__(self, "seq_lens", lens)

    @property
    def seq_len(self) -> int:
        return self.cu_seqlens_padded[-1]

    @property
    def seq_local(self) -> int:
        return self.seq_len // self.world_size

    def documents(self) -> tuple[tuple[int, int], ...]:
        """The real tokens of each sequence (padding excluded), as global (start, stop)."""
        return tuple((a, a + n) for a, n in zip(self.cu_seqlens_padded, self.seq_lens) if n > 0)

    def runs(self, chunk: int, span: int = 1) -> tuple[tuple[int, int, int], ...]:
        # kept: a plan asks for a chunk's runs per block, and a chunk holds two of every sequence
        cache = self.__dict__.setdefault("_runs", {})
        got = cache.get((chunk, span))
        if got is None:
            if len(cache) >= _RUNS_KEPT:
                cache.pop(next(iter(cache)))
            got = cache[chunk, span] = self._chunk_runs(chunk, span)
        return got

    def __getstate__(self) -> dict:  # a worker process is sent the layout, not the runs it kept
        return {k: v for k, v in self.__dict__.items() if k != "_runs"}

    def _chunk_runs(self, chunk: int, span: int) -> tuple[tuple[int, int, int], ...]:
        P = self.world_size // span
        if span < 1 or self.world_size % span or not 0 <= chunk < P:
            raise ValueError(f"chunk {chunk} of span {span} does not exist over CP size {self.world_size}")
        out, local = [], 0
        for a, b in zip(self.cu_seqlens_padded, self.cu_seqlens_padded[1:]):
            h = (b - a) // (2 * P)
            out.append((local, a + chunk * h, h))
            out.append((local + h, a + (2 * P - 1 - chunk) * h, h))
            local += 2 * h
        return tuple(out)

    def text(self) -> str:
        return (f"thd P={self.world_size} cu={','.join(map(str, self.cu_seqlens_padded))} "
                f"lens={','.join(map(str, self.seq_lens))}")

    @classmethod
    def parse(cls, rest: str) -> "ThdLayout":
        m = match_text(r"^P=(\d+) cu=(\d+(?:,\d+)*) lens=(\d+(?:,\d+)*)$", rest, "thd P=2 cu=0,4,8 lens=3,4")
        return cls(int(m.group(1)), _ints(m.group(2)), _ints(m.group(3)))


# chunks whose runs a THD layout keeps (every chunk of a comparison's THD plans, up to 64 ranks)
_RUNS_KEPT = 128


@register_layout("span")
@dataclass(frozen=True)
class SpanLayout(Layout):
    """A layout seen by the inner plan of a Ulysses group: its P/span chunks are the span-``span``
    chunks of ``base`` (see the module docstring), so an inner plan built over it computes on the
    same global positions."""

    base: Layout
    span: int

    def __post_init__(self) -> None:
        if self.span < 1 or self.base.world_size % self.span:
            raise ValueError(f"span {self.span} must divide the CP size {self.base.world_size}")

    @property
    def world_size(self) -> int:
        return self.base.world_size // self.span

    @property
    def seq_len(self) -> int:
        return self.base.seq_len

    @property
    def seq_local(self) -> int:
        return self.base.seq_local * self.span

    def runs(self, chunk: int, span: int = 1) -> tuple[tuple[int, int, int], ...]:
        return self.base.runs(chunk, self.span * span)

    def documents(self):
        return self.base.documents()

    def text(self) -> str:
        return f"span U={self.span} of {self.base.text()}"

    @classmethod
    def parse(cls, rest: str) -> "SpanLayout":
        m = match_text(r"^U=(\d+) of (.+)$", rest, "span U=2 of zigzag P=4 S=16")
        return cls(layout_from_text(m.group(2)), int(m.group(1)))


def split_evenly(n: int, parts: int) -> list[int]:
    """Boundaries that cut ``n`` items into ``parts`` contiguous parts whose sizes differ by at
    most one (the larger ones last), e.g. split_evenly(10, 4) == [0, 2, 4, 7, 10]."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    return [i * n // parts for i in range(parts + 1)]


def slot_segments(seq_local: int, num_slots: int) -> list[tuple[Segment, Segment]]:
    """TASP slots of a zigzag chunk: slot s is sub-chunk s of the front half followed by
    sub-chunk s of the back half, so each slot keeps the two-halves shape that balances causal
    work.

    Example: seq_local = 12 (halves of 6), 3 slots -> [(0,2)+(6,8)], [(2,4)+(8,10)], [(4,6)+(10,12)].
    """
    if seq_local % 2:
        raise ValueError(f"local sequence length {seq_local} must be even (two zigzag halves)")
    half = seq_local // 2
    if half < num_slots:
        raise ValueError(
            f"local sequence length {seq_local} is too short for {num_slots} slots: each half "
            f"({half} tokens) must hold at least one token per slot, i.e. seq_local >= {2 * num_slots}"
        )
    b = split_evenly(half, num_slots)
    return [(Segment(b[s], b[s + 1]), Segment(half + b[s], half + b[s + 1])) for s in range(num_slots)]


def check_ulysses_heads(ulysses: int, heads: int, kv_heads: int) -> None:
    """ValueError unless a Ulysses all-to-all of degree ``ulysses`` can scatter these heads:
    query heads divisible by it, key/value heads divisible by it or dividing it (then each KV
    head is replicated to ulysses / kv_heads ranks, as DeepSpeed-Ulysses does)."""
    if ulysses < 1:
        raise ValueError(f"ulysses size must be >= 1, got {ulysses}")
    if heads % ulysses:
        raise ValueError(f"query heads ({heads}) must be divisible by the ulysses size ({ulysses}): the all-to-all "
                         "gives every rank of the group heads / ulysses query heads")
    if kv_heads % ulysses and ulysses % kv_heads:
        raise ValueError(f"kv heads ({kv_heads}) must be divisible by the ulysses size ({ulysses}) or divide it "
                         "(then each KV head is replicated to ulysses / kv_heads ranks)")


def head_slice(side: str, u: int, ulysses: int, heads: int, kv_heads: int) -> tuple[int, int]:
    """Heads [start, stop) of head slice ``u`` of ``ulysses`` for query heads (``side`` "q") or
    key/value heads ("kv"). With fewer KV heads than slices, slice u gets KV head
    u * kv_heads // ulysses: the one its query heads use (GQA), replicated."""
    if side == "q":
        n = heads // ulysses
        return u * n, (u + 1) * n
    if kv_heads >= ulysses:
        n = kv_heads // ulysses
        return u * n, (u + 1) * n
    k = u * kv_heads // ulysses
    return k, k + 1

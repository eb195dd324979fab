"""The plan IR: what one rank does, as data -- and its text form.

A :class:`Plan` holds one :class:`RankPlan` per rank of the context-parallel (CP) group. A rank
plan is two op lists (forward, backward) that the torch executor walks in order and that the
validator, the simulator and the byte and memory accounting read without torch. Everything
rank-dependent -- which token ranges a rank holds, which blocks it computes with which mask,
whom it sends what -- is decided here, so the executor contains no rank logic.

Glossary (used everywhere in the package):

* **rank**     -- a position 0..P-1 in the CP group (Megatron's CP rank).
* **chunk**    -- the tokens a rank owns in the sequence layout ("chunk g" = rank g's tokens,
  see :mod:`.layout`). A *span-u chunk* is chunk m of the same layout over P/u ranks: the union
  of the chunks of ranks m*u .. m*u+u-1 (what a Ulysses all-to-all group of u ranks gathers).
* **slot**     -- a sub-part of a chunk that travels on its own (a TASP slot, the halo a mask
  needs). ``slot == -1`` means the whole chunk; :meth:`Plan.segments` gives a slot's tokens.
* **head slice** -- one of the ``heads_split`` equal parts of the heads (a Ulysses all-to-all
  scatters heads); ``heads == -1`` means all heads.
* **buffer**   -- a named set of tensors on one rank, addressed by a :class:`Key`.
* **selection** -- token ranges of a buffer (a tuple of local :class:`Segment`); ``None`` = all.
* **block**    -- the attention of some query rows against some key/value columns, computed by
  one kernel call that returns (out, lse); its mask is "full", "causal" (top-left, on identical
  query and key tokens) or "masked" (the plan's :class:`~.mask.Mask` on the tokens' global
  positions).
* **tile**     -- the set of blocks one rank computes (Mesh-Attention: a Q chunks x b KV chunks).
* **ring**     -- an ordered cycle of ranks; data and accumulators move one hop per round along it.
* **round**    -- one batch of transfers a rank posts at one point of its op list; sends of
  round t on rank r match receives of round t on the peer.
* **transfer** -- one buffer sent from one rank to another in a round.

Buffer kinds (:data:`KINDS`; the one table the executor allocates from and the accounting prices):

==========  ==========================================  =========================
kind        tensors                                     dtype
==========  ==========================================  =========================
``q``       (q,)            [B, H, T, D]                input
``kv``      (k, v)          [B, Hkv, T, D] each         input
``o``       (out, lse)      [B, H, T, D], [B, H, T]     acc (partial output)
``do``      (dout, lse, delta) [B,H,T,D], [B,H,T] x2    input, acc, acc
``dq``      (dq,)           [B, H, T, D]                acc (gradient partial)
``dkv``     (dk, dv)        [B, Hkv, T, D] each         acc (gradient partial)
``y``       (out,)          [B, H, T, D]                input (a finished output)
``dy``      (dout,)         [B, H, T, D]                input
``gq``      (dq,)           [B, H, T, D]                input (a finished gradient)
``gkv``     (dk, dv)        [B, Hkv, T, D] each         input (finished gradients)
==========  ==========================================  =========================

"acc" is fp32 (fp64 when the inputs are fp64): partial results are never accumulated in bf16.
T is the buffer's token count (:meth:`Plan.tokens`); H / Hkv are the heads of one head slice
when the key names one.

Text form. Every op prints as one line and parses back (:func:`parse_op`, :meth:`Plan.to_text`
/ :meth:`Plan.from_text`), so a plan can be written by hand, validated and executed before any
builder exists -- e.g. rank 1 of the 4-rank 2x2 Mesh forward::

    post 1: send kv1->3 | recv kv3<-3
    attend q1 x kv1 causal -> o1
    wait 1
    post 2: send q1->0 | recv q0<-0
    attend q1[2:4] x kv3 full -> o1
    wait 2
    attend q0[2:4] x kv3,kv1 full -> o0
    post 3: send o0->0 | recv o1<-0
    wait 3
    merge o1< -> o1

Key text: ``kind chunk [*span] [.slot] [/h<slice>] [<]``, e.g. ``kv3.2`` (slot 2 of chunk 3),
``q0*2/h1`` (head slice 1 of the span-2 chunk 0), ``o1<`` (an incoming partial output).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, NamedTuple, Union

__all__ = [
    "KINDS", "CASTS", "Kind", "Segment", "Sel", "Key", "Transfer", "Post", "Wait", "Attend", "AttendBackward",
    "MergeOut", "AddGrad", "Copy", "RowStats", "Free", "Op", "OP_TYPES", "MASK_KINDS", "RankPlan", "Plan",
    "format_op", "parse_op", "map_runs", "sel_len", "sel_text", "parse_sel", "sub_selection", "relative_selection",
]


# -- buffer kinds --------------------------------------------------------------------------------
class Kind(NamedTuple):
    """One buffer kind: per tensor, whether it has query heads ("q") or key/value heads ("kv"),
    whether it has the head_dim axis, and whether it is in the input dtype or the accumulator's."""

    tensors: tuple[tuple[str, bool, str], ...]

    @property
    def accumulator(self) -> bool:
        return all(dtype == "acc" for _, _, dtype in self.tensors)


KINDS: dict[str, Kind] = {
    "q": Kind((("q", True, "input"),)),
    "kv": Kind((("kv", True, "input"), ("kv", True, "input"))),
    "o": Kind((("q", True, "acc"), ("q", False, "acc"))),
    "do": Kind((("q", True, "input"), ("q", False, "acc"), ("q", False, "acc"))),
    "dq": Kind((("q", True, "acc"),)),
    "dkv": Kind((("kv", True, "acc"), ("kv", True, "acc"))),
    # finished results in the input dtype, as a Ulysses all-to-all moves them home
    "y": Kind((("q", True, "input"),)),
    "dy": Kind((("q", True, "input"),)),
    "gq": Kind((("q", True, "input"),)),
    "gkv": Kind((("kv", True, "input"), ("kv", True, "input"))),
}
# Copy may change the kind only to finish an accumulator: (from, to); it takes the leading tensors
CASTS = {("o", "y"), ("dq", "gq"), ("dkv", "gkv")}

MASK_KINDS = ("full", "causal", "masked")


# -- token selections ----------------------------------------------------------------------------
class Segment(NamedTuple):
    """Token range [start, stop) of a buffer (or of a rank's local chunk)."""

    start: int
    stop: int


Sel = tuple  # tuple[Segment, ...]: token ranges of a buffer, in order


def sel_len(sel: Sel | None, whole: int) -> int:
    """Tokens in selection ``sel`` of a buffer of ``whole`` tokens."""
    return whole if sel is None else sum(s.stop - s.start for s in sel)


def sel_text(sel: Sel | None) -> str:
    return "" if sel is None else "[" + ",".join(f"{s.start}:{s.stop}" for s in sel) + "]"


def parse_sel(text: str | None) -> Sel | None:
    if not text:
        return None
    body = text.strip()[1:-1]
    out = []
    for part in body.split(","):
        a, b = part.split(":")
        out.append(Segment(int(a), int(b)))
    return tuple(out)


def sub_selection(segments: Sel, sel: Sel | None) -> Sel:
    """Compose: the tokens ``sel`` (indices into the concatenation of ``segments``) as ranges of
    the space ``segments`` index into. E.g. segments ((10, 14), (20, 24)) and sel ((2, 6),)
    give ((12, 14), (20, 22))."""
    if sel is None:
        return tuple(segments)
    out: list[Segment] = []
    for lo, hi in sel:
        pos = 0
        for s0, s1 in segments:
            n = s1 - s0
            a, b = max(lo, pos), min(hi, pos + n)
            if a < b:
                seg = Segment(s0 + a - pos, s0 + b - pos)
                if out and out[-1].stop == seg.start:
                    out[-1] = Segment(out[-1].start, seg.stop)
                else:
                    out.append(seg)
            pos += n
    return tuple(out)


def relative_selection(sel: Sel, within: Sel) -> Sel:
    """Inverse of :func:`sub_selection`: the chunk-local ranges ``sel`` (inside ``within``) as
    indices into the concatenation of ``within``. E.g. sel ((12, 14),) within ((10, 14), (20, 24))
    gives ((2, 4),)."""
    out: list[Segment] = []
    for lo, hi in sel:
        pos = 0
        for w0, w1 in within:
            a, b = max(lo, w0), min(hi, w1)
            if a < b:
                seg = Segment(pos + a - w0, pos + b - w0)
                if out and out[-1].stop == seg.start:
                    out[-1] = Segment(out[-1].start, seg.stop)
                else:
                    out.append(seg)
            pos += w1 - w0
    if sum(b - a for a, b in out) != sum(b - a for a, b in sel):
        raise ValueError(f"selection {sel} is not inside {within}")
    return tuple(out)


# -- keys ----------------------------------------------------------------------------------------
_KEY = re.compile(r"^([a-z]+)(\d+)(?:\*(\d+))?(?:\.(\d+))?(?:/h(\d+))?(<?)$")


class Key(NamedTuple):
    """Name of a buffer on one rank (see the module docstring for its text form).

    ``incoming`` marks an accumulator received from another rank, kept apart from this rank's
    own partial of the same tokens until a :class:`MergeOut` / :class:`AddGrad` combines them.
    """

    kind: str
    chunk: int
    slot: int = -1
    incoming: bool = False
    heads: int = -1
    span: int = 1

    def __str__(self) -> str:
        s = f"{self.kind}{self.chunk}"
        if self.span != 1:
            s += f"*{self.span}"
        if self.slot >= 0:
            s += f".{self.slot}"
        if self.heads >= 0:
            s += f"/h{self.heads}"
        return s + ("<" if self.incoming else "")

    @classmethod
    def parse(cls, text: str) -> "Key":
        m = _KEY.match(text.strip())
        if m is None or m.group(1) not in KINDS:
            raise ValueError(f"not a buffer key: {text!r} (e.g. 'kv3', 'kv3.2', 'q0*2/h1', 'o1<'; kinds "
                             f"{', '.join(KINDS)})")
        kind, chunk, span, slot, heads, inc = m.groups()
        return cls(kind, int(chunk), int(slot) if slot else -1, bool(inc), int(heads) if heads else -1,
                   int(span) if span else 1)

    @property
    def base(self) -> "Key":
        """The key without the ``incoming`` mark: what sender and receiver agree on."""
        return self._replace(incoming=False) if self.incoming else self


def _keys_text(keys, cols=None) -> str:
    cols = cols if cols is not None else (None,) * len(keys)
    return ",".join(f"{k}{sel_text(c)}" for k, c in zip(keys, cols))


_KEYSEL = re.compile(r"([^\[\],\s]+)(\[[0-9:,]*\])?")


def _parse_keys(text: str) -> tuple[tuple[Key, ...], tuple]:
    keys, sels = [], []
    for m in _KEYSEL.finditer(text):
        keys.append(Key.parse(m.group(1)))
        sels.append(parse_sel(m.group(2)))
    return tuple(keys), tuple(sels)


def _heads_text(heads) -> str:
    return "" if heads is None else f"{{h{heads[0]}:{heads[1]}}}"


def _parse_dst(text: str) -> tuple[Key, Sel | None, tuple[int, int] | None]:
    m = re.match(r"^\s*([^\[\{\s]+)(\[[0-9:,]*\])?(?:\{h(\d+):(\d+)\})?\s*$", text)
    if m is None:
        raise ValueError(f"not a destination: {text!r}")
    heads = (int(m.group(3)), int(m.group(4))) if m.group(3) else None
    return Key.parse(m.group(1)), parse_sel(m.group(2)), heads


# -- ops -------------------------------------------------------------------------------------------
class Transfer(NamedTuple):
    """One buffer to send to, or receive from, ``peer``."""

    peer: int
    key: Key


class Post(NamedTuple):
    """Start round ``round``: post all sends and receives of this rank, asynchronously."""

    round: int
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]

    def reads(self) -> tuple[Key, ...]:
        return tuple(t.key for t in self.sends)

    def writes(self) -> tuple[Key, ...]:  # received buffers exist from the matching Wait on
        return tuple(t.key for t in self.recvs)

    def __str__(self) -> str:
        s = " ".join(f"{t.key}->{t.peer}" for t in self.sends)
        r = " ".join(f"{t.key}<-{t.peer}" for t in self.recvs)
        return f"post {self.round}: send {s or '-'} | recv {r or '-'}"

    @classmethod
    def parse(cls, text: str) -> "Post":
        m = re.match(r"^post (\d+): send (.*) \| recv (.*)$", text)
        if m is None:
            raise ValueError(f"not a post: {text!r} (e.g. 'post 1: send kv1->3 | recv kv3<-3')")

        def items(part: str, arrow: str) -> tuple[Transfer, ...]:
            if part.strip() == "-":
                return ()
            out = []
            for item in part.split():
                k, p = item.rsplit(arrow, 1)
                out.append(Transfer(int(p), Key.parse(k)))
            return tuple(out)
        return cls(int(m.group(1)), items(m.group(2), "->"), items(m.group(3), "<-"))


class Wait(NamedTuple):
    """Block until every transfer of round ``round`` on this rank has completed."""

    round: int

    def reads(self) -> tuple[Key, ...]:
        return ()

    def writes(self) -> tuple[Key, ...]:
        return ()

    def __str__(self) -> str:
        return f"wait {self.round}"

    @classmethod
    def parse(cls, text: str) -> "Wait":
        m = re.match(r"^wait (\d+)$", text)
        if m is None:
            raise ValueError(f"not a wait: {text!r}")
        return cls(int(m.group(1)))


class Attend(NamedTuple):
    """Forward block: rows ``rows`` of ``q`` against the concatenation of the ``kv`` buffers (each
    cut to its ``cols`` entry), with mask ``mask``; the (out, lse) result is LSE-merged into the
    partial output ``out`` on the same rows."""

    q: Key
    kv: tuple[Key, ...]
    out: Key
    rows: Sel | None = None
    cols: tuple | None = None  # tuple[Sel | None, ...] per kv buffer; None = all of each
    mask: str = "full"

    def col(self, i: int) -> Sel | None:
        return None if self.cols is None else self.cols[i]

    def reads(self) -> tuple[Key, ...]:
        return (self.q, *self.kv, self.out)

    def writes(self) -> tuple[Key, ...]:
        return (self.out,)

    def __str__(self) -> str:
        return (f"attend {self.q}{sel_text(self.rows)} x {_keys_text(self.kv, self.cols)} {self.mask} "
                f"-> {self.out}")

    @classmethod
    def parse(cls, text: str) -> "Attend":
        m = re.match(r"^attend (\S+) x (\S+) (\w+) -> (\S+)$", text)
        if m is None:
            raise ValueError(f"not an attend: {text!r} (e.g. 'attend q1[2:4] x kv3,kv1 full -> o1')")
        (q,), (rows,) = _parse_keys(m.group(1))
        kv, cols = _parse_keys(m.group(2))
        return cls(q, kv, Key.parse(m.group(4)), rows, None if all(c is None for c in cols) else cols,
                   _mask(m.group(3), text))


class AttendBackward(NamedTuple):
    """Backward block matching an :class:`Attend`: reads ``q`` and ``do`` (rows ``rows``) and the
    ``kv`` buffers (``cols``); adds the block gradients into ``dq`` (same rows) and ``dkv[i]``
    (the ``cols[i]`` of the i-th kv buffer)."""

    q: Key
    do: Key
    kv: tuple[Key, ...]
    dq: Key
    dkv: tuple[Key, ...]
    rows: Sel | None = None
    cols: tuple | None = None
    mask: str = "full"

    def col(self, i: int) -> Sel | None:
        return None if self.cols is None else self.cols[i]

    def reads(self) -> tuple[Key, ...]:
        return (self.q, self.do, *self.kv)

    def writes(self) -> tuple[Key, ...]:
        return (self.dq, *self.dkv)

    def __str__(self) -> str:
        return (f"attend_bwd {self.q}{sel_text(self.rows)} {self.do} x {_keys_text(self.kv, self.cols)} {self.mask} "
                f"-> {self.dq} | {_keys_text(self.dkv)}")

    @classmethod
    def parse(cls, text: str) -> "AttendBackward":
        m = re.match(r"^attend_bwd (\S+) (\S+) x (\S+) (\w+) -> (\S+) \| (\S+)$", text)
        if m is None:
            raise ValueError(f"not an attend_bwd: {text!r} (e.g. 'attend_bwd q1[2:4] do1 x kv3 full -> dq1 | dkv3')")
        (q,), (rows,) = _parse_keys(m.group(1))
        kv, cols = _parse_keys(m.group(3))
        dkv, _ = _parse_keys(m.group(6))
        return cls(q, Key.parse(m.group(2)), kv, Key.parse(m.group(5)), dkv, rows,
                   None if all(c is None for c in cols) else cols, _mask(m.group(4), text))


def _mask(word: str, text: str) -> str:
    if word not in MASK_KINDS:
        raise ValueError(f"block mask {word!r} in {text!r} is not one of {', '.join(MASK_KINDS)}")
    return word


class MergeOut(NamedTuple):
    """``dst`` <- LSE-merge(``dst``, ``src``): combine two partial outputs of the same rows (src's
    rows land on dst's ``into`` rows, in order; None: the same rows)."""

    src: Key
    dst: Key
    into: Sel | None = None

    def reads(self) -> tuple[Key, ...]:
        return (self.src, self.dst)

    def writes(self) -> tuple[Key, ...]:
        return (self.dst,)

    def __str__(self) -> str:
        return f"merge {self.src} -> {self.dst}{sel_text(self.into)}"

    @classmethod
    def parse(cls, text: str) -> "MergeOut":
        m = re.match(r"^merge (\S+) -> (.+)$", text)
        if m is None:
            raise ValueError(f"not a merge: {text!r}")
        dst, into, _ = _parse_dst(m.group(2))
        return cls(Key.parse(m.group(1)), dst, into)


class AddGrad(NamedTuple):
    """``dst`` += ``src`` (fp32). src's tokens land on dst's ``into`` rows in order and on its
    ``heads`` range [a, b) (None: the same rows / all heads). Creates ``dst`` (zeros) if absent:
    a rank's own gradient may be made only of received partials."""

    src: Key
    dst: Key
    into: Sel | None = None
    heads: tuple[int, int] | None = None

    def reads(self) -> tuple[Key, ...]:
        return (self.src,)

    def writes(self) -> tuple[Key, ...]:
        return (self.dst,)

    def __str__(self) -> str:
        return f"add {self.src} -> {self.dst}{sel_text(self.into)}{_heads_text(self.heads)}"

    @classmethod
    def parse(cls, text: str) -> "AddGrad":
        m = re.match(r"^add (\S+) -> (.+)$", text)
        if m is None:
            raise ValueError(f"not an add: {text!r}")
        dst, into, heads = _parse_dst(m.group(2))
        return cls(Key.parse(m.group(1)), dst, into, heads)


class Copy(NamedTuple):
    """``dst``[into rows, heads] <- ``src``[rows]: move tokens between buffers of one kind (the
    token reorder and head assembly around a Ulysses all-to-all), or finish an accumulator into
    the input dtype (:data:`CASTS`, e.g. ``o`` -> ``y``). Creates ``dst`` if absent."""

    src: Key
    dst: Key
    rows: Sel | None = None
    into: Sel | None = None
    heads: tuple[int, int] | None = None

    def reads(self) -> tuple[Key, ...]:
        return (self.src,)

    def writes(self) -> tuple[Key, ...]:
        return (self.dst,)

    def __str__(self) -> str:
        return f"copy {self.src}{sel_text(self.rows)} -> {self.dst}{sel_text(self.into)}{_heads_text(self.heads)}"

    @classmethod
    def parse(cls, text: str) -> "Copy":
        m = re.match(r"^copy (\S+) -> (.+)$", text)
        if m is None:
            raise ValueError(f"not a copy: {text!r}")
        (src,), (rows,) = _parse_keys(m.group(1))
        dst, into, heads = _parse_dst(m.group(2))
        return cls(src, dst, rows, into, heads)


class RowStats(NamedTuple):
    """``dst`` (a ``do`` buffer) <- the incoming gradient ``dout`` (a ``dy`` buffer) with the row
    statistics of the partial output ``out`` (an ``o`` buffer of the same tokens): its lse and
    delta = rowsum(dout * out). Lets a rank that holds a row's output compute them, instead of
    receiving them (a Ulysses all-to-all then moves dout alone)."""

    dout: Key
    out: Key
    dst: Key

    def reads(self) -> tuple[Key, ...]:
        return (self.dout, self.out)

    def writes(self) -> tuple[Key, ...]:
        return (self.dst,)

    def __str__(self) -> str:
        return f"rowstats {self.dout} {self.out} -> {self.dst}"

    @classmethod
    def parse(cls, text: str) -> "RowStats":
        m = re.match(r"^rowstats (\S+) (\S+) -> (\S+)$", text)
        if m is None:
            raise ValueError(f"not a rowstats: {text!r}")
        return cls(Key.parse(m.group(1)), Key.parse(m.group(2)), Key.parse(m.group(3)))


class Free(NamedTuple):
    """``key`` is not read again: the executor may reuse its memory."""

    key: Key

    def reads(self) -> tuple[Key, ...]:
        return ()

    def writes(self) -> tuple[Key, ...]:
        return ()

    def __str__(self) -> str:
        return f"free {self.key}"

    @classmethod
    def parse(cls, text: str) -> "Free":
        m = re.match(r"^free (\S+)$", text)
        if m is None:
            raise ValueError(f"not a free: {text!r}")
        return cls(Key.parse(m.group(1)))


Op = Union[Post, Wait, Attend, AttendBackward, MergeOut, AddGrad, Copy, RowStats, Free]
# every op type, by the first word of its text form; consumers keep one handler per entry (a test
# checks that the executor, the validator, the simulator and the memory walk handle all of them)
OP_TYPES: dict[str, type] = {"post": Post, "wait": Wait, "attend": Attend, "attend_bwd": AttendBackward,
                             "merge": MergeOut, "add": AddGrad, "copy": Copy, "rowstats": RowStats, "free": Free}


def format_op(op: Op) -> str:
    """One line per op, e.g. ``post 1: send q0->1 | recv q1<-1`` (parses back with :func:`parse_op`)."""
    if type(op) not in OP_TYPES.values():
        raise TypeError(f"not a plan op: {op!r}")
    return str(op)


def parse_op(line: str) -> Op:
    """The op of one text line (see :func:`format_op`)."""
    text = line.strip()
    word = text.split(" ", 1)[0].rstrip(":")
    cls = OP_TYPES.get(word)
    if cls is None:
        raise ValueError(f"unknown op {word!r} in {line!r}; ops: {', '.join(OP_TYPES)}")
    return cls.parse(text)


# -- rank plans and plans ----------------------------------------------------------------------------
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


def _plan_header(plan: "Plan") -> str:
    tile = "-" if plan.tile is None else f"{plan.tile[0]}x{plan.tile[1]}"
    return (f"plan {plan.mode} P={plan.world_size} seq_local={plan.seq_local} mask={plan.mask.text()} "
            f"tile={tile} schedule={plan.schedule or '-'} heads_split={plan.heads_split}")


@dataclass(frozen=True, eq=False)
class Plan:
    """The plan of one attention call over a CP group of ``world_size`` ranks.

    ``mode`` names the CP mode that built it ("mesh", "tasp", "a2a+mesh", ...; ring attention is
    mesh with tile (1, P)). ``mask`` (:class:`~.mask.Mask`) says which (query, key) pairs of the
    global sequence attend; ``layout`` maps each rank's tokens to global positions (default:
    Megatron's zigzag over ``world_size`` ranks). ``slots`` maps (span, chunk, slot) to the token
    segments of that slot buffer within its chunk (:meth:`segments`). ``heads_split`` is the
    number of head slices keys may name (a Ulysses degree; 1 otherwise); ``inner`` is a hybrid's
    inner plan (over world_size / heads_split ranks), whose traffic the simulator prices instead of
    reading every rank of the composed plan. ``rings`` names the
    rings the plan moves data on (the simulator's fast path and reports); ``options`` holds the
    builder's settings as typed facts (e.g. ``backward_chunks``); ``notes`` human-readable facts.

    Rank plans are built on first access by ``build_rank`` (a plan over 256 ranks holds 65,536
    blocks; most users touch one rank). ``build_rounds``, when given, returns just the Post/Wait
    ops of a rank -- what the matching and deadlock checks need -- without building its blocks.
    """

    mode: str
    world_size: int
    seq_local: int
    build_rank: Callable[[int], RankPlan] = field(repr=False)
    mask: object = None  # a .mask.Mask; None means causal
    layout: object = None  # a .layout layout; None means ZigzagLayout(world_size, world_size * seq_local)
    slots: object = None  # Callable[[Key], Sel] or a dict {(span, chunk, slot): Sel}
    heads_split: int = 1
    tile: tuple[int, int] | None = None
    schedule: str = ""
    rings: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    build_rounds: Callable[[int, str], tuple[Op, ...]] | None = field(default=None, repr=False)
    inner: "Plan | None" = field(default=None, repr=False)  # a hybrid's inner plan (the simulator prices it)
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        from .layout import ZigzagLayout
        from .mask import Mask

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
        return bool(self.slots) and not callable(self.slots)

    def tokens(self, key: Key) -> int:
        """Token count of buffer ``key``."""
        if key.slot < 0:
            return self.seq_local * key.span
        return sum(s.stop - s.start for s in self.segments(key))

    def positions(self, key: Key, sel: Sel | None = None) -> tuple[tuple[int, int], ...]:
        """Global position runs (start, length) of buffer ``key``'s tokens (``sel`` of them), in
        buffer order."""
        ck = ("pos", key.span, key.chunk, key.slot, sel)
        hit = self._cache.get(ck)
        if hit is None:
            runs = self.layout.runs(key.chunk, key.span)
            hit = self._cache[ck] = map_runs(runs, sub_selection(self.segments(key), sel))
        return hit

    def head_counts(self, key: Key, heads: int, kv_heads: int) -> tuple[int, int]:
        """(query heads, key/value heads) of buffer ``key`` for a problem of ``heads`` / ``kv_heads``."""
        if key.heads < 0 or self.heads_split == 1:
            return heads, kv_heads
        from .layout import head_slice

        q0, q1 = head_slice("q", key.heads, self.heads_split, heads, kv_heads)
        k0, k1 = head_slice("kv", key.heads, self.heads_split, heads, kv_heads)
        return q1 - q0, k1 - k0

    # -- text -------------------------------------------------------------------------------------
    def describe(self, ranks: Iterable[int] | None = None) -> str:
        """A compact text form of the ops of ``ranks`` (default all; Free ops left out)."""
        lines = [_plan_header(self)]
        lines += [f"  note: {n}" for n in self.notes]
        for r in range(self.world_size) if ranks is None else ranks:
            rp = self.rank(r)
            for direction in ("forward", "backward"):
                lines.append(f"rank {rp.rank} {direction}:")
                lines += ["  " + str(op) for op in rp.ops(direction) if type(op) is not Free]
        return "\n".join(lines)

    def to_text(self) -> str:
        """The whole plan as text (every rank, every op, inputs and slots); :meth:`from_text`
        reads it back."""
        lines = [_plan_header(self)]
        slots = {}
        for rp in self.ranks:
            for op in (*rp.forward, *rp.backward):
                for k in _op_keys(op):
                    if k.slot >= 0:
                        slots[(k.span, k.chunk, k.slot)] = self.segments(k)
            for table in (rp.forward_inputs, rp.backward_inputs):
                for k in table:
                    if k.slot >= 0:
                        slots[(k.span, k.chunk, k.slot)] = self.segments(k)
        for (span, chunk, slot), segs in sorted(slots.items()):
            lines.append(f"slot {Key('q', chunk, slot, span=span)}{sel_text(segs)}".replace("slot q", "slot ", 1))
        lines += [rp.to_text() for rp in self.ranks]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str, layout=None) -> "Plan":
        """Parse :meth:`to_text` output -- or a hand-written plan in that form -- into a Plan.

        ``layout`` overrides the default zigzag layout (e.g. a THD layout)."""
        return _parse_plan(text, layout)


def _op_keys(op) -> tuple[Key, ...]:
    if type(op) is Post:
        return tuple(t.key for t in (*op.sends, *op.recvs))
    return tuple(dict.fromkeys((*op.reads(), *op.writes())))


def map_runs(runs, segs: Sel) -> tuple[tuple[int, int], ...]:
    """Global position runs of local ``segs`` of a chunk whose tokens are ``runs`` (local, start, length)."""
    out: list[tuple[int, int]] = []
    for s in segs:
        for local, start, length in runs:
            a, b = max(s.start, local), min(s.stop, local + length)
            if a < b:
                pos = start + a - local
                if out and out[-1][0] + out[-1][1] == pos:
                    out[-1] = (out[-1][0], out[-1][1] + b - a)
                else:
                    out.append((pos, b - a))
    return tuple(out)


def _parse_plan(text: str, layout=None) -> Plan:
    from .mask import Mask

    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if not lines or not lines[0].startswith("plan "):
        raise ValueError("a plan text starts with 'plan MODE P=.. seq_local=.. mask=.. ...'")
    head = dict(item.split("=", 1) for item in lines[0].split()[2:])
    mode = lines[0].split()[1]
    P, T = int(head["P"]), int(head["seq_local"])
    tile = None if head.get("tile", "-") == "-" else tuple(int(x) for x in head["tile"].split("x"))
    slots: dict = {}
    ranks: dict[int, dict] = {}
    cur, direction = None, None
    for ln in lines[1:]:
        s = ln.strip()
        if s.startswith("slot "):
            m = re.match(r"^slot (\d+)(?:\*(\d+))?\.(\d+)(\[.*\])$", s)
            if m is None:
                raise ValueError(f"bad slot line {ln!r} (e.g. 'slot 3.1[0:2,6:8]')")
            slots[(int(m.group(2) or 1), int(m.group(1)), int(m.group(3)))] = parse_sel(m.group(4))
        elif s.startswith("rank "):
            m = re.match(r"^rank (\d+): output (\S+) grad_q (\S+) grad_kv (\S+)$", s)
            if m is None:
                raise ValueError(f"bad rank line {ln!r}")
            cur = ranks[int(m.group(1))] = dict(output=Key.parse(m.group(2)), grad_q=Key.parse(m.group(3)),
                                                grad_kv=Key.parse(m.group(4)), forward=[], backward=[],
                                                forward_inputs={}, backward_inputs={}, saved=[])
            direction = None
        elif cur is None:
            raise ValueError(f"line {ln!r} comes before any 'rank N:' line")
        elif s in ("forward:", "backward:"):
            direction = s[:-1]
        elif s.startswith(("forward_input ", "backward_input ")):
            word, rest = s.split(" ", 1)
            (k,), (sel,) = _parse_keys(rest)
            cur[word + "s"][k] = sel if sel is not None else (Segment(0, T * k.span),)
        elif s.startswith("saved "):
            cur["saved"].append(Key.parse(s.split(" ", 1)[1]))
        elif direction is None:
            raise ValueError(f"op {ln!r} outside a 'forward:' / 'backward:' section")
        else:
            cur[direction].append(parse_op(s))
    if sorted(ranks) != list(range(P)):
        raise ValueError(f"plan text for P={P} ranks has rank sections {sorted(ranks)}")
    built = {r: RankPlan(r, T, tuple(d["forward"]), tuple(d["backward"]), d["forward_inputs"],
                         d["backward_inputs"], d["output"], d["grad_q"], d["grad_kv"], tuple(d["saved"]))
             for r, d in ranks.items()}
    return Plan(mode=mode, world_size=P, seq_local=T, build_rank=built.__getitem__,
                mask=Mask.from_text(head.get("mask", "causal")), layout=layout, slots=slots,
                heads_split=int(head.get("heads_split", 1)), tile=tile,
                schedule="" if head.get("schedule", "-") == "-" else head["schedule"])

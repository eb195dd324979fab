"""The plan IR's vocabulary: buffer kinds, buffer keys and the op set -- each op with its reads,
writes and one-line text form (printed by ``str``, read back by ``parse``).

Words (rank, chunk, slot, head slice, buffer, selection, block, tile, ring, round, transfer)
are those of the glossary in docs/design.md.

Buffer kinds (:data:`KINDS`; the one table the executor allocates from and the accounting prices):

==========  ==============================================  =========================
kind        tensors                                         dtype
==========  ==============================================  =========================
``q``       (q,)            [B, H, T, D]                    input
``kv``      (k, v)          [B, Hkv, T, D], [B, Hkv, T, Dv] input
``o``       (out, lse)      [B, H, T, Dv], [B, H, T]        acc (partial output)
``do``      (dout, lse, delta) [B,H,T,Dv], [B,H,T] x2       input, acc, acc
``dq``      (dq,)           [B, H, T, D]                    acc (gradient partial)
``dkv``     (dk, dv)        [B, Hkv, T, D], [B, Hkv, T, Dv] acc (gradient partial)
``y``       (out,)          [B, H, T, Dv]                   input (a finished output)
``dy``      (dout,)         [B, H, T, Dv]                   input
``gq``      (dq,)           [B, H, T, D]                    input (a finished gradient)
``gkv``     (dk, dv)        [B, Hkv, T, D], [B, Hkv, T, Dv] input (finished gradients)
==========  ==============================================  =========================

"acc" is fp32 (fp64 when the inputs are fp64): partial results are never accumulated in bf16.
D is the query/key head dim, Dv the value head dim (:meth:`~..shape.AttentionShape.dim`; equal
but under MLA).
T is the buffer's token count (:meth:`~.plan.Plan.tokens`); H / Hkv are the heads of one head
slice when the key names one.

Key text: ``kind chunk [*span] [.slot] [/h<slice>] [']``, e.g. ``kv3.2`` (slot 2 of chunk 3),
``q0*2/h1`` (head slice 1 of the span-2 chunk 0), ``o1'`` (an incoming partial output, kept apart
from this rank's own ``o1`` until a merge). Op text, e.g. rank 1 of the 4-rank 2x2 Mesh forward
(the plan docs/design.md prints; tests/plan/test_plan_ir.py checks it against the builder)::

    post 1: send kv1->3 | recv kv3<-3
    attend q1 x kv1 causal -> o1
    wait 1
    post 2: send q1->0 | recv q0<-0
    attend q1[2:4] x kv3 full -> o1
    wait 2
    attend q0[2:4] x kv3,kv1 full -> o0
    post 3: send o0->0 | recv o1'<-0
    wait 3
    merge o1' -> o1
"""

from __future__ import annotations

import re
from typing import NamedTuple, Union

from ..mask import BlockKind
from ..sel import Sel, parse_sel, sel_text

__all__ = [
    "KINDS", "CASTS", "Kind", "Key", "Transfer", "Post", "Wait", "Attend", "AttendBackward", "MergeOut", "AddGrad",
    "Copy", "RowStats", "Free", "Op", "OP_TYPES", "format_op", "parse_op", "op_keys",
]


# -- buffer kinds --------------------------------------------------------------------------------
class Kind(NamedTuple):
    """One buffer kind: per tensor, whether it has query heads ("q") or key/value heads ("kv"),
    its last axis ("qk": the query/key head dim, "v": the value head dim, "": none -- a row
    statistic; :meth:`~..shape.AttentionShape.dim`), and whether it is in the input dtype or the
    accumulator's; ``start``: per tensor, the value an accumulator starts from (0 unless given:
    the lse of a row that has seen no key is -inf)."""

    tensors: tuple[tuple[str, str, str], ...]
    start: tuple[float, ...] = ()

    def initial(self, i: int) -> float:
        return self.start[i] if i < len(self.start) else 0.0

    @property
    def accumulator(self) -> bool:
        return all(dtype == "acc" for _, _, dtype in self.tensors)

    @property
    def side(self) -> str:
        """"q" for buffers of query rows, "kv" for key/value columns (whose head slices are the
        key/value heads')."""
        return self.tensors[0][0]


KINDS: dict[str, Kind] = {
    "q": Kind((("q", "qk", "input"),)),
    "kv": Kind((("kv", "qk", "input"), ("kv", "v", "input"))),
    "o": Kind((("q", "v", "acc"), ("q", "", "acc")), start=(0.0, float("-inf"))),
    "do": Kind((("q", "v", "input"), ("q", "", "acc"), ("q", "", "acc"))),
    "dq": Kind((("q", "qk", "acc"),)),
    "dkv": Kind((("kv", "qk", "acc"), ("kv", "v", "acc"))),
    # finished results in the input dtype, as a Ulysses all-to-all moves them home
    "y": Kind((("q", "v", "input"),)),
    "dy": Kind((("q", "v", "input"),)),
    "gq": Kind((("q", "qk", "input"),)),
    "gkv": Kind((("kv", "qk", "input"), ("kv", "v", "input"))),
}
# Copy may change the kind only to finish an accumulator: (from, to); it takes the leading tensors
CASTS = {("o", "y"), ("dq", "gq"), ("dkv", "gkv")}


# -- keys ----------------------------------------------------------------------------------------
_KEY = re.compile(r"^([a-z]+)(\d+)(?:\*(\d+))?(?:\.(\d+))?(?:/h(\d+))?('?)$")


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
        return s + ("'" if self.incoming else "")

    @classmethod
    def parse(cls, text: str) -> "Key":
        m = _KEY.match(text.strip())
        if m is None or m.group(1) not in KINDS:
            raise ValueError(f"not a buffer key: {text!r} (e.g. 'kv3', 'kv3.2', 'q0*2/h1', \"o1'\"; kinds "
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
    """Start round ``round``: post all sends and receives of this rank, asynchronously.

    ``group`` (plan ranks, sorted; empty: point-to-point) says the round is one all-to-all over
    those ranks: every member posts it, with transfers only to and from members, so a transport
    with a process group of exactly them moves it in one collective call instead of a call per
    tensor (:meth:`~megatron_mesh.comm.base.Communicator.exchange`). A Ulysses group's rounds
    are: at U = 8 a rank's q/kv round is 28 point-to-point calls, or one ``all_to_all_single``.
    """

    round: int
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]
    group: tuple[int, ...] = ()

    def reads(self) -> tuple[Key, ...]:
        return tuple(t.key for t in self.sends)

    def writes(self) -> tuple[Key, ...]:  # received buffers exist from the matching Wait on
        return tuple(t.key for t in self.recvs)

    def __str__(self) -> str:
        s = " ".join(f"{t.key}->{t.peer}" for t in self.sends)
        r = " ".join(f"{t.key}<-{t.peer}" for t in self.recvs)
        g = f" | all-to-all {','.join(map(str, self.group))}" if self.group else ""
        return f"post {self.round}: send {s or '-'} | recv {r or '-'}{g}"

    @classmethod
    def parse(cls, text: str) -> "Post":
        m = re.match(r"^post (\d+): send (.*) \| recv (.*?)(?: \| all-to-all (\S*))?$", text)
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
        if m.group(4) is not None and not re.fullmatch(r"\d+(,\d+)+", m.group(4)):
            raise ValueError(f"not a post: {text!r} -- an all-to-all names its group's ranks, e.g. "
                             f"'| all-to-all 0,1', not {m.group(4)!r}")
        group = tuple(int(x) for x in m.group(4).split(",")) if m.group(4) else ()
        return cls(int(m.group(1)), items(m.group(2), "->"), items(m.group(3), "<-"), group)


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
    mask: BlockKind = BlockKind.FULL

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
    mask: BlockKind = BlockKind.FULL

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


def _mask(word: str, text: str) -> BlockKind:
    try:
        return BlockKind(word)
    except ValueError:
        raise ValueError(f"block mask {word!r} in {text!r} is not one of {', '.join(BlockKind)}") from None


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
    receiving them (a Ulysses all-to-all then moves dout alone). ``rows``: only those rows (the
    same in all three buffers), e.g. one all-to-all round's rows as they arrive."""

    dout: Key
    out: Key
    dst: Key
    rows: Sel | None = None

    def reads(self) -> tuple[Key, ...]:
        return (self.dout, self.out)

    def writes(self) -> tuple[Key, ...]:
        return (self.dst,)

    def __str__(self) -> str:
        return f"rowstats {self.dout}{sel_text(self.rows)} {self.out} -> {self.dst}"

    @classmethod
    def parse(cls, text: str) -> "RowStats":
        m = re.match(r"^rowstats (\S+) (\S+) -> (\S+)$", text)
        if m is None:
            raise ValueError(f"not a rowstats: {text!r}")
        (dout,), (rows,) = _parse_keys(m.group(1))
        return cls(dout, Key.parse(m.group(2)), Key.parse(m.group(3)), rows)


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


def op_keys(op: Op) -> tuple[Key, ...]:
    """Every buffer an op names (a Post: its transfers' keys)."""
    if type(op) is Post:
        return tuple(t.key for t in (*op.sends, *op.recvs))
    return tuple(dict.fromkeys((*op.reads(), *op.writes())))

"""The plan IR: what one rank does, as data.

A :class:`Plan` holds one :class:`RankPlan` per rank of the context-parallel (CP) group. A rank
plan is two op lists (forward, backward) that the torch executor walks in order and that the
validator and the simulator read without torch. Everything rank-dependent -- which chunks a rank
holds, which blocks it computes with which mask, whom it sends what -- is decided here, so the
executor contains no rank logic.

Glossary (used everywhere in the package):

* **rank**     -- a position 0..P-1 in the CP group (Megatron's CP rank).
* **chunk**    -- the tokens a rank owns in Megatron's zigzag layout ("chunk g" = rank g's two
  halves, see :mod:`megatron_mesh.plan.layout`).
* **slot**     -- a sub-part of a chunk that travels on its own (TASP splits a KV chunk into one
  slot per ring). ``slot == -1`` means the whole chunk.
* **buffer**   -- a named set of tensors on one rank, addressed by a :class:`Key`.
* **block**    -- the attention of some query tokens against some key/value tokens, computed by
  one kernel call that returns (out, lse).
* **tile**     -- the set of blocks one rank computes (Mesh-Attention: a Q chunks x b KV chunks).
* **ring**     -- an ordered cycle of ranks; data and accumulators move one hop per round along it.
* **round**    -- one batch of transfers that every rank posts at the same point of its op list;
  sends of round t on rank r match receives of round t on the peer.
* **transfer** -- one buffer sent from one rank to another in a round.

Buffer kinds (what the tensors of a buffer are; byte sizes in :mod:`.accounting`):

==========  ==========================================  =========================
kind        tensors                                     dtype
==========  ==========================================  =========================
``q``       (q,)            [B, H, T, D]                input
``kv``      (k, v)          [B, Hkv, T, D] each         input
``o``       (out, lse)      [B, H, T, D], [B, H, T]     acc (partial output)
``do``      (dout, lse, delta) [B,H,T,D], [B,H,T] x2    input, acc, acc
``dq``      (dq,)           [B, H, T, D]                acc (gradient partial)
``dkv``     (dk, dv)        [B, Hkv, T, D] each         acc (gradient partial)
==========  ==========================================  =========================

"acc" is fp32 (fp64 when the inputs are fp64): partial results are never accumulated in bf16.

T is the token count of the buffer: the rank's local sequence length for a whole chunk, or the
slot's length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, NamedTuple, Union

__all__ = [
    "KINDS",
    "HALVES",
    "Key",
    "Transfer",
    "Post",
    "Wait",
    "Attend",
    "AttendBackward",
    "MergeOut",
    "AddGrad",
    "Free",
    "Op",
    "Segment",
    "RankPlan",
    "Plan",
    "format_op",
]

KINDS = ("q", "kv", "o", "do", "dq", "dkv")

# Which part of a buffer's tokens a block reads or writes. "front"/"back" are the first/second
# half of the buffer's tokens: for a whole zigzag chunk they are its two halves, for a TASP slot
# its front and back sub-chunks.
HALVES = ("all", "front", "back")


class Key(NamedTuple):
    """Name of a buffer on one rank.

    ``incoming`` marks an accumulator received from the previous rank on a ring, kept apart from
    this rank's own partial of the same chunk until a :class:`MergeOut` / :class:`AddGrad`
    combines them.
    """

    kind: str
    chunk: int
    slot: int = -1
    incoming: bool = False

    def __str__(self) -> str:
        s = f"{self.kind}{self.chunk}"
        if self.slot >= 0:
            s += f".{self.slot}"
        return s + ("<" if self.incoming else "")

    def travelling(self) -> "Key":
        """The key without the ``incoming`` mark: what sender and receiver agree on."""
        return self._replace(incoming=False)


class Transfer(NamedTuple):
    """One buffer to send to, or receive from, ``peer``."""

    peer: int
    key: Key


class Post(NamedTuple):
    """Start round ``round``: post all sends and receives of this rank, asynchronously."""

    round: int
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]


class Wait(NamedTuple):
    """Block until every transfer of round ``round`` on this rank has completed."""

    round: int


class Attend(NamedTuple):
    """Forward block: ``q`` (rows ``q_half``) against the concatenation of ``kv`` (each cut to
    ``kv_half``), LSE-merged into the partial output ``out`` on the same rows.

    ``causal`` applies the causal mask over the block's own token order; the plan only sets it on
    diagonal blocks, where query and key tokens are the same tokens in the same order.
    """

    q: Key
    kv: tuple[Key, ...]
    q_half: str
    kv_half: str
    causal: bool
    out: Key


class AttendBackward(NamedTuple):
    """Backward block matching an :class:`Attend`: reads ``q`` and ``do`` (rows ``q_half``) and
    ``kv``; adds the block gradients into ``dq`` (same rows) and ``dkv[i]`` (``kv_half`` of the
    i-th kv buffer)."""

    q: Key
    do: Key
    kv: tuple[Key, ...]
    q_half: str
    kv_half: str
    causal: bool
    dq: Key
    dkv: tuple[Key, ...]


class MergeOut(NamedTuple):
    """``dst`` <- LSE-merge(``dst``, ``src``): combine two partial outputs of the same rows."""

    src: Key
    dst: Key


class Segment(NamedTuple):
    """Token range [start, stop) of a rank's local chunk."""

    start: int
    stop: int


class AddGrad(NamedTuple):
    """``dst`` += ``src`` (fp32). With ``into``, src's tokens are added into those token ranges of
    dst, in order (used to scatter TASP slot gradients back into the chunk)."""

    src: Key
    dst: Key
    into: tuple[Segment, ...] | None = None


class Free(NamedTuple):
    """``key`` is not read again: the executor may reuse its memory."""

    key: Key


Op = Union[Post, Wait, Attend, AttendBackward, MergeOut, AddGrad, Free]


@dataclass(frozen=True)
class RankPlan:
    """Everything one rank does in one attention call.

    ``forward_inputs`` / ``backward_inputs`` say how the executor builds the initial buffers from
    the local tensors: each key maps to the token segments of the local chunk it is made of
    (concatenated). Forward inputs are cut from (q,) or (k, v); backward inputs also from
    (dout, lse, delta) for kind ``do``. ``saved`` are forward buffers that the backward reads
    (kept instead of re-communicated). ``output`` is the final (out, lse) buffer; ``grad_q`` and
    ``grad_kv`` the final gradient buffers.
    """

    rank: int
    seq_local: int
    forward: tuple[Op, ...]
    backward: tuple[Op, ...]
    forward_inputs: dict[Key, tuple[Segment, ...]]
    backward_inputs: dict[Key, tuple[Segment, ...]]
    output: Key
    grad_q: Key
    grad_kv: Key
    saved: tuple[Key, ...] = ()

    def ops(self, direction: str) -> tuple[Op, ...]:
        if direction not in ("forward", "backward"):
            raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
        return self.forward if direction == "forward" else self.backward

    def rounds(self, direction: str) -> Iterator[Post]:
        return (op for op in self.ops(direction) if isinstance(op, Post))

    def blocks(self, direction: str = "forward") -> Iterator[Attend | AttendBackward]:
        return (op for op in self.ops(direction) if isinstance(op, (Attend, AttendBackward)))


@dataclass(frozen=True, eq=False)
class Plan:
    """The plan of one attention call over a CP group of ``world_size`` ranks.

    ``mode`` is "mesh" (ring attention is mesh with tile (1, P)) or "tasp". ``slot_tokens`` gives
    the token count of each slot (whole chunks hold ``seq_local`` tokens). ``rings`` names the
    rings the plan moves data on (for reports); ``notes`` carries human-readable facts about the
    plan (e.g. a TASP plan that could not use a full Hamiltonian decomposition says so).

    Rank plans are built on first access by ``build_rank`` (a plan over 256 ranks holds 65,536
    blocks; most users touch one rank). ``build_rounds``, when given, returns just the Post/Wait
    ops of a rank -- what the matching and deadlock checks need -- without building its blocks.
    """

    mode: str
    world_size: int
    seq_local: int
    causal: bool
    build_rank: Callable[[int], RankPlan] = field(repr=False)
    slot_tokens: dict[int, int] = field(default_factory=dict)
    tile: tuple[int, int] | None = None
    schedule: str = ""
    rings: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    build_rounds: Callable[[int, str], tuple[Op, ...]] | None = field(default=None, repr=False)
    _cache: dict = field(default_factory=dict, repr=False)

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
                self._cache[ck] = tuple(op for op in self.rank(r).ops(direction) if isinstance(op, (Post, Wait)))
        return self._cache[ck]

    def tokens(self, key: Key) -> int:
        """Token count of buffer ``key``."""
        return self.seq_local if key.slot < 0 else self.slot_tokens[key.slot]

    def describe(self, ranks: Iterable[int] | None = None) -> str:
        """A compact text form of the ops of ``ranks`` (default all; for docs and debugging)."""
        lines = [f"{self.mode} plan: P={self.world_size} tile={self.tile} schedule={self.schedule} "
                 f"causal={self.causal} seq_local={self.seq_local}"]
        lines += [f"  note: {n}" for n in self.notes]
        for r in range(self.world_size) if ranks is None else ranks:
            rp = self.rank(r)
            for direction in ("forward", "backward"):
                lines.append(f"rank {rp.rank} {direction}:")
                lines += ["  " + format_op(op) for op in rp.ops(direction) if not isinstance(op, Free)]
        return "\n".join(lines)


def format_op(op: Op) -> str:
    """One line per op, e.g. ``post 1: send q0->1 | recv q1<-1``."""
    if isinstance(op, Post):
        s = " ".join(f"{t.key}->{t.peer}" for t in op.sends)
        r = " ".join(f"{t.key}<-{t.peer}" for t in op.recvs)
        return f"post {op.round}: send {s or '-'} | recv {r or '-'}"
    if isinstance(op, Wait):
        return f"wait {op.round}"
    if isinstance(op, Attend):
        kv = ",".join(str(k) for k in op.kv)
        mask = "causal" if op.causal else "full"
        return f"attend {op.q}[{op.q_half}] x {kv}[{op.kv_half}] {mask} -> {op.out}"
    if isinstance(op, AttendBackward):
        kv = ",".join(str(k) for k in op.kv)
        mask = "causal" if op.causal else "full"
        return f"attend_bwd {op.q}[{op.q_half}] x {kv}[{op.kv_half}] {mask} -> {op.dq}, {','.join(map(str, op.dkv))}"
    if isinstance(op, MergeOut):
        return f"merge {op.src} -> {op.dst}"
    if isinstance(op, AddGrad):
        return f"add {op.src} -> {op.dst}" + (f" at {list(op.into)}" if op.into else "")
    if isinstance(op, Free):
        return f"free {op.key}"
    raise TypeError(f"not a plan op: {op!r}")

"""Ulysses x (Mesh | TASP | ring): a hierarchical CP plan over P = U * M ranks.

U consecutive CP ranks (inside a node) form an all-to-all group. Its all-to-all turns each
rank's [S/P tokens, H heads] into [U*S/P tokens, H/U heads]: rank u of the group gets head slice
u of every group member's chunk. The U chunks of a group, front halves in rank order and back
halves in reverse, are exactly chunk m of the zigzag over M = P/U ranks (:mod:`.layout`), so the
*inner plan* -- Mesh of any tile a x b = M, TASP or ring -- runs unchanged across the M groups,
one independent inner CP group per head slice (CP ranks m*U + u for m < M), with its causal
balance intact. The output goes back through the reverse all-to-all; the backward mirrors it.
GQA: with fewer KV heads than U, each KV head is replicated to U / kv_heads ranks (what
DeepSpeed-Ulysses does; the bytes count the copies) and their dK/dV partials are summed at home.

On a layout balanced for these groups (:func:`~.balance.balanced_layout` with ``group`` U) the
all-to-all runs in rounds by document (:mod:`.hybrid_sets`): the tokens of
documents that cross into another group, then the documents inside the group, each rank sending
1/U of each. The own block runs in parts, the inside documents' while the crossing ones' blocks
with other groups' keys are pending, and the inside rows go home before the rest: only the
crossing tokens' share of the all-to-all stays exposed (at 256 GPUs, 1M tokens of lognormal:4096
documents, 24-58 % of a group's tokens). With ``hide`` the layout also sets apart inside
documents run first (hiding the crossing tokens' gather) and last (hiding their return).

Everything is plan ops: the all-to-all is one :class:`~.ir.Post` per direction and way (a rank
sends one head slice to each of its U - 1 group peers), marked as one all-to-all over the group
(``Post.group``: a transport with the group's process group moves it in one collective call,
not a call per tensor and peer), the token reorder is :class:`~.ir.Copy`
ops, the inner plan's ops are relabelled (keys get the span-U chunk and head slice u, peers become
CP ranks, rounds shift by one). So the executor runs it, ``comm_counter()`` counts it, the
validator checks it (exact cover per head slice) and the simulator times it.

Worked example (P = 4, U = 2, inner ring over M = 2, 4 heads): CP rank 1 is (group 0, slice 1)::

    post 1: send q1/h0->0 kv1/h0->0 | recv q0/h1<-0 kv0/h1<-0 | all-to-all 0,1   # the all-to-all
    wait 1
    copy q0/h1 -> q0*2/h1[0:2,6:8]          # rank 0's halves: the inner chunk's outer segments
    copy q1/h1 -> q0*2/h1[2:6]              # rank 1's halves: its inner segments
    ... (the same for kv)
    post 2: send kv0*2/h1->3 | recv kv1*2/h1<-3                  # the inner ring over ranks 1, 3
    attend q0*2/h1 x kv0*2/h1 causal -> o0*2/h1
    ...
    copy o0*2/h1[0:2,6:8] -> y0/h1          # rank 0's rows of my head slice, finished (input dtype)
    copy o0*2/h1[2:6] -> y1{h2:4}           # my own rows of it: straight into my chunk's output
    post 3: send y0/h1->0 | recv y1/h0<-0 | all-to-all 0,1
    wait 3
    copy y1/h0 -> y1{h0:2}                  # rank 0's slice of my rows: the output assembled

Inputs are cut per head slice (``q1/h0`` = heads 0-1 of rank 1's q). The forward keeps the
inner Q, K/V and output (the all-to-all'd tokens) for the backward, as Ulysses does, so the
backward all-to-all moves dout alone and the lse / delta of each row are computed where the
output is (:class:`~.ir.RowStats`); the inner plan keeps or re-fetches its own chunks as it would
alone. What travels home is finished (``y``, ``gq``, ``gkv``: the input dtype, Ulysses' bytes),
except dK/dV of a KV head replicated to several ranks, a partial sum (fp32).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from .balance import SETS
from .hybrid_sets import SET_ROUNDS, SetLowering, SetRows
from .ir import KINDS, AddGrad, Attend, Copy, Free, Key, Op, Plan, Post, RankPlan, RowStats, Transfer, Wait
from .ir.facts import Contiguous, Facts, register_facts
from .layout import Layout, SpanLayout, check_ulysses_heads, head_slice
from .mask import Mask
from .passes import insert_frees
from .sel import Segment, first_at
from .shape import AttentionShape
from .units import count

__all__ = ["build_hybrid_plan", "inner_shape", "hybrid_rings", "UlyssesFacts"]

# the finished kinds a rank's own rows go home as: their head slice is copied straight into the
# chunk's buffer; "dkv" (a replicated KV head's partial) is summed there instead
_STRAIGHT = ("y", "gq", "gkv")


def _span_segments(layout, rank: int, U: int, outer=None) -> tuple[Segment, ...]:
    """Token ranges of span-U chunk rank // U that rank ``rank``'s tokens occupy, in its local
    order (every run of the rank lies inside one run of the span chunk). ``outer``: the span
    chunk's runs by global start (:func:`_by_start`), when the caller keeps them for its U ranks."""
    outer, starts = _by_start(layout, rank // U, U) if outer is None else outer
    out: list[Segment] = []
    at = 0  # the span chunk's run the last one lay in: a rank's runs mostly follow each other
    for _, start, n in layout.runs(rank):
        while n:  # a run may continue in the next run of the span chunk (the balanced layout's sets)
            if not outer[at][1] <= start < outer[at][1] + outer[at][2]:
                at = first_at(starts, start)
            local, s0, sn = outer[at]
            if not s0 <= start < s0 + sn:
                raise ValueError(f"rank {rank}'s tokens {start}..{start + n} are not in its Ulysses group's chunk")
            take = min(n, s0 + sn - start)
            a = local + start - s0
            if out and out[-1].stop == a:
                out[-1] = Segment(out[-1].start, a + take)
            else:
                out.append(Segment(a, a + take))
            start, n = start + take, n - take
    return tuple(out)


def _by_start(layout, chunk: int, U: int) -> tuple[list, list[int]]:
    """Span-U chunk ``chunk``'s runs by global start, and their starts: a bisection finds a run's
    home (THD has thousands of runs)."""
    outer = sorted(layout.runs(chunk, U), key=lambda r: r[1])
    return outer, [s0 for _, s0, _ in outer]


def inner_shape(shape: AttentionShape, ulysses: int) -> AttentionShape:
    """The per-rank shape the inner plan sees: U times the tokens, one head slice."""
    check_ulysses_heads(ulysses, shape.heads, shape.kv_heads)
    kv = shape.kv_heads // ulysses if shape.kv_heads >= ulysses else 1
    return replace(shape, seq_local=shape.seq_local * ulysses, heads=shape.heads // ulysses, kv_heads=kv)


def hybrid_rings(world_size: int, ulysses: int, inner_rings: dict) -> dict[str, tuple[tuple[int, ...], ...]]:
    """The rings of a hybrid over CP ranks: the all-to-all groups ("a2a": U consecutive ranks) and,
    per head slice u, the inner rings over inner ranks m mapped to CP ranks m * U + u."""
    U = ulysses
    out = {"a2a": tuple(tuple(range(m * U, (m + 1) * U)) for m in range(world_size // U))}
    for fam, rs in inner_rings.items():
        out[fam] = tuple(tuple(r * U + u for r in ring) for u in range(U) for ring in rs)
    return out


def build_hybrid_plan(mode: str, world_size: int, ulysses: int, build_inner: Callable[..., Plan],
                      shape: AttentionShape, mask: Mask, layout: Layout) -> Plan:
    """The hybrid plan (mode name ``mode``): ``build_inner(inner_shape, mask, inner_layout) -> Plan``
    makes the inner plan over M = world_size / ulysses ranks; ``mask`` / ``layout`` are normalised."""
    U, P = ulysses, world_size
    if not isinstance(U, int) or isinstance(U, bool) or U < 1 or P % U:
        raise ValueError(f"ulysses size {U!r} must be a positive divisor of the CP size {P}")
    sub = inner_shape(shape, U)
    inner = build_inner(sub, mask, SpanLayout(layout, U))
    lowering = _HybridLowering(P, U, shape, inner, layout)
    heads = f"{shape.heads // U} query / {count(sub.kv_heads, 'key-value head')} per rank"
    notes = (f"all-to-all over {count(U, 'consecutive rank')} ({heads}"
             f"{'' if shape.kv_heads >= U else f', each KV head replicated to {U // shape.kv_heads} ranks'}), "
             f"then {inner.mode} over {count(P // U, 'rank')}", *inner.notes)
    return Plan(mode=mode, world_size=P, seq_local=shape.seq_local, mask=inner.mask, layout=layout,
                build_rank=lowering.rank_plan, build_rounds=lowering.round_ops, slots=lowering.segments,
                facts=UlyssesFacts(U, (shape.heads, shape.kv_heads), inner), backward_chunks=inner.backward_chunks,
                kernel_calls=inner.kernel_calls, rings=hybrid_rings(P, U, inner.rings), notes=notes)


@register_facts
@dataclass(frozen=True)
class UlyssesFacts(Facts):
    """A Ulysses hybrid's facts: its all-to-all degree ``ulysses`` (the head slices keys may name),
    the (query, key/value) ``heads`` the slices were cut from, and its ``inner`` plan over
    world_size / ulysses ranks (whose traffic the simulator prices). How its blocks are placed and
    its rounds ordered are the inner plan's facts; its last round is its own (the return
    all-to-all's, after the inner plan's), so it states none."""

    holds_inner = True
    ulysses: int = field()  # field(): required (without it a Facts default would be taken)
    heads: tuple[int, int] | None = field()
    inner: Plan = field(repr=False)

    @property
    def tile(self) -> tuple[int, int] | None:
        return self.inner.facts.tile

    @property
    def contiguous(self) -> Contiguous | None:
        return self.inner.facts.contiguous

    @property
    def assignment(self) -> str:
        return self.inner.facts.assignment

    @property
    def own_first(self) -> tuple:
        """The inner plan's choices (its ranks: inner rank m runs on ranks m U ... m U + U - 1)."""
        return self.inner.facts.own_first

    @property
    def direct(self) -> bool:
        return self.inner.facts.direct

    @property
    def tile_placed(self) -> tuple[int, int] | None:
        return self.inner.facts.tile_placed

    def header(self) -> dict[str, str]:
        inner = self.inner.facts.header()
        inner.pop("last_round", None)
        inner.pop("ranks_per_node", None)
        heads = "-" if self.heads is None else f"{self.heads[0]}/{self.heads[1]}"
        return {**inner, "ulysses": str(self.ulysses), "heads": heads}

    @classmethod
    def from_header(cls, head: dict[str, str], inner: Plan) -> "UlyssesFacts":
        heads = None if head["heads"] == "-" else tuple(int(x) for x in head["heads"].split("/"))
        return cls(int(head["ulysses"]), heads, inner)  # type: ignore[arg-type]


class _HeadSlices:
    """The inner plan's ops and keys relabelled to head slice u of a Ulysses group (cached: a P=256
    plan relabels ~10^6 of them); the inner rounds come ``shift`` rounds after the all-to-all's."""

    def __init__(self, U: int, inner: Plan, shift: int):
        self.U, self.inner, self.shift = U, inner, shift
        self._keys: list[dict] = [{} for _ in range(U)]  # inner key -> its head-slice-u key
        self._transfers: list[dict] = [{} for _ in range(U)]

    def key(self, key: Key, u: int) -> Key:
        cache = self._keys[u]
        k = cache.get(key)
        if k is None:
            k = cache[key] = Key(key.kind, key.chunk, key.slot, key.incoming, u, self.U)
        return k

    def transfer(self, t: Transfer, u: int) -> Transfer:
        cache = self._transfers[u]
        x = cache.get(t)
        if x is None:
            x = cache[t] = Transfer(t.peer * self.U + u, self.key(t.key, u))
        return x

    def ops(self, m: int, u: int, direction: str, blocks: bool) -> list[Op]:
        """The inner plan's ops of inner rank m, relabelled to head slice u; its rounds follow the
        all-to-all's (``shift``: one round, or :data:`~.hybrid_sets.SET_ROUNDS` by document)."""
        shift = self.shift
        src = self.inner.rank(m).ops(direction) if blocks else self.inner.round_ops(m, direction)
        out = []
        for op in src:
            t = type(op)
            if t is Free:  # the combined list gets its own Frees
                continue
            if t is Post:
                out.append(Post(op.round + shift, tuple(self.transfer(x, u) for x in op.sends),
                                tuple(self.transfer(x, u) for x in op.recvs), tuple(r * self.U + u for r in op.group)))
            elif t is Wait:
                out.append(Wait(op.round + shift))
            else:
                fields = {}
                for name, v in zip(op._fields, op):
                    if isinstance(v, Key):
                        fields[name] = self.key(v, u)
                    elif isinstance(v, tuple) and v and isinstance(v[0], Key):
                        fields[name] = tuple(self.key(k, u) for k in v)
                out.append(op._replace(**fields))
        return out


class _HybridLowering:
    def __init__(self, P: int, U: int, shape: AttentionShape, inner: Plan, layout):
        self.P, self.U, self.shape, self.inner = P, U, shape, inner
        self.T = shape.seq_local
        self.grad_kv = "dkv" if shape.kv_heads < U else "gkv"  # replicated KV heads: partial sums (fp32)
        # where rank m*U + p's tokens sit in span chunk m (its runs, in local order): for the zigzag
        # its two halves, for the THD layout its two halves of every sequence
        self.span_segments = [_span_segments(layout, m * U + p, U, outer) for m in range(P // U)
                              for outer in (_by_start(layout, m, U),) for p in range(U)]
        # the inner plan's last round: the return all-to-all comes after it
        self.last_round = {d: inner.max_round(d) for d in ("forward", "backward")}
        self._early: dict[int, bool] = {}  # inner rank -> dQ goes home before dK/dV
        self._empty: dict[int, bool] = {}  # inner rank -> it computes nothing (THD padding alone)
        # the all-to-all in rounds by document (a layout balanced for this group: :mod:`.hybrid_sets`)
        self.sets = U > 1 and layout.group == U
        self.set_rows = SetRows(layout, U, self.span_segments)
        self.head_slices = _HeadSlices(U, inner, SET_ROUNDS if self.sets else 1)

    def segments(self, key: Key):
        if key.span == self.U:
            return self.inner.segments(key._replace(heads=-1, span=1))
        if self.sets and key.span == 1 and 0 <= key.slot < len(SETS):  # a rank's rows of one all-to-all round
            return self.set_rows.member_sets(key.chunk)[key.slot][0]
        raise KeyError(f"hybrid plan has no slot {key}")

    def heads(self, side: str, p: int) -> tuple[int, int]:
        return head_slice(side, p, self.U, self.shape.heads, self.shape.kv_heads)

    def lower(self, g: int, direction: str, blocks: bool = True) -> list[Op]:
        if self.sets:
            ops = SetLowering(self, g, direction).ops()
            return ops if blocks else [op for op in ops if type(op) in (Post, Wait)]
        U, backward = self.U, direction == "backward"
        m, u = divmod(g, U)
        group = [m * U + p for p in range(U)]
        peers = [x for x in group if x != g]
        in_kinds = ("dy",) if backward else ("q", "kv")
        ops: list[Op] = []
        if peers:  # the all-to-all: my chunk's head slice p to rank p, their chunks' slice u to me
            ops.append(Post(1, tuple(Transfer(x, Key(k, g, heads=x - m * U)) for x in peers for k in in_kinds),
                            tuple(Transfer(x, Key(k, x, heads=u)) for x in peers for k in in_kinds), tuple(group)))
            ops.append(Wait(1))
        if blocks:
            for k in in_kinds:
                for p, x in enumerate(group):
                    src, dst = Key(k, x, heads=u), Key(k, m, heads=u, span=U)
                    if src != dst:  # U = 1: the group's buffer is the rank's own chunk, nothing to assemble
                        ops.append(Copy(src, dst, into=self.span_segments[x]))
            if backward and not self._no_blocks(m):  # the row statistics come from the output this rank kept
                ops.append(RowStats(Key("dy", m, heads=u, span=U), Key("o", m, heads=u, span=U),
                                    Key("do", m, heads=u, span=U)))
            # the inner plan's own input cuts (slots of its chunk) come from the assembled buffers
            rp = self.inner.rank(m)
            for key, segs in (rp.backward_inputs if backward else rp.forward_inputs).items():
                if key.slot >= 0:
                    ops.append(Copy(self.head_slices.key(key._replace(slot=-1), u), self.head_slices.key(key, u), rows=segs))
        inner = self.head_slices.ops(m, u, direction, blocks)
        # finished results go home in the input dtype, as Ulysses sends them; dK/dV of a KV head
        # replicated to several ranks is still a partial sum there: it travels in fp32
        outs = (("dq", "gq"), ("dkv", self.grad_kv)) if backward else (("o", "y"),)
        last = self.last_round[direction] + 2
        # the return all-to-all: one round, or dQ's and then dK/dV's
        if self._no_blocks(m):
            # the group holds only padding (THD): no output or gradient was made, every member's
            # are zeros -- what the executor's final buffers start as -- and nothing goes home
            return ops + inner
        if peers and backward and self._dq_home_early(m):
            # dQ is final once the inner plan's last call ran (no dQ partials come back): it goes
            # home while the dK/dV partials still return, the inner plan's last round
            returning = {op.round for op in inner if type(op) is Post and any(
                t.key.kind in ("o", "dq", "dkv") for t in op.sends + op.recvs)}
            at = next((i for i, op in enumerate(inner) if type(op) is Wait and op.round in returning), len(inner))
            ops.extend(inner[:at])
            ops.extend(self._home(g, group, outs[:1], last, blocks))
            ops.extend(inner[at:])
            ops.extend(self._home(g, group, outs[1:], last + 1, blocks))
            waits = [Wait(last), Wait(last + 1)]
        else:
            ops.extend(inner)
            home = self._home(g, group, outs, last, blocks)
            ops.extend(home if peers else home[:-1])  # alone in its group: nothing to send
            waits = [Wait(last)] if peers else []
        ops.extend(waits)
        if blocks:
            ops.extend(self._assemble(g, outs, [(-1, None)]))
        return ops

    def _home(self, g: int, group: list[int], outs, round_: int, blocks: bool, slot: int = -1) -> list[Op]:
        """The copies of ``outs`` ((accumulator, finished kind) pairs) into each group member's
        buffer, then the round that sends them home (the last op). ``slot`` j >= 0: only the rows
        of all-to-all round j (:meth:`member_sets`; a member with none gets nothing). My own rows
        of a finished kind go straight into my chunk's head slice (one copy instead of two); a
        replicated KV head's dK/dV partial is summed in :meth:`_assemble`."""
        U, (m, u) = self.U, divmod(g, self.U)
        rows = {x: self.span_segments[x] if slot < 0 else self.set_rows.member_sets(x)[slot][1] for x in group}
        ops: list[Op] = []
        if blocks:
            for acc, k in outs:
                for x in group:
                    if not rows[x]:
                        continue
                    if x == g and k in _STRAIGHT:  # my own rows of my head slice: straight into my chunk's buffer
                        into = None if slot < 0 else self.set_rows.member_sets(g)[slot][0]
                        ops.append(Copy(Key(acc, m, heads=u, span=U), Key(k, g), rows=rows[g], into=into,
                                        heads=self.heads(KINDS[k].side, u)))
                    else:
                        ops.append(Copy(Key(acc, m, heads=u, span=U), Key(k, x, slot=slot, heads=u), rows=rows[x]))
        peers = [x for x in group if x != g]
        ops.append(Post(round_, tuple(Transfer(x, Key(k, x, slot=slot, heads=u)) for x in peers for _, k in outs
                                      if rows[x]),
                        tuple(Transfer(x, Key(k, g, slot=slot, heads=x - m * U)) for x in peers for _, k in outs
                              if rows[g]), tuple(group)))
        return ops

    def _assemble(self, g: int, outs, parts) -> list[Op]:
        """My chunk's head slices of ``outs``, come home, into its buffers (dK/dV of a replicated KV
        head: summed); ``parts``: (slot, my local rows) of each round they came in (-1, None: one)."""
        ops: list[Op] = []
        own = g % self.U
        for _, k in outs:
            side = KINDS[k].side
            # round by round, head slice after head slice: a round's slices lie side by side in
            # the arena and go into consecutive heads (one copy: :class:`~.arena_runs.CopyRun`)
            for slot, into in parts:
                for p in range(self.U):
                    if p == own and k in _STRAIGHT:  # copied in straight from the span buffer (_home)
                        continue
                    src, heads = Key(k, g, slot=slot, heads=p), self.heads(side, p)
                    ops.append(AddGrad(src, Key(k, g), into=into, heads=heads) if k == "dkv" else
                               Copy(src, Key(k, g), into=into, heads=heads))
        return ops

    def _no_blocks(self, m: int) -> bool:
        """Whether inner rank m computes nothing (its tokens are THD padding, which no query and
        no key of a document reaches): its group then has no output or gradients to send home.
        Worked example: 6 ranks, U = 3, one 3-token document in 12 tokens -- group 1 (ranks 3-5)
        holds only padding."""
        got = self._empty.get(m)
        if got is None:
            got = self._empty[m] = not any(type(op) is Attend for op in self.inner.rank(m).ops("forward"))
        return got

    def _dq_home_early(self, m: int) -> bool:
        """Whether inner rank m's dQ is final before its last round completes: a mask-aware inner
        plan (its last round returns partials and only merges follow it) whose rank receives no
        dQ partials (a query owner's)."""
        got = self._early.get(m)
        if got is None:
            inner = self.inner
            got = self._early[m] = bool(inner.facts.direct and inner.facts.last_round is not None) and not any(
                t.key.kind == "dq" for op in inner.round_ops(m, "backward") if type(op) is Post for t in op.recvs)
        return got

    def round_ops(self, g: int, direction: str) -> tuple[Op, ...]:
        return tuple(op for op in self.lower(g, direction, blocks=False) if type(op) in (Post, Wait))

    def rank_plan(self, g: int) -> RankPlan:
        U = self.U
        m, u = divmod(g, U)
        whole = (Segment(0, self.T),)
        inner = self.inner.rank(m)
        # the inner tokens and output (none where the group computes nothing)
        kept = {Key(k, m, heads=u, span=U) for k in ("q", "kv") + (() if self._no_blocks(m) else ("o",))}
        saved = tuple(sorted(kept | {self.head_slices.key(k, u) for k in inner.saved}))
        output, grad_q, grad_kv = Key("y", g), Key("gq", g), Key(self.grad_kv, g)
        forward = insert_frees(self.lower(g, "forward"), keep={output, *saved})
        backward = insert_frees(self.lower(g, "backward"), keep={grad_q, grad_kv})
        if self.sets:  # my rows of each all-to-all round, per head slice
            cuts = [(j, rows) for j, (rows, _) in enumerate(self.set_rows.member_sets(g)) if rows]
            fwd_in = {Key(k, g, slot=j, heads=p): rows for k in ("q", "kv") for p in range(U) for j, rows in cuts}
            bwd_in = {Key("dy", g, slot=j, heads=p): rows for p in range(U) for j, rows in cuts}
        else:
            fwd_in = {Key(k, g, heads=p): whole for k in ("q", "kv") for p in range(U)}
            bwd_in = {Key("dy", g, heads=p): whole for p in range(U)}
        return RankPlan(rank=g, seq_local=self.T, forward=forward, backward=backward, forward_inputs=fwd_in,
                        backward_inputs=bwd_in, output=output, grad_q=grad_q, grad_kv=grad_kv, saved=saved)

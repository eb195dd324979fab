"""TASP plans: ring attention whose KV rotation is split over arc-disjoint Hamiltonian rings.

Ring attention moves a rank's whole KV chunk one hop per step over one link. TASP cuts each KV
chunk into k *slots* (one per ring) and moves slot s around ring s; the rings are arc-disjoint
(:mod:`.hamiltonian`), so a step uses k links per rank at once, each carrying 1/k of a chunk. The
bytes are those of ring attention; what shrinks is the load of the busiest link in a step.

Rings:

* one node (``ranks_per_node`` None, or the whole group): the n - 1 cycles of a Hamiltonian
  decomposition of K*_P -- every rank sends one slot to every other rank per step. P = 4 and 6
  have none; there the plan uses P - 2 arc-disjoint cycles and says so in ``Plan.notes``.
* u >= 2 nodes of m GPUs: m rings, each an intra-node Hamiltonian path chained over the nodes --
  every rank sends m - 1 slots inside its node and exactly one to the next node per step.

Slots and the causal mask. Rank g holds Megatron's zigzag chunk g (two halves). Slot s of a chunk
is sub-chunk s of the front half followed by sub-chunk s of the back half
(:func:`.layout.slot_segments`), so a slot keeps the two-halves shape and the zigzag balance
holds for it unchanged (:func:`.mask.classify_block` on the slot's positions): a slot from a
lower rank o < g is attended by all of q with its front half; one from a higher rank by the back
half of q with all of it. Every slot block is half a full slot block, so every rank does the
same work in every step.

Steps (P steps; k rings; origin of the slot on ring s at step t = the rank t hops behind on ring s)::

    step 0       attend q_g x kv_g (the causal diagonal block), while round 1 brings step 1's slots
    step t >= 1  post round t+1 (forward each held slot to its ring successor, receive the next),
                 attend the k slots of step t in at most two calls (one per mask), wait round t+1

Backward: the KV slots travel again the same way; each slot's dK/dV accumulator follows its slot
one step behind (the partial computed at step t leaves in the round posted at step t+1, and the
next holder adds its own partial to it), and after P - 1 hops it is home: the owner scatters it
into its whole-chunk dK/dV (``AddGrad(..., into=slot segments)``). dQ stays local.

Worked example (P = 3, causal, one node): K*_3 decomposes into rings 0: (0 1 2) and 1: (0 2 1).
Each chunk (halves of 2 tokens) is cut into 2 slots: slot 0 = tokens [0, 2], slot 1 = [1, 3] of
the chunk. Rank 1's forward::

    post 1: send kv1.0->2 kv1.1->0 | recv kv0.0<-0 kv2.1<-2
    attend q1 x kv1 causal -> o1            # step 0: the diagonal block
    wait 1
    post 2: send kv0.0->2 kv2.1->0 | recv kv2.0<-0 kv0.1<-2
    attend q1 x kv0.0[0:1] full -> o1       # step 1: slot 0 of chunk 0 (a lower rank): its front half
    attend q1[2:4] x kv2.1 full -> o1       #         slot 1 of chunk 2 (a higher rank): back half of q
    wait 2
    attend q1 x kv0.1[0:1] full -> o1       # step 2
    attend q1[2:4] x kv2.0 full -> o1

Per step, rank 1 sends half a chunk to rank 2 and half to rank 0 (ring attention: a whole chunk
to rank 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .accounting import round_link_bytes
from .blocks import block_ops
from .hamiltonian import (NO_DECOMPOSITION, chained_rings, hamiltonian_decomposition,
                          max_disjoint_hamiltonian_cycles)
from .ir import AddGrad, Attend, AttendBackward, Key, Op, Plan, Post, RankPlan, Transfer, Wait
from .ir.facts import Facts, optional_int, optional_text, register_facts
from .layout import ZigzagLayout, slot_segments
from .mask import BlockKind, Mask, classify_block
from .passes import insert_frees
from .sel import Segment, map_runs
from .shape import AttentionShape
from .units import count

__all__ = ["tasp_rings", "build_tasp_plan", "LinkLoad", "link_load", "TaspFacts"]


def tasp_rings(world_size: int, ranks_per_node: int | None = None) -> tuple[list[list[int]], tuple[str, ...]]:
    """The rings of a TASP plan over ``world_size`` ranks and notes that describe them."""
    P = world_size
    if not isinstance(P, int) or P < 1:
        raise ValueError(f"world_size must be a positive integer, got {P!r}")
    if ranks_per_node is not None:
        if not isinstance(ranks_per_node, int) or ranks_per_node < 1 or P % ranks_per_node:
            raise ValueError(f"CP ranks per node (gpus_per_node) must be a positive divisor of the CP size {P}, got "
                             f"{ranks_per_node!r}")
        nodes = P // ranks_per_node
        if nodes >= 2:
            rings = chained_rings(ranks_per_node, nodes)
            if ranks_per_node == 1:  # one rank per node: a single ring, nothing stays inside a node
                return rings, (f"one ring over {nodes} nodes of 1 GPU: each rank sends 1 slot to the next node "
                               "per step",)
            return rings, (f"{ranks_per_node} rings chained over {nodes} nodes of {ranks_per_node} GPUs: each rank "
                           f"sends {count(ranks_per_node - 1, 'slot')} inside its node and 1 to the next node per "
                           "step",)
    if P in NO_DECOMPOSITION:
        rings = max_disjoint_hamiltonian_cycles(P)
        return rings, (f"CP size {P} has no Hamiltonian decomposition of its {P * (P - 1)} links (Tillson: none "
                       f"for 4 and 6), so TASP uses {len(rings)} arc-disjoint Hamiltonian rings: each step uses "
                       f"{len(rings)} of the {P - 1} links out of every rank ({len(rings)} slots per chunk)",)
    rings = hamiltonian_decomposition(P)
    if P <= 1:
        return rings, ("one rank: only the local block, no rings",)
    return rings, (f"all {P * (P - 1)} links split into {len(rings)} Hamiltonian ring{'s' * (len(rings) > 1)}: "
                   f"every rank sends one slot to each other rank per step",)


def build_tasp_plan(world_size: int, shape: AttentionShape, causal: bool = True,
                    ranks_per_node: int | None = None) -> Plan:
    """The dense TASP plan of every rank (causal or full attention on Megatron's zigzag; see the
    module docstring). Masks and other layouts: ``resolve("tasp", ...).build``.

    ``ranks_per_node``: None for one flat decomposition over the CP group; otherwise the number of
    consecutive CP ranks per node (a divisor of the CP size), which chains intra-node Hamiltonian
    paths over the nodes so that each rank has one inter-node send and receive per step.
    """
    rings, notes = tasp_rings(world_size, ranks_per_node)
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    if shape.seq_local % 2:
        raise ValueError(f"local sequence length {shape.seq_local} must be even (two zigzag halves)")
    if shape.seq_local // 2 < len(rings):
        raise ValueError(
            f"TASP over CP size {world_size} splits each KV chunk into {len(rings)} slots (one per ring), "
            f"so each zigzag half needs at least {len(rings)} tokens: local sequence length "
            f"{shape.seq_local} is too short (need >= {2 * len(rings)})")
    return _build(world_size, tuple(tuple(r) for r in rings), notes, shape.seq_local, Mask(causal), ranks_per_node)


@lru_cache(maxsize=32)  # as mesh._build_mesh_plan: a cached plan keeps the rank plans built from it
def _build(P: int, rings: tuple[tuple[int, ...], ...], notes: tuple[str, ...], T: int, mask: Mask,
           ranks_per_node: int | None) -> Plan:
    segments = [_merge(s) for s in slot_segments(T, len(rings))] if rings else []
    layout = ZigzagLayout(P, P * T)
    lowering = _TaspLowering(P, rings, T, mask, layout, segments)
    return Plan(mode="tasp", world_size=P, seq_local=T, mask=mask, layout=layout, build_rank=lowering.rank_plan,
                build_rounds=lowering.round_ops, slots=lambda key: segments[key.slot],
                facts=TaspFacts(ranks_per_node), rings={"kv": rings}, notes=notes)


@register_facts
@dataclass(frozen=True)
class TaspFacts(Facts):
    """A dense TASP plan's facts: its rounds are the steps of its Hamiltonian rings (schedule
    "rings"), each block computed by its query chunk's owner as the KV chunks travel the rings
    (assignment "rings"), built for ``ranks_per_node`` consecutive CP ranks per node (None: one node)."""

    schedules = ("rings",)
    assignment = "rings"
    ranks_per_node: int | None = None

    def header(self) -> dict[str, str]:
        return {"schedule": "rings", "assignment": self.assignment,
                "ranks_per_node": optional_text(self.ranks_per_node)}

    @classmethod
    def from_header(cls, head: dict[str, str], inner) -> "TaspFacts":
        return cls(optional_int(head["ranks_per_node"]))


def _merge(segs) -> tuple[Segment, ...]:
    """Join touching segments: with one slot the slot is the whole chunk, a view instead of a copy."""
    out: list[Segment] = []
    for s in segs:
        if out and out[-1].stop == s.start:
            out[-1] = Segment(out[-1].start, s.stop)
        else:
            out.append(Segment(*s))
    return tuple(out)


class _TaspLowering:
    """Per-rank op lists; every rank runs the same step loop with its own ring neighbours."""

    def __init__(self, P: int, rings, T: int, mask: Mask, layout, segments):
        self.P, self.rings, self.T, self.mask, self.layout, self.segments = P, rings, T, mask, layout, segments
        self.pos = [{r: i for i, r in enumerate(ring)} for ring in rings]
        self.classes: dict = {}

    def _block(self, g: int, o: int, s: int):
        """(kernel mask, rows, cols) of q chunk g x slot s of kv chunk o (None rows/cols: all)."""
        ck = (g, o, s)
        c = self.classes.get(ck, 0)
        if c == 0:
            runs = lambda chunk: tuple((a, n) for _, a, n in self.layout.runs(chunk))  # noqa: E731
            c = classify_block(self.mask, runs(g), (map_runs(self.layout.runs(o), self.segments[s]),))
            if c is not None:
                slot_len = sum(x.stop - x.start for x in self.segments[s])
                c = (c.kind, None if c.rows == (Segment(0, self.T),) else c.rows,
                     None if c.cols[0] == (Segment(0, slot_len),) else c.cols[0])
            self.classes[ck] = c
        return c

    def _origin(self, s: int, g: int, t: int) -> int:
        """The chunk whose slot s rank g holds at step t: its owner is t hops behind on ring s."""
        ring = self.rings[s]
        return ring[(self.pos[s][g] - t) % self.P]

    def _next(self, s: int, g: int) -> int:
        return self._origin(s, g, -1)

    def _prev(self, s: int, g: int) -> int:
        return self._origin(s, g, 1)

    def rank_plan(self, g: int) -> RankPlan:
        whole = (Segment(0, self.T),)
        slots = {Key("kv", g, s): segs for s, segs in enumerate(self.segments)}
        q, kv, do = Key("q", g), Key("kv", g), Key("do", g)
        output, grad_q, grad_kv = Key("o", g), Key("dq", g), Key("dkv", g)
        return RankPlan(
            rank=g, seq_local=self.T,
            forward=insert_frees(self.lower(g, "forward"), keep={output}),
            backward=insert_frees(self.lower(g, "backward"), keep={grad_q, grad_kv}),
            forward_inputs={q: whole, kv: whole, **slots},
            backward_inputs={q: whole, kv: whole, do: whole, **slots},
            output=output, grad_q=grad_q, grad_kv=grad_kv)

    def round_ops(self, g: int, direction: str) -> tuple[Op, ...]:
        return tuple(op for op in self.lower(g, direction, blocks=False) if isinstance(op, (Post, Wait)))

    def _kv_transfers(self, g: int, t: int) -> tuple[list[Transfer], list[Transfer]]:
        """Round bringing step t's slots: forward each slot of step t-1, receive those of step t."""
        k = len(self.rings)
        sends = [Transfer(self._next(s, g), Key("kv", self._origin(s, g, t - 1), s)) for s in range(k)]
        recvs = [Transfer(self._prev(s, g), Key("kv", self._origin(s, g, t), s)) for s in range(k)]
        return sends, recvs

    def _dkv_transfers(self, g: int, t: int) -> tuple[list[Transfer], list[Transfer]]:
        """Round after step t: my dK/dV accumulators of step t's slots leave, the previous holder's
        accumulators of step t+1's slots arrive (at t = P-1: my own slots' totals come home)."""
        k = len(self.rings)
        sends = [Transfer(self._next(s, g), Key("dkv", self._origin(s, g, t), s)) for s in range(k)]
        recvs = [Transfer(self._prev(s, g), Key("dkv", self._origin(s, g, t + 1), s, incoming=True))
                 for s in range(k)]
        return sends, recvs

    def _blocks(self, g: int, t: int, backward: bool) -> list[Op]:
        """Step t >= 1: one call per mask over the slots held (slot order within a call)."""
        groups: dict = {}
        for s in range(len(self.rings)):
            o = self._origin(s, g, t)
            c = self._block(g, o, s)
            if c is not None:
                groups.setdefault((c[0], c[1]), []).append((Key("kv", o, s), *c))
        ops: list[Op] = []
        # slots from lower ranks (all query rows) first, then those from higher ranks (the back half)
        for _, items in sorted(groups.items(), key=lambda item: item[0][1] is not None):
            ops.extend(block_ops(Key("q", g), items, backward))
        return ops

    def lower(self, g: int, direction: str, blocks: bool = True) -> list[Op]:
        backward = direction == "backward"
        P, k = self.P, len(self.rings)
        ops: list[Op] = []
        rounds = [0]

        def post(sends: list[Transfer], recvs: list[Transfer]) -> int | None:
            if not sends and not recvs:
                return None
            rounds[0] += 1
            ops.append(Post(rounds[0], tuple(sends), tuple(recvs)))
            return rounds[0]

        r = post(*self._kv_transfers(g, 1)) if P > 1 else None
        if blocks:
            kind = BlockKind.CAUSAL if self.mask.causal else BlockKind.FULL
            q, kv = Key("q", g), (Key("kv", g),)
            ops.append(AttendBackward(q, Key("do", g), kv, Key("dq", g), (Key("dkv", g),), mask=kind)
                       if backward else Attend(q, kv, Key("o", g), mask=kind))
        if r is not None:
            ops.append(Wait(r))
        for t in range(1, P):
            sends, recvs = self._kv_transfers(g, t + 1) if t + 1 < P else ([], [])
            if backward and t >= 2:  # step t-1's accumulators leave; step t's arrive
                ds, dr = self._dkv_transfers(g, t - 1)
                sends, recvs = sends + ds, recvs + dr
            r = post(sends, recvs)
            if blocks:
                ops.extend(self._blocks(g, t, backward))
            if r is not None:
                ops.append(Wait(r))
            if backward and t >= 2 and blocks:
                ops.extend(AddGrad(Key("dkv", self._origin(s, g, t), s, incoming=True),
                                   Key("dkv", self._origin(s, g, t), s)) for s in range(k))
        if backward and P > 1:  # the last holders send the totals home
            ops.append(Wait(post(*self._dkv_transfers(g, P - 1))))
            if blocks:
                ops.extend(AddGrad(Key("dkv", g, s, incoming=True), Key("dkv", g), into=self.segments[s])
                           for s in range(k))
        return ops


# -- link load ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LinkLoad:
    """The busiest link of a plan, per round (bytes; forward or backward).

    ``max_link``: most bytes on one directed link in a round, over all rounds.
    ``max_inter_node``: most bytes one rank sends to other nodes in a round (0 without nodes).
    ``inter_node_links``: most distinct inter-node links (rank pairs) one rank sends on in a round.
    """

    max_link: int
    max_inter_node: int
    inter_node_links: int
    rounds: int


def link_load(plan: Plan, shape: AttentionShape, direction: str = "forward",
              ranks_per_node: int | None = None) -> LinkLoad:
    """Per-round link load of any plan (ring, Mesh or TASP) from its byte accounting; with
    ``ranks_per_node`` ranks r and r' are on one node iff r // ranks_per_node == r' // ranks_per_node."""
    per_round = round_link_bytes(plan, shape, direction)
    max_link = max_inter = inter_links = 0
    for links in per_round.values():
        max_link = max(max_link, max(links.values(), default=0))
        if ranks_per_node:
            sent: dict[int, int] = {}
            peers: dict[int, int] = {}
            for (src, dst), b in links.items():
                if src // ranks_per_node != dst // ranks_per_node:
                    sent[src] = sent.get(src, 0) + b
                    peers[src] = peers.get(src, 0) + 1
            max_inter = max(max_inter, max(sent.values(), default=0))
            inter_links = max(inter_links, max(peers.values(), default=0))
    return LinkLoad(max_link, max_inter, inter_links, len(per_round))

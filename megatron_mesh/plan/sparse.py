"""Mask-aware plans: every mode under documents, sliding windows or the THD layout.

A dense plan (ring, Mesh, TASP over causal or full attention) forwards whole chunks around rings,
because every rank needs (part of) every chunk on its rings. A mask breaks that: with a window
shorter than a chunk, a rank needs only the halo of its two zigzag neighbours; with short
documents, only the chunks that share one of its documents. This module builds those plans
from the mask itself, for every mode:

1. **Blocks** (:mod:`.sparse_blocks`). Every (query chunk i, key/value chunk j) is classified under
   the mask (:func:`~.mask.classify_block`): empty blocks are dropped, the others trimmed to the rows
   and columns that have allowed pairs.
2. **Assignment** (which rank computes each block) -- the mode's identity: ring and TASP give
   block (i, j) to the query owner i (ship K/V, keep Q home); Mesh gives it to its tile owner, or
   -- when the mask leaves the tile nothing to gain -- to the query owner too: of the two
   assignments it takes the one whose busiest rank moves fewer bytes (so a windowed Mesh plan
   degenerates to the halo exchange, instead of shipping Q chunks and partial outputs to other
   ranks for blocks next to the diagonal).
3. **Transfers** (:mod:`.sparse_needs`, :mod:`.sparse_rounds`). Each rank receives exactly the tokens its blocks read, straight from their
   owner, once: a *slot* of chunk x for needer y holds the rows (or columns) of chunk x that y's
   blocks use. No chunk reaches a rank none of whose blocks needs it; partial outputs and
   gradients go back only for those tokens and are merged into the owner's rows (``into`` = the
   slot's segments). Rounds: ring and Mesh pull by *shift* -- in round d, rank x receives from
   x - d and sends to x + d, so every round is a permutation and blocks start as soon as their
   slots arrive; every pull is posted up front, and the partials of shift d go home in round
   P + d as soon as the blocks writing them ran -- which a rank runs before its own rows' blocks
   (its peers wait for them, :meth:`_SparseLowering._schedule`). TASP pulls over all links at once, in
   ``burst_groups`` rounds (:class:`~.tunables.Tunables`: groups of a rank's remote slots of
   about equal work), and returns each group's partials in a round of its own while the next group computes (a long
   document's blocks start before all its slots are in, and its fp32 dK/dV return hides behind
   the rank's remaining work instead of following its last block).
4. **Kernel calls** (:mod:`.sparse_calls`). The rank's own block runs as at most two masked calls over contiguous rows
   (:meth:`~.sparse_calls.Calls.own_calls`), each cut into one causal mask piece per document, which a
   variable-length kernel runs together (:func:`~.mask.call_groups`); the blocks with other
   ranks' slots that are ready in the same round are fused per query rows: one call over their
   columns in position order (runs of a document that continue each other join into long runs,
   which :func:`~.mask.mask_pieces` runs as a few full calls), and one merge instead of one per
   block. Where nothing returns the own block runs first, hiding the pulls; where the rank sends
   partials home, after the return rounds are posted (the partials travel while it computes) --
   or its first k calls (documents, in row order) first, where the plan's ``own_first`` choices
   say (:mod:`.polish` makes them by simulation for plans of a few ranks).
5. **Backward chunks.** Under ``backward_chunks="auto"`` a rank keeps what it pulled of each
   chunk for the backward, in the order its backward reads them, while it fits in the keep limit
   (2 by default) x its own Q, K and V (:class:`~.sparse_needs.Keeps`,
   :func:`~.sparse_needs.kept_chunks`): its backward pulls dO and only the chunks it did not keep;
   rounds in which a rank only sends are posted before its compute. Its blocks over kept columns
   run one shift at a time, each shift's partials going home before the next, unless it keeps all
   it pulled and that is at most its own chunk's worth: then one call per query rows
   (:meth:`~.sparse_needs.Keeps.one_call`).

Slot names: ``q{x}.{y}`` are the rows of chunk x rank y needs (also ``do``, ``o``, ``dq`` of those
rows), ``kv{x}.{P+y}`` the columns (also ``dkv``).

Worked example (P = 4, zigzag, causal, window (2, 0), S = 16: halves of 2 tokens; rank 1 holds
positions [2, 3, 12, 13]): its rows [2, 3] need keys [0, 1] of rank 0's front half, its rows
[12, 13] need keys [10, 11] of rank 2's back half. Ring attention's plan for rank 1 therefore::

    post 1: send kv1.6->2 | recv kv0.5<-0          # shift 1: rank 0's columns [0:2]; rank 2 needs ours
    post 3: send kv1.4->0 | recv kv2.5<-2          # shift 3 (= -1): rank 2's columns [2:4]
    attend q1 x kv1 masked -> o1                   # the local block (a window cuts it)
    wait 1
    attend q1[0:2] x kv0.5 masked -> o1
    wait 3
    attend q1[2:4] x kv2.5 masked -> o1

moving 2 of the 12 tokens ring attention would move. Its backward (the slots kept) returns each
dK/dV partial in its shift's return round, and its own block runs while they travel::

    attend_bwd q1[0:2] do1 x kv0.5 masked -> dq1 | dkv0.5
    attend_bwd q1[2:4] do1 x kv2.5 masked -> dq1 | dkv2.5
    post 5: send dkv0.5->0 | recv dkv1.6'<-2       # shift 1: to rank 0; rank 2's partial of mine
    post 7: send dkv2.5->2 | recv dkv1.4'<-0       # shift 3
    attend_bwd q1 do1 x kv1 masked -> dq1 | dkv1
    wait 5
    add dkv1.6' -> dkv1[0:2]
    wait 7
    add dkv1.4' -> dkv1[2:4]
"""

from __future__ import annotations

import copy
import typing
from dataclasses import dataclass, field, replace
from typing import Callable, Literal

from .ir import Key, Op, Plan, Post, RankPlan, Wait
from .ir.facts import (Contiguous, Facts, choice, optional_int, optional_text, parse_tile_text, register_facts,
                       tile_text)
from .layout import Layout
from .mask import Mask
from .own_first import check_own_first, own_first_text, parse_own_first
from .passes import insert_frees
from .sel import Segment
from .shape import AttentionShape
from .sparse_blocks import block_parts, block_table, blocks_of
from .sparse_calls import Calls
from .sparse_compete import compete
from .sparse_needs import (ASSIGNMENT_KEEP_LIMIT, KEEP_LIMIT, Keeps, Needs, QueryOwnerNeeds, Slots, check_keep_limit,
                           token_bytes)
from .sparse_rounds import Rounds
from .tunables import TUNABLES, Tunables

__all__ = ["build_sparse_plan", "reordered", "own_calls", "block_table", "block_parts", "Assignment", "QUERY_OWNER",
           "TILE_MAP", "RoundOrder", "MaskAwareFacts"]

QUERY_OWNER = "query owner"  # the assignment every mask-aware plan may take: a block computed by its query's owner
TILE_MAP = "tile"  # the name of a Mesh tile map's owner map (Assignment.owners)
# how a mask-aware plan's pulls are ordered: one round per rank distance, or groups over every link
RoundOrder = Literal["shift", "burst"]


@dataclass(frozen=True)
class Assignment:
    """How a mode places the blocks of a mask-aware plan -- its identity under a mask:

    * ``owners``: candidate maps (name, owner(q_chunk, kv_chunk) -> rank); the plan takes the one
      whose busiest rank moves the fewest bytes, the query owner (ship K/V, keep Q home) always
      among them (ring, TASP: only it; Mesh: its tile maps too, each a :class:`~.mesh.TileMap`);
    * ``rounds``: "shift" (round d: receive from rank - d, send to rank + d: every round a
      permutation, blocks start as their slots arrive) or "burst" (each group of a rank's slots
      in one round over every link at once, TASP's way: ``burst_groups``);
    * ``tile`` / ``contiguous``: the Mesh tile map the "tile" owner comes from (plan facts);
    * ``tiles``: where several tile maps compete (Mesh's ``auto`` tile under a mask), the
      (tile, contiguous) of each owner map, in the order of ``owners``: the plan's tile facts are
      the chosen map's;
    * ``compete``: False -- the one map in ``owners`` is used as it is, without the query owner
      competing (a layout that names its blocks' owners balances work with them:
      :class:`~.balance.BalancedLayout`).
    """

    owners: tuple[tuple[str, Callable[[int, int], int]], ...] = ()
    rounds: RoundOrder = "shift"
    tile: tuple[int, int] | None = None
    contiguous: Contiguous | None = None
    tiles: tuple[tuple[tuple[int, int], Contiguous], ...] = ()
    compete: bool = True

    @property
    def rings(self) -> bool:
        """Whether this assignment builds ring's mask-aware plan: no owner map but the query owner's
        competing, one round per shift (e.g. every Mesh tile on a layout whose blocks it cannot
        place: the planner need not plan those tiles again)."""
        return not self.owners and self.rounds == "shift" and self.compete

    def __post_init__(self) -> None:
        choice("rounds", self.rounds, RoundOrder)
        if not self.compete and len(self.owners) != 1:
            raise ValueError(f"compete=False uses one owner map as it is, got {len(self.owners)}")
        if self.tiles and len(self.tiles) != len(self.owners):
            raise ValueError(f"tiles must name the tile of each of the {len(self.owners)} owner maps, "
                             f"got {self.tiles!r}")


def build_sparse_plan(mode: str, P: int, shape: AttentionShape, mask: Mask, layout: Layout, assignment: Assignment,
                      *, backward_chunks: str = "refetch", ranks_per_node: int | None = None,
                      keep_limit: float = KEEP_LIMIT, tunables: Tunables = TUNABLES,
                      own_first: tuple[tuple[int, str, int], ...] = ()) -> Plan:
    """The mask-aware plan of ``mode`` (its name) placed by ``assignment`` -- see the module
    docstring. ``mask`` and ``layout`` are normalised (:func:`~.problem.normalize`); under
    ``backward_chunks="auto"`` a rank keeps what it pulled up to ``keep_limit`` x its own Q, K and V
    bytes (:class:`~.sparse_needs.Keeps`). ``own_first``: (rank, direction, k) -- that rank runs
    the first k calls of its own block (:func:`own_calls` of them, one per document in row order)
    in that direction before its other blocks and the rest after, instead of the share the
    transfers' bytes give (what :mod:`.polish` chooses by simulation)."""
    own_first = check_own_first(P, own_first)
    T = shape.seq_local
    index = blocks_of(P, mask, layout, tunables.own_call_tokens)
    if backward_chunks not in ("refetch", "keep", "auto"):
        raise ValueError(f"backward_chunks must be one of refetch, keep, auto, got {backward_chunks!r}")
    check_keep_limit("keep_limit", keep_limit)
    notes: list[str] = []
    needs: object = QueryOwnerNeeds(index)
    assigned = QUERY_OWNER
    tile, contiguous = assignment.tile, assignment.contiguous
    if not assignment.compete:  # the map is the layout's: its work balance rests on it
        assigned, owner = assignment.owners[0]
        needs = Needs(P, index.spans(), owner)
        notes.append(f"every block is computed where the {assigned} map names (the layout's balance rests on it)")
    elif assignment.owners:  # compare the mode's maps with the query owner by the busiest rank's bytes
        # each map with the ranks that would keep their slots under it ("auto" decides per map), at
        # most ASSIGNMENT_KEEP_LIMIT's worth: the bytes are blind to the work
        best, needs = compete(index, assignment.owners, shape, backward_chunks, min(keep_limit, ASSIGNMENT_KEEP_LIMIT))
        assigned = QUERY_OWNER if best == 0 else assignment.owners[best - 1][0]
        if assigned == QUERY_OWNER:
            names = ", ".join(dict.fromkeys(n for n, _ in assignment.owners))
            notes.append(f"the mask leaves the {names} assignment nothing to gain: every block is computed by its "
                         "query chunk's owner (fewer bytes on the busiest rank)")
        elif assignment.tiles:
            tile, contiguous = assignment.tiles[best - 1]
            notes.append(f"tile {tile[0]}x{tile[1]} (contiguous {contiguous}): of the {len(assignment.tiles)} tile "
                         "maps and the query owner, the fewest bytes on the busiest rank under this mask")
    burst = assignment.rounds == "burst"
    keeps = Keeps(backward_chunks, needs, T, token_bytes(shape), keep_limit)
    lowering = _SparseLowering(P, T, needs, index, keeps, burst, tunables,
                               {(x, d == "backward"): k for x, d, k in own_first})
    lowering.check_choices()
    notes.append(f"mask {mask.summary()}: each rank computes only the blocks with allowed pairs and receives only the "
                 f"tokens they read, from their owner ({'over all links at once, in groups' if burst else 'one round per shift'})")
    facts = MaskAwareFacts(assignment.rounds, assigned, tile, contiguous, lowering.rounds.final_round,
                           ranks_per_node, own_first)
    return Plan(mode=mode, world_size=P, seq_local=T, mask=mask, layout=layout, build_rank=lowering.rank_plan,
                build_rounds=lowering.round_ops, slots=lowering.slots, facts=facts, backward_chunks=backward_chunks,
                notes=tuple(notes))


def reordered(plan: Plan, own_first: tuple) -> Plan:
    """``plan`` (a mask-aware plan of :func:`build_sparse_plan`) with the ranks' ``own_first``
    choices instead of its own: its blocks, slots and rounds shared, its ranks built anew as they
    are asked for (the trials of :mod:`.polish`: a rebuild would redo the blocks and rounds)."""
    lowering = _lowering(plan)
    own_first = check_own_first(plan.world_size, own_first)
    new = copy.copy(lowering)
    new.own_first = {(x, d == "backward"): k for x, d, k in own_first}
    new.check_choices()
    return replace(plan, build_rank=new.rank_plan, build_rounds=new.round_ops,
                   facts=replace(plan.facts, own_first=own_first), _cache={})


def own_calls(plan: Plan, x: int, direction: str) -> int:
    """How many calls rank x's own block makes in ``direction`` of a mask-aware ``plan`` (one per
    document with enough rows, in row order): the choices ``own_first`` has for it are 0 ... that."""
    return _lowering(plan).own_count(x, direction == "backward")


def _lowering(plan: Plan) -> "_SparseLowering":
    lowering = getattr(plan.build_rank, "__self__", None)
    if not isinstance(lowering, _SparseLowering):
        raise ValueError(f"only a mask-aware plan (build_sparse_plan's) takes own_first choices, not a {plan.mode} "
                         f"plan with {type(plan.facts).__name__}")
    return lowering


@register_facts
@dataclass(frozen=True)
class MaskAwareFacts(Facts):
    """A mask-aware plan's facts (every mode's, under a mask or on another layout): its pulls'
    ``rounds`` order, the owner map that won (``assignment``: :data:`QUERY_OWNER`, :data:`TILE_MAP`,
    or a map a mode or layout names, e.g. "layout"), the mode's Mesh ``tile`` / ``contiguous``
    (None for modes without one), the ``last_round`` any rank posts and the ``ranks_per_node`` it
    was built for. Its transfers go straight between the ranks that need them (``direct``)."""

    schedules = typing.get_args(RoundOrder)
    direct = True
    rounds: RoundOrder = field()  # field(): required (without it a Facts default would be taken)
    assignment: str = field()
    tile: tuple[int, int] | None = None
    contiguous: Contiguous | None = None
    last_round: int | None = None
    ranks_per_node: int | None = None
    own_first: tuple = ()  # (rank, direction, k): its own block's first k calls run first (:mod:`.polish`)

    @property
    def tile_placed(self) -> tuple[int, int] | None:
        return self.tile if self.assignment == TILE_MAP else None

    def header(self) -> dict[str, str]:
        return {"tile": tile_text(self.tile), "schedule": self.rounds, "contiguous": self.contiguous or "-",
                "assignment": self.assignment.replace(" ", "_") or "-", "direct": "yes",
                "last_round": optional_text(self.last_round), "ranks_per_node": optional_text(self.ranks_per_node),
                **({"own_first": own_first_text(self.own_first)} if self.own_first else {})}

    @classmethod
    def from_header(cls, head: dict[str, str], inner) -> "MaskAwareFacts":
        contiguous = None if head["contiguous"] == "-" else choice("contiguous", head["contiguous"], Contiguous)
        return cls(choice("schedule", head["schedule"], RoundOrder),
                   "" if head["assignment"] == "-" else head["assignment"].replace("_", " "),
                   parse_tile_text(head["tile"]), contiguous, optional_int(head["last_round"]),
                   optional_int(head["ranks_per_node"]), parse_own_first(head.get("own_first", "-")))


class _SparseLowering:
    """Each rank's ops of one mask-aware plan: its pull rounds (:class:`~.sparse_rounds.Rounds`)
    posted up front, its blocks' calls (:class:`~.sparse_calls.Calls`) step by step as their slots
    arrive -- those whose partials go home first --, each return round posted once the blocks
    writing it ran (the module docstring)."""

    def __init__(self, P: int, T: int, needs, index, keeps: Keeps, burst: bool, tunables: Tunables,
                 own_first: dict | None = None):
        self.P, self.T, self.needs, self.keeps, self.burst = P, T, needs, keeps, burst
        self.own_first = own_first or {}  # (rank, backward) -> how many of its own block's calls run first
        self.slots = Slots(needs, P)
        self.rounds = Rounds(P, needs, index, keeps, burst, tunables)
        self.calls = Calls(P, T, index, self.slots)

    def own_count(self, x: int, backward: bool) -> int:
        """The calls of rank x's own block (none where it has no allowed pair)."""
        return len(self.calls.block(x, x, x, backward)) if (x, x) in self.needs.blocks(x) else 0

    def check_choices(self) -> None:
        """ValueError for a choice of more own calls than the rank's own block makes."""
        for (x, backward), k in self.own_first.items():
            n = self.own_count(x, backward)
            if k > n:
                raise ValueError(f"own_first: rank {x}'s own block makes {n} call{'s' * (n != 1)} in the "
                                 f"{'backward' if backward else 'forward'}, got {k} to run first")

    def _pulls(self, x: int, direction: str) -> dict[int, tuple[list, list]]:
        """Round -> (sends, recvs) of the pulls; in burst mode every rank posts every pull round,
        empty or not (TASP's all-to-all transport is a collective, and ranks keeping their slots
        pull nothing)."""
        pulls = self.rounds.pulls(x, direction)
        if self.burst and self.rounds.moves(direction):
            for g in range(self.rounds.groups):
                pulls.setdefault(1 + g, ([], []))
        return pulls

    def _steps(self, x: int, mine, backward: bool, grouped: bool) -> Callable[[tuple[int, int]], tuple[int, int]]:
        """A block's step: (the pull round it waits for, its return group). A block is ready once
        the rounds bringing its remote slots have completed (rows always travel: q and/or do;
        columns not in a backward that kept them from the forward)."""
        shift = self.rounds.shift
        # a rank that keeps part of its pulls, or more than its own chunk's worth, runs the blocks
        # over kept columns one shift at a time (Keeps.one_call)
        partly = backward and not self.keeps.one_call(x)

        def step(b: tuple[int, int]) -> tuple[int, int]:
            i, j = b
            r = shift(x, i, False) if i != x else 0
            kept = j != x and backward and self.keeps(x, j)
            if j != x and not kept:
                r = max(r, shift(x, j, False))
            if grouped:
                return r, self.rounds.block_group(x, b)
            # blocks over kept columns are ready at once; on a rank that pulls the rest again they
            # still run one shift at a time, in the order their columns came in, so each shift's
            # partials go home as soon as they are made (one call for all of them would hold every
            # return round back until its end, the next pulls' blocks behind it); a rank keeping
            # all, at most its own chunk's worth, runs them in one call per query rows (fewer
            # kernel calls, its returns the last)
            return r, shift(x, j, False) if kept and partly and r == 0 else 0
        return step

    def _own(self, x: int, own: list[Op], returns, backward: bool) -> tuple[list[Op], list[Op]]:
        """The own block's calls before the pulls' wait and after the returns are posted: where this
        rank has a return round, none first -- partials it sends travel while the own block
        computes (its peers wait for them at the end of their step), and a round in which it
        receives them is posted before the block, so the senders' transfers, which complete only
        once both ends posted them, need not wait for it; where no partial moves (a query owner's
        forward), all first, hiding the pulls -- unless the plan says how many calls
        (``own_first``, which :mod:`.polish` chooses by simulation for plans of a few ranks).
        Until stop 67 the pulls' share of the bytes ran first (a third in the backward);
        none is faster on the 56 rows it changed at 32 GPUs and on 207 of 225 at 256 (docs/performance.md,
        "The own block after the returns")."""
        k = self.own_first.get((x, backward))
        if k is None:
            k = 0 if any(r[0] or r[1] for r in returns.values()) else len(own)
        return self.calls.own_calls(x, own[:k], own[k:], backward)

    def lower(self, x: int, direction: str, blocks: bool = True) -> list[Op]:
        backward = direction == "backward"
        pulls = self._pulls(x, direction)
        order = sorted(pulls)
        mine = sorted(self.needs.blocks(x), key=lambda b: (b != (x, x), b))
        returns = self.rounds.returns(x, direction)
        # blocks run step by step, and a return round is posted once every block writing what it
        # sends has run (a rank that sends no partials -- the query owner's forward -- fuses the
        # calls of each pull round)
        step = self._steps(x, mine, backward, self.burst and any(r[0] for r in returns.values()))
        by_step: dict[tuple[int, int], list] = {}
        for b in mine:
            if b != (x, x):
                by_step.setdefault(step(b), []).append(b)
        own = self.calls.block(x, x, x, backward) if blocks and (x, x) in mine else []
        own, later = self._own(x, own, returns, backward)
        if self.burst and self.rounds.moves(direction):  # every rank posts every return round (a collective)
            for g in range(self.rounds.groups):
                returns.setdefault(1 + self.rounds.groups + g, ([], [], [], set()))
        # every pull up front, in round order on every rank (so no rank waits on a round its peer
        # posts later): a rank's sends go out before its compute, and the return rounds, numbered
        # after every pull, can be posted as soon as their partials are written
        ops: list[Op] = [Post(t, tuple(pulls[t][0]), tuple(pulls[t][1])) for t in order]
        ops += own
        ops += self._schedule(x, order, by_step, returns, backward, blocks)
        ops += later
        for t in sorted(returns):
            ops.append(Wait(t))
            if blocks:
                ops.extend(returns[t][2])
        return ops

    def _schedule(self, x: int, order: list[int], by_step: dict, returns: dict, backward: bool,
                  blocks: bool = True) -> list[Op]:
        """The blocks step by step, each after the waits for the pull rounds up to its own: first
        the blocks whose partials go home -- rows of another rank's queries, in the backward also
        columns of another's keys -- then the rest, each in step order: the peers wait for those
        partials, the rest only for this rank. Each return round is posted, in order, as soon as
        every block writing what it sends has run (``blocks`` False: the rounds only).

        Example (Mesh on the owners layout, 8 GPUs, seed 6 of ``lognormal:4096``): rank 5 computes
        a block of rank 7's queries (their rows pulled in round 6) and its own rows against chunks
        of rounds 1-5; in round order rank 7's forward ended waiting 0.45 ms for partials (rounds 14
        and 15), with the blocks going home first 0.15 ms: 2.35 -> 2.06 ms (docs/performance.md,
        "Partials home first")."""
        def home(b: tuple[int, int]) -> set[int]:  # the chunks whose owners block b writes partials of
            return {c for c in set(b) - {x} if c == b[0] or (backward and c == b[1])}
        left: dict[int, int] = {}  # chunk -> blocks still to run that write its partials
        for bs in by_step.values():
            for b in bs:
                for c in home(b):
                    left[c] = left.get(c, 0) + 1
        pending, waits, ops = sorted(returns), list(order), []

        def post_returns(final: bool = False) -> None:
            while pending and (final or all(not left.get(c) for c in returns[pending[0]][3])):
                t = pending.pop(0)
                ops.append(Post(t, tuple(returns[t][0]), tuple(returns[t][1])))

        def run(st: tuple[int, int], bs: list) -> None:
            while bs and waits and waits[0] <= st[0]:  # the pull rounds up to the step's, in order
                ops.append(Wait(waits.pop(0)))
            if bs and blocks:
                ops.extend(self.calls.compute(x, bs, backward))
            for b in bs:
                for c in home(b):
                    left[c] -= 1
            post_returns()

        steps = sorted(by_step)
        for st in steps:
            run(st, [b for b in by_step[st] if home(b)])
        for st in steps:
            run(st, [b for b in by_step[st] if not home(b)])
        ops.extend(Wait(t) for t in waits)
        post_returns(final=True)
        return ops

    def round_ops(self, x: int, direction: str) -> tuple[Op, ...]:
        return tuple(self.lower(x, direction, blocks=False))

    def rank_plan(self, x: int) -> RankPlan:
        P = self.P
        whole = (Segment(0, self.T),)
        q, kv, do = Key("q", x), Key("kv", x), Key("do", x)
        fwd_in = {q: whole, kv: whole}
        bwd_in = {q: whole, kv: whole, do: whole}
        for y in self.needs.row_needers(x):
            rows = self.needs.rows(y)[x]
            fwd_in[Key("q", x, y)] = rows
            bwd_in[Key("do", x, y)] = rows
            if not self.keeps(y, x):
                bwd_in[Key("q", x, y)] = rows
        for y in self.needs.col_needers(x):
            cols = self.needs.cols(y)[x]
            fwd_in[Key("kv", x, P + y)] = cols
            if not self.keeps(y, x):
                bwd_in[Key("kv", x, P + y)] = cols
        saved = tuple(Key("q", c, x) for c in sorted(self.needs.rows(x)) if self.keeps(x, c)) + \
            tuple(Key("kv", c, P + x) for c in sorted(self.needs.cols(x)) if self.keeps(x, c))
        output, grad_q, grad_kv = Key("o", x), Key("dq", x), Key("dkv", x)
        forward = insert_frees(self.lower(x, "forward"), keep={output, q, kv, *saved})
        backward = insert_frees(self.lower(x, "backward"), keep={grad_q, grad_kv})
        return RankPlan(rank=x, seq_local=self.T, forward=forward, backward=backward, forward_inputs=fwd_in,
                        backward_inputs=bwd_in, output=output, grad_q=grad_q, grad_kv=grad_kv, saved=saved)

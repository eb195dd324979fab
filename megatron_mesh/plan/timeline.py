"""The simulated ranks' timelines: a compute stream and a communication stream per rank, stepped
through the rank's op list (approximations 1 and 2 of :mod:`~.simulate`). ``Post(t)`` starts
round t once the compute issued before it has finished and the rank's previous round has
completed (NCCL runs a rank's rounds in posting order); ``Wait(t)`` stalls the compute stream until
round t has completed.

Each rank also has a **host** that issues its ops in order, each at its torch ops'
``Topology.host_op_time`` (a view's ``host_view_time``; :mod:`.hostops` counts them): an op's
device work starts once the host has issued its first torch op (and the stream is free) and ends
no sooner than its last is issued; a round starts no sooner than its ``Post`` is issued. The host
never waits for the device (NCCL's waits are the stream's), so where it is slower the device
idles -- a timeline's "host" events -- and the direction ends no sooner than the host's last work.

An all-to-all round (``Post.group``: a Ulysses group's, one collective call) starts once every
member of its group has posted it, and its transport's copies run on the compute stream: the pack
of its sends before it starts, the unpack of its receives after its wait, each the bytes read and
written once at ``Topology.memory_bandwidth`` (none where one tensor is all: it goes as it lies).

Two ways to step: :func:`run_lockstep` (round t lasts as long as on the slowest rank of the group:
the steady state of ring-shaped plans) and :func:`run_pairwise` (every rank on its own: a
round waits for its own peers only, as point-to-point transfers do; mask-aware plans).

Worked example (ring attention, P = 2, forward of rank 0: the diagonal block costs c1, the
block with the remote chunk c2, round 1 takes m)::

    compute  |-- block (0,0) c1 --|.......wait.......|-- block (0,1) c2 --|
    comm     |-------- round 1 (KV chunk 1 -> 0) m --------|
    time = max(c1, m) + c2
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from .costs import compute_cost, cost_signature, fresh_rows, result_casts
from .single_writes import single_writes
from .hostops import side_by_side, step_host_ops, wire_copies
from .accounting import key_bytes
from .ir import Free, Plan, Post, Wait
from .shape import AttentionShape
from .topology import Topology

__all__ = ["Event", "run_lockstep", "run_pairwise"]


class Event(NamedTuple):
    """One interval on a rank's timeline (seconds from the start of the direction)."""

    rank: int
    stream: str  # "compute" or "comm"
    start: float
    end: float
    what: str


_UNPRICED = (Free, Post, Wait)  # ops that take no compute-stream time of their own


@dataclass
class _Rank:
    rank: int
    ops: tuple
    first: dict = field(default_factory=dict)  # op index -> {accumulator: rows it writes first} (Plan.first_writes)
    issue: tuple = ()  # op index -> the host's seconds issuing it (empty: no host modelled)
    seconds: tuple = ()  # op index -> its compute seconds (0 for posts, waits and frees)
    cast: float = 0.0  # seconds casting the results the caller casts (costs.result_casts)
    around: float = 0.0  # the host's seconds around the ops (inputs, results, the last queued writes)
    pc: int = 0
    clock: float = 0.0  # compute stream
    host: float = 0.0  # the host: when it has issued everything so far
    lead: float = 0.0  # how far ahead of the device the host started (Topology.host_lead)
    busy: float = 0.0
    events: list = field(default_factory=list)
    pack: dict = field(default_factory=dict)  # op index of an all-to-all round's Post -> its pack copy's seconds
    unpack: dict = field(default_factory=dict)  # such a round -> its unpack copy's seconds

    def compute(self, op, seconds: float, timeline: bool) -> None:
        """Run ``op`` on the compute stream: it starts once the host has issued its first torch op
        and the stream is free, and ends no sooner than the host has issued its last."""
        issue = self.issue[self.pc] if self.issue else 0.0
        start, ready = self.clock, self.host + min(issue, self.first_op)
        self.host += issue
        if ready > start:
            if timeline:
                self.events.append(Event(self.rank, "compute", start, ready, "host"))
            start = ready
        done = start + seconds
        end = max(done, self.host)  # its last torch op issued
        if timeline:
            self.events.append(Event(self.rank, "compute", start, done, type(op).__name__))
            if end > done:
                self.events.append(Event(self.rank, "compute", done, end, "host"))
        self.clock = end
        self.busy += seconds

    def post(self, timeline: bool = False) -> float:
        """The host issues a Post (its transfers' calls; an all-to-all round's pack copy runs on
        the compute stream first): when its round may start."""
        pack = self.pack.get(self.pc)
        if pack:
            self._copy(max(self.clock, self.host), pack, "pack", timeline)
        if self.issue:
            self.host += self.issue[self.pc]
        return max(self.clock, self.host)

    def arrived(self, t: int, done: float, timeline: bool) -> None:
        """``Wait(t)``: the compute stream stalls until round t is done, then unpacks an
        all-to-all round's receives."""
        if timeline and done > self.clock:
            self.events.append(Event(self.rank, "compute", self.clock, done, f"wait {t}"))
        self.clock = max(self.clock, done)
        unpack = self.unpack.get(t)
        if unpack:
            self._copy(self.clock, unpack, "unpack", timeline)

    def _copy(self, start: float, seconds: float, what: str, timeline: bool) -> None:
        if timeline:
            self.events.append(Event(self.rank, "compute", start, start + seconds, what))
        self.clock = start + seconds
        self.busy += seconds

    def finish(self, timeline: bool = False) -> None:
        """The host's work after the last op (results, the last queued writes): the direction
        ends no sooner; then the results' casts, where the caller casts them (``cast``)."""
        self.host += self.around
        if timeline and self.host > self.clock:
            self.events.append(Event(self.rank, "compute", self.clock, self.host, "host"))
        self.clock = max(self.clock, self.host)
        if self.cast:
            self._copy(self.clock, self.cast, "cast", timeline)

    first_op: float = 0.0  # the host's seconds per torch op (an op's device work starts after its first)


class _Costs:
    """Compute seconds per op, priced once per :func:`~.costs.cost_signature` (ops of a dense plan
    repeat a handful); and the host's seconds issuing each op of a rank (:mod:`.hostops`)."""

    def __init__(self, plan: Plan, shape: AttentionShape, topo: Topology):
        self.plan, self.shape, self.topo, self.seen = plan, shape, topo, {}

    def rank(self, r: int, direction: str) -> _Rank:
        """Rank ``r``'s state for stepping ``direction``, with its host's seconds per op."""
        st = _Rank(r, self.plan.rank(r).ops(direction), self.plan.first_writes(r, direction))
        topo = self.topo
        st.pack, st.unpack = self.plan.memo(("transport copies", r, direction, self.shape, topo.memory_bandwidth),
                                            lambda: _transport_copies(self.plan, r, direction, self.shape, topo))
        # each op's compute seconds, kept with the plan per rank: a polished plan's trials
        # (:func:`~.ir.plan.carry`) price again only the rank whose ops they change
        single = single_writes(self.plan, r, direction, topo.mask_piece)
        st.seconds = self.plan.memo(("op seconds", r, direction, self.shape, topo),
                                    lambda: tuple(0.0 if type(op) in _UNPRICED else
                                                  self(op, st.first.get(i), single.get(i))
                                                  for i, op in enumerate(st.ops)))
        st.cast = result_casts(self.plan, r, direction, self.shape, topo)
        if topo.host_priced:
            ops, around = step_host_ops(self.plan, r, direction, self.shape, piece=topo.mask_piece)
            per_op, per_view = topo.host_op_time, topo.host_view_time
            st.issue = tuple(h.seconds(per_op, per_view) for h in ops)
            st.around, st.first_op = around.seconds(per_op, per_view), per_op
            st.lead = topo.host_lead
            st.host = -st.lead  # what it issued before the device started is already queued
        return st

    def __call__(self, op, first=None, single=None) -> float:
        """``first``: the accumulator rows ``op`` (a block) writes first -- copied, not merged / added;
        ``single``: those it writes into the result itself (:func:`~.single_writes.single_writes`)."""
        fresh = fresh_rows(op, first, single)
        sig = (cost_signature(self.plan, op), fresh)
        c = self.seen.get(sig)
        if c is None:
            c = self.seen[sig] = compute_cost(self.plan, op, self.shape, self.topo, fresh)
        return c


def _transport_copies(plan: Plan, rank: int, direction: str, shape: AttentionShape,
                      topo: Topology) -> tuple[dict, dict]:
    """Per all-to-all round of ``rank``'s ``direction`` (``Post.group``), its transport's pack and unpack copies
    (:func:`~megatron_mesh.comm.torch_dist.all_to_all_round`): the sends' bytes read and written
    once (op index -> seconds), the receives' (round -> seconds); none where one tensor is all or
    they lie side by side in the order they go (:func:`~.hostops.wire_copies`)."""
    pack, unpack = {}, {}
    runs = None
    ops = plan.rank(rank).ops(direction)
    for i, op in enumerate(ops):
        if type(op) is not Post or not op.group:
            continue
        if runs is None:
            runs = side_by_side(plan, rank, direction, (shape.heads, shape.kv_heads))
        for transfers, into, at, copied in zip((op.sends, op.recvs), (pack, unpack), (i, op.round),
                                               wire_copies(op, runs)):
            if copied:
                into[at] = 2 * sum(key_bytes(plan, t.key, shape) for t in transfers) / topo.memory_bandwidth
    return pack, unpack


def _finished(states: list[_Rank], moved: bool, direction: str, timeline: bool = False) -> bool:
    """Every simulated rank has run its last op (then its host's last work); a pass that moved
    nothing is a deadlock."""
    if all(st.pc == len(st.ops) for st in states):
        for st in states:
            st.finish(timeline)
        return True
    if not moved:
        stuck = {st.rank: str(st.ops[st.pc]) for st in states if st.pc < len(st.ops)}
        raise ValueError(f"{direction}: simulated ranks block forever: {stuck}")
    return False


def _result(states: list[_Rank], comm_end: float, timeline: bool) -> tuple[float, float, int, list[Event], float]:
    """(time, compute of the slowest rank, rounds of the busiest rank, events, the slowest rank's
    host seconds)."""
    slowest = max(states, key=lambda s: s.clock)
    rounds = max(sum(1 for op in st.ops if type(op) is Post) for st in states)
    events = sorted((e for st in states for e in st.events), key=lambda e: (e.rank, e.start)) if timeline else []
    return max(slowest.clock, comm_end), slowest.busy, rounds, events, slowest.host + slowest.lead


def run_lockstep(plan: Plan, shape: AttentionShape, topo: Topology, direction: str, ranks: list[int],
                  duration: dict[int, float], timeline: bool) -> tuple[float, float, int, list[Event], float]:
    """Step the simulated ranks together; round t starts once every simulated rank that posts it
    has posted it and each of them has finished its previous rounds (a rank's rounds run in
    posting order; approximation 1). Returns (time, compute of the slowest rank, rounds of the
    busiest rank, events, the slowest rank's host seconds)."""
    costs = _Costs(plan, shape, topo)
    states = [costs.rank(r, direction) for r in ranks]
    posters: dict[int, int] = {}  # round -> how many simulated ranks post it
    for st in states:
        for op in st.ops:
            if type(op) is Post:
                posters[op.round] = posters.get(op.round, 0) + 1
    posted: dict[int, list[tuple[float, _Rank]]] = {}
    ready: list[int] = []  # rounds every poster has posted, not yet resolved
    done: dict[int, float] = {}
    comm_free = {st.rank: 0.0 for st in states}
    while True:
        moved = False
        for st in states:
            ops, n = st.ops, len(st.ops)
            while st.pc < n:
                op = ops[st.pc]
                kind = type(op)
                if kind is Wait:
                    if op.round not in done:
                        break
                    st.arrived(op.round, done[op.round], timeline)
                elif kind is Post:
                    entries = posted.setdefault(op.round, [])
                    entries.append((st.post(timeline), st))
                    if len(entries) == posters[op.round]:
                        ready.append(op.round)
                elif kind is not Free:
                    st.compute(op, st.seconds[st.pc], timeline)
                st.pc += 1
                moved = True
        for t in ready:
            entries = posted[t]
            start = max(max(c for c, _ in entries), max(comm_free[st.rank] for _, st in entries))
            done[t] = start + duration.get(t, 0.0)
            for _, st in entries:
                comm_free[st.rank] = done[t]
                if timeline:
                    st.events.append(Event(st.rank, "comm", start, done[t], f"round {t}"))
            moved = True
        ready.clear()
        if _finished(states, moved, direction, timeline):
            break
    return _result(states, max(comm_free.values()), timeline)


def run_pairwise(plan: Plan, shape: AttentionShape, topo: Topology, direction: str,
                  per_rank: dict[tuple[int, int], float], timeline: bool) -> tuple[float, float, int, list[Event], float]:
    """Every rank stepped on its own (a mask-aware plan, whose ranks post different rounds to
    different peers): rank r's round t starts once r and each of its peers in that round have
    posted t and r's previous round is done, and lasts r's own duration -- transfers between two
    ranks wait for those two only, as point-to-point transfers do (the lockstep model would make
    every rank wait for the slowest poster of the whole group)."""
    costs = _Costs(plan, shape, topo)
    states = [costs.rank(r, direction) for r in range(plan.world_size)]
    posted: dict[tuple[int, int], float] = {}  # (rank, round) -> post time
    peers: dict[tuple[int, int], tuple[int, ...]] = {}
    queue: list[list[int]] = [[] for _ in states]  # each rank's posted, unresolved rounds, in order
    done: dict[tuple[int, int], float] = {}
    comm_free = [0.0] * len(states)
    while True:
        moved = False
        for st in states:
            ops, n, r = st.ops, len(st.ops), st.rank
            while st.pc < n:
                op = ops[st.pc]
                kind = type(op)
                if kind is Wait:
                    end = done.get((r, op.round))
                    if end is None:
                        break
                    st.arrived(op.round, end, timeline)
                elif kind is Post:
                    posted[(r, op.round)] = st.post(timeline)
                    # a collective waits for every member of its group, a point-to-point round for its peers
                    peers[(r, op.round)] = tuple(x for x in op.group if x != r) if op.group else \
                        tuple({t.peer for t in op.sends + op.recvs})
                    queue[r].append(op.round)
                elif kind is not Free:
                    st.compute(op, st.seconds[st.pc], timeline)
                st.pc += 1
                moved = True
        for r, pending in enumerate(queue):  # resolve rounds whose peers have all posted them
            while pending:
                t = pending[0]
                times = [posted.get((p, t)) for p in peers[(r, t)]]
                if any(x is None for x in times):
                    break
                start = max([posted[(r, t)], comm_free[r], *times])
                done[(r, t)] = comm_free[r] = start + per_rank.get((r, t), 0.0)
                if timeline:
                    states[r].events.append(Event(r, "comm", start, done[(r, t)], f"round {t}"))
                pending.pop(0)
                moved = True
        if _finished(states, moved, direction, timeline):
            break
    return _result(states, max(comm_free), timeline)

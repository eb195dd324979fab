"""Discrete-event simulation of a :class:`~megatron_mesh.plan.ir.Plan` on a :class:`Topology`:
predicted forward and backward time of one attention call, and how much communication is exposed.

It walks the *same op lists the executor runs* and prices each op (:data:`_COSTS`):

* **Compute stream** (one per rank, in op order). ``Attend``: 4 * batch * heads * head_dim FLOPs
  per (query, key) pair the kernel call computes (:func:`~.accounting.block_area`: a causal
  block of n tokens computes n(n+1)/2 pairs, about half; a masked block runs as the calls of its
  mask pieces, :func:`~.mask.mask_pieces`, as the runtime runs it), at ``attention_flops``, plus
  ``kernel_latency`` per call, plus the fp32 merge into
  the accumulator at ``memory_bandwidth``. ``AttendBackward``: 2.5x the forward FLOPs
  (FlashAttention's backward does 5 matmuls to the forward's 2) plus the dQ/dKV accumulation.
  ``MergeOut``/``AddGrad``/``RowStats``: read two buffers, write one, at ``memory_bandwidth``;
  ``Copy``: read and write the rows it moves.
  ``Free`` costs nothing.
* **Communication stream** (one per rank; NCCL runs a rank's rounds in posting order). ``Post(t)``
  starts round t once the compute issued before it has finished (the NCCL stream waits on the
  compute stream at the call, as PyTorch's ProcessGroupNCCL does) and the rank's previous round
  has completed. The round takes ``latency + max(egress, ingress) / bandwidth`` per link class
  ("intra"/"inter", :class:`Topology`), the slower class deciding: transfers of a round that
  leave (enter) a GPU on the same class share its egress (ingress) bandwidth, e.g. TASP's seven
  NVLink sends of one step, or one NIC per GPU. ``Wait(t)`` stalls the compute stream until
  round t has completed. Exposed communication = time - compute.

Approximations (say them with every number):

1. **Lockstep peers.** Every rank posts round t when the simulated ranks do, and round t lasts
   as long as on the *slowest* rank of the whole group (its link classes and loads). A ring is as
   fast as its slowest hop, so this is the steady state of ring-shaped plans; it is pessimistic
   for ranks whose own hops are fast when the slow hop's delay would take several rounds to
   reach them.
2. **SPMD.** Compute is simulated on ranks 0 and P-1 (``ranks=`` picks others): in Megatron's
   zigzag layout every rank gets the same FLOPs, but not the same merge traffic -- a block
   below the diagonal merges all query rows, one above only the back half, and rank 0 has only
   blocks above, rank P-1 only below -- nor always the same number of kernel calls. These two
   extremes bound the others closely (a test compares with simulating every rank). All ranks
   post their rounds in the same order.
3. **Traffic by ring.** Rank 0's transfers are matched to the rings of ``plan.rings``; every rank
   is assumed to move the same bytes to its own neighbours on the same rings, which gives each
   rank's link classes in O(P) instead of building P op lists (rank P-1's real rounds are checked
   against the prediction; ``exact=True`` reads every rank's rounds instead).
4. Not modelled: contention between communication and compute for SMs or HBM, NCCL protocol
   and chunking effects, network congestion beyond one NIC per GPU, CPU launch overhead.

Worked example (ring attention, P = 2 ranks, one node, causal, forward of rank 0: the diagonal
block costs c1 (n(n+1)/2 pairs), the block with the remote chunk c2 (n/2 x n pairs); round 1
moves one KV chunk in m = latency + bytes / bandwidth)::

    compute  |-- block (0,0) c1 --|.......wait.......|-- block (0,1) c2 --|
    comm     |-------- round 1 (KV chunk 1 -> 0) m --------|
    time = max(c1, m) + c2: the transfer hides behind the local diagonal block when m <= c1.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from .accounting import block_area, key_bytes
from .hybrid import inner_shape
from .ir import AddGrad, Attend, AttendBackward, Copy, Free, MergeOut, Op, Plan, Post, RowStats, Wait
from .mask import BlockKind, mask_pieces
from .sel import sel_len
from .shape import AttentionShape
from .topology import LINK_CLASSES, Topology

__all__ = ["Event", "PhaseResult", "SimResult", "simulate", "RoundTraffic", "round_traffic", "BACKWARD_FLOPS"]

BACKWARD_FLOPS = 2.5  # backward FLOPs / forward FLOPs of one block (5 matmuls vs 2)
_DIRECTIONS = ("forward", "backward")


class Event(NamedTuple):
    """One interval on a rank's timeline (seconds from the start of the direction)."""

    rank: int
    stream: str  # "compute" or "comm"
    start: float
    end: float
    what: str


@dataclass(frozen=True)
class PhaseResult:
    """One direction (forward or backward) of one attention call."""

    time: float  # wall time, slowest simulated rank
    compute: float  # busy time of that rank's compute stream
    rounds: int  # communication rounds (Posts) per rank
    bytes_sent: int  # per rank: the busiest rank (every rank sends the same in SPMD plans)
    intra_bytes: float  # sent over intra-node links, mean over ranks
    inter_bytes: float  # sent over inter-node links, mean over ranks
    max_inter_bytes: int  # the rank that sends the most across nodes
    timeline: tuple[Event, ...] = ()
    sent_per_rank: tuple[int, ...] | None = None  # when every rank's rounds were read

    @property
    def exposed_comm(self) -> float:
        return max(0.0, self.time - self.compute)


@dataclass(frozen=True)
class SimResult:
    forward: PhaseResult
    backward: PhaseResult
    exact: bool = False

    @property
    def time(self) -> float:
        return self.forward.time + self.backward.time

    @property
    def compute(self) -> float:
        return self.forward.compute + self.backward.compute

    @property
    def exposed_comm(self) -> float:
        return self.forward.exposed_comm + self.backward.exposed_comm

    @property
    def rounds(self) -> int:
        return self.forward.rounds + self.backward.rounds

    @property
    def bytes_sent(self) -> int:
        """Forward + backward bytes of the busiest rank (ranks differ in a mask-aware plan)."""
        f, b = self.forward.sent_per_rank, self.backward.sent_per_rank
        if f is not None and b is not None:
            return max(x + y for x, y in zip(f, b))
        return self.forward.bytes_sent + self.backward.bytes_sent

    @property
    def inter_bytes(self) -> float:
        return self.forward.inter_bytes + self.backward.inter_bytes

    @property
    def intra_bytes(self) -> float:
        return self.forward.intra_bytes + self.backward.intra_bytes

    @property
    def max_inter_bytes(self) -> int:
        return self.forward.max_inter_bytes + self.backward.max_inter_bytes


# -- traffic: per-round durations and per-rank link bytes ------------------------------------------
@dataclass(frozen=True)
class RoundTraffic:
    """What the communication of one direction costs, over all ranks.

    ``duration[t]``: round t's duration on the slowest rank; ``sent[r]`` / ``inter[r]``: bytes
    rank r sends in total / across nodes (``None`` when only summarised); ``mean_*``/``max_*``
    summarise over all ranks.
    """

    duration: dict[int, float]
    bytes_sent: int
    mean_intra: float
    mean_inter: float
    max_inter: int
    sent: tuple[int, ...] | None = None
    received: tuple[int, ...] | None = None
    inter: tuple[int, ...] | None = None
    per_rank: dict[tuple[int, int], float] | None = None  # (rank, round) -> that rank's round duration


def _round_time(loads: dict[tuple[str, bool], int], topo: Topology) -> float:
    """Duration of one rank's round from its bytes per (link class, is_send)."""
    t = 0.0
    for link in LINK_CLASSES:
        out, inc = loads.get((link, True), 0), loads.get((link, False), 0)
        if out or inc:
            t = max(t, topo.latency(link) + max(out, inc) / topo.bandwidth(link))
    return t


def _posts(ops) -> list[Post]:
    return [op for op in ops if isinstance(op, Post)]


def _nbytes(plan: Plan, key, shape: AttentionShape, cache: dict) -> int:
    per_chunk = key.slot >= 0 and plan.slots_vary  # slots that differ per chunk (mask-aware plans)
    ck = (key.kind, key.slot, key.span, key.heads, key.chunk if per_chunk else 0)
    n = cache.get(ck)
    if n is None:
        n = cache[ck] = key_bytes(plan, key, shape)
    return n


def round_traffic(plan: Plan, shape: AttentionShape, topo: Topology, direction: str,
                  exact: bool = False) -> RoundTraffic:
    """Per-round durations and link bytes of ``direction`` (see :class:`RoundTraffic`).

    ``exact``: read every rank's rounds (O(P x rounds) op objects); otherwise derive them from
    rank 0's rounds and ``plan.rings`` (approximation 3 of the module docstring), falling back to
    the exact reading when rank 0's transfers do not follow the plan's rings.
    """
    topo.check(plan.world_size)
    if not exact:
        if plan.inner is not None:
            return _composed_traffic(plan, shape, topo, direction)
        if plan.direct:  # ranks move different tokens to different peers: every rank is read
            return _exact_traffic(plan, shape, topo, direction)
        fast = _RingTraffic.build(plan, shape, topo, direction)
        if fast is not None:
            return fast
    return _exact_traffic(plan, shape, topo, direction)


def _composed_traffic(plan: Plan, shape: AttentionShape, topo: Topology, direction: str) -> RoundTraffic:
    """A Ulysses hybrid: its all-to-all rounds (every rank sends one head slice to each of its
    group peers: symmetric, priced from rank 0 and rank P-1) plus the inner plan's traffic,
    priced on the inner group of head slice 0 (CP ranks m * U; every slice's group sits on the same
    nodes) with its rounds shifted by the first all-to-all round."""
    U = plan.ulysses
    inner = plan.inner
    sub = inner_shape(shape, U)
    inner_topo = replace(topo, node_of=tuple(topo.node(m * U) for m in range(inner.world_size)))
    t = round_traffic(inner, sub, inner_topo, direction)
    cache: dict = {}
    duration = {r + 1: d for r, d in t.duration.items()}
    per_rank = None
    if t.per_rank is not None:  # every head slice's inner group runs the same rounds on its own ranks
        per_rank = {(m * U + u, rnd + 1): d for (m, rnd), d in t.per_rank.items() for u in range(U)}
    a2a_sent = a2a_inter = max_inter = 0
    for r in (0, plan.world_size - 1):
        sent = inter = 0
        for op in plan.round_ops(r, direction):
            if type(op) is not Post or not any(x.key.span == 1 for x in op.sends + op.recvs):
                continue
            loads: Counter = Counter()
            for x in op.sends:
                n = _nbytes(plan, x.key, shape, cache)
                link = topo.link(r, x.peer)
                loads[(link, True)] += n
                sent += n
                inter += n if link == "inter" else 0
            for x in op.recvs:
                loads[(topo.link(x.peer, r), False)] += _nbytes(plan, x.key, shape, cache)
            duration[op.round] = max(duration.get(op.round, 0.0), _round_time(loads, topo))
        a2a_sent, a2a_inter, max_inter = sent, max(a2a_inter, inter), max(max_inter, inter)
    if per_rank is not None:  # the all-to-alls: the same on every rank (priced on the extremes)
        for rnd in set(duration) - {rnd + 1 for rnd in t.duration}:
            per_rank.update({(r, rnd): duration[rnd] for r in range(plan.world_size)})
    return RoundTraffic(duration, t.bytes_sent + a2a_sent, t.mean_intra + a2a_sent - a2a_inter,
                        t.mean_inter + a2a_inter, t.max_inter + max_inter, per_rank=per_rank)


def _exact_traffic(plan: Plan, shape: AttentionShape, topo: Topology, direction: str) -> RoundTraffic:
    cache: dict = {}
    duration: dict[int, float] = {}
    per_rank: dict[tuple[int, int], float] = {}
    sent, received, inter, intra = [], [], [], []
    for r in range(plan.world_size):
        s = rcv = x = i = 0
        for post in _posts(plan.round_ops(r, direction)):
            loads: Counter = Counter()
            for t in post.sends:
                n = _nbytes(plan, t.key, shape, cache)
                link = topo.link(r, t.peer)
                loads[(link, True)] += n
                s += n
                if link == "inter":
                    x += n
                else:
                    i += n
            for t in post.recvs:
                n = _nbytes(plan, t.key, shape, cache)
                loads[(topo.link(t.peer, r), False)] += n
                rcv += n
            per_rank[(r, post.round)] = _round_time(loads, topo)
            duration[post.round] = max(duration.get(post.round, 0.0), per_rank[(r, post.round)])
        sent.append(s)
        received.append(rcv)
        inter.append(x)
        intra.append(i)
    P = plan.world_size
    return RoundTraffic(duration, max(sent), sum(intra) / P, sum(inter) / P, max(inter), tuple(sent),
                        tuple(received), tuple(inter), per_rank)


class _RingTraffic:
    """Approximation 3: every rank's round t moves rank 0's bytes to its own ring neighbours.

    A transfer of rank 0 is labelled by the ring it travels on: (family, ring index, send/recv).
    On rank r the same label means: the successor (send) or predecessor (receive) of r on that
    ring if r is on it, else on the ring of the same family that holds r (Mesh: r's own Q or KV
    ring). Ranks with the same link class for every label are interchangeable, so each round is
    priced once per class pattern.
    """

    def __init__(self, plan: Plan):
        self.plan, P = plan, plan.world_size
        self.arc: dict[tuple[int, int], tuple[str, int] | None] = {}  # None: on two rings
        self.next: dict[tuple[str, int], dict[int, int]] = {}
        self.prev: dict[tuple[str, int], dict[int, int]] = {}
        self.holder: dict[str, list[int]] = {}  # family -> rank -> the one ring holding it (-1: none/several)
        for fam, rs in plan.rings.items():
            holder = self.holder[fam] = [-1] * P
            seen = [0] * P
            for k, ring in enumerate(rs):
                n = len(ring)
                nxt = self.next[(fam, k)] = {u: ring[(i + 1) % n] for i, u in enumerate(ring)}
                self.prev[(fam, k)] = {u: ring[(i - 1) % n] for i, u in enumerate(ring)}
                for u in ring:
                    seen[u] += 1
                    holder[u] = k if seen[u] == 1 else -1
                    if n > 1:
                        a = (u, nxt[u])
                        self.arc[a] = None if a in self.arc else (fam, k)

    def peers(self, fam: str, k: int, is_send: bool) -> list[int] | None:
        """Every rank's peer for label (fam, k, is_send), or None if some rank has no such ring."""
        table = self.next if is_send else self.prev
        own, holder = table[(fam, k)], self.holder[fam]
        out = []
        for r in range(self.plan.world_size):
            p = own.get(r)
            if p is None:
                h = holder[r]
                if h < 0:
                    return None
                p = table[(fam, h)][r]
            out.append(p)
        return out

    @classmethod
    def build(cls, plan: Plan, shape: AttentionShape, topo: Topology, direction: str) -> RoundTraffic | None:
        P = plan.world_size
        if P == 1:
            return RoundTraffic({}, 0, 0.0, 0.0, 0, (0,), (0,), (0,))
        self = cls(plan)
        cache: dict = {}
        labels: dict[tuple[str, int, bool], int] = {}
        rounds: list[tuple[int, list[tuple[int, int]]]] = []  # round -> [(label index, bytes)]
        for post in _posts(plan.round_ops(0, direction)):
            items = []
            for is_send, transfers in ((True, post.sends), (False, post.recvs)):
                for t in transfers:
                    ring = self.arc.get((0, t.peer) if is_send else (t.peer, 0))
                    if ring is None:
                        return None
                    li = labels.setdefault((*ring, is_send), len(labels))
                    items.append((li, _nbytes(plan, t.key, shape, cache)))
            rounds.append((post.round, items))
        label_list = list(labels)
        peers = [self.peers(*label) for label in label_list]  # label -> rank -> peer
        if any(p is None for p in peers):
            return None
        if not cls._matches(plan, direction, P - 1, rounds, label_list, [p[P - 1] for p in peers], shape, cache):
            return None
        node = [topo.node(r) for r in range(P)]
        links = [["intra" if node[r] == node[p] else "inter" for r, p in enumerate(row)] for row in peers]
        return cls._summarise(rounds, label_list, links, topo, P)

    @staticmethod
    def _matches(plan, direction, r, rounds, label_list, peers_r, shape, cache) -> bool:
        """Rank r's real rounds are the predicted ones (same peers, same bytes, same order)."""
        real = _posts(plan.round_ops(r, direction))
        if [p.round for p in real] != [t for t, _ in rounds]:
            return False
        for post, (_, items) in zip(real, rounds):
            got = sorted([(True, t.peer, _nbytes(plan, t.key, shape, cache)) for t in post.sends]
                         + [(False, t.peer, _nbytes(plan, t.key, shape, cache)) for t in post.recvs])
            if got != sorted((label_list[li][2], peers_r[li], n) for li, n in items):
                return False
        return True

    @staticmethod
    def _summarise(rounds, label_list, links, topo: Topology, P: int) -> RoundTraffic:
        patterns = Counter(zip(*links))  # rank -> its link class per label; equal rows price alike
        duration: dict[int, float] = {}
        priced: dict[tuple, float] = {}  # most rounds repeat the same transfers (a ring step)
        sent_by_label: Counter = Counter()
        for t, items in rounds:
            sig = tuple(items)
            worst = priced.get(sig)
            if worst is None:
                worst = 0.0
                for pattern in patterns:
                    loads: Counter = Counter()
                    for li, n in items:
                        loads[(pattern[li], label_list[li][2])] += n
                    worst = max(worst, _round_time(loads, topo))
                priced[sig] = worst
            duration[t] = worst
            for li, n in items:
                if label_list[li][2]:
                    sent_by_label[li] += n
        total = sum(sent_by_label.values())
        inter_of = {pattern: sum(n for li, n in sent_by_label.items() if pattern[li] == "inter") for pattern in patterns}
        mean_inter = sum(inter_of[p] * c for p, c in patterns.items()) / P
        return RoundTraffic(duration, total, total - mean_inter, mean_inter, max(inter_of.values(), default=0))


# -- compute costs ------------------------------------------------------------------------------------
def _block_cost(plan: Plan, op, shape: AttentionShape, topo: Topology) -> float:
    """A kernel call: its (query, key) pairs at ``attention_flops``, plus the launch latency and
    the fp32 accumulator traffic. A masked block runs as the kernel calls of its mask pieces
    (:func:`~.mask.mask_pieces`): their areas, one launch each."""
    calls = 1
    if op.mask == BlockKind.MASKED:
        pieces = mask_pieces(plan.mask, plan.positions(op.q, op.rows),
                             tuple(r for i, k in enumerate(op.kv) for r in plan.positions(k, op.col(i))), topo.mask_piece)
        pairs = sum((r1 - r0) * (r1 - r0 + 1) // 2 if kind == BlockKind.CAUSAL else (r1 - r0) * (c1 - c0)
                    for kind, (r0, r1), (c0, c1) in pieces)
        calls = max(1, len(pieces))
    else:
        pairs = block_area(plan, op)
    h, g = plan.head_counts(op.q, shape.heads, shape.kv_heads)
    flops = 4.0 * shape.batch * h * shape.head_dim * pairs
    rows = sel_len(op.rows, plan.tokens(op.q))
    acc = 4  # fp32 accumulators: read + write the accumulator, read the block result
    if type(op) is Attend:
        moved = 3 * shape.batch * h * rows * (shape.head_dim + 1) * acc
    else:
        flops *= BACKWARD_FLOPS
        cols = sum(sel_len(op.col(i), plan.tokens(k)) for i, k in enumerate(op.kv))
        moved = 3 * shape.batch * shape.head_dim * acc * (h * rows + 2 * g * cols)
    return flops / topo.attention_flops + calls * topo.kernel_latency + moved / topo.memory_bandwidth


def _combine_cost(plan: Plan, op, shape: AttentionShape, topo: Topology) -> float:
    """A merge, gradient add or row statistics: read two buffers' worth and write one, at HBM
    bandwidth; a copy reads one and writes one (of the rows it moves)."""
    if type(op) is Copy:
        return 2 * key_bytes(plan, op.dst, shape) * sel_len(op.rows, plan.tokens(op.src)) / \
            plan.tokens(op.dst) / topo.memory_bandwidth
    src = op.dout if type(op) is RowStats else op.src
    return 3 * key_bytes(plan, src, shape) / topo.memory_bandwidth


# seconds the compute stream spends on each op type (communication ops are timed by their rounds)
_COSTS = {Attend: _block_cost, AttendBackward: _block_cost, MergeOut: _combine_cost, AddGrad: _combine_cost,
          Copy: _combine_cost, RowStats: _combine_cost}


def _compute_cost(plan: Plan, op: Op, shape: AttentionShape, topo: Topology) -> float:
    """Seconds the compute stream spends on ``op`` (0 for comm and Free ops)."""
    fn = _COSTS.get(type(op))
    return 0.0 if fn is None else fn(plan, op, shape, topo)


def _cost_signature(plan: Plan, op: Op) -> tuple:
    """What an op's cost depends on (buffer sizes and masks, not which chunks, unless slots differ
    per chunk): ops of a dense plan repeat a handful of signatures."""
    kind = type(op)
    per_chunk = plan.slots_vary
    if kind is Attend or kind is AttendBackward:
        if per_chunk or op.mask == BlockKind.MASKED:
            return (kind, op)
        kv = op.kv
        return (kind, op.q.slot, op.q.span, op.q.heads, op.rows, op.cols, op.mask,
                kv[0].slot if len(kv) == 1 else tuple(k.slot for k in kv))
    if kind is Copy:
        return (kind, op.src.kind, op.dst.kind, op.src.span, op.dst.span, op.rows, op.into, op.heads)
    if kind in _COSTS:
        src = op.dout if kind is RowStats else op.src
        return (kind, src.kind, src.slot, src.span, src.heads, src.chunk if per_chunk else 0)
    return (kind,)


# -- the lockstep timeline -------------------------------------------------------------------------
@dataclass
class _Rank:
    rank: int
    ops: tuple
    pc: int = 0
    clock: float = 0.0  # compute stream
    busy: float = 0.0
    events: list = field(default_factory=list)


def _run_lockstep(plan: Plan, shape: AttentionShape, topo: Topology, direction: str, ranks: list[int],
                  duration: dict[int, float], timeline: bool) -> tuple[float, float, int, list[Event]]:
    """Step the simulated ranks together; round t starts once every simulated rank that posts it
    has posted it and each of them has finished its previous rounds (a rank's rounds run in
    posting order; approximation 1). Returns (time, compute of the slowest rank, rounds of the
    busiest rank, events)."""
    states = [_Rank(r, plan.rank(r).ops(direction)) for r in ranks]
    posters: dict[int, int] = {}  # round -> how many simulated ranks post it
    for st in states:
        for op in st.ops:
            if type(op) is Post:
                posters[op.round] = posters.get(op.round, 0) + 1
    posted: dict[int, list[tuple[float, _Rank]]] = {}
    ready: list[int] = []  # rounds every poster has posted, not yet resolved
    done: dict[int, float] = {}
    comm_free = {st.rank: 0.0 for st in states}
    costs: dict = {}
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
                    if timeline and done[op.round] > st.clock:
                        st.events.append(Event(st.rank, "compute", st.clock, done[op.round], f"wait {op.round}"))
                    st.clock = max(st.clock, done[op.round])
                elif kind is Post:
                    entries = posted.setdefault(op.round, [])
                    entries.append((st.clock, st))
                    if len(entries) == posters[op.round]:
                        ready.append(op.round)
                elif kind is not Free:
                    sig = _cost_signature(plan, op)
                    c = costs.get(sig)
                    if c is None:
                        c = costs[sig] = _compute_cost(plan, op, shape, topo)
                    if timeline:
                        st.events.append(Event(st.rank, "compute", st.clock, st.clock + c, kind.__name__))
                    st.clock += c
                    st.busy += c
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
        if all(st.pc == len(st.ops) for st in states):
            break
        if not moved:
            stuck = {st.rank: str(st.ops[st.pc]) for st in states if st.pc < len(st.ops)}
            raise ValueError(f"{direction}: simulated ranks block forever: {stuck}")
    slowest = max(states, key=lambda s: s.clock)
    time = max(slowest.clock, max(comm_free.values()))
    rounds = max(sum(1 for op in st.ops if type(op) is Post) for st in states)
    events = sorted((e for st in states for e in st.events), key=lambda e: (e.rank, e.start)) if timeline else []
    return time, slowest.busy, rounds, events


def _run_pairwise(plan: Plan, shape: AttentionShape, topo: Topology, direction: str,
                  per_rank: dict[tuple[int, int], float], timeline: bool) -> tuple[float, float, int, list[Event]]:
    """Every rank stepped on its own (a mask-aware plan, whose ranks post different rounds to
    different peers): rank r's round t starts once r and each of its peers in that round have
    posted t and r's previous round is done, and lasts r's own duration -- transfers between two
    ranks wait for those two only, as point-to-point transfers do (the lockstep model would make
    every rank wait for the slowest poster of the whole group)."""
    states = [_Rank(r, plan.rank(r).ops(direction)) for r in range(plan.world_size)]
    posted: dict[tuple[int, int], float] = {}  # (rank, round) -> post time
    peers: dict[tuple[int, int], tuple[int, ...]] = {}
    queue: list[list[int]] = [[] for _ in states]  # each rank's posted, unresolved rounds, in order
    done: dict[tuple[int, int], float] = {}
    comm_free = [0.0] * len(states)
    costs: dict = {}
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
                    if timeline and end > st.clock:
                        st.events.append(Event(r, "compute", st.clock, end, f"wait {op.round}"))
                    st.clock = max(st.clock, end)
                elif kind is Post:
                    posted[(r, op.round)] = st.clock
                    peers[(r, op.round)] = tuple({t.peer for t in op.sends + op.recvs})
                    queue[r].append(op.round)
                elif kind is not Free:
                    sig = _cost_signature(plan, op)
                    c = costs.get(sig)
                    if c is None:
                        c = costs[sig] = _compute_cost(plan, op, shape, topo)
                    if timeline:
                        st.events.append(Event(r, "compute", st.clock, st.clock + c, kind.__name__))
                    st.clock += c
                    st.busy += c
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
        if all(st.pc == len(st.ops) for st in states):
            break
        if not moved:
            stuck = {st.rank: str(st.ops[st.pc]) for st in states if st.pc < len(st.ops)}
            raise ValueError(f"{direction}: simulated ranks block forever: {stuck}")
    slowest = max(states, key=lambda s: s.clock)
    time = max(slowest.clock, max(comm_free))
    rounds = max(sum(1 for op in st.ops if type(op) is Post) for st in states)
    events = sorted((e for st in states for e in st.events), key=lambda e: (e.rank, e.start)) if timeline else []
    return time, slowest.busy, rounds, events


def _default_ranks(plan: Plan) -> list[int]:
    """Ranks 0 and P-1 for plans where every rank posts the same rounds (approximation 2); every
    rank for mask-aware plans, whose ranks differ in work and rounds."""
    if plan.direct:
        return list(range(plan.world_size))
    return [0, plan.world_size - 1]


def simulate(plan: Plan, shape: AttentionShape, topology: Topology | None = None, *, exact: bool = False,
             timeline: bool = False, ranks: list[int] | None = None) -> SimResult:
    """Predicted time of ``plan`` (forward, backward) on ``topology`` (default: H100 nodes of 8).

    ``ranks``: the ranks whose compute is simulated (default 0 and P-1, approximation 2; every
    rank for a mask-aware plan);
    ``exact``: derive round durations from every rank's rounds; ``timeline``: keep the events.
    """
    topo = topology if topology is not None else Topology.for_cp(plan.world_size)
    if shape.seq_local != plan.seq_local:
        raise ValueError(f"shape.seq_local {shape.seq_local} != the plan's {plan.seq_local}")
    sim_ranks = sorted(set(ranks if ranks is not None else _default_ranks(plan)))
    if not sim_ranks or not all(0 <= r < plan.world_size for r in sim_ranks):
        raise ValueError(f"ranks {ranks} must be a non-empty subset of 0..{plan.world_size - 1}")
    for r in sim_ranks:  # build the simulated ranks first: their rounds are then read off their ops
        plan.rank(r)
    phases = []
    for direction in _DIRECTIONS:
        traffic = round_traffic(plan, shape, topo, direction, exact=exact)
        if traffic.per_rank is not None and len(sim_ranks) == plan.world_size:
            time, busy, rounds, events = _run_pairwise(plan, shape, topo, direction, traffic.per_rank, timeline)
        else:
            time, busy, rounds, events = _run_lockstep(plan, shape, topo, direction, sim_ranks, traffic.duration,
                                                       timeline)
        phases.append(PhaseResult(time, busy, rounds, traffic.bytes_sent, traffic.mean_intra, traffic.mean_inter,
                                  traffic.max_inter, tuple(events), traffic.sent))
    return SimResult(*phases, exact=exact)

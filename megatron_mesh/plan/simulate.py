"""Discrete-event simulation of a :class:`~megatron_mesh.plan.ir.Plan` on a :class:`Topology`:
predicted forward and backward time of one attention call, and how much communication is exposed.

It walks the *same op lists the executor runs* and prices each op (:data:`_COSTS`):

* **Compute stream** (one per rank, in op order). ``Attend``: 4 * batch * heads * head_dim FLOPs
  (2 * (head_dim + v_head_dim) per head where the value head dim differs: :func:`~.costs.pair_flops`)
  per (query, key) pair the kernel call computes (:func:`~.accounting.block_area`: a causal
  block of n tokens computes n(n+1)/2 pairs, about half; a masked block runs as the calls of its
  mask pieces, :func:`~.mask.mask_pieces`, as the runtime runs it), at ``attention_flops``, plus
  ``kernel_latency`` per call, plus the fp32 merge into
  the accumulator at ``memory_bandwidth`` (a copy on rows no earlier op wrote:
  :meth:`~.ir.Plan.first_writes`, as the runtime does). ``AttendBackward``: 2.5x the forward FLOPs
  at equal head dims (FlashAttention's backward does 5 matmuls to the forward's 2) plus the dQ/dKV accumulation.
  ``MergeOut``/``AddGrad``/``RowStats``: read two buffers, write one, at ``memory_bandwidth``;
  ``Copy``: read and write the rows it moves (a cast of an fp32 accumulator into the input
  dtype reads its values and writes them once, in 16 bits: 1.5x the output's fp32 bytes).
  ``Free`` costs nothing. After a direction's last op, the casts of the results a plan leaves in
  fp32 accumulators (a plain plan's output and gradients, cast into the input dtype at the end;
  :func:`~.costs.result_casts`), priced as a ``Copy`` cast (since stop 67) -- less the rows one
  kernel call wrote straight into the result in the input dtype, which a block prices as a copy
  in that dtype instead (:mod:`.single_writes`, since stop 68).
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
4. **The host** issues a rank's torch ops in order at ``Topology.host_op_time`` each, its
   ops counted from the plan (:mod:`.hostops`, held within 25 % of the executor's count on the
   CPU); the device waits where the host is behind (:mod:`.timeline`). One cost for every op
   (views included: the measured average), the same on every rank; CUDA graphs (which would
   take most of it away) are not modelled.
5. Not modelled: contention between communication and compute for SMs or HBM, NCCL protocol
   and chunking effects, network congestion beyond one NIC per GPU, the copy that joins the key/value buffers of one kernel call over several of them (dense Mesh and
   TASP steps, fused document calls: at most the call's K/V bytes, read and written once), and
   with a micro-batch of more than one sample the copy that folds the batch into the tokens of a
   variable-length call. Kernel calls are those of the CUDA flash kernel on 16-bit inputs
   (:func:`~.mask.call_groups`, ``plan.kernel_calls``): fp32 inputs and the other CUDA ops run
   a variable-length group one piece at a time.

Worked example (ring attention, P = 2 ranks, one node, causal, forward of rank 0: the diagonal
block costs c1 (n(n+1)/2 pairs), the block with the remote chunk c2 (n/2 x n pairs); round 1
moves one KV chunk in m = latency + bytes / bandwidth)::

    compute  |-- block (0,0) c1 --|.......wait.......|-- block (0,1) c2 --|
    comm     |-------- round 1 (KV chunk 1 -> 0) m --------|
    time = max(c1, m) + c2: the transfer hides behind the local diagonal block when m <= c1.
"""

from __future__ import annotations

from dataclasses import dataclass

from .costs import BACKWARD_FLOPS, block_cost_parts, compute_cost, fresh_rows, result_casts
from .single_writes import single_writes
from .ir import Attend, AttendBackward, Copy, Plan, Post
from .shape import AttentionShape
from .timeline import Event, run_lockstep, run_pairwise
from .topology import Topology
from .traffic import RoundTraffic, round_traffic

# the simulator's parts (traffic, costs, timeline) re-exported where callers look for them
__all__ = ["Event", "PhaseResult", "SimResult", "simulate", "simulate_direction", "RoundTraffic", "round_traffic",
           "BACKWARD_FLOPS", "TimeBreakdown", "time_breakdown"]

_DIRECTIONS = ("forward", "backward")


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
    inter_per_rank: tuple[int, ...] | None = None  # the same, across nodes
    host: float = 0.0  # the slowest rank's host: seconds issuing its torch ops (Topology.host_op_time)

    @property
    def exposed_comm(self) -> float:
        return max(0.0, self.time - self.compute)

    @property
    def host_bound(self) -> bool:
        """The host needs longer to issue the direction's ops than the device to run them."""
        return self.host > self.compute


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
    def host(self) -> float:
        return self.forward.host + self.backward.host

    @property
    def host_bound(self) -> bool:
        """The host needs longer to issue the call's ops (forward + backward) than the device to
        run them: the device waits for it (the planner marks such rows)."""
        return self.host > self.compute

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
        """Forward + backward bytes across nodes of the rank that sends the most across nodes."""
        f, b = self.forward.inter_per_rank, self.backward.inter_per_rank
        if f is not None and b is not None:
            return max(x + y for x, y in zip(f, b))
        return self.forward.max_inter_bytes + self.backward.max_inter_bytes


def _default_ranks(plan: Plan) -> list[int]:
    """Ranks 0 and P-1 for plans where every rank posts the same rounds (approximation 2); every
    rank for mask-aware plans, whose ranks differ in work and rounds."""
    if plan.facts.direct:
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
    return SimResult(*(_phase(plan, shape, topo, direction, sim_ranks, exact, timeline) for direction in _DIRECTIONS),
                     exact=exact)


def simulate_direction(plan: Plan, shape: AttentionShape, topology: Topology, direction: str, *,
                       timeline: bool = False, traffic: RoundTraffic | None = None) -> PhaseResult:
    """One direction of :func:`simulate` (every rank of a mask-aware plan): what a choice that
    changes only that direction's ops compares (:mod:`.polish`). ``traffic``: the direction's
    :func:`~.traffic.round_traffic`, where the caller knows it (a plan whose rounds are another's)."""
    sim_ranks = sorted(set(_default_ranks(plan)))
    for r in sim_ranks:  # as simulate: built first, their rounds are read off their ops
        plan.rank(r)
    return _phase(plan, shape, topology, direction, sim_ranks, False, timeline, traffic)


def _phase(plan: Plan, shape: AttentionShape, topo: Topology, direction: str, sim_ranks: list[int], exact: bool,
           timeline: bool, traffic: RoundTraffic | None = None) -> PhaseResult:
    if traffic is None:
        traffic = round_traffic(plan, shape, topo, direction, exact=exact)
    if traffic.per_rank is not None and len(sim_ranks) == plan.world_size:
        time, busy, rounds, events, host = run_pairwise(plan, shape, topo, direction, traffic.per_rank, timeline)
    else:
        time, busy, rounds, events, host = run_lockstep(plan, shape, topo, direction, sim_ranks,
                                                         traffic.duration, timeline)
    return PhaseResult(time, busy, rounds, traffic.bytes_sent, traffic.mean_intra, traffic.mean_inter,
                       traffic.max_inter, tuple(events), traffic.sent, traffic.inter, host)


@dataclass(frozen=True)
class TimeBreakdown:
    """Where one direction's predicted time goes on its slowest rank (the one that finishes last,
    of the ranks the simulator steps: every rank of a mask-aware plan, 0 and P-1 otherwise):
    ``parts`` in seconds -- "flops" (the kernel calls' pairs at peak), "launches", "accumulate"
    (fp32 merges of the calls' results), "copies" (Copy ops: the Ulysses reorder, slot cuts, casts),
    "combine" (merges, gradient adds, row statistics of received partials), "host" (the device
    waiting for its host to issue ops) and "exposed" (the rest: waiting for communication) -- and
    ``waits``: (round, seconds, what it moves) of each
    round the rank's compute stream waited for, longest first."""

    direction: str
    rank: int
    time: float
    parts: dict
    waits: tuple


def _round_text(post: Post) -> str:
    kinds = sorted({t.key.kind for t in post.sends + post.recvs})
    peers = len({t.peer for t in post.sends + post.recvs})
    return f"{','.join(kinds) or 'nothing'} with {peers} peer{'s' if peers != 1 else ''}"


def time_breakdown(plan: Plan, shape: AttentionShape, topology: Topology | None = None,
                   sim: SimResult | None = None) -> tuple[TimeBreakdown, ...]:
    """Forward and backward :class:`TimeBreakdown` of ``plan`` (from ``sim``, a :func:`simulate`
    of it on ``topology`` with its timeline, or one run here). Worked example:
    ``megatron-mesh-plan --explain`` prints it for the fastest plan; its parts add up to the
    direction's time."""
    topo = topology if topology is not None else Topology.for_cp(plan.world_size)
    if sim is None or not (sim.forward.timeline or sim.backward.timeline):
        sim = simulate(plan, shape, topo, timeline=True)
    out = []
    for direction, phase in zip(_DIRECTIONS, (sim.forward, sim.backward)):
        ends: dict[int, float] = {}
        for e in phase.timeline:
            ends[e.rank] = max(ends.get(e.rank, 0.0), e.end)
        rank = max(sorted(ends), key=lambda r: ends[r]) if ends else 0
        parts = dict.fromkeys(("flops", "launches", "accumulate", "copies", "combine"), 0.0)
        posts = {}
        first = plan.first_writes(rank, direction)
        single = single_writes(plan, rank, direction, topo.mask_piece)
        for i, op in enumerate(plan.rank(rank).ops(direction)):
            kind = type(op)
            if kind is Attend or kind is AttendBackward:
                flops, launches, acc = block_cost_parts(plan, op, shape, topo,
                                                        fresh_rows(op, first.get(i), single.get(i)))
                parts["flops"] += flops
                parts["launches"] += launches
                parts["accumulate"] += acc
            elif kind is Copy:
                parts["copies"] += compute_cost(plan, op, shape, topo)
            elif kind is Post:
                posts[op.round] = op
            else:
                parts["combine"] += compute_cost(plan, op, shape, topo)
        parts["copies"] += result_casts(plan, rank, direction, shape, topo)  # the caller's casts, after the ops
        parts["host"] = sum(e.end - e.start for e in phase.timeline
                            if e.rank == rank and e.stream == "compute" and e.what == "host")
        parts["exposed"] = max(0.0, phase.time - sum(parts.values()))
        waits = []
        for e in phase.timeline:
            if e.rank == rank and e.stream == "compute" and e.what.startswith("wait ") and e.end > e.start:
                t = int(e.what.split()[1])
                waits.append((t, e.end - e.start, _round_text(posts[t]) if t in posts else ""))
        out.append(TimeBreakdown(direction, rank, phase.time, parts,
                                 tuple(sorted(waits, key=lambda w: (-w[1], w[0])))))
    return tuple(out)

"""The planner: every CP mode of one problem on one machine, side by side.

For the plan-based modes (``ring``, ``mesh`` with each tile, ``mesh-auto``, ``tasp``) the numbers
come from the plans the runtime executes: bytes from their rounds, time from
:func:`~megatron_mesh.plan.simulate.simulate`, buffer memory from
:func:`~megatron_mesh.plan.memory.buffer_memory`. ``ulysses`` and ``usp`` (Ulysses all-to-all
inside a node x ring across nodes) have no plan here; they are priced by formula:

* Ulysses of degree u moves (u-1)/u of the local q, k, v and out in the forward, of dout and
  dq, dk, dv in the backward, in the activation dtype, as four all-to-alls that do not overlap
  the attention (head-sharded attention over the whole sequence runs between them). It needs
  ``heads % u == 0``; KV heads are replicated up to u when ``u % kv_heads == 0``.
* USP (u x r = P): the Ulysses all-to-all over u consecutive ranks, then zigzag ring attention
  over r ranks on u-times longer chunks of heads/u heads -- simulated with the ring plan.

Numbers are per rank and per attention call (one layer), forward + backward.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from .accounting import AttentionShape
from .ir import Plan
from .memory import buffer_memory
from .mesh import build_mesh_plan, tile_shapes
from .simulate import BACKWARD_FLOPS, SimResult, simulate
from .topology import Topology

__all__ = ["MODES", "ModeResult", "evaluate_plan", "mesh_candidates", "pick_best", "evaluate",
           "ulysses_result", "usp_result", "tasp_result", "TIME_TOLERANCE"]

MODES = ("ring", "mesh", "mesh-auto", "tasp", "ulysses", "usp")
# predicted times closer than this count as equal: the model is not more accurate than that, and
# the tie goes to fewer inter-node bytes, then fewer bytes (other traffic shares the network)
TIME_TOLERANCE = 0.01


@dataclass(frozen=True)
class ModeResult:
    """One CP mode: bytes are sent per rank, forward + backward; times in seconds."""

    mode: str
    tile: tuple[int, int] | None
    bytes_per_rank: int
    intra_node_bytes_per_rank: float  # mean over ranks
    inter_node_bytes_per_rank: float  # mean over ranks (ring: only the ranks at node boundaries send)
    max_inter_node_bytes: float  # the rank with the most inter-node bytes
    steps: int  # communication rounds (all-to-alls for Ulysses) per rank, forward + backward
    peak_buffer_bytes: int
    time_s: float
    forward_s: float
    backward_s: float
    compute_s: float
    contiguous: str | None = None
    detail: str = ""
    by_formula: bool = False
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def exposed_comm_s(self) -> float:
        return max(0.0, self.time_s - self.compute_s)

    def to_json(self) -> dict:
        d = asdict(self)
        d["tile"] = list(self.tile) if self.tile is not None else None
        d["exposed_comm_s"] = self.exposed_comm_s
        for k in ("intra_node_bytes_per_rank", "inter_node_bytes_per_rank", "max_inter_node_bytes"):
            d[k] = round(d[k])  # whole bytes (the per-rank means can be fractional)
        d.update(d.pop("extra"))
        return d


def evaluate_plan(mode: str, plan: Plan, shape: AttentionShape, topo: Topology, detail: str = "",
                  contiguous: str | None = None) -> ModeResult:
    """Simulate ``plan`` and read its memory: one row of the planner."""
    sim: SimResult = simulate(plan, shape, topo)
    mem = buffer_memory(plan, shape)
    return ModeResult(mode, plan.tile if mode != "tasp" else None, sim.bytes_sent, sim.intra_bytes, sim.inter_bytes,
                      sim.max_inter_bytes, sim.rounds, mem.peak, sim.time, sim.forward.time, sim.backward.time,
                      sim.compute, contiguous, detail, extra={"saved_bytes": mem.saved, "held_buffer_bytes": mem.held})


def _spans_nodes(world_size: int, topo: Topology) -> bool:
    return topo.nodes_used(world_size) > 1


def mesh_candidates(world_size: int, shape: AttentionShape, topo: Topology, causal: bool = True,
                    backward_chunks: str = "refetch", schedule: str = "greedy") -> list[ModeResult]:
    """Every Mesh tile (1xP is ring attention), with both rank orders ("q"/"kv" consecutive) when
    the CP group spans nodes and the tile has two real rings."""
    out = []
    for a, b in tile_shapes(world_size):
        orders = ("q", "kv") if _spans_nodes(world_size, topo) and a > 1 and b > 1 else ("q",)
        for c in orders:
            plan = build_mesh_plan(world_size, (a, b), shape, causal=causal, schedule=schedule,
                                   backward_chunks=backward_chunks, contiguous=c)
            out.append(evaluate_plan("mesh", plan, shape, topo, contiguous=c))
    return out


def pick_best(candidates: list[ModeResult]) -> ModeResult:
    """The fastest candidate; within :data:`TIME_TOLERANCE` of it, fewest inter-node bytes, then
    fewest bytes, then least buffer memory, then the flatter tile."""
    if not candidates:
        raise ValueError("no candidates to choose from")
    fastest = min(c.time_s for c in candidates)
    close = [c for c in candidates if c.time_s <= fastest * (1 + TIME_TOLERANCE)]
    return min(close, key=lambda c: (c.inter_node_bytes_per_rank, c.bytes_per_rank, c.peak_buffer_bytes,
                                     c.tile or (0, 0), c.contiguous or ""))


def tasp_result(world_size: int, shape: AttentionShape, topo: Topology, causal: bool = True) -> ModeResult:
    """TASP's plan (Hamiltonian rings; the hierarchical decomposition when the CP group spans
    nodes). Raises ValueError when TASP cannot run this problem, ImportError when it is absent."""
    from .tasp import build_tasp_plan  # the TASP plan builder lives in its own module

    gpn = topo.gpus_per_node if _spans_nodes(world_size, topo) else None
    plan = build_tasp_plan(world_size, shape, causal=causal, gpus_per_node=gpn)
    detail = "; ".join(plan.notes)
    return evaluate_plan("tasp", plan, shape, topo, detail=detail)


# -- Ulysses / USP by formula ----------------------------------------------------------------------
def _ulysses_kv_heads(u: int, shape: AttentionShape) -> int | None:
    """KV heads after replication for Ulysses degree u (None: not possible)."""
    if shape.heads % u:
        return None
    if shape.kv_heads % u == 0:
        return shape.kv_heads
    if u % shape.kv_heads == 0:
        return u  # each rank gets one (replicated) KV head
    return None


def _a2a(world_size: int, u: int, nbytes: float, topo: Topology) -> tuple[float, float, float, float]:
    """All-to-alls inside each group of u consecutive ranks, ``nbytes`` of local data per rank
    (1/u of it stays home): (mean intra bytes, mean inter bytes, max inter bytes, time on the
    slowest rank) per rank."""
    per_peer = nbytes / u
    intra = inter = worst_inter = worst = 0.0
    for g0 in range(0, world_size, u):
        per_node: dict[int, int] = {}
        for r in range(g0, g0 + u):
            per_node[topo.node(r)] = per_node.get(topo.node(r), 0) + 1
        for r in range(g0, g0 + u):
            c = per_node[topo.node(r)]
            loads = {"intra": (c - 1) * per_peer, "inter": (u - c) * per_peer}
            intra, inter = intra + loads["intra"], inter + loads["inter"]
            worst_inter = max(worst_inter, loads["inter"])
            worst = max([worst] + [topo.latency(k) + v / topo.bandwidth(k) for k, v in loads.items() if v])
    return intra / world_size, inter / world_size, worst_inter, worst


@dataclass
class _AllToAlls:
    """The four all-to-alls of Ulysses of degree u (forward: q,k,v in, out back; backward: dout
    in, dq,dk,dv back), each group of u consecutive ranks among ``world_size``."""

    bytes_sent: float = 0.0
    intra: float = 0.0
    inter: float = 0.0
    max_inter: float = 0.0
    time: dict = field(default_factory=dict)  # direction -> seconds
    local: int = 0  # q + k + v (replicated KV heads) bytes on one rank

    @classmethod
    def price(cls, world_size: int, u: int, shape: AttentionShape, kv_heads: int, topo: Topology) -> "_AllToAlls":
        e, B, n, D = shape.itemsize, shape.batch, shape.seq_local, shape.head_dim
        q, kv = B * n * shape.heads * D * e, 2 * B * n * kv_heads * D * e
        acc = cls(local=q + kv)
        for direction, sizes in (("forward", (q + kv, q)), ("backward", (q, q + kv))):
            acc.time[direction] = 0.0
            for nbytes in sizes:
                i, x, mx, dt = _a2a(world_size, u, nbytes, topo)
                acc.intra, acc.inter, acc.max_inter = acc.intra + i, acc.inter + x, acc.max_inter + mx
                acc.time[direction] += dt
                acc.bytes_sent += nbytes * (u - 1) / u
        return acc


def _attention_time(seq_len: int, heads: int, shape: AttentionShape, topo: Topology, causal: bool) -> float:
    pairs = seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len
    return 4.0 * shape.batch * heads * shape.head_dim * pairs / topo.attention_flops + topo.kernel_latency


def ulysses_result(world_size: int, shape: AttentionShape, topo: Topology, causal: bool = True) -> ModeResult:
    """Ulysses (DeepSpeed-Ulysses, Transformer Engine's ``a2a``) of degree P, by formula."""
    u = world_size
    kv_heads = _ulysses_kv_heads(u, shape)
    if kv_heads is None:
        raise ValueError(f"Ulysses of degree {u} needs heads ({shape.heads}) divisible by {u} and kv heads "
                         f"({shape.kv_heads}) divisible by, or a divisor of, {u}")
    a2a = _AllToAlls.price(world_size, u, shape, kv_heads, topo)
    fwd_compute = _attention_time(shape.seq_local * u, shape.heads // u, shape, topo, causal)
    bwd_compute = fwd_compute * BACKWARD_FLOPS
    fwd, bwd = a2a.time["forward"] + fwd_compute, a2a.time["backward"] + bwd_compute
    # head-sharded q, k, v, out kept for the backward, then dout and the gradients
    peak = 2 * a2a.local + shape.batch * shape.seq_local * shape.heads * shape.head_dim * shape.itemsize
    return ModeResult("ulysses", None, round(a2a.bytes_sent), a2a.intra, a2a.inter, a2a.max_inter, 4, peak,
                      fwd + bwd, fwd, bwd, fwd_compute + bwd_compute, detail=f"all-to-all degree {u}",
                      by_formula=True, extra={"ulysses_degree": u})


def _usp_degree(world_size: int, shape: AttentionShape, topo: Topology) -> int | None:
    """The largest all-to-all degree that stays inside a node and fits the heads."""
    best = None
    for u in range(2, min(world_size - 1, topo.gpus_per_node) + 1):
        if world_size % u == 0 and _ulysses_kv_heads(u, shape) is not None:
            best = u
    return best


def usp_result(world_size: int, shape: AttentionShape, topo: Topology, causal: bool = True) -> ModeResult:
    """USP / Transformer Engine ``a2a+p2p``: Ulysses over u consecutive ranks (inside a node) x
    zigzag ring over the r = P/u ranks holding the same heads (simulated with the ring plan)."""
    from .mesh import build_ring_plan

    u = _usp_degree(world_size, shape, topo)
    if u is None:
        raise ValueError(f"USP needs an all-to-all degree 1 < u < {world_size}, u <= {topo.gpus_per_node} GPUs per "
                         f"node, dividing the CP size and the heads ({shape.heads}/{shape.kv_heads})")
    r = world_size // u
    kv_heads = _ulysses_kv_heads(u, shape)
    sub = AttentionShape(seq_local=shape.seq_local * u, batch=shape.batch, heads=shape.heads // u,
                         kv_heads=max(1, kv_heads // u), head_dim=shape.head_dim, itemsize=shape.itemsize)
    ring_topo = topo.with_(node_of=tuple(topo.node(j * u) for j in range(r)))
    ring = evaluate_plan("ring", build_ring_plan(r, sub, causal=causal), sub, ring_topo)
    a2a = _AllToAlls.price(world_size, u, shape, kv_heads, topo)
    fwd, bwd = a2a.time["forward"] + ring.forward_s, a2a.time["backward"] + ring.backward_s
    return ModeResult("usp", None, round(a2a.bytes_sent) + ring.bytes_per_rank,
                      a2a.intra + ring.intra_node_bytes_per_rank, a2a.inter + ring.inter_node_bytes_per_rank,
                      a2a.max_inter + ring.max_inter_node_bytes, 4 + ring.steps,
                      2 * a2a.local + ring.peak_buffer_bytes, fwd + bwd, fwd, bwd, ring.compute_s,
                      detail=f"all-to-all degree {u} x ring {r}", by_formula=True,
                      extra={"ulysses_degree": u, "ring_degree": r})


# -- everything -----------------------------------------------------------------------------------------
def evaluate(world_size: int, shape: AttentionShape, topo: Topology, causal: bool = True,
             modes=MODES, backward_chunks: str = "refetch", schedule: str = "greedy"
             ) -> tuple[list[ModeResult], list[dict]]:
    """Rows for ``modes`` (see :data:`MODES`) and the modes that cannot run, with the reason."""
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; allowed: {', '.join(MODES)}")
    topo.check(world_size)
    rows: list[ModeResult] = []
    skipped: list[dict] = []
    mesh = None
    if {"mesh", "mesh-auto"} & set(modes):
        mesh = mesh_candidates(world_size, shape, topo, causal, backward_chunks, schedule)
    for mode in modes:
        try:
            if mode == "ring":
                if mesh is not None:
                    rows.append(_renamed(next(c for c in mesh if c.tile == (1, world_size)), "ring"))
                else:
                    plan = build_mesh_plan(world_size, (1, world_size), shape, causal=causal, schedule=schedule,
                                           backward_chunks=backward_chunks)
                    rows.append(evaluate_plan("ring", plan, shape, topo, contiguous="q"))
            elif mode == "mesh":
                rows.extend(c for c in mesh if c.tile != (1, world_size))
            elif mode == "mesh-auto":
                rows.append(_renamed(pick_best(mesh), "mesh-auto"))
            elif mode == "tasp":
                rows.append(tasp_result(world_size, shape, topo, causal))
            elif mode == "ulysses":
                rows.append(ulysses_result(world_size, shape, topo, causal))
            elif mode == "usp":
                rows.append(usp_result(world_size, shape, topo, causal))
        except (ValueError, ImportError) as e:
            skipped.append({"mode": mode, "reason": str(e)})
    return rows, skipped


def _renamed(row: ModeResult, mode: str) -> ModeResult:
    return replace(row, mode=mode)

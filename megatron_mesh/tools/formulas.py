"""Ulysses and USP priced by formula, as their papers and Transformer Engine describe them (the
planner's ``ulysses`` and ``usp`` rows, next to our plan of the same algorithm, ``a2a+ring``):

* Ulysses of degree u moves (u-1)/u of the local q, k, v and out in the forward, of dout and
  dq, dk, dv in the backward, in the activation dtype, as four all-to-alls that do not overlap
  the attention (head-sharded attention over the whole sequence runs between them). It needs
  ``heads % u == 0``; KV heads are replicated up to u when ``u % kv_heads == 0``.
* USP (u x r = P): the Ulysses all-to-all over u consecutive ranks, then zigzag ring attention
  over r ranks on u-times longer chunks of heads/u heads -- simulated with the ring plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..plan.autotile import evaluate_plan
from ..plan.costs import pair_flops
from ..plan.mesh import build_mesh_plan
from ..plan.shape import AttentionShape
from ..plan.topology import Topology
from .mode_result import ModeResult

__all__ = ["FORMULA", "ulysses_result", "usp_degree", "usp_result"]


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
        e, B, n, D, Dv = shape.itemsize, shape.batch, shape.seq_local, shape.head_dim, shape.v_head_dim
        q, kv, out = B * n * shape.heads * D * e, B * n * kv_heads * (D + Dv) * e, B * n * shape.heads * Dv * e
        acc = cls(local=q + kv)
        for direction, sizes in (("forward", (q + kv, out)), ("backward", (out, q + kv))):
            acc.time[direction] = 0.0
            for nbytes in sizes:
                i, x, mx, dt = _a2a(world_size, u, nbytes, topo)
                acc.intra, acc.inter, acc.max_inter = acc.intra + i, acc.inter + x, acc.max_inter + mx
                acc.time[direction] += dt
                acc.bytes_sent += nbytes * (u - 1) / u
        return acc


def _attention_time(seq_len: int, heads: int, shape: AttentionShape, topo: Topology, causal: bool) -> float:
    pairs = seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len
    return pair_flops(shape, heads) * pairs / topo.attention_flops + topo.kernel_latency


def ulysses_result(world_size: int, shape: AttentionShape, topo: Topology, causal: bool = True) -> ModeResult:
    """Ulysses (DeepSpeed-Ulysses, Transformer Engine's ``a2a``) of degree P, by formula."""
    u = world_size
    kv_heads = _ulysses_kv_heads(u, shape)
    if kv_heads is None:
        raise ValueError(f"Ulysses of degree {u} needs heads ({shape.heads}) divisible by {u} and kv heads "
                         f"({shape.kv_heads}) divisible by, or a divisor of, {u}")
    a2a = _AllToAlls.price(world_size, u, shape, kv_heads, topo)
    fwd_compute = _attention_time(shape.seq_local * u, shape.heads // u, shape, topo, causal)
    bwd_compute = fwd_compute * pair_flops(shape, 1, backward=True) / pair_flops(shape, 1)  # BACKWARD_FLOPS, any dims
    fwd, bwd = a2a.time["forward"] + fwd_compute, a2a.time["backward"] + bwd_compute
    # head-sharded q, k, v, out kept for the backward, then dout and the gradients
    peak = 2 * a2a.local + shape.batch * shape.seq_local * shape.heads * shape.v_head_dim * shape.itemsize
    return ModeResult("ulysses", None, round(a2a.bytes_sent), a2a.intra, a2a.inter, a2a.max_inter, 4, peak,
                      fwd + bwd, fwd, bwd, fwd_compute + bwd_compute, detail=f"all-to-all degree {u}",
                      by_formula=True, ulysses=u, extra={"ulysses_degree": u})


def usp_degree(world_size: int, shape: AttentionShape, topo: Topology) -> int | None:
    """The largest all-to-all degree that stays inside a node and fits the heads."""
    best = None
    for u in range(2, min(world_size - 1, topo.gpus_per_node) + 1):
        if world_size % u == 0 and _ulysses_kv_heads(u, shape) is not None:
            best = u
    return best


def usp_result(world_size: int, shape: AttentionShape, topo: Topology, causal: bool = True) -> ModeResult:
    """USP / Transformer Engine ``a2a+p2p``: Ulysses over u consecutive ranks (inside a node) x
    zigzag ring over the r = P/u ranks holding the same heads (simulated with the ring plan)."""
    u = usp_degree(world_size, shape, topo)
    if u is None:
        raise ValueError(f"USP needs an all-to-all degree 1 < u < {world_size}, u <= {topo.gpus_per_node} GPUs per "
                         f"node, dividing the CP size and the heads ({shape.heads}/{shape.kv_heads})")
    r = world_size // u
    kv_heads = _ulysses_kv_heads(u, shape)
    sub = replace(shape, seq_local=shape.seq_local * u, heads=shape.heads // u, kv_heads=max(1, kv_heads // u))
    ring_topo = replace(topo, node_of=tuple(topo.node(j * u) for j in range(r)))
    ring = evaluate_plan(build_mesh_plan(r, (1, r), sub, causal=causal), sub, ring_topo)
    a2a = _AllToAlls.price(world_size, u, shape, kv_heads, topo)
    fwd, bwd = a2a.time["forward"] + ring.forward_s, a2a.time["backward"] + ring.backward_s
    return ModeResult("usp", None, round(a2a.bytes_sent) + ring.bytes_per_rank,
                      a2a.intra + ring.intra_node_bytes_per_rank, a2a.inter + ring.inter_node_bytes_per_rank,
                      a2a.max_inter + ring.max_inter_node_bytes, 4 + ring.rounds,
                      2 * a2a.local + ring.peak_buffer_bytes, fwd + bwd, fwd, bwd, ring.compute_s,
                      detail=f"all-to-all degree {u} x ring {r}", by_formula=True, ulysses=u,
                      extra={"ulysses_degree": u, "ring_degree": r, "host_s": ring.host_s})


FORMULA = {"ulysses": ulysses_result, "usp": usp_result}

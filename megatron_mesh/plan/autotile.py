"""The one Mesh tile chooser: which tile (a x b = P) and rank order to run, by predicted time or
by bytes.

``objective="time"`` (what ``tile="auto"`` means everywhere) simulates every allowed tile (its
host's time issuing the executor's ops included, ``Topology.host_op_time``) -- with
both rank orders when the CP group spans nodes: Q rings on consecutive ranks (``contiguous="q"``)
or KV rings (``"kv"``), i.e. which ring's hops stay inside a node -- and keeps the fastest, ties
(within :data:`TIME_TOLERANCE`) going to fewer inter-node bytes, then fewer bytes, then less
buffer memory, then the flatter tile. ``objective="bytes"`` takes the fewest bytes per rank in
closed form (:func:`~.mesh.best_tile`; it knows neither links nor overlap).

What decides it, per hop of each ring (forward + backward, refetch): the Q ring carries Q, the
partial outputs O (fp32 + LSE), dO and dQ (fp32) of ``heads`` heads; the KV ring carries K, V and
dK, dV (fp32) of ``kv_heads`` heads. With grouped-query attention (heads > kv_heads) the Q ring
carries more per hop, so it is the one worth keeping on NVLink (``contiguous="q"``), and tiles
get taller (smaller a) because Q chunks cost more than KV chunks.

Example: 64 ranks as 8 nodes x 8 H100s, GQA 32/8 heads of dim 128, 1M tokens (16K per rank):
``choose_tile`` returns ``((8, 8), "q")`` -- each Q ring is one node, so Q, O, dO and dQ move
over NVLink and only the KV rings (K, V, dK, dV of 8 heads) cross nodes; by bytes alone the
answer is (4, 16).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .shape import AttentionShape
from .ir import Plan
from .memory import buffer_memory
from .mesh import best_tile, build_mesh_plan, tile_shapes
from .simulate import simulate
from .topology import Topology

__all__ = ["Candidate", "evaluate_plan", "rank_tiles", "choose_tile", "pick_best", "TIME_TOLERANCE", "TIE_RULE"]

# predicted times closer than this count as equal: the model is not more accurate than that, and
# the tie goes to fewer inter-node bytes, then fewer bytes (other traffic shares the network)
TIME_TOLERANCE = 0.01
# the rule in words, for every text that calls a pick "the fastest" (help, tables, reports): written
# from TIME_TOLERANCE so that the number lives in one place
TIE_RULE = f"ties within {TIME_TOLERANCE * 100:g} % going to fewer inter-node bytes"


@dataclass(frozen=True)
class Candidate:
    """One simulated plan: bytes sent per rank (forward + backward), times in seconds."""

    tile: tuple[int, int] | None
    contiguous: str | None
    time_s: float
    forward_s: float
    backward_s: float
    compute_s: float
    bytes_per_rank: int
    intra_node_bytes_per_rank: float  # mean over ranks
    inter_node_bytes_per_rank: float  # mean over ranks
    max_inter_node_bytes: float
    rounds: int  # communication rounds per rank, forward + backward
    peak_buffer_bytes: int
    saved_bytes: int
    held_buffer_bytes: int
    host_s: float = 0.0  # the slowest rank's host issuing its ops, forward + backward (Topology.host_op_time)


def evaluate_plan(plan: Plan, shape: AttentionShape, topo: Topology, contiguous: str | None = None,
                  sim=None) -> Candidate:
    """Simulate ``plan`` on ``topo`` (or take ``sim``, its simulation) and read its buffer memory."""
    sim = sim if sim is not None else simulate(plan, shape, topo)
    mem = buffer_memory(plan, shape)
    return Candidate(plan.facts.tile, contiguous, sim.time, sim.forward.time, sim.backward.time, sim.compute,
                     sim.bytes_sent, sim.intra_bytes, sim.inter_bytes, sim.max_inter_bytes, sim.rounds, mem.peak,
                     mem.saved, mem.held, sim.host)


def pick_best(candidates):
    """The fastest candidate; within :data:`TIME_TOLERANCE` of it, fewest inter-node bytes, then
    fewest bytes, then least buffer memory, then the flatter tile."""
    candidates = list(candidates)
    if not candidates:
        raise ValueError("no candidates to choose from")
    fastest = min(c.time_s for c in candidates)
    close = [c for c in candidates if c.time_s <= fastest * (1 + TIME_TOLERANCE)]
    return min(close, key=lambda c: (c.inter_node_bytes_per_rank, c.bytes_per_rank, c.peak_buffer_bytes,
                                     c.tile or (0, 0), c.contiguous or ""))


def rank_tiles(world_size: int, shape: AttentionShape, topology: Topology | None = None, *, causal: bool = True,
               backward_chunks: str = "refetch", schedule: str = "greedy", tile="auto",
               contiguous: str = "auto") -> list[Candidate]:
    """Every allowed (tile, rank order), fastest first (predicted forward + backward time)."""
    topo = topology if topology is not None else Topology.for_cp(world_size)
    topo.check(world_size)
    spans = topo.nodes_used(world_size) > 1
    out = []
    for a, b in tile_shapes(world_size):
        if tile != "auto" and (a, b) != tuple(tile):
            continue
        for c in (("q", "kv") if spans and a > 1 and b > 1 else ("q",)):
            if contiguous not in ("auto", c) and not (a == 1 or b == 1):
                continue
            plan = build_mesh_plan(world_size, (a, b), shape, causal=causal, schedule=schedule,
                                   backward_chunks=backward_chunks, contiguous=c)
            out.append(evaluate_plan(plan, shape, topo, contiguous=c))
    return sorted(out, key=lambda r: r.time_s)


@lru_cache(maxsize=64)
def choose_tile(world_size: int, shape: AttentionShape, topology: Topology | None = None, *,
                objective: str = "time", tile="auto", contiguous: str = "auto", causal: bool = True,
                backward_chunks: str = "refetch", schedule: str = "greedy") -> tuple[tuple[int, int], str]:
    """The Mesh tile (a, b) and rank order ("q" or "kv", see :class:`~.mesh.TileMap`) for a CP
    group of ``world_size`` ranks on ``topology`` (default: nodes of 8 H100s); ``tile`` /
    ``contiguous`` other than "auto" fix that part of the answer.

    ``topology.gpus_per_node`` must be the number of *CP ranks* that share a node (CP ranks are
    consecutive inside a node). Deterministic: every rank computes the same answer.
    """
    if objective not in ("time", "bytes"):
        raise ValueError(f"objective must be 'time' or 'bytes', got {objective!r}")
    if objective == "bytes":
        t = best_tile(world_size, shape, backward_chunks) if tile == "auto" else tuple(tile)
        return t, "q" if contiguous == "auto" else contiguous
    if tile != "auto" and contiguous != "auto":
        return tuple(tile), contiguous
    best = pick_best(rank_tiles(world_size, shape, topology, causal=causal, backward_chunks=backward_chunks,
                                schedule=schedule, tile=tile, contiguous=contiguous))
    return best.tile, best.contiguous

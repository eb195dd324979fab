"""``auto`` Mesh tile: the tile and rank order the simulator predicts fastest on the machine.

:func:`~megatron_mesh.plan.mesh.best_tile` picks the tile with the fewest bytes per rank in
closed form; it knows neither links nor overlap. :func:`choose_tile` simulates every tile
(a x b = P) -- with both rank orders when the CP group spans nodes: Q rings on consecutive ranks
(``contiguous="q"``) or KV rings (``"kv"``), i.e. which ring's hops stay inside a node -- and
keeps the fastest, ties (within 1 %) going to fewer inter-node bytes, then fewer bytes.

What decides it, per hop of each ring (forward + backward, refetch): the Q ring carries Q, the
partial outputs O (fp32 + LSE), dO and dQ (fp32) of ``heads`` heads; the KV ring carries K, V and
dK, dV (fp32) of ``kv_heads`` heads. With grouped-query attention (heads > kv_heads) the Q ring
carries more per hop, so it is the one worth keeping on NVLink (``contiguous="q"``), and tiles
get taller (smaller a) because Q chunks cost more than KV chunks.

Example: 64 ranks as 8 nodes x 8 H100s, GQA 32/8 heads of dim 128, 1M tokens (16K per rank):
``choose_tile`` returns ``((8, 8), "q")`` -- each Q ring is one node, so Q, O, dO and dQ move
over NVLink and only the KV rings (K, V, dK, dV of 8 heads) cross nodes; ``best_tile`` (bytes
only) says (4, 16).
"""

from __future__ import annotations

from functools import lru_cache

from .accounting import AttentionShape
from .planner import ModeResult, mesh_candidates, pick_best
from .topology import Topology

__all__ = ["choose_tile", "rank_tiles"]


def rank_tiles(world_size: int, shape: AttentionShape, topology: Topology | None = None, *, causal: bool = True,
               backward_chunks: str = "refetch", schedule: str = "greedy") -> list[ModeResult]:
    """Every candidate (tile, rank order), fastest first (predicted forward + backward time)."""
    topo = topology if topology is not None else Topology.for_cp(world_size)
    topo.check(world_size)
    rows = mesh_candidates(world_size, shape, topo, causal, backward_chunks, schedule)
    return sorted(rows, key=lambda r: r.time_s)


@lru_cache(maxsize=64)
def choose_tile(world_size: int, shape: AttentionShape, topology: Topology | None = None, *, causal: bool = True,
                backward_chunks: str = "refetch", schedule: str = "greedy") -> tuple[tuple[int, int], str]:
    """The Mesh tile (a, b) and rank order ("q" or "kv", see :class:`~.mesh.TileMap`) predicted
    fastest for a CP group of ``world_size`` ranks on ``topology`` (default: nodes of 8 H100s).

    ``topology.gpus_per_node`` must be the number of *CP ranks* that share a node (CP ranks are
    consecutive inside a node). Deterministic: every rank computes the same answer.
    """
    topo = topology if topology is not None else Topology.for_cp(world_size)
    topo.check(world_size)
    best = pick_best(mesh_candidates(world_size, shape, topo, causal, backward_chunks, schedule))
    return best.tile, best.contiguous

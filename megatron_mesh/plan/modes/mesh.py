"""Mesh-Attention and ring attention as CP modes: options, resolution (the ``auto`` tile), the
dense plan, the block assignment under a mask, rings, planner candidates.

Ring attention is Mesh with tile 1 x P (every rank computes its whole row of blocks); it is its own
mode because users ask for it by name (Transformer Engine's ``p2p`` algorithm).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from ..autotile import TIE_RULE, choose_tile
from ..mask import Mask
from ..mesh import BACKWARD_CHUNKS, CONTIGUOUS, TileMap, build_mesh_plan, build_ring_plan, parse_tile, tile_shapes
from ..schedule import SCHEDULES
from ..shape import AttentionShape
from ..sparse import TILE_MAP, Assignment
from ..sparse_needs import KEEP_LIMIT, check_keep_limit
from ..topology import Topology
from .base import Mode, Placement, setting, topology_for

__all__ = ["MeshMode", "RingMode", "MeshOptions", "RingOptions", "keep_limit_setting", "backward_words"]

_BACKWARD_HELP = ("'refetch' re-communicates Q/KV chunks in the backward (ring attention's memory); 'keep' keeps "
                  "the forward's (fewer bytes, more activation memory); 'auto', under documents, windows or a "
                  "document layout, keeps on each rank as many of the chunks it pulled as fit in twice its own Q, "
                  "K and V (those its backward reads first; --mesh-backward-keep-limit) and refetches the rest; dense "
                  "plans refetch")


def backward_words(options) -> str:
    """What a placement's backward keeps, in words: its backward chunks, with the keep limit where
    it is not the default (e.g. "auto, keep limit 2.0")."""
    limit = options.backward_keep_limit
    return options.backward_chunks + (f", keep limit {limit}" if limit != KEEP_LIMIT else "")


def keep_limit_setting(flag: str):
    """The ``backward_keep_limit`` option (its Megatron ``flag``): ring's, Mesh's and TASP's."""
    return setting(KEEP_LIMIT, flag=flag, check=check_keep_limit, only_with=("backward_chunks", "auto"),
                   help="under backward chunks 'auto' (documents, windows or a document layout): a rank keeps for "
                        "the backward what it pulled in the forward up to this many times the bytes of its own Q, K "
                        "and V chunk, and pulls the rest again -- more keeps fewer bytes and rounds for more "
                        f"activation memory (default {KEEP_LIMIT}: at most {KEEP_LIMIT:g} more Q + K + V chunks' bytes per "
                        "layer; 1 at most one, 0 keeps nothing, inf everything)")


@dataclass(frozen=True)
class MeshOptions:
    """Mesh-Attention's options (before resolution: ``tile`` / ``contiguous`` may be "auto")."""

    tile: Any = setting("auto", flag="--mesh-tile-shape",
                        help="Mesh tile AxB: each CP rank computes A query chunks x B key/value chunks (A*B = CP "
                             "size; 1xCP is ring attention), or 'auto': the tile the planner predicts fastest ("
                             f"{TIE_RULE})")
    contiguous: Literal[CONTIGUOUS + ("auto",)] = setting(
        "auto", flag="--mesh-contiguous",
        help="which Mesh ring is made of consecutive CP ranks, i.e. stays inside a node ('auto': the planner's "
             "faster one)")
    schedule: Literal[SCHEDULES] = setting("greedy", flag="--mesh-schedule",
                                           help="order of the Mesh pulls: 'greedy' (compute unlocked per byte) or "
                                                "'lockstep'")
    backward_chunks: Literal[BACKWARD_CHUNKS] = setting("auto", flag="--mesh-backward-chunks", help=_BACKWARD_HELP)
    backward_keep_limit: float = keep_limit_setting("--mesh-backward-keep-limit")
    tile_auto: bool = setting(False, help="set by resolution: the tile was 'auto', so under a mask on Megatron's "
                                          "zigzag every tile's block map competes, not only the dense choice")


@dataclass(frozen=True)
class RingOptions:
    backward_chunks: Literal[BACKWARD_CHUNKS] = setting("auto", flag="--mesh-backward-chunks", help=_BACKWARD_HELP)
    backward_keep_limit: float = keep_limit_setting("--mesh-backward-keep-limit")


class MeshMode(Mode):
    name = "mesh"
    Options = MeshOptions
    doc = "Mesh-Attention: each rank computes an a x b tile of the block matrix (a * b = CP size)"
    auto_row = "mesh-auto"
    auto_pool = ("ring",)
    shorthand = ("tile",)
    takes_block_owners = True

    def resolve(self, world_size: int, shape: AttentionShape, topology: Topology | None, ranks_per_node, options,
                mask: Mask) -> Placement:
        tile = parse_tile(options.tile, world_size)
        contiguous = options.contiguous
        tile_auto = options.tile_auto or tile == "auto"
        if tile == "auto" or contiguous == "auto":
            topo = topology_for(world_size, ranks_per_node, topology)
            tile, contiguous = choose_tile(world_size, shape, topo, tile=tile, contiguous=contiguous,
                                           causal=mask.causal, backward_chunks=options.backward_chunks,
                                           schedule=options.schedule)
        return Placement(self.name, world_size, replace(options, tile=tile, contiguous=contiguous, tile_auto=tile_auto),
                         ranks_per_node)

    def build_dense(self, p: Placement, shape: AttentionShape, mask: Mask):
        o = p.options
        return build_mesh_plan(p.world_size, o.tile, shape, causal=mask.causal, schedule=o.schedule,
                               backward_chunks=o.backward_chunks, contiguous=o.contiguous)

    def assignment(self, p: Placement, mask: Mask, layout) -> Assignment:
        """The tile map competes with the query owner by bytes on Megatron's zigzag; a layout that
        places documents itself (THD, balanced) keeps a document on the few ranks that share it,
        where a tile over the whole group would only ship queries and partial outputs away.

        With the ``auto`` tile, every tile map of the group competes (each rank order where it
        differs), each with its own keep decisions: the dense choice knows nothing of the mask.
        Worked example: 8 ranks, 19 documents of 245-13,321 tokens in 64K, heads 2/2 of 32
        (docs/performance.md, "Masks measured on CPU"). The dense choice is 2x4 (4x2 with the host
        left out, ``Topology(host_op_time=0)``: so small a problem is the host's). With refetched
        backward chunks the 8x1 map's busiest rank moves 29.4 MB sent + received against 4x2's
        29.8 MB, so the plan takes 8x1 (its notes say so); with the default "auto" backward
        chunks 4x2 stays the fewest (23.1 MB).

        A layout that names its blocks' owners (``BalancedLayout.owners``) gets them as they are:
        its work balance rests on them."""
        a, b = p.options.tile
        contiguous = p.options.contiguous
        if layout.owners:  # the layout names where its blocks are computed
            return Assignment(owners=(("layout", layout.owner),), tile=(a, b), contiguous=contiguous, compete=False)
        if layout.documents() is not None:
            return Assignment(tile=(a, b), contiguous=contiguous)
        if not p.options.tile_auto:
            return Assignment(owners=((TILE_MAP, TileMap(a, b, contiguous)),) if a > 1 else (), tile=(a, b),
                              contiguous=contiguous)
        # the dense choice last: the builder breaks ties towards the last map
        maps = [((x, y), c) for x, y in tile_shapes(p.world_size) if x > 1 for c in (CONTIGUOUS if y > 1 else ("q",))
                if ((x, y), c) != ((a, b), contiguous)]
        maps += [((a, b), contiguous)] if a > 1 else []
        return Assignment(owners=tuple((TILE_MAP, TileMap(*t, c)) for t, c in maps), tile=(a, b),
                          contiguous=contiguous, tiles=tuple(maps))

    def rings(self, p: Placement) -> dict:
        return TileMap(*p.options.tile, p.options.contiguous).rings()

    def candidates(self, world_size: int, shape: AttentionShape, topo: Topology) -> list[Placement]:
        rpn = topo.ranks_per_node(world_size)
        spans = rpn is not None
        out = []
        for a, b in tile_shapes(world_size):
            if a == 1:
                continue  # ring's own row
            for c in (CONTIGUOUS if spans and b > 1 else ("q",)):
                out.append(Placement(self.name, world_size, MeshOptions(tile=(a, b), contiguous=c), rpn))
        return out

    def describe(self, p: Placement) -> str:
        o = p.options
        return (f"mesh (CP {p.world_size}, tile {o.tile[0]}x{o.tile[1]}, schedule {o.schedule}, backward "
                f"{backward_words(o)}, contiguous {o.contiguous})")


class RingMode(Mode):
    name = "ring"
    Options = RingOptions
    uses_nodes = False  # one ring over every rank, whatever the nodes
    doc = "zigzag ring attention (Transformer Engine's p2p algorithm): Mesh with tile 1 x CP"

    def build_dense(self, p: Placement, shape: AttentionShape, mask: Mask):
        return build_ring_plan(p.world_size, shape, causal=mask.causal, backward_chunks=p.options.backward_chunks)

    def rings(self, p: Placement) -> dict:
        return TileMap(1, p.world_size).rings()

    def describe(self, p: Placement) -> str:
        o = p.options
        backward = "" if (o.backward_chunks, o.backward_keep_limit) == ("auto", KEEP_LIMIT) else \
            f", backward {backward_words(o)}"
        return f"ring (CP {p.world_size}, zigzag ring{backward})"

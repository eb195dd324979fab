"""The plan layer: pure Python (never imports torch).

Sequence layouts, Mesh tile maps, TASP ring decompositions, per-rank op lists, schedules, the
validator and the byte/time accounting. The torch executor and the simulator read the same
:class:`Plan`.
"""

from .accounting import (AttentionShape, RankBytes, block_pairs, buffer_bytes, rank_work, link_bytes, mesh_bytes_formula,
                         plan_bytes, round_link_bytes, tasp_bytes_formula)
from .ir import (AddGrad, Attend, AttendBackward, Free, Key, MergeOut, Plan, Post, RankPlan, Segment,
                 Transfer, Wait, format_op)
from .layout import BlockMask, ZigzagLayout, block_mask, slot_segments, split_evenly
from .mesh import BACKWARD_CHUNKS, CONTIGUOUS, TileMap, best_tile, build_mesh_plan, build_ring_plan, parse_tile, tile_shapes
from .autotile import choose_tile
from .hamiltonian import (chained_rings, hamiltonian_decomposition, hamiltonian_path_decomposition,
                          max_disjoint_hamiltonian_cycles)
from .memory import BufferMemory, buffer_memory
from .schedule import SCHEDULES
from .simulate import SimResult, simulate
from .tasp import LinkLoad, build_tasp_plan, link_load, tasp_rings
from .topology import Topology
from .validate import PlanError, check_cover, check_dataflow, check_matching, dry_run, validate_plan

__all__ = [
    "AttentionShape", "RankBytes", "buffer_bytes", "link_bytes", "round_link_bytes", "mesh_bytes_formula",
    "plan_bytes", "tasp_bytes_formula", "block_pairs", "rank_work",
    "AddGrad", "Attend", "AttendBackward", "Free", "Key", "MergeOut", "Plan", "Post", "RankPlan", "Segment",
    "Transfer", "Wait", "format_op",
    "BlockMask", "ZigzagLayout", "block_mask", "slot_segments", "split_evenly",
    "BACKWARD_CHUNKS", "CONTIGUOUS", "TileMap", "best_tile", "build_mesh_plan", "build_ring_plan", "parse_tile", "tile_shapes",
    "SCHEDULES", "choose_tile", "chained_rings", "hamiltonian_decomposition", "hamiltonian_path_decomposition",
    "max_disjoint_hamiltonian_cycles", "LinkLoad", "build_tasp_plan", "link_load", "tasp_rings", "BufferMemory", "buffer_memory", "SimResult", "simulate", "Topology",
    "PlanError", "check_cover", "check_dataflow", "check_matching", "dry_run", "validate_plan",
]

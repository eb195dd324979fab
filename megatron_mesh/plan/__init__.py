"""The plan layer: pure Python (never imports torch).

Sequence layouts, the mask, Mesh tile maps, TASP ring decompositions, Ulysses hybrids, per-rank
op lists, schedules, the validator and the byte/time accounting. The torch executor and the
simulator read the same :class:`Plan`; :mod:`.modes` is the registry of CP modes and their
:class:`Placement`.
"""

from .accounting import (RankBytes, block_area, block_pairs, buffer_bytes, key_bytes, link_bytes, mesh_bytes_formula,
                         plan_bytes, rank_work, round_link_bytes, tasp_bytes_formula)
from .autotile import choose_tile, rank_tiles
from .balance import BalancedLayout, balanced_layout
from .hamiltonian import (chained_rings, hamiltonian_decomposition, hamiltonian_path_decomposition,
                          max_disjoint_hamiltonian_cycles)
from .hybrid import UlyssesFacts, build_hybrid_plan, inner_shape
from .ir import (KINDS, OP_TYPES, AddGrad, Attend, AttendBackward, Copy, Free, Key, MergeOut, Plan, Post, RankPlan,
                 RowStats, Transfer, Wait, format_op, parse_op)
from .ir.facts import Facts
from .layout import (Layout, SpanLayout, ThdLayout, ZigzagLayout, head_slice, layout_from_text, positions,
                     slot_segments, split_evenly)
from .mask import BlockClass, BlockKind, Mask, classify_block
from .maskkinds import Chunked, MaskKind, Prefix, register_mask_kind
from .memory import BufferMemory, buffer_memory
from .mesh import BACKWARD_CHUNKS, CONTIGUOUS, MeshFacts, TileMap, best_tile, build_mesh_plan, build_ring_plan, parse_tile, tile_shapes
from .modes import HYBRID_PREFIX, MODES, TRANSPORTS, Mode, Placement, get_mode, register, resolve, setting
from .problem import is_dense, normalize
from .schedule import SCHEDULES
from .simulate import SimResult, simulate
from .sel import Segment
from .shape import AttentionShape
from .sparse import Assignment, MaskAwareFacts, build_sparse_plan
from .tasp import LinkLoad, TaspFacts, build_tasp_plan, link_load, tasp_rings
from .topology import Topology
from .validate import PlanError, check_cover, check_dataflow, check_matching, dry_run, validate_plan

__all__ = [
    "AttentionShape", "RankBytes", "buffer_bytes", "key_bytes", "link_bytes", "round_link_bytes", "mesh_bytes_formula",
    "plan_bytes", "tasp_bytes_formula", "block_pairs", "block_area", "rank_work",
    "KINDS", "OP_TYPES", "AddGrad", "Attend", "AttendBackward", "Copy", "Free", "Key", "MergeOut", "Plan", "Post",
    "RankPlan", "RowStats", "Segment", "Transfer", "Wait", "format_op", "parse_op",
    "Facts", "MeshFacts", "TaspFacts", "MaskAwareFacts", "UlyssesFacts",
    "Mask", "MaskKind", "Chunked", "Prefix", "register_mask_kind", "BlockClass", "BlockKind", "classify_block",
    "normalize", "is_dense",
    "Layout", "ZigzagLayout", "ThdLayout", "SpanLayout", "BalancedLayout", "balanced_layout", "layout_from_text", "positions", "head_slice",
    "slot_segments", "split_evenly",
    "BACKWARD_CHUNKS", "CONTIGUOUS", "TileMap", "best_tile", "build_mesh_plan", "build_ring_plan", "parse_tile",
    "tile_shapes", "SCHEDULES", "choose_tile", "rank_tiles", "chained_rings", "hamiltonian_decomposition",
    "hamiltonian_path_decomposition", "max_disjoint_hamiltonian_cycles", "LinkLoad", "build_tasp_plan", "link_load",
    "tasp_rings", "build_sparse_plan", "Assignment", "build_hybrid_plan", "inner_shape", "MODES", "Mode", "Placement",
    "get_mode", "register", "resolve", "setting", "HYBRID_PREFIX", "TRANSPORTS", "BufferMemory", "buffer_memory", "SimResult", "simulate", "Topology",
    "PlanError", "check_cover", "check_dataflow", "check_matching", "dry_run", "validate_plan",
]

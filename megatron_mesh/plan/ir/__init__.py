"""The plan IR: buffer kinds, keys and ops (:mod:`.ops`), rank plans and plans with their text
form (:mod:`.plan`). The selection algebra it builds on is :mod:`megatron_mesh.plan.sel`."""

from ..sel import Segment, Sel, map_runs, parse_sel, relative_selection, sel_len, sel_text, sub_selection
from .ops import (CASTS, KINDS, OP_TYPES, AddGrad, Attend, AttendBackward, Copy, Free, Key, Kind, MergeOut, Op, Post,
                  RowStats, Transfer, Wait, format_op, op_keys, parse_op)
from .plan import Plan, RankPlan, SlotTable

__all__ = ["KINDS", "CASTS", "Kind", "Key", "Transfer", "Post", "Wait", "Attend", "AttendBackward", "MergeOut",
           "AddGrad", "Copy", "RowStats", "Free", "Op", "OP_TYPES", "format_op", "parse_op", "op_keys", "RankPlan",
           "Plan", "SlotTable", "Segment", "Sel", "sel_len", "sel_text", "parse_sel", "sub_selection",
           "relative_selection", "map_runs"]

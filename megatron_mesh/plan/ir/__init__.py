"""The plan IR: buffer kinds, keys and ops (:mod:`.ops`), rank plans (:mod:`.rank`), plans
(:mod:`.plan`) with their typed facts (:mod:`.facts`: one class per mode family, beside its
builder) and their text form (:mod:`.plan_text`). The selection algebra it builds on is
:mod:`megatron_mesh.plan.sel`."""

from ..sel import Segment, Sel, map_runs, parse_sel, relative_selection, sel_len, sel_text, sub_selection
from .ops import (CASTS, KINDS, OP_TYPES, AddGrad, Attend, AttendBackward, Copy, Free, Key, Kind, MergeOut, Op, Post,
                  RowStats, Transfer, Wait, format_op, op_keys, parse_op)
from .facts import Facts
from .plan import Plan, SlotTable
from .rank import RankPlan

__all__ = ["KINDS", "CASTS", "Kind", "Key", "Transfer", "Post", "Wait", "Attend", "AttendBackward", "MergeOut",
           "AddGrad", "Copy", "RowStats", "Free", "Op", "OP_TYPES", "format_op", "parse_op", "op_keys", "RankPlan",
           "Plan", "SlotTable", "Facts", "Segment", "Sel", "sel_len", "sel_text", "parse_sel", "sub_selection",
           "relative_selection", "map_runs"]

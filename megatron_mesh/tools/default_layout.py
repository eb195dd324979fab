"""The planner's rows of layout "auto": what Megatron's default ``--cp-layout auto`` runs -- per
sample and mode the balanced layout's row or the zigzag's, as
:func:`megatron_mesh.plan.choice.choose_layout` picks them (the balanced layout under a window
or full attention, where the choice is not priced).

Example: at 256 GPUs (lognormal:4096 documents, seed 0) the "auto" rows of ring and TASP are the
zigzag's (10.47 and 10.73 ms) and that of ``a2a+tasp`` U 8 the balanced layout's (3.04 ms).
"""

from __future__ import annotations

from dataclasses import replace

from ..plan.balance import balanced_layout
from ..plan.choice import choose_layout
from ..plan.modes import MODES as REGISTRY

__all__ = ["AUTO_LAYOUT", "auto_rows"]

AUTO_LAYOUT = "auto"


def _mode_of(row) -> str:
    """The registered mode a row runs: its own, a derived row's (e.g. mesh-auto: mesh), or the
    pick of the fastest-of-all row (``extra["pick"]``, e.g. "a2a+tasp U 8")."""
    for name, m in REGISTRY.items():
        if row.mode in (name, m.auto_row):
            return name
    return row.extra["pick"].split()[0]


def auto_rows(rows, cu_seqlens, world_size: int, shape, topo, causal: bool, window, ranks_per_node) -> list:
    """Rows of layout "auto" from ``rows`` (the zigzag's and the balanced layout's rows of one
    sample; a row of either missing in the other is left out): each the balanced row or the
    zigzag's of the same mode and all-to-all degree, as ``--cp-layout auto`` chooses for that
    mode; ``extra["auto_pick"]`` says which."""
    zigzag = {(r.mode, r.ulysses): r for r in rows if r.layout == "zigzag"}
    zigzag_by_mode = {r.mode: r for r in rows if r.layout == "zigzag"}
    out = []
    for r in rows:
        if r.layout != "balanced":
            continue
        z = zigzag.get((r.mode, r.ulysses), zigzag_by_mode.get(r.mode))
        if z is None:
            continue
        pick = "balanced"
        if causal and window is None:  # a window keeps the balanced layout (as in Megatron)
            nodes = ranks_per_node if ranks_per_node and ranks_per_node % r.ulysses == 0 else None
            layout = balanced_layout(cu_seqlens, world_size, group=r.ulysses, ranks_per_node=nodes)
            pick = choose_layout(layout, shape, topo, _mode_of(r), r.ulysses)[0]
        row = r if pick == "balanced" else z
        out.append(replace(row, layout=AUTO_LAYOUT, extra={**row.extra, "auto_pick": pick}))
    return out

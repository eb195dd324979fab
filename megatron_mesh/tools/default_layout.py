"""The planner's rows of a derived CP layout (``auto``, Megatron's default ``--cp-layout``): per
sample and mode the row of the layout the kind picks (:meth:`~megatron_mesh.plan.layouts.LayoutKind.pick`:
``auto`` prices the balanced layout against the zigzag for the mode with
:func:`megatron_mesh.plan.choice.pick_layout`, and for Mesh on up to 8 ranks simulates the owners
layout against that; the balanced layout under a window or full attention, where the choice is not
priced).

Example: at 256 GPUs (lognormal:4096 documents, seed 0) the "auto" rows of ring and TASP are the
zigzag's (10.47 and 10.73 ms) and that of ``a2a+tasp`` U 8 the balanced layout's (3.04 ms).
"""

from __future__ import annotations

from dataclasses import replace

from ..plan.modes import MODES as REGISTRY
from .planner import AUTO, _auto_row

__all__ = ["derived_rows", "registered_mode"]


def registered_mode(mode: str) -> str:
    """The registered mode a planner row of ``mode`` runs: itself, or a derived row's (e.g. mesh-auto:
    mesh); ``mode`` itself where none does (the fastest of every mode, Transformer Engine's)."""
    return next((name for name, m in REGISTRY.items() if mode in (name, m.auto_row)), mode)


def derived_rows(kind, rows, sample) -> list:
    """Rows of the derived layout ``kind`` from ``rows`` (the rows of the kinds it picks between,
    :attr:`~megatron_mesh.plan.layouts.LayoutKind.derived_from`, of one ``sample``): per row of the
    first kind, the row of the same mode and all-to-all degree on the kind ``kind.pick`` names for
    that mode (left out where that row is missing); ``extra["auto_pick"]`` says which. The fastest
    of every mode (``auto``, where the first kind has that row) is the fastest of these rows (of
    the registered modes' where there are some): each mode may run on another layout, so ``rows``
    should hold every mode's (:func:`~.layout_rows.layout_rows` plans them all for it)."""
    first = kind.derived_from[0]
    by_name = {name: ({(r.mode, r.ulysses): r for r in rows if r.layout == name},
                      {r.mode: r for r in rows if r.layout == name}) for name in kind.derived_from}
    out, fastest = [], False
    for r in rows:
        if r.layout != first:
            continue
        if r.mode == AUTO:
            fastest = True
            continue
        pick = kind.pick(replace(sample, group=r.ulysses, mode=registered_mode(r.mode)))
        exact, by_mode = by_name[pick]
        row = r if pick == first else exact.get((r.mode, r.ulysses), by_mode.get(r.mode))
        if row is None:
            continue
        out.append(replace(row, layout=kind.name, extra={**row.extra, "auto_pick": pick}))
    pool = [r for r in out if r.mode in REGISTRY] or out  # the modes' own rows (mesh-auto is one of them)
    return out + ([_auto_row(pool)] if fastest and pool else [])

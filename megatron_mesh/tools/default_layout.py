"""The planner's rows of a derived CP layout (``auto``, Megatron's default ``--cp-layout``): per
sample and mode the row of the layout the kind picks (:meth:`~megatron_mesh.plan.layouts.LayoutKind.pick`:
``auto`` prices the balanced layout against the zigzag for the mode with
:func:`megatron_mesh.plan.choice.choose_layout`; the balanced layout under a window or full
attention, where the choice is not priced).

Example: at 256 GPUs (lognormal:4096 documents, seed 0) the "auto" rows of ring and TASP are the
zigzag's (10.47 and 10.73 ms) and that of ``a2a+tasp`` U 8 the balanced layout's (3.04 ms).
"""

from __future__ import annotations

from dataclasses import replace

from ..plan.modes import MODES as REGISTRY

__all__ = ["derived_rows"]


def _mode_of(row) -> str:
    """The registered mode a row runs: its own, a derived row's (e.g. mesh-auto: mesh), or the
    pick of the fastest-of-all row (``extra["pick"]``, e.g. "a2a+tasp U 8")."""
    for name, m in REGISTRY.items():
        if row.mode in (name, m.auto_row):
            return name
    return row.extra["pick"].split()[0]


def derived_rows(kind, rows, sample) -> list:
    """Rows of the derived layout ``kind`` from ``rows`` (the rows of the kinds it picks between,
    :attr:`~megatron_mesh.plan.layouts.LayoutKind.derived_from`, of one ``sample``; a row missing
    from one of them is left out): per row of the first kind, the row of the same mode and
    all-to-all degree on the kind ``kind.pick`` names for that mode; ``extra["auto_pick"]`` says which."""
    first = kind.derived_from[0]
    by_name = {name: ({(r.mode, r.ulysses): r for r in rows if r.layout == name},
                      {r.mode: r for r in rows if r.layout == name}) for name in kind.derived_from}
    out = []
    for r in rows:
        if r.layout != first:
            continue
        same = {name: r if name == first else exact.get((r.mode, r.ulysses), by_mode.get(r.mode))
                for name, (exact, by_mode) in by_name.items()}
        if any(row is None for row in same.values()):
            continue
        pick = kind.pick(replace(sample, group=r.ulysses, mode=_mode_of(r)))
        row = same[pick]
        out.append(replace(row, layout=kind.name, extra={**row.extra, "auto_pick": pick}))
    return out

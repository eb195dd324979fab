"""A mask kind's rule for whole arrays of positions (:meth:`~.base.MaskKind.allowed`): the runtime's
masked kernel calls and the dense reference build their boolean masks with it, from the kind's
pieces (:meth:`~.base.MaskKind.split`) and bands (:meth:`~.base.MaskKind.pair_band`) alone.

Example (``prefix(2)``, one document [0, 4), queries and keys 0..3): parts 0 = {0, 1} (both ways)
and 1 = {2, 3} (causal), so row 1 is [T, T, F, F] and row 3 [T, T, T, T]
(``tests/plan/test_mask_kinds.py::test_vectorised_worked_example``).
"""

from __future__ import annotations

__all__ = ["allowed"]


def allowed(mask, q_pos, k_pos):
    """``mask``'s rule, vectorised: [len(q_pos), len(k_pos)] booleans, entry (a, b) = query
    ``q_pos[a]`` attends key ``k_pos[b]``, for 1-D integer arrays of any library with
    broadcasting arithmetic and comparisons (torch, numpy: this module imports neither)."""
    qg, qp, q_parts = _ids(mask, q_pos)
    kg, kp, k_parts = _ids(mask, k_pos)
    d = q_pos[:, None] - k_pos[None, :]
    ok = None
    for a in q_parts:
        for b in k_parts:
            lo, hi = mask.pair_band(a, b)
            if lo > hi:
                continue
            both = (d >= lo) & (d <= hi)
            if len(q_parts) > 1 or len(k_parts) > 1:
                both = both & (qp[:, None] == a) & (kp[None, :] == b)
            ok = both if ok is None else ok | both
    same = (qg[:, None] == kg[None, :]) & (qg[:, None] >= 0)
    return same & (d != d) if ok is None else same & ok


def _ids(mask, pos):
    """Per position, its group id (-1: padding) and part, and the parts present (array
    arithmetic only: the pieces of the positions' range, each adds its ids)."""
    groups, parts = pos * 0 - 1, pos * 0
    present: set = set()
    if len(pos):
        lo, hi = int(pos.min()), int(pos.max()) + 1
        for _, a, n, g, part in mask.split([(lo, hi - lo)]):
            if g is None:
                continue
            inside = (pos >= a) & (pos < a + n)
            groups = groups + inside * (g + 1)
            parts = parts + inside * part
            present.add(part)
    return groups, parts, sorted(present)

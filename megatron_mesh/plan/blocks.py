"""Block ops shared by the ring-shaped builders (Mesh, TASP): consecutive blocks of one query
buffer under the same kernel mask become one kernel call."""

from __future__ import annotations

from .ir import Attend, AttendBackward, Key, Op
from .mask import BlockKind

__all__ = ["block_ops"]


def block_ops(q: Key, blocks, backward: bool) -> list[Op]:
    """Attend (or AttendBackward) ops for blocks of one query buffer ``q``: ``blocks`` is a list of
    (kv key, kernel mask, rows, cols) (None rows/cols: the whole buffer); consecutive full blocks
    with the same rows share one kernel call (their columns concatenated).

    Example: [(kv3, full, None, None), (kv1, full, None, None)] -> ``attend q0 x kv3,kv1 full -> o0``."""
    groups: list[list] = []
    for kv, kind, rows, col in blocks:
        if groups and kind == BlockKind.FULL and groups[-1][0] == BlockKind.FULL and groups[-1][1] == rows:
            groups[-1][2].append(kv)
            groups[-1][3].append(col)
        else:
            groups.append([kind, rows, [kv], [col]])
    ops: list[Op] = []
    for kind, rows, kvs, cols in groups:
        cols_t = None if all(x is None for x in cols) else tuple(cols)
        if backward:
            ops.append(AttendBackward(q, q._replace(kind="do"), tuple(kvs), q._replace(kind="dq"),
                                      tuple(k._replace(kind="dkv") for k in kvs), rows, cols_t, BlockKind(kind)))
        else:
            ops.append(Attend(q, tuple(kvs), q._replace(kind="o"), rows, cols_t, BlockKind(kind)))
    return ops

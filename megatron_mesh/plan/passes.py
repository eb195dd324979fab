"""Lowering passes shared by every plan builder."""

from __future__ import annotations

from .ir import Free, Key, Op, Post, Wait

__all__ = ["insert_frees"]


def insert_frees(ops: list[Op], keep: set[Key]) -> tuple[Op, ...]:
    """Add a :class:`Free` after the last use of every buffer not in ``keep``.

    A buffer that is sent is in use until the Wait of its round (the transport reads it until
    then), so its Free goes after that Wait.
    """
    last: dict[Key, int] = {}
    round_wait: dict[int, int] = {op.round: i for i, op in enumerate(ops) if type(op) is Wait}
    for i, op in enumerate(ops):
        reads, writes = op.reads(), op.writes()
        for k in writes:
            last[k] = i
        if type(op) is Post:
            for k in reads:
                last[k] = round_wait.get(op.round, i)
            for k in writes:  # a received buffer exists from its Wait on
                last[k] = max(last.get(k, i), round_wait.get(op.round, i))
        else:
            for k in reads:
                last[k] = max(last.get(k, i), i)
    frees_after: dict[int, list[Key]] = {}
    for k, i in last.items():
        if k not in keep:
            frees_after.setdefault(i, []).append(k)
    out: list[Op] = []
    for i, op in enumerate(ops):
        out.append(op)
        freed = frees_after.get(i)
        if freed:
            out.extend(Free(k) for k in sorted(freed))
    return tuple(out)

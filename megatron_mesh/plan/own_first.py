"""A mask-aware plan's ``own_first`` choices (:func:`~.sparse.build_sparse_plan`, :mod:`.polish`):
(rank, direction, k) -- that rank runs the first k calls of its own block (one per document, in
row order) before its other blocks in that direction, the rest after -- checked, and as the plan
header's text (``own_first=3b2,7f0``). Pure functions, no plan: the builder checks k against the
rank's own calls.
"""

from __future__ import annotations

import re

__all__ = ["check_own_first", "own_first_text", "parse_own_first"]


def check_own_first(P: int, given) -> tuple[tuple[int, str, int], ...]:
    """``given`` (rank, direction, k) entries, checked and sorted (one per rank and direction)."""
    out = {}
    for entry in given:
        x, direction, k = entry
        if not (type(x) is int and 0 <= x < P) or direction not in ("forward", "backward") or \
                not (type(k) is int and k >= 0) or (x, direction) in out:
            raise ValueError(f"own_first entries are (rank 0..{P - 1}, 'forward' or 'backward', own calls k >= 0), "
                             f"one per rank and direction; got {entry!r} in {tuple(given)!r}")
        out[x, direction] = k
    return tuple((x, d, k) for (x, d), k in sorted(out.items()))


def own_first_text(own_first: tuple) -> str:
    """The header's text of a plan's ``own_first``: ``3b2,7f0`` (rank 3's backward runs its own
    block's first 2 calls before its other blocks, rank 7's forward none); ``-`` for none."""
    return ",".join(f"{x}{d[0]}{k}" for x, d, k in own_first) or "-"


def parse_own_first(text: str) -> tuple:
    """:func:`own_first_text` read back (ValueError naming an entry that is not rank, f or b, and k)."""
    if text == "-":
        return ()
    out = []
    for e in text.split(","):
        got = re.fullmatch(r"(\d+)([fb])(\d+)", e)
        if got is None:
            raise ValueError(f"plan header own_first={text}: entry {e!r} is not a rank, f or b, and a count of "
                             "own calls (e.g. 3b2: rank 3's backward runs its own block's first 2 calls first)")
        out.append((int(got[1]), "forward" if got[2] == "f" else "backward", int(got[3])))
    if len({(x, d) for x, d, _ in out}) < len(out):
        raise ValueError(f"plan header own_first={text}: a rank and direction twice")
    return tuple(sorted(out))

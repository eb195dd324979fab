"""How quantities are written for people: one formatter of byte counts for the planner, the report
and the training log (binary units, two decimals: ``format_bytes(3 * 2**20) == '3.00 MiB'``), and
counts of things with the noun in the right number (``count(1, "ring") == '1 ring'``)."""

from __future__ import annotations

import operator

__all__ = ["format_bytes", "count", "as_int"]


def format_bytes(n: float | None) -> str:
    """``n`` bytes in B / KiB / MiB / GiB / TiB ('-' for None: a quantity not measured)."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, plural unless n is 1 (``plural``: when it is not noun + "s").

    >>> count(1, "ring"), count(8, "GPU"), count(0, "slot")
    ('1 ring', '8 GPUs', '0 slots')
    """
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def as_int(value) -> int | None:
    """``value`` as an int (numpy / torch integer scalars pass through their ``__index__``), or
    None for anything else -- a float (16.0 too), a bool or a string is never truncated."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None

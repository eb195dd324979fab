"""How quantities are written for people: one formatter of byte counts for the planner, the report
and the training log (binary units, two decimals: ``format_bytes(3 * 2**20) == '3.00 MiB'``)."""

from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(n: float | None) -> str:
    """``n`` bytes in B / KiB / MiB / GiB / TiB ('-' for None: a quantity not measured)."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"

"""Token selections: the algebra every other plan module builds on (a leaf: imports nothing of the
package).

A *selection* is a tuple of :class:`Segment` -- token ranges [start, stop) of a buffer (or of a
rank's local tokens), in buffer order; ``None`` means "all of it". A *run* is (global start,
length): consecutive global positions. Layouts describe a rank's tokens as runs with their local
offsets, ``(local, start, length)``.

Worked example: a buffer made of local segments ((10, 14), (20, 24)) -- 8 tokens -- and the
selection ((2, 6),) of that buffer::

    sub_selection(((10, 14), (20, 24)), ((2, 6),))   == ((12, 14), (20, 22))   # in local coordinates
    relative_selection(((12, 14), (20, 22)), ((10, 14), (20, 24))) == ((2, 6),) # and back
    map_runs(((0, 100, 16), (16, 300, 16)), ((12, 14), (20, 22)))  == ((112, 2), (304, 2))
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Segment", "Sel", "sel_len", "sel_text", "parse_sel", "sub_selection", "relative_selection", "map_runs",
           "union_intervals", "merge_runs"]


class Segment(NamedTuple):
    """Token range [start, stop) of a buffer (or of a rank's local chunk)."""

    start: int
    stop: int


Sel = tuple  # tuple[Segment, ...]: token ranges of a buffer, in order


def sel_len(sel: Sel | None, whole: int) -> int:
    """Tokens in selection ``sel`` of a buffer of ``whole`` tokens."""
    return whole if sel is None else sum(s.stop - s.start for s in sel)


def sel_text(sel: Sel | None) -> str:
    return "" if sel is None else "[" + ",".join(f"{s.start}:{s.stop}" for s in sel) + "]"


def parse_sel(text: str | None) -> Sel | None:
    if not text:
        return None
    body = text.strip()[1:-1]
    out = []
    for part in body.split(","):
        a, b = part.split(":")
        out.append(Segment(int(a), int(b)))
    return tuple(out)


def _append(out: list[Segment], seg: Segment) -> None:
    if out and out[-1].stop == seg.start:
        out[-1] = Segment(out[-1].start, seg.stop)
    else:
        out.append(seg)


def sub_selection(segments: Sel, sel: Sel | None) -> Sel:
    """Compose: the tokens ``sel`` (indices into the concatenation of ``segments``) as ranges of
    the space ``segments`` index into (see the module docstring)."""
    if sel is None:
        return tuple(segments)
    out: list[Segment] = []
    for lo, hi in sel:
        pos = 0
        for s0, s1 in segments:
            n = s1 - s0
            a, b = max(lo, pos), min(hi, pos + n)
            if a < b:
                _append(out, Segment(s0 + a - pos, s0 + b - pos))
            pos += n
    return tuple(out)


def relative_selection(sel: Sel, within: Sel) -> Sel:
    """Inverse of :func:`sub_selection`: the ranges ``sel`` (inside ``within``) as indices into
    the concatenation of ``within``."""
    out: list[Segment] = []
    for lo, hi in sel:
        pos = 0
        for w0, w1 in within:
            a, b = max(lo, w0), min(hi, w1)
            if a < b:
                _append(out, Segment(pos + a - w0, pos + b - w0))
            pos += w1 - w0
    if sum(b - a for a, b in out) != sum(b - a for a, b in sel):
        raise ValueError(f"selection {sel} is not inside {within}")
    return tuple(out)


def map_runs(runs, segs: Sel) -> tuple[tuple[int, int], ...]:
    """Global position runs (start, length) of the local ``segs`` of a chunk whose tokens are
    ``runs`` (local offset, global start, length)."""
    out: list[tuple[int, int]] = []
    for s in segs:
        for local, start, length in runs:
            a, b = max(s.start, local), min(s.stop, local + length)
            if a < b:
                pos = start + a - local
                if out and out[-1][0] + out[-1][1] == pos:
                    out[-1] = (out[-1][0], out[-1][1] + b - a)
                else:
                    out.append((pos, b - a))
    return tuple(out)


def union_intervals(intervals) -> tuple[Segment, ...]:
    """Sorted, merged segments covering ``intervals`` ((start, stop) pairs)."""
    out: list[Segment] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1].stop:
            if b > out[-1].stop:
                out[-1] = Segment(out[-1].start, b)
        else:
            out.append(Segment(a, b))
    return tuple(out)


def merge_runs(runs) -> list[tuple[int, int]]:
    """(start, length) runs with touching neighbours joined."""
    out: list[tuple[int, int]] = []
    for s, n in runs:
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((s, n))
    return out

"""Token selections: the algebra every other plan module builds on (a leaf: imports nothing of the
package).

A *selection* is a tuple of :class:`Segment` -- disjoint token ranges [start, stop) of a buffer
(or of a rank's local tokens), in the order they are read (the buffer's order, except where a
fused kernel call takes its columns in position order and the layout's local order differs);
``None`` means "all of it". A *run* is (global start, length): consecutive global positions.
Layouts describe a rank's tokens as runs with their local offsets, ``(local, start, length)``.

Worked example: a buffer made of local segments ((10, 14), (20, 24)) -- 8 tokens -- and the
selection ((2, 6),) of that buffer::

    sub_selection(((10, 14), (20, 24)), ((2, 6),))   == ((12, 14), (20, 22))   # in local coordinates
    relative_selection(((12, 14), (20, 22)), ((10, 14), (20, 24))) == ((2, 6),) # and back
    map_runs(((0, 100, 16), (16, 300, 16)), ((12, 14), (20, 22)))  == ((112, 2), (304, 2))
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import accumulate
from typing import NamedTuple

__all__ = ["Segment", "Sel", "minus_intervals", "sel_len", "sel_text", "parse_sel", "sub_selection", "segment_begins",
           "relative_selection", "selection_index", "map_runs", "union_intervals", "merge_runs", "first_at"]


class Segment(NamedTuple):
    """Token range [start, stop) of a buffer (or of a rank's local chunk)."""

    start: int
    stop: int


Sel = tuple  # tuple[Segment, ...]: token ranges of a buffer, in order


def sel_len(sel: Sel | None, whole: int) -> int:
    """Tokens in selection ``sel`` of a buffer of ``whole`` tokens."""
    if sel is None:
        return whole
    return sel[0].stop - sel[0].start if len(sel) == 1 else sum(s.stop - s.start for s in sel)


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


def first_at(offsets: list[int], pos: int) -> int:
    """Index of the last of ascending ``offsets`` at or before ``pos`` (0 if none): where a scan
    for the runs overlapping a range that starts at ``pos`` begins."""
    return max(0, bisect_right(offsets, pos) - 1)


def _append(out: list[Segment], seg: Segment) -> None:
    if out and out[-1].stop == seg.start:
        out[-1] = Segment(out[-1].start, seg.stop)
    else:
        out.append(seg)


def segment_begins(segments: Sel) -> list[int]:
    """Where each of ``segments`` begins in their concatenation (and, last, its length)."""
    return list(accumulate((s1 - s0 for s0, s1 in segments), initial=0))


def sub_selection(segments: Sel, sel: Sel | None, begins: list[int] | None = None) -> Sel:
    """Compose: the tokens ``sel`` (indices into the concatenation of ``segments``) as ranges of
    the space ``segments`` index into (see the module docstring). ``begins``:
    :func:`segment_begins` of ``segments``, when the caller keeps it for many selections."""
    if sel is None:
        return tuple(segments)
    # where each segment begins in the concatenation: a bisection finds a range's first segment,
    # so a buffer of thousands of documents' runs costs O(n log n), not O(n^2)
    begins = segment_begins(segments) if begins is None else begins
    out: list[Segment] = []
    for lo, hi in sel:
        for n in range(first_at(begins, lo), len(segments)):
            pos = begins[n]
            if pos >= hi:
                break
            s0, s1 = segments[n]
            a, b = max(lo, pos), min(hi, pos + s1 - s0)
            if a < b:
                _append(out, Segment(s0 + a - pos, s0 + b - pos))
    return tuple(out)


def selection_index(within: Sel) -> tuple[list[int], list[int], bool]:
    """What :func:`relative_selection` reads of ``within`` for every selection inside it: where
    each range begins in the concatenation, the ranges' starts, and whether they ascend."""
    begins = list(accumulate((w1 - w0 for w0, w1 in within), initial=0))
    ordered = all(a.stop <= b.start for a, b in zip(within, within[1:]))
    return begins, [w0 for w0, _ in within], ordered


def relative_selection(sel: Sel, within: Sel, index: tuple | None = None) -> Sel:
    """Inverse of :func:`sub_selection`: the ranges ``sel`` (inside ``within``) as indices into
    the concatenation of ``within``. ``index``: :func:`selection_index` of ``within``, when the
    caller keeps it for many selections (a buffer of thousands of documents' ranges)."""
    # ``within`` in ascending order (a chunk's runs are) lets a bisection find the first overlap
    begins, starts, ordered = selection_index(within) if index is None else index
    out: list[Segment] = []
    want = got = 0  # every token of sel must be found in within (joining touching pieces keeps the sum)
    for lo, hi in sel:
        want += hi - lo
        first = first_at(starts, lo) if ordered else 0
        for n in range(first, len(within)):
            w0, w1 = within[n]
            if ordered and w0 >= hi:
                break
            a, b = max(lo, w0), min(hi, w1)
            if a < b:
                got += b - a
                _append(out, Segment(begins[n] + a - w0, begins[n] + b - w0))
    if got != want:
        raise ValueError(f"selection {sel} is not inside {within}")
    return tuple(out)


def map_runs(runs, segs: Sel, locals_: list[int] | None = None) -> tuple[tuple[int, int], ...]:
    """Global position runs (start, length) of the local ``segs`` of a chunk whose tokens are
    ``runs`` (local offset, global start, length; in local order, as layouts give them);
    ``locals_``: their local offsets, when the caller keeps them for many selections."""
    runs = tuple(runs)
    locals_ = [local for local, _, _ in runs] if locals_ is None else locals_
    out: list[tuple[int, int]] = []
    for s in segs:
        for n in range(first_at(locals_, s.start), len(runs)):
            local, start, length = runs[n]
            if local >= s.stop:
                break
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
    items = sorted(intervals)
    if len(items) < 2:  # most blocks' rows and columns are one interval: no merge to do
        return (Segment(*items[0]),) if items else ()
    out: list[Segment] = []
    start, stop = items[0]
    for a, b in items:  # one Segment per merged interval (thousands of documents' rows join into few)
        if a <= stop:
            if b > stop:
                stop = b
        else:
            out.append(Segment(start, stop))
            start, stop = a, b
    out.append(Segment(start, stop))
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


def minus_intervals(segs: list[Segment], cut: list[Segment]) -> list[Segment]:
    """The parts of ``segs`` outside ``cut`` (disjoint; ``cut`` sorted: a bisection finds the first
    of it a segment meets, so thousands of documents' rows cost O(n log n), not O(n^2)).
    Example: ``minus_intervals([(0, 10)], [(2, 4), (6, 7)])`` is ``[(0, 2), (4, 6), (7, 10)]``."""
    out = []
    for a, b in segs:
        i = bisect_left(cut, (a,))  # the first piece of cut starting at a or later, or the one before it
        if i and cut[i - 1][1] > a:
            i -= 1
        for i in range(i, len(cut)):
            c, d = cut[i]
            if c >= b:
                break
            if c > a:
                out.append(Segment(a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append(Segment(a, b))
    return out

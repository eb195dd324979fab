"""How long the planner takes: the cyclic garbage collector held back while it plans, and the
rows past a time budget -- each row's planning time estimated before any is planned -- left out up
front, named in one line (what the comparison of every layout did for THD alone above 64 ranks).

A row's time is one plan of every rank and one simulation of it, so it grows with the ranks,
with the documents' pieces (a rank's own block is cut per document) and with the pairs of ranks
that share a document (a block each). :func:`row_seconds` prices a row from those three counts
(:class:`LayoutSize`, from the documents and the layout's rule, no plan built), with costs per
unit measured on this project's 2-core build machine (docs/performance.md, "Planner speed").

Worked example (CP 1024, 1M tokens, 4,096 documents of mean 256 tokens, the zigzag): 1,024 ranks,
about 5,100 pieces and 7,200 pairs; ring costs about 1.4 s, a2a+ring U 2 about 2 s: a budget of
40 s plans every mode's first candidates on each layout and leaves most Mesh tiles out.
"""

from __future__ import annotations

import gc
import math
import time
from bisect import bisect_right
from contextlib import contextmanager
from dataclasses import dataclass

from ..plan.balance import document_work
from ..plan.layout import ThdLayout, ZigzagLayout

__all__ = ["planning_gc", "set_planning_gc", "LayoutSize", "layout_size", "thd_size", "problem_size", "row_seconds",
           "balanced_size", "Rows", "budget_rows", "Budget", "BUDGET_S", "BUDGET_REASON", "LATE_REASON", "DEADLINE_SLACK_S"]

# the collector's first threshold while planning: plans and the caches shared between rows are
# millions of small objects, and with the default (700) its passes over them took a fifth of the
# planner's time (CP 1024, 1M tokens of lognormal documents)
PLANNING_GC_THRESHOLD = 100_000


def set_planning_gc() -> None:
    """Collect less often in this process (a worker of ``--jobs`` runs it first)."""
    _, second, third = gc.get_threshold()
    gc.set_threshold(PLANNING_GC_THRESHOLD, second, third)


@contextmanager
def planning_gc():
    """:func:`set_planning_gc` while the block runs, the caller's thresholds after it."""
    before = gc.get_threshold()
    set_planning_gc()
    try:
        yield
    finally:
        gc.set_threshold(*before)


@dataclass(frozen=True)
class LayoutSize:
    """What a mask-aware row's planning time grows with on one layout: its ranks, its pieces --
    (rank, document) pairs summed over the ranks -- and its blocks between ranks, estimated as the
    pairs of ranks that share a document (a window keeps a rank's piece to its neighbours)."""

    ranks: int
    pieces: int
    pairs: int


def _doc_pairs(holders: int, length: int, window) -> int:
    """Blocks of one document held by ``holders`` ranks: every pair of them, or under a window of
    ``window`` tokens only those within reach (each holder's piece about ``length / holders``)."""
    if window is None or holders <= 1:
        return holders * holders
    reach = 1 + 2 * -(-window * holders // max(1, length))
    return holders * min(holders, reach)


def layout_size(layout, bounds, window=None) -> LayoutSize:
    """:class:`LayoutSize` of ``layout`` (any layout with ``runs(rank)``) for the documents
    ``bounds`` ((start, stop), ...; None: one document over the sequence) under a causal window of
    ``window`` tokens (None: none). Linear in the layout's runs: a document inside one run is one
    piece of one rank; the ranks holding the documents at the runs' ends are counted."""
    P = layout.world_size
    bounds = bounds if bounds is not None else ((0, layout.seq_len),)
    starts = [a for a, _ in bounds]
    pieces = 0
    ends: dict[int, set] = {}
    for r in range(P):
        for _, start, n in layout.runs(r):
            d0 = bisect_right(starts, start) - 1
            d1 = bisect_right(starts, start + n - 1) - 1
            pieces += d1 - d0 + 1
            ends.setdefault(d0, set()).add(r)
            ends.setdefault(d1, set()).add(r)
    pairs = sum(_doc_pairs(len(rs), bounds[d][1] - bounds[d][0], window) for d, rs in ends.items() if len(rs) > 1)
    return LayoutSize(P, pieces, pairs)


def thd_size(world_size: int, lengths, window=None) -> LayoutSize:
    """:class:`LayoutSize` of Transformer Engine's THD layout of documents of ``lengths`` tokens
    (each padded to a multiple of 2 x CP and zigzag-split on its own: every rank holds two
    pieces of every document, padding or not, and the ranks holding its real tokens share it)."""
    P = world_size
    pairs = 0
    for n in lengths:
        half = -(-n // (2 * P))  # tokens of each of the document's 2P halves
        holders = min(P, -(-n // half))
        pairs += _doc_pairs(holders, n, window) if holders > 1 else 0
    return LayoutSize(P, 2 * P * len(lengths), pairs)

def problem_size(world_size: int, seq_len: int, mask, layout) -> LayoutSize | None:
    """:class:`LayoutSize` of one layout of a problem (``layout`` None: Megatron's zigzag of
    ``seq_len`` tokens, the documents the mask's); None when nothing is mask-aware (a dense plan
    takes milliseconds)."""
    docs = mask.documents if layout is None else layout.documents()
    window = mask.window[0]
    if docs is None and window is None:
        return None
    if isinstance(layout, ThdLayout):
        return thd_size(world_size, layout.seq_lens, window)
    return layout_size(ZigzagLayout(world_size, seq_len) if layout is None else layout, docs, window)


# seconds of a row (a plan of every rank and its simulation, one core of the build machine,
# docs/performance.md "Planner speed"): per rank; per pair of ranks sharing a document, by layout;
# per piece, once per layout and all-to-all degree (the index of the documents, their cuts into
# kernel calls and the balanced layout of a degree are shared by the rows that run on them)
PER_RANK_S = 8e-4
# (the balanced layout's counts are estimated, :func:`balanced_size`: about half its pairs).
# Transformer Engine's own rows on THD ("te") simulate two ranks of a ring: their pieces, every row
PER_PAIR_S = {"zigzag": 8e-5, "balanced": 4.5e-4, "thd": 2.3e-4, "te": 0.0}
PER_PIECE_S = {"zigzag": 2e-5, "balanced": 3e-5, "thd": 2e-5, "te": 1.5e-4}
# and per piece in every row of the plugin's modes (its rank's own calls, their writes and their
# simulation): 1M 1-token documents cost about 9 s a row at 1024 ranks on the zigzag. On THD far
# more: each document padded to 2P tokens, a ring row of 16,384 1-token documents at 8 ranks
# (262,144 pieces) ran over 99 s of CPU unfinished -- priced so that it is left out; TE's own rows
# there alike (every TE row pays its pieces: they share nothing)
PER_ROW_PIECE_S = {"zigzag": 8e-6, "balanced": 8e-6, "thd": 1.5e-4, "te": 0.0}


def row_seconds(size: LayoutSize, layout: str, ulysses: int = 1, first: bool = True) -> float:
    """Estimated seconds to plan and simulate one mask-aware row on a layout of ``size`` (its kind
    ``layout``: zigzag, balanced, thd, or te for Transformer Engine's own rows on THD); ``first``:
    the first row of its layout and all-to-all
    degree ``ulysses``, which builds what the others reuse. A hybrid's inner plan runs over
    fewer, longer chunks: its pairs cost about 1/sqrt(U) of a plain mode's."""
    s = PER_RANK_S * size.ranks + PER_PAIR_S[layout] * size.pairs / math.sqrt(ulysses)
    s += PER_ROW_PIECE_S[layout] * size.pieces
    return s + (PER_PIECE_S[layout] * size.pieces if first else 0.0)


# the planner's default budget: the estimated seconds of mask-aware rows it plans (the rest of a
# run -- layouts, formulas, the table -- fits in what is left of a minute on 2 cores)
BUDGET_S = 40.0


def _tile(p) -> tuple[int, int] | None:
    tile = getattr((p.inner or p).options, "tile", None) if p is not None else None
    return tuple(tile) if tile else None


def preference(p) -> tuple:
    """The order a mode's placements are admitted in: the squarest tile first (the one that moves
    the fewest bytes on dense attention, and the likeliest pick), the smaller all-to-all degree
    first, query-contiguous ranks first."""
    if p is None:
        return ()
    tile = _tile(p)
    squareness = 0.0 if tile is None else abs(math.log2(tile[0] / tile[1]))
    return (squareness, p.ulysses, getattr((p.inner or p).options, "contiguous", None) not in (None, "q"))


@dataclass(frozen=True)
class Rows:
    """The rows one layout would plan: ``tasks`` (mode name, placement -- None for Transformer
    Engine's own rows -- all-to-all degree), in the planner's order, and the layout's size (None:
    dense plans, not budgeted)."""

    layout: str
    kind: str  # zigzag, balanced or thd: which costs per unit apply
    tasks: tuple
    size: LayoutSize | None


def budget_rows(name: str, tasks, world_size: int, shape, mask, layout, kind: str | None = None,
                size: LayoutSize | None = None) -> Rows:
    """Layout ``name``'s rows ``tasks`` ((mode name, placement), ...) as the budget prices them:
    ``kind`` (the costs per unit: zigzag, balanced or thd) and ``size`` when the caller knows them
    (a balanced layout's size is estimated from the documents, :func:`balanced_size`), else from
    ``layout`` (None: the zigzag; a function of the placement: its first placement's)."""
    if callable(layout):
        layout = layout(tasks[0][1]) if tasks else None
    if kind is None:
        kind = "zigzag" if layout is None else "thd" if isinstance(layout, ThdLayout) else "balanced"
    if size is None:
        size = problem_size(world_size, world_size * shape.seq_local, mask, layout)
    return Rows(name, kind, tuple((m, p, p.ulysses) for m, p in tasks), size)


class Budget:
    """The estimated planning seconds a run may still spend (None: no limit): :meth:`admit` takes
    rows from it, :meth:`portion` sets part of it aside for one sample. The estimates are a
    machine's (docs/performance.md); where they are wrong a clock backs them up: once the
    budget's seconds and :data:`DEADLINE_SLACK_S` more have passed since it was made, :meth:`late`
    says so, and the rows not yet planned are left out. ``clock``: seconds, monotonic -- by default
    this process's CPU time, so that a busy machine stretches the run but leaves out the same rows
    (with worker processes, wall time: the caller's CPU waits); a test's own."""

    def __init__(self, seconds: float | None, parent: "Budget | None" = None, clock=time.process_time):
        if seconds is not None and not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"the planning budget must be a finite number of seconds >= 0 (0: no limit), got "
                             f"{seconds!r}")
        self.left = float(seconds) if seconds else None
        self.parent = parent
        self.admitted: dict[str, float] = {}  # per layout, the estimated seconds :meth:`admit` took for its rows
        self.clock = clock if parent is None else parent.clock
        # the time after which nothing more is planned: the whole run's (a sample's share keeps it)
        self.deadline = (parent.deadline if parent is not None else
                         None if self.left is None else clock() + self.left + DEADLINE_SLACK_S)

    def late(self) -> bool:
        """Whether the run is past its deadline (rows not yet planned are then left out)."""
        return self.deadline is not None and self.clock() >= self.deadline

    @property
    def limited(self) -> bool:
        return self.left is not None

    def portion(self, parts: int) -> "Budget":
        """1/``parts`` of what is left, for one of ``parts`` samples planned one after another
        (what one leaves goes to the next); what it spends is spent here too."""
        return Budget(None if self.left is None else self.left / max(1, parts) or 1e-9, self)

    def spend(self, seconds: float) -> None:
        if self.left is not None:
            self.left -= seconds
        if self.parent is not None:
            self.parent.spend(seconds)

    def admit(self, layouts: list[Rows]) -> dict[str, list[bool]]:
        """Which rows of ``layouts`` fit, per layout: every mode's likeliest placement
        (:func:`preference`) on every layout, then every mode's second, and so on, each taken
        while its estimate (:func:`row_seconds`) fits in what is left -- so a cheap row still
        fits after a dear one did not. Rows of a dense layout (size None) always fit."""
        keep = {rows.layout: [rows.size is None or not self.limited] * len(rows.tasks) for rows in layouts}
        queues = []  # per (layout, mode): its task indices by preference
        for rows in layouts:
            by_mode: dict[str, list[int]] = {}
            for i, (name, p, _) in enumerate(rows.tasks):
                by_mode.setdefault(name, []).append(i)
            queues += [(rows, sorted(ix, key=lambda i, rows=rows: preference(rows.tasks[i][1])))
                       for ix in by_mode.values()]
        paid: set = set()  # (layout, degree) whose first row was admitted
        for k in range(max((len(q) for _, q in queues), default=0)):
            for rows, q in queues:
                if k >= len(q) or keep[rows.layout][q[k]]:
                    continue
                _, p, u = rows.tasks[q[k]]
                kind = rows.kind if p is not None else "te"  # Transformer Engine's rows: no placement
                cost = row_seconds(rows.size, kind, u, first=p is None or (rows.layout, u) not in paid)
                if cost <= self.left:
                    keep[rows.layout][q[k]] = True
                    paid.add((rows.layout, u))
                    self.spend(cost)
                    self.admitted[rows.layout] = self.admitted.get(rows.layout, 0.0) + cost
        return keep

    @staticmethod
    def skipped(tasks, keep: list[bool], reason: str = "") -> list[dict]:
        """The planner's "not available" entries for the ``tasks`` (mode name first) :meth:`admit`
        (or :meth:`late`) left out: one per mode, with how many of its placements, and one reason
        for all (the table prints it once; default :data:`BUDGET_REASON`)."""
        out: dict[str, list[int]] = {}
        for task, kept in zip(tasks, keep):
            counts = out.setdefault(task[0], [0, 0])
            counts[0] += not kept
            counts[1] += 1
        return [{"mode": f"{name} ({k} of {n} placements)" if n > 1 else name, "reason": reason or BUDGET_REASON}
                for name, (k, n) in out.items() if k]


BUDGET_REASON = ("left out up front, past the planning budget (the planner estimates each row's time from the ranks, "
                 "the documents' pieces and the ranks sharing a document, and plans every mode's likeliest placements "
                 "first); --plan-budget 0 plans every row")
# the clock's backstop: rows admitted but not planned when the run is its budget and this many
# seconds old are left out (the default: 45 s, so that the row in progress and what follows the rows --
# the auto layout's picks, the table -- fit in the minute on a busy machine too)
DEADLINE_SLACK_S = 5.0
LATE_REASON = (f"left out: the run spent its planning budget and {DEADLINE_SLACK_S:g} s more (CPU seconds; wall seconds "
               "with --jobs) before planning it, the estimates being low for this machine; --plan-budget 0 plans "
               "every row")


def balanced_size(world_size: int, bounds, causal: bool = True, window=None) -> LayoutSize:
    """:class:`LayoutSize` of the balanced layout of the documents ``bounds``, estimated without
    building it (a million documents take seconds to place): a document whose work or tokens
    exceed a rank's share is cut into that many pieces on as many ranks, and each rank's last
    piece may be cut once more to fill it."""
    P = world_size
    S = bounds[-1][1]
    w = (window, 0 if causal else window)
    works = [document_work(0, b - a, b - a, causal, w) for a, b in bounds]
    mean = max(1.0, sum(works) / P)
    pieces, pairs = P, 4 * P
    for (a, b), work in zip(bounds, works):
        holders = min(P, max(math.ceil(work / mean), math.ceil((b - a) * P / S)))
        pieces += holders
        pairs += _doc_pairs(holders, b - a, window) if holders > 1 else 0
    return LayoutSize(P, pieces, pairs)

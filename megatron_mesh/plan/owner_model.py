"""The bytes and work of a layout whose blocks are computed where it names (``BalancedLayout.owners``),
in the family the owner-choosing builders search: causal attention over packed documents (no window),
*long* documents (work above the mean per-rank work, or more tokens than a rank holds) poured in
contiguous portions into the room the others leave along an order of the ranks, every other document
whole on one rank. ``scripts/search_layout.py`` anneals over it; :mod:`.balance_owners` builds in it.

:meth:`Problem.score` counts what Mesh's plan of the layout moves (``plan_bytes``: forward + backward,
portions kept for the backward where :class:`~.sparse_needs.Keeps` keeps them) and what each rank
computes (``rank_work``), without building the plan: for the block of rank i's queries against rank
j's keys computed on rank h, h pulls i's rows of each document they share (Q, and dO in the
backward; O and dQ go back) unless h = i, and j's columns (K/V; dK/dV go back) unless h = j -- once
per (h, i) or (h, j) and document, however many blocks h computes with them. Worked example
(``BalancedLayout``'s: one document of 12 tokens on 3 ranks of 4): the query owner computes 10, 26
and 42 pairs; with block (2, 0) on rank 0, 26 each, and each rank sends one portion per block it
takes part in (``tests/plan/test_balance_owners.py`` checks the model against the plans).
"""

from __future__ import annotations

from .balance import BalancedLayout
from .docwork import document_work
from .shape import AttentionShape
from .sparse_needs import KEEP_LIMIT, kept_chunks, token_bytes

__all__ = ["Problem", "State", "pairs", "first_homes", "layout_of"]


def pairs(n: int) -> int:
    """Causal (query, key) pairs of n tokens of one document among themselves (the balanced
    layout's rule: :func:`~.docwork.document_work`)."""
    return document_work(0, n, n)


class State:
    """Where each short document lives (``home``), the order the long ones are poured along, and
    the rank of each block that is not its query owner's (``owners``: (i, j) -> h)."""

    def __init__(self, home: dict[int, int], order: list[int], owners: dict[tuple[int, int], int]):
        self.home, self.order, self.owners = home, order, owners

    def owner(self, i: int, j: int) -> int:
        return self.owners.get((i, j), i)


class Problem:
    """One sample: P ranks of T tokens, the documents' lengths, bytes per token of each buffer, and
    what a rank keeps for the backward of what it pulled (``keep_limit`` x its own Q, K and V)."""

    def __init__(self, world: int, lengths: list[int], shape: AttentionShape, keep_limit: float = KEEP_LIMIT):
        self.P, self.T, self.lengths, self.keep_limit = world, shape.seq_local, lengths, keep_limit
        self.token = token_bytes(shape)
        self.mean = sum(pairs(n) for n in lengths) / world
        # poured longest first: the longest gets the first ranks' room
        self.long = sorted((d for d, n in enumerate(lengths) if pairs(n) > self.mean or n > self.T),
                           key=lambda d: (-lengths[d], d))
        self.long_set = set(self.long)
        self.short = [d for d in range(len(lengths)) if d not in self.long_set]

    def portions(self, state: State) -> list[list[tuple[int, int, int]]] | None:
        """Each rank's (document, start, end): the short documents at their homes, then the long
        ones poured in order into what is left, rank by rank along ``state.order``; None where the
        homes overfill a rank."""
        ranks: list[list[tuple[int, int, int]]] = [[] for _ in range(self.P)]
        left = [self.T] * self.P
        for d, r in state.home.items():
            ranks[r].append((d, 0, self.lengths[d]))
            left[r] -= self.lengths[d]
        if min(left) < 0:
            return None
        at = 0
        for d in self.long:
            lo = 0
            while lo < self.lengths[d]:
                while left[state.order[at]] == 0:
                    at += 1
                r = state.order[at]
                take = min(left[r], self.lengths[d] - lo)
                ranks[r].append((d, lo, lo + take))
                left[r] -= take
                lo += take
        return ranks

    def score(self, state: State):
        """(busiest rank's bytes sent, work max/mean, sent per rank, work per rank, portions), or
        None for a state that overfills a rank."""
        ranks = self.portions(state)
        if ranks is None:
            return None
        P, tb = self.P, self.token
        work = [sum(pairs(b - a) for _, a, b in pcs) for pcs in ranks]
        where: dict[int, list[tuple[int, int, int]]] = {}
        for r, pcs in enumerate(ranks):
            for d, a, b in pcs:
                where.setdefault(d, []).append((r, a, b))
        rows: dict[tuple[int, int], set] = {}  # (computing rank, query rank) -> documents whose rows it reads
        cols: dict[tuple[int, int], set] = {}
        for d, pcs in where.items():
            for i, a, b in pcs:
                for j, c, e in pcs:
                    if i != j and e <= a:  # j's portion comes first: i's rows see all of it
                        h = state.owner(i, j)
                        work[h] += (b - a) * (e - c)
                        if h != i:
                            rows.setdefault((h, i), set()).add(d)
                        if h != j:
                            cols.setdefault((h, j), set()).add(d)
        portion = {(r, d): b - a for r, pcs in enumerate(ranks) for d, a, b in pcs}
        row_n = {k: sum(portion[k[1], d] for d in ds) for k, ds in rows.items()}
        col_n = {k: sum(portion[k[1], d] for d in ds) for k, ds in cols.items()}
        pulled: list[dict[int, int]] = [{} for _ in range(P)]  # rank -> chunk -> bytes it pulled of it
        for (h, i), n in row_n.items():
            pulled[h][i] = pulled[h].get(i, 0) + n * tb["q"]
        for (h, j), n in col_n.items():
            pulled[h][j] = pulled[h].get(j, 0) + n * tb["kv"]
        budget = self.keep_limit * self.T * (tb["q"] + tb["kv"])
        kept = [kept_chunks(h, P, pulled[h], budget) for h in range(P)]
        sent = [0] * P
        for (h, i), n in row_n.items():
            sent[i] += n * (tb["q"] * (1 if i in kept[h] else 2) + tb["do"])
            sent[h] += n * (tb["o"] + tb["dq"])
        for (h, j), n in col_n.items():
            sent[j] += n * tb["kv"] * (1 if j in kept[h] else 2)
            sent[h] += n * tb["dkv"]
        return max(sent), max(work) / self.mean, sent, work, ranks


def first_homes(problem: Problem) -> dict[int, int]:
    """Each short document, longest first, on the rank with the most room left: a start that
    overfills no rank wherever the documents allow one (ValueError naming them where not)."""
    left = [problem.T] * problem.P
    home = {}
    for d in sorted(problem.short, key=lambda d: (-problem.lengths[d], d)):
        r = max(range(problem.P), key=lambda r: (left[r], -r))
        if problem.lengths[d] > left[r]:
            raise ValueError(f"the short documents do not fit whole on {problem.P} ranks of {problem.T} tokens "
                             f"(document {d} of {problem.lengths[d]} tokens finds at most {left[r]} left)")
        home[d] = r
        left[r] -= problem.lengths[d]
    return home


def layout_of(problem: Problem, bounds: list[int], state: State, ranks) -> BalancedLayout:
    """The BalancedLayout of ``ranks``' portions (each rank's runs in position order), with the
    owners of the blocks that exist and are not their query owner's."""
    runs = tuple(tuple(sorted((bounds[d] + a, b - a) for d, a, b in pcs)) for pcs in ranks)
    docs_of = [{d for d, _, _ in pcs} for pcs in ranks]
    owners = tuple(sorted((i, j, h) for (i, j), h in state.owners.items()
                          if h != i and docs_of[i] & docs_of[j] & problem.long_set))
    return BalancedLayout(problem.P, runs, tuple(zip(bounds, bounds[1:])), owners=owners)

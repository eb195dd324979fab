"""Hamiltonian decompositions of the complete directed graph: the rings TASP moves KV slots on.

In an NVSwitch node every GPU can send to every other GPU at full speed at once: the topology is
the complete directed graph K*_n, with an arc i -> j for each ordered pair of distinct ranks. One
ring uses n of its n(n-1) arcs. A *Hamiltonian decomposition* is a set of n - 1 directed cycles,
each through all n ranks, that together use every arc exactly once; TASP sends one KV slot around
each of them, so every link carries traffic in every step.

Constructions (one exists for every n except 4 and 6 -- Tillson, 1980):

* **n odd** -- rotated zigzags. Rank inf = n - 1 is fixed and the others are Z_N (N = n - 1, even).
  The zigzag z = 0, 1, -1, 2, -2, ... of Z_N steps by +1, -2, +3, ..., which hits every nonzero
  residue exactly once, so the N cycles (inf, z + i), i in Z_N, use every arc inside Z_N once, and
  every arc into and out of inf once. (Walecki's cycles, each in both directions.)
* **n even, n >= 8** -- the odd construction on n - 1 ranks (inf1 = n - 2 fixed) plus a second
  fixed rank inf2 = n - 1: in each of the n - 2 cycles one arc x -> y becomes x -> inf2 -> y. The
  n - 2 arcs taken out must form a Hamiltonian path inf1 -> v1 -> ... -> v(n-2) over the old ranks;
  the last cycle is (inf2, inf1, v1, ..., v(n-2)). For n = 0 (mod 4) the arcs taken out follow a
  closed formula (reverse-engineered from TASP's ``gen_hamilton_circle``; it fails for n = 2 mod
  4). For n = 2 (mod 4) the path is found by a search (:func:`search_insertion_path`); the paths
  for n <= 98 are stored in :mod:`._hamiltonian_paths` and re-verified by the tests, larger n are
  searched on first use (seconds to minutes).
* **n = 2**: the cycle (0, 1). **n = 1**: no cycles. **n = 4, 6**: no decomposition exists;
  :func:`max_disjoint_hamiltonian_cycles` gives n - 2 arc-disjoint cycles (the most possible).

Multi-node: with u nodes of m GPUs, TASP chains one intra-node Hamiltonian *path* per ring across
the nodes (:func:`chained_rings`). The m paths decompose K*_m (:func:`hamiltonian_path_decomposition`:
delete one rank from a cycle decomposition of K*_(m+1)); because every rank is the last rank of
exactly one path, every rank sends exactly one slot to the next node per step.

Worked example (n = 5: N = 4, z = 0, 1, 3, 2, inf = 4; each cycle listed from rank 0)::

    C0 = (inf, 0, 1, 3, 2) -> [0, 1, 3, 2, 4]        C2 = (inf, 2, 3, 1, 0) -> [0, 4, 2, 3, 1]
    C1 = (inf, 1, 2, 0, 3) -> [0, 3, 4, 1, 2]        C3 = (inf, 3, 0, 2, 1) -> [0, 2, 1, 4, 3]

    C2 is C0 reversed and C3 is C1 reversed; the 4 cycles x 5 arcs are the 20 arcs of K*_5.

Multi-node example (m = 4 GPUs per node, u = 2 nodes): zigzag paths P_r = r + (0, 1, 3, 2) mod 4,
ring r = P_r on node 0 followed by P_r + 4 on node 1::

    ring 0: 0 1 3 2 | 4 5 7 6     inter-node arcs 2 -> 4, 6 -> 0
    ring 1: 1 2 0 3 | 5 6 4 7     inter-node arcs 3 -> 5, 7 -> 1
    ring 2: 2 3 1 0 | 6 7 5 4     inter-node arcs 0 -> 6, 4 -> 2
    ring 3: 3 0 2 1 | 7 4 6 5     inter-node arcs 1 -> 7, 5 -> 3   (each rank sends once)
"""

from __future__ import annotations

import random
from functools import lru_cache
from typing import Sequence

__all__ = [
    "hamiltonian_decomposition",
    "max_disjoint_hamiltonian_cycles",
    "hamiltonian_path_decomposition",
    "chained_rings",
    "check_cycles",
    "check_paths",
    "search_insertion_path",
    "disjoint_cycle_search",
    "NO_DECOMPOSITION",
    "NO_PATH_DECOMPOSITION",
]

# K*_n has no Hamiltonian decomposition for these n (Tillson 1980; the tests check it exhaustively).
NO_DECOMPOSITION = (4, 6)
# K*_m has no decomposition into Hamiltonian paths for these m (checked exhaustively by the tests).
NO_PATH_DECOMPOSITION = (3, 5)


def hamiltonian_decomposition(n: int) -> list[list[int]]:
    """n - 1 directed Hamiltonian cycles of K*_n that use every ordered pair (i, j), i != j, once.

    Each cycle is a list of the n ranks starting at rank 0; it closes from its last rank back to
    its first. Raises ValueError for n = 4 and n = 6, where no such set exists.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if n in NO_DECOMPOSITION:
        raise ValueError(
            f"the complete directed graph on {n} ranks has no Hamiltonian decomposition (Tillson's "
            f"theorem: every n except 4 and 6 has one); use max_disjoint_hamiltonian_cycles({n}) for the "
            f"largest arc-disjoint set ({n - 2} cycles)")
    return [list(c) for c in _decomposition(n)]


def max_disjoint_hamiltonian_cycles(n: int) -> list[list[int]]:
    """The largest set of arc-disjoint directed Hamiltonian cycles of K*_n this module builds:
    the full decomposition (n - 1 cycles), or n - 2 cycles for n = 4 and 6 (n - 1 is impossible
    there, so n - 2 is the maximum)."""
    if isinstance(n, int) and n in NO_DECOMPOSITION:
        return [list(c) for c in _small_disjoint_cycles(n)]
    return hamiltonian_decomposition(n)


def hamiltonian_path_decomposition(m: int) -> list[list[int]]:
    """m directed Hamiltonian paths of K*_m that use every ordered pair once (m >= 1).

    Every rank starts exactly one path and ends exactly one (a rank has m - 1 out-arcs and sits
    on m paths, so it is the last rank of exactly one). Even m: the zigzag paths r + z. Odd m: the
    cycles of K*_(m+1) with rank m deleted. Raises ValueError for m = 3 and 5 (none exists).
    """
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"gpus per node must be a positive integer, got {m!r}")
    if m in NO_PATH_DECOMPOSITION:
        raise ValueError(
            f"the complete directed graph on {m} ranks has no decomposition into {m} Hamiltonian paths "
            f"(none exists for 3 and 5), so TASP cannot chain rings over nodes of {m} GPUs; "
            f"use one node (ranks_per_node=None; gpus_per_node=None in the Python API: one flat decomposition "
            f"over the whole CP group)")
    return [list(p) for p in _path_decomposition(m)]


def chained_rings(gpus_per_node: int, nodes: int) -> list[list[int]]:
    """The multi-node TASP rings: ring r runs path r of :func:`hamiltonian_path_decomposition` on
    node 0, then the same path on node 1, ..., and closes back to node 0. Ranks are numbered node
    by node (rank = node * gpus_per_node + local rank). The rings are arc-disjoint and every rank
    has exactly one inter-node out-arc and one in-arc over all of them."""
    if not isinstance(nodes, int) or nodes < 2:
        raise ValueError(f"chained rings need at least 2 nodes, got {nodes!r} (one node: use "
                         "hamiltonian_decomposition)")
    paths = hamiltonian_path_decomposition(gpus_per_node)
    return [[node * gpus_per_node + x for node in range(nodes) for x in p] for p in paths]


# -- verification ----------------------------------------------------------------------------------

def _arcs_of(cycle: Sequence[int], closed: bool) -> list[tuple[int, int]]:
    arcs = list(zip(cycle, cycle[1:]))
    if closed and len(cycle) > 1:
        arcs.append((cycle[-1], cycle[0]))
    return arcs


def check_cycles(cycles: Sequence[Sequence[int]], n: int, complete: bool = True) -> None:
    """Raise ValueError unless every cycle visits all n ranks once, no arc is used twice and
    (``complete``) the cycles use all n(n-1) arcs."""
    _check(cycles, n, closed=True, complete=complete, what="cycle")


def check_paths(paths: Sequence[Sequence[int]], n: int) -> None:
    """Raise ValueError unless the paths are Hamiltonian and use every arc of K*_n exactly once."""
    _check(paths, n, closed=False, complete=True, what="path")


def _check(walks, n: int, closed: bool, complete: bool, what: str) -> None:
    seen: dict[tuple[int, int], int] = {}
    for i, w in enumerate(walks):
        if sorted(w) != list(range(n)):
            raise ValueError(f"{what} {i} {list(w)} does not visit each of the {n} ranks exactly once")
        for arc in _arcs_of(w, closed):
            if arc in seen:
                raise ValueError(f"arc {arc[0]}->{arc[1]} is in {what}s {seen[arc]} and {i}")
            seen[arc] = i
    if complete and len(seen) != n * (n - 1):
        raise ValueError(f"the {what}s use {len(seen)} of the {n * (n - 1)} arcs of K*_{n}")


# -- constructions ---------------------------------------------------------------------------------

def _zigzag(N: int) -> list[int]:
    """0, 1, -1, 2, -2, ... (mod N), N entries; for even N its steps hit every nonzero residue once."""
    z = [0]
    k = 1
    while len(z) < N:
        z.append(k % N)
        if len(z) < N:
            z.append(-k % N)
        k += 1
    return z


def _from_zero(cycle: Sequence[int]) -> tuple[int, ...]:
    i = list(cycle).index(0)
    return tuple(cycle[i:]) + tuple(cycle[:i])


def _rotated_zigzags(n: int) -> list[list[int]]:
    """n odd: the N = n - 1 cycles (inf, z + i) with inf = n - 1, as lists starting at inf."""
    N = n - 1
    z = _zigzag(N)
    return [[N] + [(x + i) % N for x in z] for i in range(N)]


@lru_cache(maxsize=None)
def _decomposition(n: int) -> tuple[tuple[int, ...], ...]:
    if n == 1:
        return ()
    if n == 2:
        return ((0, 1),)
    if n % 2:
        cycles = _rotated_zigzags(n)
    else:
        base = _rotated_zigzags(n - 1)
        path = _tasp_insertion_path(n) if n % 4 == 0 else _stored_or_searched_path(n)
        cycles = _insert_second_fixed_rank(n, base, path)
    out = tuple(_from_zero(c) for c in cycles)
    check_cycles(out, n)  # cheap (O(n^2)); a wrong table or formula must never reach a plan
    return out


def _insert_second_fixed_rank(n: int, base: list[list[int]], path: Sequence[int]) -> list[list[int]]:
    """Insert inf2 = n - 1 into the base cycles along the arcs of inf1 -> path (one arc per cycle)
    and add the cycle (inf2, inf1, path)."""
    inf1, inf2 = n - 2, n - 1
    owner = {arc: i for i, c in enumerate(base) for arc in _arcs_of(c, closed=True)}
    cut: dict[int, tuple[int, int]] = {}
    for arc in zip([inf1, *path], path):
        i = owner.get(arc)
        if i is None or i in cut:
            raise ValueError(f"insertion path for n={n} is invalid at arc {arc}")
        cut[i] = arc
    if len(cut) != len(base):
        raise ValueError(f"insertion path for n={n} cuts {len(cut)} of {len(base)} cycles")
    cycles = []
    for i, c in enumerate(base):
        x, _ = cut[i]
        j = c.index(x) + 1
        cycles.append(c[:j] + [inf2] + c[j:])
    cycles.append([inf2, inf1, *path])
    return cycles


def _tasp_insertion_path(n: int) -> list[int]:
    """n = 0 (mod 4), n >= 8: the arcs TASP's gen_hamilton_circle takes out (cycle i, listed from
    inf1, loses the arc ending at its position s_i), chained from inf1 into the insertion path."""
    k, N = n // 4 - 1, n - 2
    shifts = [2 * k] * N
    shifts[0], shifts[k + 1], shifts[2 * k + 2], shifts[3 * k + 2] = 1, 4 * k + 2, 3, 4 * k
    nxt = {}
    for c, s in zip(_rotated_zigzags(n - 1), shifts):
        nxt[c[s - 1]] = c[s % len(c)]
    path, v = [], N
    while v in nxt and len(path) < N:
        v = nxt[v]
        path.append(v)
    return path


def _stored_or_searched_path(n: int) -> list[int]:
    if n < 8:
        raise ValueError(f"no Hamiltonian decomposition of K*_{n}")
    from ._hamiltonian_paths import INSERTION_PATHS

    stored = INSERTION_PATHS.get(n)
    return list(stored) if stored is not None else search_insertion_path(n)


def search_insertion_path(n: int, seed: int = 0) -> list[int]:
    """n even, n >= 8: a path 0 = v1, ..., v(n-2) through Z_(n-2) such that inf1 -> v1 and the
    path's arcs lie in distinct base cycles (see the module docstring), found by depth-first
    search with forward checking, fewest-continuations-first ordering and seeded random restarts.

    Deterministic for a given seed. Fast up to n ~ 70 (under ~3 s), slower beyond; v1 = 0 loses
    nothing because rotating a solution by +1 gives a solution.
    """
    if n < 8 or n % 2:
        raise ValueError(f"the insertion path is defined for even n >= 8, got {n}")
    N = n - 2
    cycle_of = [[-1] * N for _ in range(N)]  # cycle_of[a][b]: the base cycle holding arc a -> b
    for i, c in enumerate(_rotated_zigzags(n - 1)):
        for a, b in _arcs_of(c, closed=True):
            if a < N and b < N:
                cycle_of[a][b] = i
    by_cycle: list[list[tuple[int, int]]] = [[] for _ in range(N)]
    for a in range(N):
        for b in range(N):
            if a != b:
                by_cycle[cycle_of[a][b]].append((a, b))
    rng = random.Random(seed)
    budget = 50 * N
    while True:
        path = _search_attempt(N, cycle_of, by_cycle, rng, budget)
        if path is not None:
            return path


def _search_attempt(N: int, cycle_of, by_cycle, rng: random.Random, budget: int) -> list[int] | None:
    # v1 = 0, and arc inf1 -> 0 lies in base cycle 0
    path, visited, used = [0], [False] * N, [False] * N
    visited[0] = used[0] = True
    nodes = [0]

    def feasible() -> bool:
        # every unused cycle still has an arc from the path's end or an unvisited rank to an unvisited rank
        end = path[-1]
        return all(used[i] or any((a == end or not visited[a]) and not visited[b] for a, b in by_cycle[i])
                   for i in range(N))

    def onward(u: int) -> int:
        return sum(1 for w in range(N) if not visited[w] and not used[cycle_of[u][w]])

    def dfs() -> bool:
        nodes[0] += 1
        if nodes[0] > budget:
            return False
        if len(path) == N:
            return True
        v = path[-1]
        options = []
        for u in range(N):
            if visited[u] or used[cycle_of[v][u]]:
                continue
            visited[u] = used[cycle_of[v][u]] = True
            deg = onward(u)
            visited[u] = used[cycle_of[v][u]] = False
            if deg or len(path) == N - 1:
                options.append((deg, rng.random(), u))
        for _, _, u in sorted(options):
            i = cycle_of[v][u]
            path.append(u)
            visited[u] = used[i] = True
            if feasible() and dfs():
                return True
            path.pop()
            visited[u] = used[i] = False
        return False

    return path if dfs() else None


@lru_cache(maxsize=None)
def _small_disjoint_cycles(n: int) -> tuple[tuple[int, ...], ...]:
    """n - 2 arc-disjoint Hamiltonian cycles of K*_n for n = 4, 6, by exhaustive search."""
    found = disjoint_cycle_search(n, n - 2)
    if found is None:  # pragma: no cover - the tests show n - 2 cycles exist for 4 and 6
        raise RuntimeError(f"no {n - 2} arc-disjoint Hamiltonian cycles found for n={n}")
    return found


def disjoint_cycle_search(n: int, count: int) -> tuple[tuple[int, ...], ...] | None:
    """``count`` arc-disjoint Hamiltonian cycles of K*_n by exhaustive search, or None if there
    are none (small n only: it enumerates all (n-1)! cycles through rank 0)."""
    import itertools

    cycles = [(0, *p) for p in itertools.permutations(range(1, n))]
    arcs = [frozenset(_arcs_of(c, closed=True)) for c in cycles]
    chosen: list[int] = []

    def extend(start: int, taken: frozenset) -> bool:
        if len(chosen) == count:
            return True
        for i in range(start, len(cycles)):
            if not (arcs[i] & taken):
                chosen.append(i)
                if extend(i + 1, taken | arcs[i]):
                    return True
                chosen.pop()
        return False

    return tuple(cycles[i] for i in chosen) if extend(0, frozenset()) else None


@lru_cache(maxsize=None)
def _path_decomposition(m: int) -> tuple[tuple[int, ...], ...]:
    if m == 1:
        return ((0,),)
    if m % 2 == 0:
        z = _zigzag(m)
        paths = [tuple((x + r) % m for x in z) for r in range(m)]
    else:
        paths = []
        for c in _decomposition(m + 1):
            j = c.index(m)
            paths.append(c[j + 1:] + c[:j])
    check_paths(paths, m)
    return tuple(paths)

"""Hamiltonian decompositions of K*_n (TASP's rings) and the multi-node chained rings.

The checks here are written independently of megatron_mesh.plan.hamiltonian.check_cycles: each
cycle is Hamiltonian, no arc is used twice and all n(n-1) arcs are covered.
"""

import itertools

import pytest

from megatron_mesh.plan import hamiltonian as H
from megatron_mesh.plan._hamiltonian_paths import INSERTION_PATHS


def _arcs(walk, closed):
    arcs = list(zip(walk, walk[1:]))
    return arcs + [(walk[-1], walk[0])] if closed else arcs


def assert_decomposition(cycles, n, complete=True):
    assert all(sorted(c) == list(range(n)) for c in cycles), "a cycle misses or repeats a rank"
    arcs = [a for c in cycles for a in _arcs(c, closed=True)]
    assert len(arcs) == len(set(arcs)), "two cycles share an arc"
    assert all(i != j for i, j in arcs)
    if complete:
        assert len(cycles) == n - 1
        assert set(arcs) == {(i, j) for i in range(n) for j in range(n) if i != j}


@pytest.mark.parametrize("n", [n for n in range(2, 65) if n not in (4, 6)])
def test_decomposition_for_every_n_up_to_64(n):
    cycles = H.hamiltonian_decomposition(n)
    assert_decomposition(cycles, n)
    assert all(c[0] == 0 for c in cycles)
    assert cycles == H.max_disjoint_hamiltonian_cycles(n)


def test_decomposition_beyond_64_closed_forms():
    for n in [*range(65, 130, 2), *range(68, 200, 4)]:  # odd n and n = 0 (mod 4): closed forms
        assert_decomposition(H.hamiltonian_decomposition(n), n)


def test_stored_insertion_paths_all_verify():
    assert set(INSERTION_PATHS) == set(range(10, max(INSERTION_PATHS) + 1, 4))
    assert max(INSERTION_PATHS) >= 66
    for n in INSERTION_PATHS:
        assert_decomposition(H.hamiltonian_decomposition(n), n)


def test_search_is_deterministic_and_valid():
    for n in (10, 14, 18, 22, 30, 12, 16):  # the search also works for n = 0 (mod 4)
        path = H.search_insertion_path(n, seed=3)
        assert path == H.search_insertion_path(n, seed=3)
        assert_decomposition(H._insert_second_fixed_rank(n, H._rotated_zigzags(n - 1), path), n)


def test_small_cases():
    assert H.hamiltonian_decomposition(1) == []
    assert H.hamiltonian_decomposition(2) == [[0, 1]]
    assert H.hamiltonian_decomposition(3) == [[0, 1, 2], [0, 2, 1]]
    # the module docstring's worked example
    assert H.hamiltonian_decomposition(5) == [[0, 1, 3, 2, 4], [0, 3, 4, 1, 2], [0, 4, 2, 3, 1], [0, 2, 1, 4, 3]]
    for bad in (0, -3, 2.5, "8"):
        with pytest.raises(ValueError):
            H.hamiltonian_decomposition(bad)


@pytest.mark.parametrize("n", [4, 6])
def test_4_and_6_raise_and_fall_back_to_n_minus_2_cycles(n):
    with pytest.raises(ValueError, match=f"{n} ranks has no Hamiltonian decomposition"):
        H.hamiltonian_decomposition(n)
    cycles = H.max_disjoint_hamiltonian_cycles(n)
    assert len(cycles) == n - 2
    assert_decomposition(cycles, n, complete=False)
    # exhaustive: n - 1 arc-disjoint Hamiltonian cycles (a decomposition) do not exist
    assert H.disjoint_cycle_search(n, n - 1) is None
    assert H.disjoint_cycle_search(5, 4) is not None  # the same search does find decompositions


def _exhaustive_path_decomposition(m):
    """Whether m arc-disjoint Hamiltonian paths of K*_m exist. Each rank starts exactly one path of
    any such set (it has m - 1 in-arcs and every path not starting at it enters it once), so path
    s may be taken to start at rank s."""
    arcs_by_start = [[frozenset(_arcs((s, *p), closed=False))
                      for p in itertools.permutations([r for r in range(m) if r != s])] for s in range(m)]

    def extend(s, taken):
        return s == m or any(not a & taken and extend(s + 1, taken | a) for a in arcs_by_start[s])

    return extend(0, frozenset())


@pytest.mark.parametrize("m", [m for m in range(1, 33) if m not in (3, 5)])
def test_path_decomposition(m):
    paths = H.hamiltonian_path_decomposition(m)
    assert len(paths) == m
    assert all(sorted(p) == list(range(m)) for p in paths)
    arcs = [a for p in paths for a in _arcs(p, closed=False)]
    assert len(arcs) == len(set(arcs)) == m * (m - 1)
    # every rank starts one path and ends one: one inter-node receive and send once chained
    assert sorted(p[0] for p in paths) == sorted(p[-1] for p in paths) == list(range(m))


@pytest.mark.parametrize("m", [3, 5])
def test_no_path_decomposition_for_3_and_5(m):
    with pytest.raises(ValueError, match="no decomposition into"):
        H.hamiltonian_path_decomposition(m)
    assert not _exhaustive_path_decomposition(m)
    assert _exhaustive_path_decomposition(m + 1)


@pytest.mark.parametrize("m,u", [(1, 3), (2, 2), (2, 5), (4, 2), (4, 4), (6, 3), (7, 2), (8, 2), (8, 4), (9, 2), (16, 2)])
def test_chained_rings_one_inter_node_arc_per_rank(m, u):
    P = m * u
    rings = H.chained_rings(m, u)
    assert len(rings) == m
    assert_decomposition(rings, P, complete=False)
    node = lambda r: r // m  # noqa: E731
    arcs = [a for ring in rings for a in _arcs(ring, closed=True)]
    inter = [(i, j) for i, j in arcs if node(i) != node(j)]
    intra = [(i, j) for i, j in arcs if node(i) == node(j)]
    # per step every ring moves one slot per rank, so these counts are per rank per step
    assert sorted(i for i, _ in inter) == list(range(P)), "each rank sends exactly once to another node"
    assert sorted(j for _, j in inter) == list(range(P)), "each rank receives exactly once from another node"
    assert all(node(j) == (node(i) + 1) % u for i, j in inter)
    assert set(intra) == {(i, j) for i in range(P) for j in range(P) if i != j and node(i) == node(j)}


def test_chained_rings_worked_example():
    assert H.chained_rings(4, 2) == [[0, 1, 3, 2, 4, 5, 7, 6], [1, 2, 0, 3, 5, 6, 4, 7],
                                     [2, 3, 1, 0, 6, 7, 5, 4], [3, 0, 2, 1, 7, 4, 6, 5]]
    with pytest.raises(ValueError, match="at least 2 nodes"):
        H.chained_rings(4, 1)
    with pytest.raises(ValueError, match="no decomposition into"):
        H.chained_rings(5, 2)

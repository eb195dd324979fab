"""The choice's per-unit sums of its pulls (plan/layout_pulls.py: ``_pull_sums``, ``_kept``) against
their plain forms, and the communication's lower bound (``_Rounds.bound``) against the rounds it
bounds: at most the ring shifts' walk, the same as TASP's rounds; and where it decides the pick
(one 329K-token document on every rank of 256) it decides as the whole price does."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_mesh.plan import AttentionShape, Topology, balanced_layout
from megatron_mesh.plan.accounting import buffer_bytes
from megatron_mesh.plan.choice import _price_parts, choose_layout, pick_layout
from megatron_mesh.plan.layout_pulls import _kept, _pull_sums, _Rounds, _sums_of
from megatron_mesh.plan.sparse_needs import kept_chunks
from megatron_mesh.tools.plan_args import document_bounds

GQA = dict(heads=32, kv_heads=8, head_dim=128, itemsize=2)


def _random_pulls(rng: random.Random, units: int, density: float, big: int = 99):
    """Per puller, holder -> (tokens >= 1, rows >= 0), holders in a random order."""
    pulls = []
    for g in range(units):
        holders = [h for h in range(units) if h != g and rng.random() < density]
        rng.shuffle(holders)
        pulls.append({h: (rng.randint(1, big), rng.randint(0, big)) for h in holders})
    return pulls


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 24), st.integers(0, 2**31), st.sampled_from([0.0, 0.5, 1.0, 2.0, 2.3, 7.77, math.inf]),
       st.booleans())
def test_kept_is_kept_chunks(units, seed, limit, ordered):
    """A unit's kept pulls, in tokens and bisected, against sparse_needs.kept_chunks in bytes:
    pulls made in units' order or not, budgets of whole and fractional bytes, none and all."""
    rng = random.Random(seed)
    kv = rng.choice([1, 3, 4096])
    g = rng.randrange(units)
    got = _random_pulls(rng, units, 0.7, big=5000)[g]
    if ordered:
        got = dict(sorted(got.items()))
    budget = limit * 1000 * kv
    want = kept_chunks(g, units, {h: n * kv for h, (n, _) in got.items()}, budget)
    assert _kept(g, got, [n for n, _ in got.values()], kv, budget) == want


@pytest.mark.parametrize("units", [2, 3, 5, 8, 13])
def test_the_pull_sums_equal_their_definitions(units):
    """Every field of ``_pull_sums`` summed pull by pull: a unit's kernel calls (ceil(max(R, 1) /
    piece) x ceil(C / piece) a pull), rows, tokens pulled and held, and per link class the tokens
    and pulls into and out of it, of all pulls and of those not kept; the units over two nodes."""
    rng = random.Random(units)
    node, piece = [u * 2 // units for u in range(units)], 10
    for _ in range(20):
        pulls = _random_pulls(rng, units, 0.5, big=35)
        kept = [frozenset(h for h in got if rng.random() < 0.5) for got in pulls]
        s = _pull_sums(pulls, node, piece, lambda g, tokens: len(kept[g]) == len(pulls[g]), lambda g, got, sizes: kept[g])
        assert s.linked().kept == kept
        pairs = [(g, h, n, r) for g, got in enumerate(pulls) for h, (n, r) in got.items()]
        for u in range(units):
            assert s.calls[u] == sum(math.ceil(max(r, 1) / piece) * math.ceil(n / piece) for g, _, n, r in pairs if g == u)
            assert s.rows[u] == sum(r for g, _, _, r in pairs if g == u)
            for c in (0, 1):
                mine = [(g, h, n) for g, h, n, _ in pairs if int(node[g] != node[h]) == c]
                again = [(g, h, n) for g, h, n in mine if h not in kept[g]]
                for name, moves, side in (("into", mine, 0), ("out", mine, 1), ("again_into", again, 0),
                                          ("again_out", again, 1)):
                    ours = [(g, h, n) for g, h, n in moves if (g, h)[side] == u]
                    assert getattr(s, name)[u][c] == sum(n for *_, n in ours), (name, u, c)
                    assert getattr(s, "n_" + name)[u][c] == len(ours), (name, u, c)
        assert s.pulled == [sum(n for n, _ in got.values()) for got in pulls]
        assert s.held == [sum(n for _, h, n, _ in pairs if h == u) for u in range(units)]


@pytest.mark.parametrize("units, per_node", [(4, 2), (7, 3), (16, 8), (24, 8)])
def test_the_bound_is_at_most_the_rounds(units, per_node):
    """``_Rounds.bound`` at most ``exact`` for ring's shift rounds, the same as ``exact`` for TASP's:
    random pulls over nodes of 2-8 units, few to every pair pulling, keep limits 0 to inf."""
    rng = random.Random(units)
    shape = AttentionShape(64, 1, **GQA)
    topo = Topology(nodes=-(-units // per_node), gpus_per_node=per_node)
    for density in (0.2, 0.6, 1.0):
        for limit in (0.0, 0.3, 2.0, math.inf):
            pulls = _random_pulls(rng, units, density, big=200)
            sums = _sums_of(pulls, units, shape, topo, 1, limit)
            ring, tasp = (_Rounds(sums, shape, topo, burst) for burst in (False, True))
            for low, exact in zip(ring.bound(), ring.exact(), strict=True):
                assert low <= exact * (1 + 1e-12), (density, limit)
                assert low > 0 or exact == 0, (density, limit)
            assert tasp.bound() == tasp.exact()


def test_the_bound_decides_where_every_pair_of_ranks_pulls(monkeypatch):
    """Seed 8 of lognormal:16384 at 256 GPUs: its 329K-token document lies on every rank of the
    balanced layout (65,280 pulls). The balanced layout's compute and host alone do not cost more
    than the zigzag's whole price; with the ring shifts' bound they do, so pick_layout keeps the
    zigzag walking only the zigzag's rounds -- as choose_layout's whole prices say."""
    from megatron_mesh.plan import layout_pulls

    P, S = 256, 1 << 20
    cu = document_bounds("lognormal:16384,1.0", S, 8)
    shape, topo = AttentionShape(S // P, 1, **GQA), Topology(nodes=P // 8, gpus_per_node=8)
    layout = balanced_layout(cu, P, ranks_per_node=8)
    pick, mine, theirs = choose_layout(layout, shape, topo, "ring")
    floor, priced = _price_parts(layout, layout.documents(), shape, topo, "ring", 1, 2.0)
    low = priced(False)
    assert pick == "zigzag" and floor.total < theirs.total < low.total <= mine.total
    assert low.total > 0.97 * mine.total  # the bound within 3 % of the whole price here
    walked, walk = [], layout_pulls._shift_rounds
    monkeypatch.setattr(layout_pulls, "_shift_rounds",
                        lambda pulls, *rest: walked.append(sum(map(len, pulls))) or walk(pulls, *rest))
    assert pick_layout(layout, shape, topo, "ring") == "zigzag"
    assert len(walked) == 1 and walked[0] < P * (P - 1)  # the zigzag's rounds only, not every pair's


def test_worked_example_of_the_bound():
    """_Rounds.bound's example: 3 units of one node; unit 1 pulls 5 tokens from unit 0 (shift 1),
    unit 0 pulls 20 from unit 1 (shift 2). Units 0 and 1 each receive in one round and send in
    the other: walked 2l + 25b, bounded by l + 20b."""
    shape, topo = AttentionShape(64, 1, **GQA), Topology(nodes=1, gpus_per_node=3)
    pulls = [{1: (20, 1)}, {0: (5, 1)}, {}]
    l, b = topo.intra_latency, buffer_bytes("kv", 1, shape) / topo.intra_bandwidth
    rounds = _Rounds(_sums_of(pulls, 3, shape, topo, 1, 2.0), shape, topo, False)
    assert rounds.exact()[0] == pytest.approx(2 * l + 25 * b, rel=1e-12)
    assert rounds.bound()[0] == pytest.approx(l + 20 * b, rel=1e-12)

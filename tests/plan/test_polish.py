"""Polishing mask-aware plans by simulation (:mod:`megatron_mesh.plan.polish`): where each rank runs
its own block, chosen per rank and direction on the 8-GPU problem of docs/performance.md; the
choices as plan facts (the header, errors); the trial plans (:func:`~megatron_mesh.plan.sparse.reordered`,
:func:`~megatron_mesh.plan.ir.plan.carry`) equal to plans built from scratch; small polished plans
valid; the plans too small to polish untouched. The numerics of plans with such choices:
tests/runtime/test_inprocess_numerics.py."""

from __future__ import annotations

import pytest

from megatron_mesh.plan import (AttentionShape, Mask, Topology, balanced_layout, inner_shape, resolve, simulate,
                                validate_plan)
from megatron_mesh.plan.ir import Plan
from megatron_mesh.plan.ir.plan import carry
from megatron_mesh.plan.layouts.base import get_layout_kind
from megatron_mesh.plan.polish import polishes
from megatron_mesh.plan.simulate import round_traffic, simulate_direction
from megatron_mesh.plan.sparse import build_sparse_plan, own_calls, reordered
from megatron_mesh.plan.tunables import Tunables
from megatron_mesh.tools.plan_args import document_bounds

from test_owners_kind import _eight_gpus

OFF = Tunables(polish_sims=1)


def _built(seed: int, kind: str, mode: str, **settings):
    sample = _eight_gpus(seed, "mesh" if mode == "mesh" else "tasp")
    layout = get_layout_kind(kind).build(sample) if kind != "groups" else \
        balanced_layout(sample.cu_seqlens, 8, group=settings["ulysses_size"])
    placement = resolve(mode, 8, sample.shape, sample.topology, ranks_per_node=8, **settings)
    return sample, placement, layout


def test_the_worked_example_mesh_on_its_owners_layout():
    """The module docstring's example: 8 GPUs, seed 6, Mesh on its owners layout -- every rank
    sending partials home runs its own block after them (6.44 ms); in the forward rank 3 waited
    for its pulls at the end, and the search runs all 3 own calls first on ranks 3 and 4: the
    forward 2.09 -> 2.00 ms, the step 6.44 -> 6.35 ms, the backward as it was."""
    sample, placement, layout = _built(6, "owners", "mesh")
    plain = placement.build(sample.shape, sample.head, layout, tunables=OFF)
    polished = placement.build(sample.shape, sample.head, layout)
    assert plain.facts.own_first == ()
    assert polished.facts.own_first == ((3, "forward", 3), (4, "forward", 3))
    assert own_calls(plain, 3, "forward") == own_calls(plain, 4, "forward") == 3  # all of them
    before, after = (simulate(p, sample.shape, sample.topology) for p in (plain, polished))
    assert round(before.time * 1e3, 2) == 6.44 and round(after.time * 1e3, 2) == 6.35
    assert (round(before.forward.time * 1e3, 2), round(after.forward.time * 1e3, 2)) == (2.09, 2.0)
    assert after.backward.time == before.backward.time
    # (validate_plan proves such a plan in ~5 minutes at this size: test_small_plans_polished_validate)
    # the same bytes moved and the same blocks computed, in another order: the own block's rows in
    # one call or two (cut where its first part ends), every other op as it was
    assert after.bytes_sent == before.bytes_sent
    for r in range(8):
        for d in ("forward", "backward"):
            mine, theirs = (_split_own(p.rank(r).ops(d), r) for p in (polished, plain))
            assert mine[0] == theirs[0] and mine[1] == theirs[1] == [(0, 8192)], (r, d)


def test_the_own_block_runs_after_the_partials_go_home():
    """The rule the search starts from (``plan/sparse.py::_own``): a rank with return rounds in a
    direction -- it sends partials home (dK/dV, dQ or partial outputs) or receives them -- runs its
    whole own block after it posted them (what it sends travels while it computes, and its peers'
    sends to it need not wait for its own block); a rank with none runs it before its first wait,
    hiding the pulls. Mesh on its owners layout (partials in both directions) and ring on the
    balanced layout (the query owner: none in the forward), 8 GPUs, unpolished; and one rank's
    choice (``own_first``) overrides the rule for it alone."""
    seen = set()
    for seed, kind, mode in ((6, "owners", "mesh"), (7, "balanced", "ring")):
        sample, placement, layout = _built(seed, kind, mode)
        plan = placement.build(sample.shape, sample.head, layout, tunables=OFF)
        for r in range(8):
            for d in ("forward", "backward"):
                ops = plan.rank(r).ops(d)
                own = [i for i, op in enumerate(ops) if _is_own(op, r)]
                returns = [i for i, op in enumerate(ops) if type(op).__name__ == "Post" and
                           any(t.key.kind in ("o", "dq", "dkv") for t in op.sends + op.recvs)]
                waits = [i for i, op in enumerate(ops) if type(op).__name__ == "Wait"]
                if not own:
                    continue
                if returns:
                    assert min(own) > max(returns), (mode, r, d)
                else:
                    assert max(own) < min(waits), (mode, r, d)
                seen.add((mode, d, bool(returns)))
    assert {("mesh", "forward", True), ("mesh", "backward", True), ("ring", "forward", False),
            ("ring", "backward", True)} <= seen
    sample, placement, layout = _built(6, "owners", "mesh")
    chosen = placement.build(sample.shape, sample.head, layout, own_first=((4, "forward", 3),))
    ops = chosen.rank(4).forward
    assert max(i for i, op in enumerate(ops) if _is_own(op, 4)) < min(i for i, op in enumerate(ops)
                                                                      if type(op).__name__ == "Wait")


def _is_own(op, r: int) -> bool:
    """Whether ``op`` is a call of rank r's own block (its rows against its own keys)."""
    return type(op).__name__ in ("Attend", "AttendBackward") and op.q.chunk == r and op.q.slot < 0 and \
        [(k.chunk, k.slot) for k in op.kv] == [(r, -1)]


def _split_own(ops, r: int) -> tuple[list[str], list[tuple[int, int]]]:
    """(every op but the own block's calls, sorted; the rows of those calls, joined)."""
    rest, rows = [], []
    for op in ops:
        if _is_own(op, r):
            rows += [(s.start, s.stop) for s in op.rows] if op.rows is not None else [(0, 8192)]
        else:
            rest.append(str(op))
    rows.sort()
    joined = rows[:1]
    for a, b in rows[1:]:
        joined[-1:] = [(joined[-1][0], b)] if a == joined[-1][1] else [joined[-1], (a, b)]
    return sorted(rest), joined


def test_tasp_on_the_balanced_layout_lets_its_host_run_ahead():
    """Seed 9, TASP on the balanced layout: every rank sends dK/dV partials home in the backward,
    so no own call runs first; two ranks whose other blocks are many small calls run all their own
    calls first (the host issues the others while the device runs them): backward 2.71 -> 2.21 ms."""
    sample, placement, layout = _built(9, "balanced", "tasp")
    plain = placement.build(sample.shape, sample.head, layout, tunables=OFF)
    polished = placement.build(sample.shape, sample.head, layout)
    assert polished.facts.own_first == ((0, "backward", 7), (3, "backward", 4))
    assert [own_calls(plain, x, "backward") for x in (0, 3)] == [7, 4]  # all of them
    before, after = (simulate(p, sample.shape, sample.topology) for p in (plain, polished))
    assert (round(before.backward.time * 1e3, 2), round(after.backward.time * 1e3, 2)) == (2.71, 2.21)
    assert after.forward.time == before.forward.time


def test_a_hybrid_is_polished_as_a_whole():
    """a2a+tasp U 2 (seed 0, the balanced layout of its groups): the inner plan's ranks' choices
    are tried on the hybrid plan (inner rank m runs on ranks 2m and 2m + 1) and kept where the
    hybrid's step is shorter; the inner plan is built with them, not polished on its own."""
    sample, placement, layout = _built(0, "groups", "a2a+tasp", ulysses_size=2)
    plain = placement.build(sample.shape, sample.head, layout, tunables=OFF)
    polished = placement.build(sample.shape, sample.head, layout)
    assert polished.facts.own_first == polished.facts.inner.facts.own_first == ((0, "backward", 9), (2, "backward", 5))
    before, after = (simulate(p, sample.shape, sample.topology).time for p in (plain, polished))
    assert after < before * 0.96
    inner = placement.inner.build(inner_shape(sample.shape, 2), polished.facts.inner.mask,
                                  polished.facts.inner.layout, own_first=polished.facts.inner.facts.own_first)
    assert all(inner.rank(m).ops(d) == polished.facts.inner.rank(m).ops(d) for m in range(4)
               for d in ("forward", "backward"))


def test_trial_plans_equal_plans_built_from_scratch():
    """A trial (the plan's lowering with other choices, :func:`reordered`, and what the plan made
    of its other ranks' ops carried over, :func:`~megatron_mesh.plan.ir.plan.carry`) has the ops and the simulated time of
    the plan built with those choices from scratch."""
    sample, placement, layout = _built(6, "owners", "mesh")
    base = placement.build(sample.shape, sample.head, layout, tunables=OFF)
    simulate(base, sample.shape, sample.topology, timeline=True)  # its ranks' derived facts made
    choices = ((6, "backward", 1), (4, "forward", 1))
    trial = reordered(base, choices)
    carry(trial, base, [4, 6])
    # the other ranks' ops priced (compute seconds, host ops) come with them; ranks 4 and 6 are priced again
    for what in ("op seconds", "host ops"):
        assert {k[2:4] for k in trial._cache if isinstance(k, tuple) and k[:2] == ("memo", what)} == \
            {(r, d) for r in range(8) if r not in (4, 6) for d in ("forward", "backward")}
    fresh = placement.build(sample.shape, sample.head, layout, own_first=choices)
    assert trial.facts == fresh.facts and trial.facts.own_first == tuple(sorted(choices))
    for d in ("forward", "backward"):
        assert all(trial.rank(r).ops(d) == fresh.rank(r).ops(d) for r in range(8))
        # a choice moves no byte: the search simulates every trial with the plan's traffic
        traffic = round_traffic(base, sample.shape, sample.topology, d)
        assert round_traffic(fresh, sample.shape, sample.topology, d) == traffic
        assert simulate_direction(trial, sample.shape, sample.topology, d, traffic=traffic).time == \
            simulate_direction(fresh, sample.shape, sample.topology, d).time
    assert trial.rank(6).backward != base.rank(6).backward and trial.rank(0) is base.rank(0)
    # what is not one rank's is made again: a digest of the whole plan (its header says the choices)
    base.memo(("agreement digest",), lambda: "base's")
    carry(trial, base, [4, 6])
    assert trial.memo(("agreement digest",), lambda: "the trial's") == "the trial's"


def test_a_hybrid_trial_equals_the_hybrid_built_from_scratch():
    """a2a+tasp U 2: the hybrid built on the inner plan's lowering with other choices has the ops
    and the time of the hybrid built with them (``own_first`` in the inner plan's ranks)."""
    from megatron_mesh.plan import build_hybrid_plan

    sample, placement, layout = _built(0, "groups", "a2a+tasp", ulysses_size=2)
    base = placement.build(sample.shape, sample.head, layout, tunables=OFF)
    choices = ((1, "forward", 2), (2, "backward", 1))
    trial = build_hybrid_plan("a2a+tasp", 8, 2, lambda *_: reordered(base.facts.inner, choices), sample.shape,
                              base.mask, layout)
    fresh = placement.build(sample.shape, sample.head, layout, own_first=choices)
    assert fresh.facts.own_first == trial.facts.own_first == choices
    for d in ("forward", "backward"):
        assert all(trial.rank(g).ops(d) == fresh.rank(g).ops(d) for g in range(8))
        assert simulate_direction(trial, sample.shape, sample.topology, d).time == \
            simulate_direction(fresh, sample.shape, sample.topology, d).time


def test_plans_are_polished_for_the_machine_they_are_simulated_on():
    """Seed 1, ring on the balanced layout, on the planner's machine with the host free: the
    choices made for the default machine (host at 23 us an op) make the plan slower there
    (4.65 -> 4.81 ms); made for that machine (``topology``, as the planner and ``auto`` pass it),
    it is no slower than the plan without choices."""
    from dataclasses import replace

    sample, placement, layout = _built(1, "balanced", "ring")
    free = replace(sample.topology, host_op_time=0.0, host_view_time=0.0)
    plain = placement.build(sample.shape, sample.head, layout, tunables=OFF)
    default, own = (placement.build(sample.shape, sample.head, layout, topology=t) for t in (None, free))
    times = [simulate(p, sample.shape, free).time for p in (plain, default, own)]
    assert default.facts.own_first != own.facts.own_first
    assert times[1] > times[0] >= times[2], times


def test_the_choices_are_plan_facts():
    """The header says them (``own_first=1b0,2f1``: rank 1's backward runs none of its own calls
    first, rank 2's forward its first) and reads them back; entries that name no rank or direction,
    a count that is not one, a rank and direction twice, or more calls than the rank's own block
    makes are errors naming them; a dense plan takes none."""
    shape = AttentionShape(16, 1, 4, 2, 8, 4)
    mask = Mask.from_cu_seqlens((0, 20, 64), 64, True)
    placement = resolve("ring", 4, shape)
    plan = placement.build(shape, mask, own_first=((2, "forward", 1), (1, "backward", 0)))
    header = plan.to_text().splitlines()[0]
    assert "own_first=1b0,2f1" in header
    assert Plan.from_text(plan.to_text()).facts == plan.facts
    assert "own_first" not in placement.build(shape, mask).to_text().splitlines()[0]
    for bad in (((4, "forward", 1),), ((0, "sideways", 1),), ((0, "forward", True),), ((0, "forward", -1),),
                ((0, "forward", 1), (0, "forward", 0))):
        with pytest.raises(ValueError, match="own_first entries are") as e:
            placement.build(shape, mask, own_first=bad)
        assert repr(bad[-1]) in str(e.value)
    with pytest.raises(ValueError, match="only a mask-aware plan"):
        reordered(placement.build(shape, Mask()), ((0, "forward", 1),))
    with pytest.raises(ValueError, match=r"own_first choices \(\(0, 'forward', 1\),\) apply to mask-aware plans"):
        placement.build(shape, Mask(), own_first=((0, "forward", 1),))  # dense: no own block to move
    n = own_calls(plan, 2, "forward")
    with pytest.raises(ValueError, match=f"rank 2's own block makes {n} call.* in the forward, got {n + 1}"):
        placement.build(shape, mask, own_first=((2, "forward", n + 1),))
    text = plan.to_text()
    for bad, why in (("own_first=1b0,2x1", "entry '2x1' is not"), ("own_first=1b0,1b1", "a rank and direction twice"),
                     ("own_first=1b0,2f", "entry '2f' is not")):
        with pytest.raises(ValueError, match=why):
            Plan.from_text(text.replace("own_first=1b0,2f1", bad, 1))
    assert build_sparse_plan  # the builder takes them too (what Mode.build passes on)


def test_small_plans_are_not_polished():
    """Below ``polish_tokens`` tokens per rank, above ``polish_ranks`` ranks, or with
    ``polish_sims`` 1, the plan is the builder's: no search, no choices."""
    assert polishes(8, 8192) and polishes(16, 4096) and not polishes(8, 2048) and not polishes(32, 8192)
    assert not polishes(1, 8192)
    assert not polishes(8, 8192, OFF)
    P, S = 4, 4 * 512
    shape = AttentionShape(S // P, 1, 4, 2, 16, 2)
    cu = document_bounds("lognormal:256,1.0", S, 0)
    plan = resolve("ring", P, shape, Topology(nodes=1, gpus_per_node=P)).build(
        shape, Mask.from_cu_seqlens(cu, S, True))
    assert plan.facts.own_first == ()


@pytest.mark.parametrize("mode, settings, heads", [("ring", {}, 2048), ("tasp", {}, 2048), ("mesh", {}, 2048),
                                                   ("a2a+ring", {"ulysses_size": 2}, 8192)])
def test_small_polished_plans_validate(mode, settings, heads):
    """Polished at 6 ranks of 48 tokens (``polish_tokens`` lowered to 16; thousands of query
    heads, so a block's compute weighs against the host and the links as at thousands of tokens,
    and the search finds choices on plans the validator proves in a second): each plan -- and the
    plans with every rank's own calls first, about half of them, or none, in both directions --
    validates (exact cover, rounds that match, no deadlock); some carry choices the search kept."""
    P, T = 6, 48
    shape = AttentionShape(T, 1, heads, heads // 4, 128, 2)
    low = Tunables(polish_tokens=16)
    chosen = 0
    for seed in range(4):
        cu = document_bounds("lognormal:48,1.0", P * T, seed)
        mask = Mask.from_cu_seqlens(cu, P * T, True)
        placement = resolve(mode, P, shape, Topology(nodes=1, gpus_per_node=P), **settings)
        layout = balanced_layout(cu, P, group=settings.get("ulysses_size", 1)) if seed % 2 else None
        plan = placement.build(shape, mask, layout, tunables=low)
        facts = plan.facts.inner.facts if plan.facts.inner is not None else plan.facts
        chosen += bool(facts.own_first)
        validate_plan(plan)
        inner = P // settings.get("ulysses_size", 1)
        base = plan.facts.inner if plan.facts.inner is not None else plan
        for part in (1.0, 0.5, 0.0):  # every own call first, about half, none
            forced = tuple((x, d, int(part * own_calls(base, x, d))) for x in range(inner) for d in ("forward", "backward"))
            validate_plan(placement.build(shape, mask, layout, own_first=forced))
    assert chosen, mode

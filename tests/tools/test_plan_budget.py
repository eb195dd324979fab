"""The planner's speed, bounded by counting work rather than timing it: the rows past the planning
budget are left out up front in one line, each row's estimate is deterministic, and the planner's
shared work (a masked block's mask pieces, the balanced layout's document starts, equal masks,
dense plans' rank work) is done once, not once per row, group or rank."""

from __future__ import annotations

import json

import pytest

from megatron_mesh.plan import AttentionShape, Mask, balanced_layout, rank_work
from megatron_mesh.plan import balance, costs
from megatron_mesh.plan.ir.plan import Plan
from megatron_mesh.plan.topology import Topology
from megatron_mesh.plan.layouts import Sample, get_layout_kind
from megatron_mesh.tools import layout_rows, plan_budget, planner
from megatron_mesh.tools.plan_budget import (BUDGET_REASON, BUDGET_S, LATE_REASON, Budget, LayoutSize, layout_size,
                                             row_seconds, thd_size)
from megatron_mesh.tools.plan_args import document_bounds
from megatron_mesh.tools.plan_cli import main

SHAPE = AttentionShape(seq_local=512, batch=1, heads=8, kv_heads=4, head_dim=16)


def _json(capsys, *argv) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_rows_past_the_budget_are_left_out_up_front_in_one_line(capsys):
    # (the clock's backstop, 5 s past the budget, is far: these rows take about a second)
    argv = ["--cp", "8", "--seq-len", "8192", "--heads", "8", "--docs", "lognormal:512,1", "--layout", "zigzag",
            "--modes", ",".join(planner.REGISTRY)]
    every = _json(capsys, *argv, "--plan-budget", "0")
    assert not [s for s in every["skipped"] if s["reason"] == BUDGET_REASON]
    some = _json(capsys, *argv, "--plan-budget", "0.075")
    left_out = [s for s in some["skipped"] if s["reason"] == BUDGET_REASON]
    planned = [r for r in some["modes"] if r["mode"] in planner.REGISTRY]
    assert left_out and planned and len(planned) < len([r for r in every["modes"] if r["mode"] in planner.REGISTRY])
    # every mode's likeliest placement comes first: ring, TASP, the squarest Mesh tile, each hybrid's smallest degree
    assert {r["mode"] for r in planned} == set(planner.REGISTRY)
    assert min((abs(r["tile"][0] - r["tile"][1]) for r in planned if r["mode"] == "mesh")) == 2  # 2x4 or 4x2
    assert {r["ulysses"] for r in planned if r["mode"] == "a2a+ring"} >= {2}
    # the rows it planned are the same numbers as without a budget
    full = {(r["mode"], r["ulysses"], tuple(r["tile"] or ()), r["contiguous"]): r for r in every["modes"]}
    for r in planned:
        assert r == full[r["mode"], r["ulysses"], tuple(r["tile"] or ()), r["contiguous"]]
    # the table says it in one line, naming how many placements of each mode it left out
    assert main(argv + ["--plan-budget", "0.075"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if BUDGET_REASON in x]
    assert len(lines) == 1 and lines[0].startswith("not available: ") and "of 3 placements" in lines[0]


class _Clock:
    """A clock that moves ``step`` seconds each time it is read."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_rows_not_planned_by_the_deadline_are_left_out_in_one_line(capsys):
    """The clock backs the estimates up: once the budget and DEADLINE_SLACK_S more have passed,
    the rows not yet planned are named (every one: a row or a reason), never planned late."""
    P, S = 4, 4 * 256
    shape = AttentionShape(seq_local=256, batch=1, heads=8, kv_heads=4, head_dim=16)
    mask = Mask.from_cu_seqlens(document_bounds("lognormal:40,1", S), S)
    topo = Topology.for_cp(P, 4)
    every, _ = planner.evaluate(P, shape, topo, modes=["ring", "mesh", "mesh-auto"], mask=mask)
    clock = _Clock(step=plan_budget.DEADLINE_SLACK_S / 2)  # the budget made at 0.5 x slack: late at the 3rd read
    budget = Budget(1e6, clock=clock)
    budget.left = 1e-9  # nothing admitted by estimate would be left out: only the clock decides
    budget.deadline = clock.now + plan_budget.DEADLINE_SLACK_S
    planned = [r for r in every if r.mode != "mesh-auto"]  # ring, every Mesh tile: one placement each
    rows, skipped = planner.evaluate(P, shape, topo, modes=["ring", "mesh", "mesh-auto"], mask=mask,
                                     budget=budget, keep=[True] * len(planned))
    late = [s for s in skipped if s["reason"] == LATE_REASON]
    own = [r for r in rows if r.mode != "mesh-auto"]
    assert own and late and len(own) < len(planned)
    assert own == planned[:len(own)]  # the rows planned in time, in order, are the same numbers
    n_late = sum(int(s["mode"].split("(")[1].split(" of")[0]) if "placements" in s["mode"] else 1 for s in late)
    assert len(own) + n_late == len(planned)  # every placement: a row or the reason, in one entry per mode
    # a derived row whose candidates all came too late says so too
    clock.now, budget.deadline = 0.0, 0.0
    rows, skipped = planner.evaluate(P, shape, topo, modes=["ring", "mesh", "mesh-auto"], mask=mask, budget=budget,
                                     keep=[True] * len(planned))
    assert not rows and {s["mode"] for s in skipped} >= {"ring", "mesh-auto"}
    assert next(s for s in skipped if s["mode"] == "mesh-auto")["reason"] == planner.NO_CANDIDATE


def test_plan_budget_flag_is_checked(capsys):
    for bad in ("-1", "nan", "inf"):
        assert main(["--cp", "4", "--docs", "fixed:1024", "--plan-budget", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--plan-budget" in err[0] and "0: plan every row" in err[0]


def test_budget_admits_likeliest_placements_round_robin_and_spends_once():
    topo = Topology.for_cp(64, 8)
    tasks = planner._mode_tasks(planner._wanted(["mesh", "a2a+ring"]), 64, SHAPE, topo, planner.plan_settings(), [])
    size = LayoutSize(ranks=64, pieces=1000, pairs=500)
    rows = plan_budget.Rows("zigzag", "zigzag", tuple((m, p, p.ulysses) for m, p in tasks), size)
    first = row_seconds(size, "zigzag", 1)
    later = row_seconds(size, "zigzag", 1, first=False)
    assert later < first  # the per-document work of a layout is paid by its first row
    budget = Budget(first + later + 1e-9)
    keep = budget.admit([rows])["zigzag"]
    kept = [t for t, k in zip(tasks, keep) if k]
    # the squarest Mesh tile (8x8) first; a2a+ring's first row (U 2: its own first row of the
    # degree, dearer) does not fit after it, the cheaper second Mesh row does
    assert [(m, p.options.tile, p.options.contiguous) for m, p in kept] == [("mesh", (8, 8), "q"),
                                                                           ("mesh", (8, 8), "kv")]
    assert budget.left == pytest.approx(first + later + 1e-9 - first - later)
    assert Budget(None).admit([rows])["zigzag"] == [True] * len(tasks)
    assert Budget.skipped(tasks, keep)[0]["mode"].startswith("mesh (")


def test_the_default_budget_bounds_the_rows_at_1024_ranks():
    """The planner's estimates of what it plans at 1024 ranks and 1M tokens of short documents on
    every default layout stay within the budget, and ring is planned on every layout."""
    P, S = 1024, 1 << 20
    shape = AttentionShape(seq_local=S // P, batch=1, heads=32, kv_heads=8, head_dim=128)
    topo = Topology.for_cp(P, 8)
    cu = document_bounds("lognormal:256,1", S)
    modes = [m for m in planner.default_modes() if m not in planner.FORMULAS]
    sample = Sample(tuple(cu), P, ranks_per_node=8, shape=shape, topology=topo)
    setups = [layout_rows._kind_setup(get_layout_kind(name), sample, shape, modes, False)
              for name in ("zigzag", "balanced")]
    budget = Budget(BUDGET_S)
    keep, cost = layout_rows._admit(setups, sample, topo, planner.plan_settings(), budget)
    assert 0 <= budget.left < BUDGET_S
    # each layout's estimate of what it was admitted: together what the budget spent
    assert set(cost) == {"zigzag", "balanced"} and sum(cost.values()) == pytest.approx(BUDGET_S - budget.left)
    for name in ("zigzag", "balanced"):
        tasks = planner._mode_tasks(planner._wanted(modes), P, shape, topo, planner.plan_settings(), [])
        assert len(keep[name]) == len(tasks) and 0 < sum(keep[name]) < len(tasks)
        assert any(k for (m, _), k in zip(tasks, keep[name]) if m == "ring")


def test_layout_size_counts_pieces_and_ranks_sharing_a_document():
    # 2 ranks x 8 tokens on the zigzag (rank 0: 0-3 and 12-15): document [0, 6) on both ranks, [6, 16) too
    from megatron_mesh.plan.layout import ZigzagLayout

    size = layout_size(ZigzagLayout(2, 16), ((0, 6), (6, 16)))
    assert size == LayoutSize(2, 5, 8)  # pieces: (0,[0,6)) (0,[6,16)) (1,[0,6)) (1,[6,16)) twice on rank 1's run
    assert thd_size(4, [1, 16]) == LayoutSize(4, 16, 16)  # a 1-token document on one rank: no pair
    assert layout_size(ZigzagLayout(2, 16), None, window=1).pairs < layout_size(ZigzagLayout(2, 16), None).pairs or \
        layout_size(ZigzagLayout(2, 16), None).pairs == 4


# -- work done once ------------------------------------------------------------------------------------
def test_equal_masks_share_their_documents_once_compared():
    cu = document_bounds("fixed:3", 3000)
    a, b = Mask.from_cu_seqlens(cu, 3000), Mask.from_cu_seqlens(cu, 3000)
    assert a.documents is not b.documents and a == b and hash(a) == hash(b)
    assert a.documents is b.documents  # the next comparison is an identity check
    assert a != Mask.from_cu_seqlens(cu[:-2] + [3000], 3000) and a != Mask(False, None, a.documents)


def test_a_masked_block_is_cut_into_mask_pieces_once_for_every_placement(monkeypatch):
    """... and once for both what prices it (costs.masked_block) and what finds the rows its calls
    write once (single_writes, bf16: the results' rows written straight)."""
    import megatron_mesh.plan.mask as mask_module
    import megatron_mesh.plan.single_writes as single_writes

    calls = []
    real = mask_module.mask_pieces
    monkeypatch.setattr(mask_module, "mask_pieces", lambda *a: calls.append(a[1:3]) or real(*a))
    for cached in (costs.masked_block, mask_module.block_pieces, single_writes._coverage):
        cached.cache_clear()
    P, S = 8, 8 * 64
    shape = AttentionShape(seq_local=64, batch=1, heads=8, kv_heads=4, head_dim=16)
    mask = Mask.from_cu_seqlens(document_bounds("lognormal:24,1", S), S)
    rows, _ = planner.evaluate(P, shape, Topology.for_cp(P, 4), modes=["ring"], mask=mask)
    once = len(calls)
    rows, _ = planner.evaluate(P, shape, Topology.for_cp(P, 4), modes=["ring", "mesh", "tasp"], mask=mask)
    assert once and len(rows) > 3 and len(calls) == len(set(calls))  # each block's pieces cut once, all modes
    assert len(calls) <= P * P


def test_balanced_layout_finds_the_document_starts_once(monkeypatch):
    seen = []
    real = balance._group_sets
    monkeypatch.setattr(balance, "_group_sets", lambda runs, bounds, hide, starts: seen.append(id(starts)) or
                        real(runs, bounds, hide, starts))
    cu = document_bounds("lognormal:16,1", 4096)
    layout = balanced_layout(cu, 16, group=2)
    for g in range(8):
        layout.set_tokens(g)
    assert len(seen) == 16 and len(set(seen)) == 2  # once for the layout, once for its set order


def test_dense_work_is_the_same_on_every_rank_in_every_mode(monkeypatch):
    """What lets the planner give a dense plan's work max / mean as 1 without building every rank's
    plan (P^2 blocks: minutes at 4096 ranks): on the zigzag every rank computes the same pairs."""
    shape = AttentionShape(seq_local=64, batch=1, heads=16, kv_heads=8, head_dim=8)
    for P in (2, 3, 4, 5, 6, 8, 16):
        topo = Topology.for_cp(P, 4 if P % 4 == 0 else 8)
        for causal in (True, False):
            for name, mode in planner.REGISTRY.items():
                for p in mode.candidates(P, shape, topo):
                    plan = p.build(shape, Mask(causal), None)
                    for direction in ("forward", "backward"):
                        work = rank_work(plan, direction)
                        assert max(work) == min(work), (P, causal, p.describe(), direction, work)
    built = []
    real = Plan.rank
    monkeypatch.setattr(Plan, "rank", lambda self, r: built.append(r) or real(self, r))
    rows, _ = planner.evaluate(64, shape, Topology.for_cp(64, 8), modes=["ring", "a2a+ring"], work=True)
    assert {r.extra["forward_work_max_over_mean"] for r in rows} == {1.0}
    assert len(set(built)) <= 5  # the simulated ranks only (0, P-1; a hybrid's inner group), not all 64


def test_rows_are_planned_every_modes_likeliest_first():
    """The planning order (planner.planning_order): every mode's likeliest placement, then every
    mode's second... -- where the budget's clock runs out, each mode keeps its likeliest rows
    (auto's 30 candidates planned first left a2a+tasp and a2a+ring with none: stop 81's review)."""
    from megatron_mesh.tools.plan_budget import preference

    P = 16
    shape = AttentionShape(seq_local=1024, batch=1, heads=32, kv_heads=8, head_dim=128)
    tasks = planner._mode_tasks(planner._wanted(["mesh", "a2a+tasp", "a2a+ring"]), P, shape, Topology.for_cp(P, 8),
                                planner.plan_settings(), [])
    order = planner.planning_order(tasks)
    assert sorted(order) == list(range(len(tasks)))
    modes = list(dict.fromkeys(name for name, _ in tasks))
    assert len(modes) == 3 and [tasks[i][0] for i in order[:3]] == modes  # one of each mode first
    for name in modes:
        mine = [tasks[i][1] for i in order if tasks[i][0] == name]
        assert [preference(p) for p in mine] == sorted(preference(p) for p in mine)

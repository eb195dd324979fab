"""The owner-choosing builder (plan/balance_owners.py): its worked example, issue 53's criteria on
the CPU problem's ten samples (work, bytes against the query-owner bound and against the zigzag's
best plain mode, all from the planner's plans), determinism, and errors naming the value."""

from __future__ import annotations

import statistics

import pytest

from megatron_mesh.plan import AttentionShape, Mask, Topology, plan_bytes, positions, rank_work, resolve
from megatron_mesh.plan.accounting import buffer_bytes
from megatron_mesh.plan.balance_owners import MAX_LONG, MAX_RANKS, owners_layout
from megatron_mesh.plan.bound import query_owner_bound
from megatron_mesh.tools.plan_args import document_bounds
from megatron_mesh.tools.planner import evaluate


def _mesh(layout, shape):
    """Every rank's bytes sent and work on Mesh's plan of ``layout`` (its blocks where it names)."""
    plan = resolve("mesh", layout.world_size, shape).build(shape, Mask(True), layout)
    return [b.sent for b in plan_bytes(plan, shape)], rank_work(plan)


def test_worked_example_of_the_module_docstring():
    shape = AttentionShape(8, 1, 2, 2, 32, 4)
    layout = owners_layout([0, 12, 16, 20, 24], 3, shape)
    held = [set(positions(layout, r)) for r in range(3)]
    assert all(len(h & set(range(12))) == 4 for h in held)  # the long document in portions of 4
    assert sorted(tuple(sorted(h - set(range(12)))) for h in held) == [tuple(range(a, a + 4)) for a in (12, 16, 20)]
    assert sorted(layout.owner(i, j) for i, j in ((1, 0), (2, 0), (2, 1))) == [0, 1, 2]  # one block each
    sent, work = _mesh(layout, shape)
    assert work == [36, 36, 36]
    b = {k: buffer_bytes(k, 4, shape) for k in ("q", "kv", "o", "do", "dq", "dkv")}  # one portion's
    # rank 0 computes (1, 0): sends O and dQ back, and its K/V to rank 2; rank 1 computes (2, 1) and sends
    # its Q and dO to rank 0; rank 2 computes (2, 0) and sends its Q and dO to rank 1, dK/dV to rank 0
    assert sent == [b["o"] + b["dq"] + b["kv"], b["q"] + b["do"] + b["o"] + b["dq"], b["dkv"] + b["q"] + b["do"]]


def test_cpu_problem_meets_issue_53():
    """Seeds 0-9 of the CPU problem (8 ranks, 64K tokens of lognormal:4096,1.0, 2 heads of 32,
    fp32): work max/mean <= 1.05, the busiest rank's bytes a median <= 1.5x the query-owner bound,
    and no sample above the zigzag's best plain mode (ring, mesh-auto, TASP: the planner's rows)."""
    S, shape = 65536, AttentionShape(8192, 1, 2, 2, 32, 4)
    topo = Topology(nodes=1, gpus_per_node=8)
    ratios = []
    for seed in range(10):
        cu = document_bounds("lognormal:4096,1.0", S, seed)
        sent, work = _mesh(owners_layout(cu, 8, shape), shape)
        assert max(work) <= 1.05 * sum(work) / 8, (seed, max(work) * 8 / sum(work))
        ratios.append(max(sent) / query_owner_bound(cu, 8, shape).bytes)
        rows = evaluate(8, shape, topo, modes=["ring", "mesh-auto", "tasp"], mask=Mask.from_cu_seqlens(cu, S))[0]
        assert max(sent) <= min(r.bytes_per_rank for r in rows), (seed, max(sent), [(r.mode, r.bytes_per_rank) for r in rows])
    assert statistics.median(ratios) <= 1.5, ratios


def test_deterministic():
    shape = AttentionShape(256, 1, 2, 2, 32, 4)
    cu = document_bounds("lognormal:128,1.0", 2048, 1)
    assert owners_layout(cu, 8, shape).text() == owners_layout(cu, 8, shape).text()


def test_errors_name_the_value():
    shape = AttentionShape(8, 1, 2, 2, 32, 4)
    with pytest.raises(ValueError, match=f"world_size must be an integer from 2 to {MAX_RANKS}.*got 16"):
        owners_layout([0, 128], 16, shape)
    with pytest.raises(ValueError, match=f"1 to {MAX_LONG} long documents.*got 0"):
        owners_layout(list(range(0, 25, 1)), 3, shape)
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to world_size x shape.seq_local = 24"):
        owners_layout([0, 12, 20], 3, shape)
    # one document over both ranks: its block is computed whole on one of them (36 + 64 against 36 pairs)
    with pytest.raises(ValueError, match=r"reached work max/mean 1\.47.*above max_balance 1\.05; balanced_layout"):
        owners_layout([0, 16], 2, shape)

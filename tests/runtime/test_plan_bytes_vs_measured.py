"""The planner's bytes are the bytes the runtime moves: for every plan-based CP mode of the registry
(ring, every Mesh tile with both rank orders and both backward modes, TASP on one node and over
emulated nodes, the Ulysses hybrids a2a+ring / a2a+mesh / a2a+tasp; documents on every mode, on
Megatron's zigzag and on the balanced layout; a sliding window on ring, Mesh and TASP) on real gloo
process groups of every P = 2..8 (part "bytes" of the one spawn, see cases.run_gloo),
``comm_counter()`` around forward + backward equals, on every rank, the bytes the simulator reads
from the plan and ``plan_bytes`` -- and the planner's numbers: the busiest rank's bytes, the
busiest rank's bytes across nodes, the mean split into intra and inter.

(Ulysses and USP by formula are priced without a plan, so they are not measured.)
"""

from __future__ import annotations

import pytest

from megatron_mesh.plan import plan_bytes
from megatron_mesh.plan.autotile import evaluate_plan
from megatron_mesh.plan.simulate import round_traffic
from megatron_mesh.plan.topology import Topology

from bytes_cases import SHAPE, cases

GLOO_PARTS = ("bytes",)


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 7, 8])
def test_planned_bytes_equal_measured_bytes(gloo, world):
    todo = cases(world)
    measured = gloo["bytes"][world]  # per group rank: (sent, received, sent_to) per case, in the order of cases()
    assert len(measured) == world and all(len(m) == len(todo) for m in measured)
    topo = Topology.for_cp(world, gpus_per_node=2)  # several "nodes": exercises the intra/inter split
    failures = []
    for i, case in enumerate(todo):
        plan = case.plan(world)
        traffic = {d: round_traffic(plan, SHAPE, topo, d, exact=True) for d in ("forward", "backward")}
        planned = [(traffic["forward"].sent[r] + traffic["backward"].sent[r],
                    traffic["forward"].received[r] + traffic["backward"].received[r]) for r in range(world)]
        got = [m[i][:2] for m in measured]
        if got != planned:
            failures.append(f"{case.name}: measured {got} planned {planned}")
        if [(b.sent, b.received) for b in plan_bytes(plan, SHAPE)] != got:
            failures.append(f"{case.name}: plan_bytes {plan_bytes(plan, SHAPE)} != measured {got}")
        row = evaluate_plan(plan, SHAPE, topo)
        busiest = max(s for s, _ in got)
        if row.bytes_per_rank != busiest:  # the planner reports the busiest rank's bytes
            failures.append(f"{case.name}: planner bytes_per_rank {row.bytes_per_rank} != the busiest rank's "
                            f"measured {busiest}")
        across = max(sum(n for peer, n in m[i][2].items() if topo.node(peer) != topo.node(r))
                     for r, m in enumerate(measured))
        if row.max_inter_node_bytes != across:
            failures.append(f"{case.name}: planner max_inter_node_bytes {row.max_inter_node_bytes} != the busiest "
                            f"rank's measured bytes across nodes {across}")
        mean = sum(s for s, _ in got) / world
        split = row.intra_node_bytes_per_rank + row.inter_node_bytes_per_rank
        if abs(split - mean) > 1e-6 * max(mean, 1):
            failures.append(f"{case.name}: intra + inter = {split} != mean measured {mean}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [4, 8])
def test_every_mode_and_mask_is_measured(world):
    """The case list really spans the registry's plan-based modes and the masks (a case dropped by
    a bad condition would silently shrink the test above)."""
    todo = cases(world)
    assert {c.mode for c in todo} == {"ring", "mesh", "tasp", "a2a+ring", "a2a+mesh", "a2a+tasp"}
    for layout in ("zigzag", "balanced"):  # documents on every mode, on both layouts
        assert {c.mode for c in todo if c.cu_seqlens and c.layout == layout} == {c.mode for c in todo}
    assert {c.mode for c in todo if c.window} == {"ring", "mesh", "tasp"}
    assert any(c.settings.get("ranks_per_node") for c in todo)
    assert sum(c.masked for c in todo) == 15 and len({c.name for c in todo}) == len(todo)

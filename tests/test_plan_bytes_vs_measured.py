"""The planner's bytes are the bytes the runtime moves: for every plan-based CP mode (ring, every
Mesh tile with both rank orders and both backward modes, TASP on one node and over emulated
nodes) on real gloo process groups of every P = 2..8 (one spawn of 8 processes, split into
subgroups), ``comm_counter()`` around forward + backward equals, on every rank, the bytes the
simulator reads from the plan -- and the planner's ``bytes_per_rank``.

(Ulysses and USP are priced by formula and have no runtime here, so they are not measured.)
"""

from __future__ import annotations

import functools
import inspect
import itertools

import pytest

from megatron_mesh.launch import spawn

import cases as dist_cases
from megatron_mesh.plan import AttentionShape, build_mesh_plan, tile_shapes
from megatron_mesh.plan.planner import evaluate_plan
from megatron_mesh.plan.simulate import round_traffic
from megatron_mesh.plan.topology import Topology

try:  # TASP comes from another change; measured here as soon as it exists
    from megatron_mesh.plan.tasp import build_tasp_plan
except ImportError:  # pragma: no cover - depends on the tree
    build_tasp_plan = None

SEQ_LOCAL, BATCH, HEADS, KV_HEADS, HEAD_DIM = 16, 1, 4, 2, 8
SHAPE = AttentionShape(SEQ_LOCAL, BATCH, HEADS, KV_HEADS, HEAD_DIM, itemsize=2)  # bf16


def _mesh(tile, contiguous, backward_chunks, causal, world, shape):
    return build_mesh_plan(world, tile, shape, causal=causal, contiguous=contiguous, backward_chunks=backward_chunks)


def _tasp(causal, gpus_per_node, world, shape):
    return build_tasp_plan(world, shape, causal=causal, gpus_per_node=gpus_per_node)


def cases(world: int) -> list[tuple[str, object]]:
    """(name, build(world, shape) -> Plan) for every plan-based mode at this CP size."""
    # the mask changes which rows a block computes, never what travels: one non-causal case suffices
    out = [("ring refetch causal=False", functools.partial(_mesh, (1, world), "q", "refetch", False))]
    for a, b in tile_shapes(world):
        orders = ("q", "kv") if a > 1 and b > 1 else ("q",)
        for contiguous, bc in itertools.product(orders, ("refetch", "keep")):
            name = ("ring" if a == 1 else f"mesh {a}x{b} {contiguous}") + f" {bc} causal=True"
            out.append((name, functools.partial(_mesh, (a, b), contiguous, bc, True)))
    if build_tasp_plan is not None:
        for causal, gpn in ((True, None), (False, None), (True, 2), (True, 4)):
            try:
                build_tasp_plan(world, SHAPE, causal=causal, gpus_per_node=gpn)
            except ValueError:  # TASP cannot run this size / node split
                continue
            out.append((f"tasp gpus_per_node={gpn} causal={causal}", functools.partial(_tasp, causal, gpn)))
    return out


def measure_all(rank: int, world: int) -> dict:
    """Every CP size 2..8 on subgroups of one 8-process group."""
    phases = ((8,), (7,), (6, 2), (5, 3), (4,))
    return dist_cases.in_subgroups(rank, world, _measure_group, phases=phases)


def _measure_group(rank: int, world: int, group=None) -> list:
    return [(rank, measure(rank, world, [n for n, _ in cases(world)], group))]


def measure(rank: int, world: int, names: list[str], group=None) -> dict[str, tuple[int, int]]:
    """Bytes sent/received by this rank around forward + backward of each case."""
    import torch

    import megatron_mesh as mm
    from megatron_mesh.runtime.api import plan_attention

    builders = dict(cases(world))
    try:
        from megatron_mesh.runtime.tasp_api import tasp_attention
    except ImportError:  # pragma: no cover - depends on the tree
        tasp_attention = None
    g = torch.Generator().manual_seed(rank)
    out = {}
    for name in names:
        q = torch.randn(SEQ_LOCAL, BATCH, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16).requires_grad_()
        k, v = (torch.randn(SEQ_LOCAL, BATCH, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16).requires_grad_()
                for _ in range(2))
        with mm.comm_counter() as c:
            public = name.startswith("tasp") and tasp_attention is not None
            if public:  # the public TASP entry point, when it takes this case's options
                causal, gpn = builders[name].args
                kwargs = {"causal": causal} if gpn is None else {"causal": causal, "gpus_per_node": gpn}
                public = set(kwargs) <= set(inspect.signature(tasp_attention).parameters)
            o = (tasp_attention(q, k, v, group=group, **kwargs) if public
                 else plan_attention(q, k, v, builders[name], group=group))
            o.float().sum().backward()
        out[name] = (c.bytes_sent, c.bytes_received)
    return out


@pytest.fixture(scope="module")
def measured_all():
    by_size: dict[int, dict[int, dict]] = {}
    for per_rank in spawn(measure_all, 8, timeout=600):
        for size, records in per_rank.items():
            for group_rank, values in records:
                by_size.setdefault(size, {})[group_rank] = values
    return by_size


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 7, 8])
def test_planned_bytes_equal_measured_bytes(measured_all, world):
    todo = cases(world)
    measured = [measured_all[world][r] for r in range(world)]
    topo = Topology.for_cp(world, gpus_per_node=2)  # several "nodes": exercises the intra/inter split
    failures = []
    for name, build in todo:
        plan = build(world, SHAPE)
        traffic = {d: round_traffic(plan, SHAPE, topo, d, exact=True) for d in ("forward", "backward")}
        planned = [(traffic["forward"].sent[r] + traffic["backward"].sent[r],
                    traffic["forward"].received[r] + traffic["backward"].received[r]) for r in range(world)]
        got = [m[name] for m in measured]
        if got != planned:
            failures.append(f"{name}: measured {got} planned {planned}")
        row = evaluate_plan("x", plan, SHAPE, topo)
        if not all(row.bytes_per_rank == s for s, _ in got):
            failures.append(f"{name}: planner bytes_per_rank {row.bytes_per_rank} != measured {got}")
        split = row.intra_node_bytes_per_rank + row.inter_node_bytes_per_rank
        if abs(split - row.bytes_per_rank) > 1e-6 * row.bytes_per_rank:
            failures.append(f"{name}: intra + inter = {split} != {row.bytes_per_rank}")
    assert not failures, "\n".join(failures)
    if build_tasp_plan is not None:
        assert any(n.startswith("tasp") for n, _ in todo)

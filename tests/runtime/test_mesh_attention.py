"""Mesh-Attention and ring attention on CPU/gloo: forward and all gradients against a dense fp64
reference for every tile shape of P = 1..8, causal and full, MHA/GQA/MQA, fp32 and bf16; bytes
measured by comm_counter() equal the plan's bytes and the closed-form formula; schedules,
backward modes, kernels, rank orders and bitwise run-to-run determinism at P = 4 and 6; the
gloo transport bitwise equal to the in-process one and to the public autograd path at P = 4.

Parts "mesh", "mesh_variants" and "gloo_outputs" of the one 8-process spawn (cases.run_gloo).
(The in-process transport's own breadth is test_inprocess_numerics.py's, which starts no process:
it runs beside this module under pytest-xdist, tests/conftest.py.)"""

import pytest
import torch

import megatron_mesh as mm
from megatron_mesh.comm.inprocess import run_inprocess
from megatron_mesh.plan import best_tile, build_mesh_plan, tile_shapes

import cases
from test_inprocess_numerics import run_case

GLOO_PARTS = ("mesh", "mesh_variants", "gloo_outputs")


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 7, 8])
def test_mesh_matches_dense_reference(gloo, world):
    per_rank = gloo["mesh"][world]
    assert len(per_rank) == world
    cases.assert_accurate(per_rank)
    cases.assert_bytes_as_expected(per_rank)
    # every tile x causal/full x MHA/GQA/MQA x fp32/bf16, each with the plan's and the formula's bytes
    assert len(per_rank[0]) == len(tile_shapes(world)) * 2 * 3 * 2
    assert all([w for w, _ in rec.expected_bytes] == ["plan", "formula"] for recs in per_rank for rec in recs)


@pytest.mark.parametrize("world", [4, 6])
def test_mesh_variants_and_determinism(gloo, world):
    per_rank = gloo["mesh_variants"][world]
    cases.assert_accurate(per_rank)
    assert len(per_rank[0]) == 2 ** 4 * len([t for t in tile_shapes(world) if 1 < t[0] < world])
    bad = [f"rank {r}: {rec.case}" for r, recs in enumerate(per_rank) for rec in recs if not rec.identical]
    assert not bad, "two runs differ bitwise:\n" + "\n".join(bad)


def test_max_errors_summary(gloo, record_property):
    """Record the largest errors seen per dtype (reported in the closing note)."""
    worst: dict[str, float] = {}
    for per_rank in gloo["mesh"].values():
        for recs in per_rank:
            for rec in recs:
                key = str(rec.problem.dtype)
                worst[key] = max(worst.get(key, 0.0), max(rec.errors.values()))
    record_property("max_abs_err", worst)
    assert worst.keys() == {"torch.float32", "torch.bfloat16"}
    assert worst["torch.float32"] < 1e-4 and worst["torch.bfloat16"] < 0.1, worst


@pytest.mark.parametrize("world", [4, 8])
def test_best_tile_moves_fewer_bytes_than_ring(gloo, world, record_property):
    """Measured (comm_counter) bytes of the closed-form best tile vs ring attention (tile 1xP)."""
    recs = gloo["mesh"][world][0]  # group rank 0; every rank moves the same bytes
    ring = {(r.problem.heads, r.problem.kv_heads, r.problem.causal, r.problem.dtype): r.sent
            for r in recs if r.tile == (1, world)}
    ratios = {}
    for rec in recs:
        p = rec.problem
        if rec.tile == tuple(best_tile(world, p.shape)):
            label = f"{p.heads}/{p.kv_heads} heads {p.dtype} causal={p.causal} best {rec.tile[0]}x{rec.tile[1]}"
            ratios[label] = rec.sent / ring[(p.heads, p.kv_heads, p.causal, p.dtype)]
    record_property("best_tile_over_ring_bytes", ratios)
    assert len(ratios) == 12, ratios  # 3 head layouts x 2 dtypes x causal/full
    assert all(r <= 1.0 for r in ratios.values()), ratios
    mha = [r for k, r in ratios.items() if k.startswith("4/4")]
    assert mha and all(r < 0.8 for r in mha), ratios  # MHA gains most


def test_bitwise_equal_to_gloo_and_autograd(gloo):
    """Same inputs, same plan: the in-process transport gives bitwise the outputs and gradients of
    the gloo transport (public autograd API in spawned processes, part "gloo_outputs"), and
    forward_backward gives bitwise what the public autograd API gives on the same virtual ranks."""
    world = 4
    gloo_runs = gloo["gloo_outputs"][world]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the spawned ranks run with one thread: same kernels, same sums
    try:
        for i, (tile, causal, heads, dtype) in enumerate(cases.GLOO_CASES):
            p = cases.Problem(world, *cases.HEADS[heads], causal, dtype)
            ref = cases.dense_reference(p)
            mine = run_case(p, build_mesh_plan(world, tile, p.shape, causal=causal), ref=ref)
            autograd = run_inprocess(lambda rank, comm: cases.measure(
                rank, p, "", lambda q, k, v: mm.mesh_attention(q, k, v, tile=tile, causal=causal, comm=comm), ref,
                keep_outputs=True).outputs, world, timeout=120)
            for r in range(world):
                assert gloo_runs[r][i].tile == tile and len(gloo_runs[r][i].outputs) == 4
                for name, a, b, c in zip(cases.NAMES, mine[r].outputs, gloo_runs[r][i].outputs, autograd[r]):
                    assert torch.equal(a, b), f"{tile} {heads} {dtype} rank {r} {name}: in-process != gloo"
                    assert torch.equal(a, c), f"{tile} {heads} {dtype} rank {r} {name}: driver != autograd"
    finally:
        torch.set_num_threads(threads)

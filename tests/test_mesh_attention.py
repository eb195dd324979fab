"""Mesh-Attention and ring attention: forward and all gradients against a dense fp64 reference on
CPU/gloo, for every tile shape of P = 1..8, causal and full, MHA/GQA/MQA, fp32 and bf16; bytes
measured by comm_counter() equal the plan's bytes and the closed-form formula."""

import pytest

from megatron_mesh.launch import spawn

import cases


def _check(records, world):
    assert records, "no cases ran"
    failures = [f"rank {r}: {rec['case']}: {name} error {rec['abs_err'][name]:.2e} ({ratio:.2f}x tolerance)"
                for r, recs in enumerate(records) for rec in recs for name, ratio in rec["ratios"].items()
                if not ratio <= 1.0]
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 7, 8])
def test_mesh_matches_dense_reference(world):
    records = spawn(cases.mesh_grid, world, timeout=600)
    _check(records, world)
    for r, recs in enumerate(records):
        for rec in recs:
            assert (rec["sent"], rec["received"]) == rec["planned"] == rec["formula"], (r, rec["case"], rec)


@pytest.mark.parametrize("world", [4, 6])
def test_mesh_variants_and_determinism(world):
    records = spawn(cases.mesh_variants, world, timeout=600)
    _check(records, world)
    for r, recs in enumerate(records):
        for rec in recs:
            assert rec["identical"], f"rank {r}: {rec['case']}: two runs differ bitwise"

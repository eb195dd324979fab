"""TASP attention: forward and all gradients against a dense fp64 reference on CPU/gloo for
P = 2..8 (P = 8 also as two emulated nodes of 4, P = 4 and 6 also as nodes of 2), causal and
full, MHA/GQA (and MQA), fp32 and bf16, both transports; bytes measured by comm_counter() equal
the plan's bytes and the closed-form formula (ring attention's bytes)."""

import pytest
import torch

from megatron_mesh.launch import spawn
from megatron_mesh.runtime.tasp_api import tasp_attention

import cases
import tasp_cases

NODE_SHAPES = {4: (2,), 6: (2,), 8: (4,)}  # world -> emulated gpus_per_node values


def _check(records):
    assert records and all(records), "no cases ran"
    failures = [f"rank {r}: {rec['case']}: {name} error {rec['abs_err'][name]:.2e} ({ratio:.2f}x tolerance)"
                for r, recs in enumerate(records) for rec in recs for name, ratio in rec["ratios"].items()
                if not ratio <= 1.0]
    assert not failures, "\n".join(failures[:20])
    for r, recs in enumerate(records):
        for rec in recs:
            assert (rec["sent"], rec["received"]) == rec["planned"] == rec["formula"], (r, rec["case"], rec)


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 7, 8])
def test_tasp_matches_dense_reference(world):
    records = spawn(tasp_cases.tasp_grid, world, NODE_SHAPES.get(world, ()), timeout=300)
    _check(records)
    expected = 8 * (1 + len(NODE_SHAPES.get(world, ())))
    assert all(len(recs) == expected for recs in records)
    # the all-to-all transport really ran (its communicator exists once an alltoall case has run)
    assert all(rec["alltoall_comm"] for recs in records for rec in recs if rec["case"].endswith("alltoall"))


@pytest.mark.parametrize("world", [3, 4])
def test_tasp_variants(world):
    _check(spawn(tasp_cases.tasp_variants, world, timeout=300))


def test_tasp_single_rank_without_process_group():
    p = cases.Problem(1, 4, 2, True, torch.float32)
    for transport in ("p2p", "alltoall"):
        ratios, _, (sent, recv), _ = cases.run_local(0, p, lambda q, k, v: tasp_attention(q, k, v, transport=transport))
        assert all(r <= 1.0 for r in ratios.values()), ratios
        assert (sent, recv) == (0, 0)


def test_tasp_rejects_bad_arguments():
    q = torch.randn(8, 1, 4, 16)
    k = v = torch.randn(8, 1, 2, 16)
    with pytest.raises(ValueError, match="transport"):
        tasp_attention(q, k, v, transport="nccl")
    with pytest.raises(ValueError, match="gpus_per_node"):
        tasp_attention(q, k, v, gpus_per_node=0)
    with pytest.raises(ValueError, match="divisible"):  # GQA rule shared with mesh_attention
        tasp_attention(q, torch.randn(8, 1, 3, 16), torch.randn(8, 1, 3, 16))
    with pytest.raises(ValueError, match="even"):
        tasp_attention(q[:7], k[:7], v[:7])

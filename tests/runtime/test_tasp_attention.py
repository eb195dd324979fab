"""TASP attention: forward and all gradients against a dense fp64 reference on CPU/gloo for
P = 2..8 (P = 8 also as two emulated nodes of 4, P = 4 and 6 also as nodes of 2), causal and
full, MHA/GQA (and MQA), fp32 and bf16 (fp64 for a long sequence), both transports; bytes
measured by comm_counter() equal the plan's bytes and the closed-form formula (ring attention's
bytes); the all-to-all transport makes one all_to_all_single per round, P2P none.

Parts "tasp" and "tasp_variants" of the one 8-process spawn (cases.run_gloo)."""

import pytest
import torch

import megatron_mesh as mm

import cases
from tasp_cases import NODE_SHAPES

GLOO_PARTS = ("tasp", "tasp_variants")


def _check(per_rank):
    cases.assert_accurate(per_rank)
    cases.assert_bytes_as_expected(per_rank)
    wrong = [f"rank {r}: {rec.case}: {rec.collectives[0]} all_to_all_single calls, expected {rec.collectives[1]}"
             for r, recs in enumerate(per_rank) for rec in recs if rec.collectives[0] != rec.collectives[1]]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 7, 8])
def test_tasp_matches_dense_reference(gloo, world):
    per_rank = gloo["tasp"][world]
    assert len(per_rank) == world
    _check(per_rank)
    assert len(per_rank[0]) == 8 * (1 + len(NODE_SHAPES.get(world, ())))
    # both transports ran, and the all-to-all one really made collectives: one per round, P - 1 forward
    by_transport = {t: [rec for rec in per_rank[0] if rec.case.endswith(t)] for t in ("p2p", "alltoall")}
    assert all(len(recs) == len(per_rank[0]) // 2 for recs in by_transport.values())
    assert all(rec.collectives[1] >= world - 1 for rec in by_transport["alltoall"])


@pytest.mark.parametrize("world", [3, 4])
def test_tasp_variants(gloo, world):
    per_rank = gloo["tasp_variants"][world]
    _check(per_rank)
    assert [rec.problem.dtype for rec in per_rank[0]] == [torch.float32] * 2 + [torch.float64] * 2 + [torch.float32] * 4
    assert all(rec.collectives[1] >= 4 for rec in per_rank[0][-4:-1])  # every rank, both rounds, both directions
    # documents that stay inside the ranks: no rounds in the plan, no collective made
    assert all(recs[-1].collectives == (0, 0) and recs[-1].sent == 0 for recs in per_rank)


def test_tasp_single_rank_without_process_group():
    p = cases.Problem(1, 4, 2, True, torch.float32)
    ref = cases.dense_reference(p)
    for transport in ("p2p", "alltoall"):
        res = cases.measure(0, p, transport, lambda q, k, v: mm.tasp_attention(q, k, v, transport=transport), ref)
        cases.assert_accurate([[res]])
        assert (res.sent, res.received) == (0, 0)


def test_tasp_rejects_bad_arguments():
    q = torch.randn(8, 1, 4, 16)
    k = v = torch.randn(8, 1, 2, 16)
    with pytest.raises(ValueError, match="transport must be one of p2p, alltoall, got 'nccl'"):
        mm.tasp_attention(q, k, v, transport="nccl")
    with pytest.raises(ValueError, match=r"CP ranks per node \(gpus_per_node\) must be a positive divisor of the CP size 1, got 0"):
        mm.tasp_attention(q, k, v, gpus_per_node=0)
    with pytest.raises(ValueError, match=r"query heads \(4\) must be divisible by kv heads \(3\)"):
        mm.tasp_attention(q, torch.randn(8, 1, 3, 16), torch.randn(8, 1, 3, 16))
    with pytest.raises(ValueError, match=r"s_local \(7\) must be even"):
        mm.tasp_attention(q[:7], k[:7], v[:7])

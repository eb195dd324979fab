"""Chunked and prefix attention with documents through ``megatron_mesh.attention(mask=...)`` on the
in-process executor: every mode (ring, mesh tiles, tasp, a2a+mesh/tasp/ring) at P = 2..8, the
chunk smaller than, equal to and larger than a rank's chunk, prefix, MHA/GQA/MQA, on the zigzag
and the balanced layout -- outputs and dQ, dK, dV against the dense fp64 reference, bytes equal
to the plan's. The gloo path runs a few of these cases in the shared spawn (mask_cases.kinds_grid,
test_masked_attention.py); this module starts no process (it runs beside the multi-process ones
under pytest-xdist, tests/conftest.py)."""

from __future__ import annotations

import itertools

import pytest
import torch

import megatron_mesh as mm
from megatron_mesh import masks
from megatron_mesh.comm.inprocess import run_inprocess
from megatron_mesh.plan import MODES, plan_bytes, resolve

import cases
import mask_cases


def _check(p: cases.Problem, mode: str, settings: dict) -> None:
    ref = cases.dense_reference(p)
    plan = resolve(mode, p.world, p.shape, **settings).build(p.shape, p.mask if p.layout is None else p.kind, p.layout)
    planned = [(b.sent, b.received) for b in plan_bytes(plan, p.shape)]

    def rank_fn(rank, comm):
        return cases.measure(rank, p, f"{mode} {settings} {p.mask.summary()} balanced={p.balanced}",
                             lambda q, k, v: mm.attention(q, k, v, mode=mode, comm=comm, **p.mask_args(), **settings),
                             ref)

    out = run_inprocess(rank_fn, p.world, timeout=120)
    cases.assert_accurate([[res] for res in out])
    assert [(res.sent, res.received) for res in out] == planned, (mode, p.mask.summary())


@pytest.mark.parametrize("P", range(2, 9))
def test_chunked_and_prefix_match_the_dense_reference_in_every_mode(P):
    T = 12
    for i, (kind, mode, balanced) in enumerate(itertools.product(mask_cases.kinds(T), MODES, (False, True))):
        heads = ("MHA", "GQA", "MQA")[i % 3]
        p = mask_cases.kind_problem(P, T, kind, heads, balanced, seed=i)
        _check(p, mode, mask_cases.kind_settings(mode, P))


@pytest.mark.parametrize("mode", ["ring", "a2a+tasp"])
def test_chunked_and_prefix_in_bf16(mode):
    for kind in mask_cases.kinds(12)[1:]:
        p = mask_cases.kind_problem(4, 12, kind, "GQA", False, dtype=torch.bfloat16)
        _check(p, mode, mask_cases.kind_settings(mode, 4))


def test_mask_and_the_loose_arguments_are_one_or_the_other():
    q = k = v = torch.zeros(4, 1, 2, 8)
    for loose in (dict(causal=False), dict(causal=True), dict(window=(2, 0)), dict(cu_seqlens=[0, 4])):
        with pytest.raises(ValueError, match=f"pass mask= or the loose causal/window/cu_seqlens arguments, not both: "
                                             f"got mask .*chunked.* and {next(iter(loose))}="):
            mm.ring_attention(q, k, v, mask=masks.chunked(2), **loose)
    with pytest.raises(ValueError, match=r"the mask's documents .* end at 6, not at the global sequence length 4"):
        mm.ring_attention(q, k, v, mask=masks.documents([0, 2, 6]) & masks.chunked(2))
    with pytest.raises(ValueError, match="mask must be a mask of megatron_mesh.masks"):
        mm.attention(q, k, v, mask="chunked:2")
    # a boolean mask tensor (torch's attn_mask) named by its shape, not printed element by element
    with pytest.raises(ValueError, match=r"got a tensor of shape \(4, 4\) and dtype torch.bool$"):
        mm.attention(q, k, v, mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="the mask and a BalancedLayout both give documents"):
        mm.ring_attention(q, k, v, mask=masks.documents([0, 1, 4]), layout=mm.balanced_layout([0, 1, 4], 1))


def test_inputs_on_a_device_without_kernels_are_refused_naming_it():
    """Meta tensors (a model built on the meta device and not materialised): the error names the
    device and the allowed ones -- autocast's own check of the device type raised first, naming
    neither (a reviewer, stop 81)."""
    q = k = v = torch.zeros(4, 1, 2, 8, device="meta")
    with pytest.raises(ValueError, match="torch attention kernels run on cpu or cuda devices, got meta"):
        mm.ring_attention(q, k, v)

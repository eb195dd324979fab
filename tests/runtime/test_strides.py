"""Inputs in any memory layout give the dense fp64 reference's output and gradients (issue 48: a
head_dim that is not stride 1 gave wrong numbers without a word in ring, Mesh and TASP).

q, k, v and dout each come as views of other memory (:data:`mask_cases.MEMORY`): the middle third
of a fused QKV projection, a [b, h, s, d] tensor permuted, every other element of a wider buffer,
a projection stored [d, h] and transposed, every dim permuted, a head or a head_dim element
broadcast with stride 0. Every mode -- ring, each Mesh tile, TASP, the Ulysses hybrids -- without
documents, with documents on Megatron's zigzag and on the balanced layout, forward and backward,
on in-process ranks (P = 3, 4: every layout on every input) and on gloo groups (P = 5, 6, the
shared spawn's part "strides": test_masked_attention.py); the caller's tensors are never written,
and the bytes moved are the plan's. This module starts no process (it runs beside the
multi-process ones under pytest-xdist, tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

import mask_cases
from megatron_mesh.comm.inprocess import run_inprocess
from megatron_mesh.kernels import CAUSAL, FULL, get_kernel


def record_failures(per_rank: list[list[mask_cases.Record]]) -> list[str]:
    """What is wrong in these records (one list per group rank): an error over the tolerance,
    bytes other than the plan's, a caller's tensor written."""
    out = []
    for r, recs in enumerate(per_rank):
        for rec in recs:
            out += [f"rank {r}: {rec.case}: {name} error {rec.abs_err[name]:.2e} ({ratio:.2f}x tolerance)"
                    for name, ratio in rec.ratios.items() if not ratio <= 1.0]
            if (rec.sent, rec.received) != rec.planned:
                out.append(f"rank {r}: {rec.case}: measured {(rec.sent, rec.received)} != planned {rec.planned}")
            if rec.inputs_written:
                out.append(f"rank {r}: {rec.case}: wrote into the caller's q, k, v or dout")
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_every_memory_layout_of_every_input_in_every_mode(world):
    cases = mask_cases.strides_cases(world)
    assert {m for c in cases for m in c.memory} == set(mask_cases.MEMORY)
    failures = []
    for c in cases:
        per_rank = run_inprocess(lambda rank, comm: [mask_cases.run(rank, c, None, comm=comm)], world, timeout=120)
        failures += record_failures(per_rank)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def test_every_memory_layout_where_a_rank_cuts_several_head_slices_at_once():
    """A Ulysses group of 4: a rank's sends to its peers are one cut of several head slices (one
    gather per tensor into [T, B, slices, heads, D], plan/arena_runs.py ``cut_groups``), from inputs
    in every memory layout -- on the zigzag (``a2a+ring``, P = 4) and on a layout balanced for the
    groups (``a2a+tasp``, P = 8, rounds by document set) -- exact, with the planned bytes."""
    names, failures = list(mask_cases.MEMORY), []
    for mode, world, balanced in (("a2a+ring", 4, 0), ("a2a+tasp", 8, 4)):
        T = 2 * max(world, 3)
        masked = dict(cu_seqlens=mask_cases.balanced_documents(world, T, 3), balanced=balanced) if balanced else {}
        for i in range(len(names)):
            memory = tuple(names[(i + j) % len(names)] for j in range(4))
            heads, kv, dtype = ((8, 4, torch.float64), (8, 8, torch.float32))[i % 2]
            c = mask_cases.Case(world, mode, (("ulysses_size", 4),), heads, kv, dtype, seq_local=T, memory=memory,
                                **masked)
            per_rank = run_inprocess(lambda rank, comm: [mask_cases.run(rank, c, None, comm=comm)], world, timeout=120)
            failures += record_failures(per_rank)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("memory", [m for m in mask_cases.MEMORY if m != "contiguous"])
def test_torch_kernel_takes_any_strides(memory):
    """The block kernel itself (called without the executor, as benchmarks do) gives on strided
    inputs what it gives on contiguous ones, forward and backward, full and causal."""
    kernel = get_kernel("torch", torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    values, lay = mask_cases.MEMORY[memory]
    # [s, b, h, d] tensors in ``memory``, seen as the kernel's [b, h, s, d]
    raw = [torch.randn(6, 2, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4)]
    strided = [lay(x).permute(1, 2, 0, 3) for x in raw]
    dense = [(x if values is None else values(x)).permute(1, 2, 0, 3).contiguous() for x in raw]
    for mask in (FULL, CAUSAL):
        want_out, want_lse = kernel.forward(*dense[:3], mask=mask, scale=0.3)
        got_out, got_lse = kernel.forward(*strided[:3], mask=mask, scale=0.3)
        torch.testing.assert_close(got_out, want_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_lse, want_lse, rtol=1e-12, atol=1e-12)
        delta = (dense[3] * want_out).sum(-1)
        want = kernel.backward(dense[3], *dense[:3], want_lse, delta, mask=mask, scale=0.3)
        got = kernel.backward(strided[3], *strided[:3], want_lse, delta, mask=mask, scale=0.3)
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"{memory} {mask.kind} {name}")

"""A block-attention kernel backend of one's own, defined in this file alone (no package file
knows it): the two methods of :class:`megatron_mesh.kernels.BlockKernel`, written as a new
contributor would (einsum over [B, H, S, D], the GQA groups as a view, the block's mask as a
bias). Handed to the public API as an object (``kernel=``), it runs every CP mode on the
in-process executor -- dense, under documents with a window, on the balanced layout; MHA, GQA,
MQA; odd and even CP sizes -- against the dense fp64 reference forward and backward, with the
bytes the plan says, and every block goes through it. This measures docs/design.md's "what a
change touches" row for a kernel backend: no package file to use one; choosing it by name
(the API's string, Megatron's ``--cp-kernel-backend``) is the name list and factory in
``megatron_mesh/kernels/__init__.py``."""

from __future__ import annotations

import itertools

import pytest
import torch

import megatron_mesh as mm
from megatron_mesh.comm.inprocess import run_inprocess
from megatron_mesh.kernels import KERNEL_BACKENDS
from megatron_mesh.plan import MODES, plan_bytes, resolve
from megatron_mesh.plan.mask import BlockKind

import cases


class ToyKernel:
    """Softmax attention of one block in einsum: scores [B, Hkv, G, Sq, Sk] (G query heads per
    key/value head), the mask added as -inf, the row statistics the executor merges by."""

    name = "toy-einsum"

    def __init__(self):
        self.calls = {"forward": 0, "backward": 0}

    def _probs(self, q, k, mask, scale, lse=None):
        b, h, sq, d = q.shape
        g = h // k.shape[1]
        s = torch.einsum("bkgqd,bkjd->bkgqj", q.float().view(b, k.shape[1], g, sq, d), k.float()) * scale
        if mask.kind == BlockKind.CAUSAL:
            s = s.masked_fill(torch.ones(sq, k.shape[2], dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        elif mask.kind == BlockKind.MASKED:
            s = s + mask.bias(s.dtype)
        if lse is None:
            lse = torch.logsumexp(s, -1)
        else:
            lse = lse.float().view(b, k.shape[1], g, sq)
        return torch.exp(s - lse.nan_to_num(neginf=0.0).unsqueeze(-1)), lse

    def forward(self, q, k, v, *, mask, scale):
        self.calls["forward"] += 1
        p, lse = self._probs(q, k, mask, scale)
        out = torch.einsum("bkgqj,bkjd->bkgqd", p, v.float())
        return out.reshape(q.shape[0], q.shape[1], q.shape[2], v.shape[-1]), lse.reshape(q.shape[:3])

    def backward(self, dout, q, k, v, lse, delta, *, mask, scale):
        self.calls["backward"] += 1
        b, h, sq, _ = q.shape
        hkv = k.shape[1]
        p, _ = self._probs(q, k, mask, scale, lse)
        do = dout.float().view(b, hkv, h // hkv, sq, dout.shape[-1])
        ds = p * (torch.einsum("bkgqd,bkjd->bkgqj", do, v.float()) - delta.float().view(b, hkv, h // hkv, sq, 1))
        dq = torch.einsum("bkgqj,bkjd->bkgqd", ds, k.float()) * scale
        dk = torch.einsum("bkgqj,bkgqd->bkjd", ds, q.float().view(b, hkv, h // hkv, sq, q.shape[-1])) * scale
        dv = torch.einsum("bkgqj,bkgqd->bkjd", p, do)
        return dq.reshape(q.shape), dk, dv


def _settings(mode: str, P: int) -> dict:
    U = 2 if P % 2 == 0 else 1
    return {"a2a+mesh": dict(ulysses_size=U), "a2a+ring": dict(ulysses_size=U), "a2a+tasp": dict(ulysses_size=U)
            }.get(mode, {})


@pytest.mark.parametrize("P", [3, 4])
def test_a_toy_kernel_backend_matches_the_dense_reference_in_every_mode(P):
    """Every mode, through mm.attention(kernel=ToyKernel()) on the in-process executor: outputs and
    dQ, dK, dV against the dense fp64 reference (causal and full dense, documents + window,
    documents on the balanced layout), the bytes equal to the plan's, and the toy kernel ran the
    blocks of every rank forward and backward."""
    T = 8
    S = P * T
    cu = (0, 5, S // 2 + 3, S)
    problems = [dict(causal=True), dict(causal=False), dict(causal=True, cu_seqlens=cu, window=(6, 0)),
                dict(causal=True, cu_seqlens=cu, balanced=True)]
    assert ToyKernel.name not in KERNEL_BACKENDS  # no package file knows it
    for i, (mode, kw) in enumerate(itertools.product(MODES, problems)):
        heads = ("MHA", "GQA", "MQA")[i % 3]
        kw = dict(kw)
        p = cases.Problem(P, *cases.HEADS[heads], kw.pop("causal"), torch.float32, seq_local=T, seed=i, **kw)
        settings = _settings(mode, P)
        ref = cases.dense_reference(p)
        plan = resolve(mode, P, p.shape, **settings).build(p.shape, p.mask, p.layout)
        planned = [(b.sent, b.received) for b in plan_bytes(plan, p.shape)]
        kernels = [ToyKernel() for _ in range(P)]

        def rank_fn(rank, comm, mode=mode, p=p, settings=settings, ref=ref, kernels=kernels):
            return cases.measure(rank, p, f"{mode} {p.mask.summary()} toy kernel", lambda q, k, v: mm.attention(
                q, k, v, mode=mode, comm=comm, kernel=kernels[rank], **p.mask_args(), **settings), ref)

        out = run_inprocess(rank_fn, P, timeout=120)
        cases.assert_accurate([[res] for res in out])
        assert [(res.sent, res.received) for res in out] == planned, (mode, p.mask.summary())
        blocks = [(sum(1 for _ in plan.rank(r).blocks("forward")), sum(1 for _ in plan.rank(r).blocks("backward")))
                  for r in range(P)]
        assert all(k.calls["forward"] >= (f > 0) and k.calls["backward"] >= (b > 0)
                   for k, (f, b) in zip(kernels, blocks)), (mode, [k.calls for k in kernels], blocks)
        assert any(k.calls["forward"] for k in kernels)

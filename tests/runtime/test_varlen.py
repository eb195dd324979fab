"""Variable-length kernel calls: a masked block's full pieces, and its causal pieces, run as one
call each (:func:`megatron_mesh.plan.call_groups`) on a kernel that has them -- the CUDA flash
kernel. Its glue (packing the pieces, the cumulative offsets, the [heads, tokens] lse, folded
batch, grouped-query heads) runs here on CPU against a stand-in for flash's varlen ops with their
contract, through the whole executor, forward and backward, against the dense fp64 reference."""

from __future__ import annotations

import pytest
import torch

import megatron_mesh as mm
from megatron_mesh.comm.inprocess import run_inprocess
from megatron_mesh.kernels import torch_sdpa
from megatron_mesh.kernels.base import loop_varlen_backward, loop_varlen_forward, varlen_forward
from megatron_mesh.kernels.torch_sdpa import TorchAttentionKernel
from megatron_mesh.plan import Mask
from megatron_mesh.plan.mask import BlockKind, call_groups

import cases


def _segments(cu):
    return [(int(a), int(b)) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]


def _scores(q, k, a, b, c, d, causal, scale):
    """fp32 scores [H, n, m] of queries [a, b) against keys [c, d) of packed [T, H, D] inputs."""
    g = q.shape[1] // k.shape[1]
    qs = q[a:b].float().transpose(0, 1)
    ks = k[c:d].float().transpose(0, 1).repeat_interleave(g, 0)
    s = qs @ ks.transpose(1, 2) * scale
    if causal:
        s = s.masked_fill(~torch.ones(b - a, d - c, dtype=torch.bool).tril(), float("-inf"))
    return s


def fake_flash_forward(calls, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """flash's varlen forward, by its contract: packed [T, H, D] in, out like q, lse [H, T] fp32."""
    calls.append(("forward", len(cu_q) - 1))
    assert cu_q.dtype == cu_k.dtype == torch.int32 and q.stride(-1) == 1
    g = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
    for (a, b), (c, d) in zip(_segments(cu_q), _segments(cu_k)):
        assert b - a <= max_q and d - c <= max_k
        s = _scores(q, k, a, b, c, d, causal, scale)
        vs = v[c:d].float().transpose(0, 1).repeat_interleave(g, 0)
        out[a:b] = (torch.softmax(s, -1) @ vs).transpose(0, 1).to(q.dtype)
        lse[:, a:b] = torch.logsumexp(s, -1)
    return out, lse


def fake_flash_backward(calls, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    """flash's varlen backward, by its contract: delta from (dout, out), dk / dv folded onto the
    key/value heads, gradients like the inputs."""
    calls.append(("backward", len(cu_q) - 1))
    hkv, g = k.shape[1], q.shape[1] // k.shape[1]
    dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32) for x in (q, k, v))
    for (a, b), (c, d) in zip(_segments(cu_q), _segments(cu_k)):
        s = _scores(q, k, a, b, c, d, causal, scale)
        p = torch.exp(s - lse[:, a:b, None])
        do, o = dout[a:b].float().transpose(0, 1), out[a:b].float().transpose(0, 1)
        ks = k[c:d].float().transpose(0, 1).repeat_interleave(g, 0)
        vs = v[c:d].float().transpose(0, 1).repeat_interleave(g, 0)
        ds = p * (do @ vs.transpose(1, 2) - (do * o).sum(-1, keepdim=True))
        dq[a:b] = (scale * ds @ ks).transpose(0, 1)
        gk = scale * ds.transpose(1, 2) @ q[a:b].float().transpose(0, 1)
        gv = p.transpose(1, 2) @ do
        dk[c:d] = gk.reshape(hkv, g, d - c, -1).sum(1).transpose(0, 1)
        dv[c:d] = gv.reshape(hkv, g, d - c, -1).sum(1).transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FlashOnCPU(TorchAttentionKernel):
    """The CUDA flash kernel's variable-length calls (its own code) on CPU tensors: the pieces the
    runtime groups go through ``forward_varlen`` / ``backward_varlen``; single pieces through the
    CPU op."""

    def __init__(self):
        super().__init__("cpu")
        self.varlen = True


@pytest.fixture
def flash_calls(monkeypatch):
    calls: list = []
    monkeypatch.setattr(torch_sdpa, "flash_varlen_forward", lambda *a: fake_flash_forward(calls, *a))
    monkeypatch.setattr(torch_sdpa, "flash_varlen_backward", lambda *a: fake_flash_backward(calls, *a))
    return calls


def test_call_groups_worked_example():
    """Own documents of 900, 2,000, 40, 30 and 500 tokens: causal, causal, masked (the two short
    ones packed), causal -> three variable-length calls (the first two documents follow each
    other; the third causal piece does not follow them), four one per piece, one for Transformer
    Engine's THD."""
    pieces = [(BlockKind.CAUSAL, (0, 900), (0, 900)), (BlockKind.CAUSAL, (900, 2900), (900, 2900)),
              (BlockKind.MASKED, (2900, 2970), (2900, 2970)), (BlockKind.CAUSAL, (2970, 3470), (2970, 3470))]
    assert call_groups(pieces, "varlen") == [(0, 1), (2,), (3,)]
    assert call_groups(pieces, "piece") == [(0,), (1,), (2,), (3,)]
    assert call_groups(pieces, "block") == [(0, 1, 2, 3)]
    full = [(BlockKind.FULL, (0, 10), (50, 60)), (BlockKind.FULL, (10, 30), (60, 70)), (BlockKind.FULL, (30, 40), (0, 5))]
    assert call_groups(full, "varlen") == [(0, 1), (2,)]  # the third's keys do not follow the second's
    assert call_groups([], "varlen") == [] and call_groups([], "block") == []
    with pytest.raises(ValueError, match="kernel_calls must be one of varlen, piece, block, got 'each'"):
        call_groups(pieces, "each")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_varlen_call_equals_one_call_per_sequence(dtype, flash_calls):
    """One variable-length call (the flash glue, batch 2, GQA 4/2) gives what one call per
    sequence gives; fp32 inputs (flash has no fp32 kernel) run as those calls."""
    torch.manual_seed(0)
    seqs = ((5, 5), (9, 9), (3, 3))
    q = torch.randn(2, 4, 17, 16, dtype=dtype)
    k, v = torch.randn(2, 2, 17, 16, dtype=dtype), torch.randn(2, 2, 17, 16, dtype=dtype)
    kernel, cpu = FlashOnCPU(), TorchAttentionKernel("cpu")
    out, lse = varlen_forward(kernel, q, k, v, seqs, causal=True, scale=0.25)
    want_out, want_lse = loop_varlen_forward(cpu, q, k, v, seqs, causal=True, scale=0.25)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.float(), want_out.float(), **tol)
    torch.testing.assert_close(lse.float(), want_lse.float(), **tol)
    dout = torch.randn_like(q)
    delta = (dout.float() * want_out.float()).sum(-1)
    got = kernel.backward_varlen(dout, q, k, v, want_lse, delta, seqs, causal=True, scale=0.25)
    want = loop_varlen_backward(cpu, dout, q, k, v, want_lse, delta, seqs, causal=True, scale=0.25)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g.float(), w.float(), **tol)
    assert flash_calls == ([("forward", 6), ("backward", 6)] if dtype == torch.bfloat16 else [])  # 3 x batch 2
    with pytest.raises(ValueError, match="causal sequences must have as many queries as keys"):
        varlen_forward(kernel, q, k, v, ((5, 4), (12, 13)), causal=True, scale=0.25)
    with pytest.raises(ValueError, match=r"do not add up to 17 queries and 17 keys"):
        varlen_forward(kernel, q, k, v, ((5, 5),), causal=True, scale=0.25)


@pytest.mark.parametrize("mode", ["ring", "tasp", "a2a+tasp"])
@pytest.mark.parametrize("heads, dtype", [("GQA", torch.bfloat16), ("MQA", torch.bfloat16), ("MHA", torch.float32)])
def test_documents_run_as_variable_length_calls_exactly(mode, heads, dtype, flash_calls):
    """Packed documents through the public API with the flash kernel's variable-length calls:
    each rank's own documents are one or two masked calls whose causal pieces (documents of at
    least MASK_PIECE / 16 tokens) run together; outputs and gradients match the dense fp64
    reference, bytes the plan's."""
    world = 4
    p = cases.Problem(world, *cases.HEADS[heads], True, dtype, seq_local=256,
                      cu_seqlens=(0, 70, 180, 300, 333, 480, 520, 700, 1024))
    ref = cases.dense_reference(p)
    settings = {"a2a+tasp": dict(ulysses_size=2)}.get(mode, {})

    def rank_fn(rank, comm):
        return cases.measure(rank, p, f"{mode} {heads} {dtype}",
                             lambda q, k, v: mm.attention(q, k, v, mode=mode, comm=comm, kernel=FlashOnCPU(),
                                                          **p.mask_args(), **settings), ref)

    out = run_inprocess(rank_fn, world, timeout=120)
    cases.assert_accurate([[res] for res in out])
    if dtype == torch.bfloat16:
        assert any(n > 1 for kind, n in flash_calls if kind == "forward"), flash_calls
        assert any(n > 1 for kind, n in flash_calls if kind == "backward"), flash_calls


def test_own_documents_are_at_most_two_calls():
    """A rank's own documents: one masked call per side of the return round (rows [0, cut) and
    [cut, T)), not one per document; the plan still validates (exact cover)."""
    from megatron_mesh.plan import AttentionShape, Attend, resolve, validate_plan

    P, T = 4, 256
    shape = AttentionShape(seq_local=T, batch=1, heads=4, kv_heads=2, head_dim=8)
    mask = Mask.from_cu_seqlens([0, 70, 180, 300, 333, 480, 520, 700, 1024], P * T)
    for mode in ("ring", "tasp", "mesh"):
        plan = resolve(mode, P, shape).build(shape, mask)
        validate_plan(plan)
        for r in range(P):
            own = [op for op in plan.rank(r).forward if type(op) is Attend and op.q.slot == -1 and
                   op.kv == (op.kv[0],) and op.kv[0].slot == -1 and op.kv[0].chunk == r]
            assert 1 <= len(own) <= 2, (mode, r, own)
            assert all(op.mask == BlockKind.MASKED and op.cols is None for op in own if len(own) > 1 or
                       op.mask == BlockKind.MASKED)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_flash_varlen_equals_one_call_per_sequence(dtype, causal):
    """The real flash varlen ops (torch's aten._flash_attention_forward / _backward with
    cumulative offsets) give what one call per sequence gives: batch 2, GQA 8/2, sequences of odd
    lengths, inputs strided as the executor passes them (views of an sbhd tensor)."""
    torch.manual_seed(0)
    seqs = ((5, 5), (130, 130), (77, 77)) if causal else ((5, 40), (130, 7), (77, 77))
    tq, tk = sum(n for n, _ in seqs), sum(m for _, m in seqs)
    q = torch.randn(tq, 2, 8, 128, device="cuda", dtype=dtype).permute(1, 2, 0, 3)
    k, v = (torch.randn(tk, 2, 2, 128, device="cuda", dtype=dtype).permute(1, 2, 0, 3) for _ in range(2))
    kernel = TorchAttentionKernel("cuda")
    assert kernel.varlen
    out, lse = varlen_forward(kernel, q, k, v, seqs, causal=causal, scale=128 ** -0.5)
    want_out, want_lse = loop_varlen_forward(kernel, q, k, v, seqs, causal=causal, scale=128 ** -0.5)
    torch.testing.assert_close(out.float(), want_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.float(), want_lse.float(), atol=2e-2, rtol=2e-2)
    dout = torch.randn_like(q)
    delta = (dout.float() * want_out.float()).sum(-1)
    got = kernel.backward_varlen(dout, q, k, v, want_lse, delta, seqs, causal=causal, scale=128 ** -0.5)
    want = loop_varlen_backward(kernel, dout, q, k, v, want_lse, delta, seqs, causal=causal, scale=128 ** -0.5)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g.float(), w.float(), atol=5e-2, rtol=5e-2, msg=name)

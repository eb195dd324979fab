"""CUDA graphs (runtime/graphs.py), CUDA tier: one rank of a plan, its messages recorded in an
in-process run of all ranks and replayed, run eagerly and as captured graphs -- the replays give
bitwise the eager outputs and gradients, every replay the same, new inputs loaded into the
static tensors give what eager gives on them; dense plans of every mode and a window."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_mesh.comm.inprocess import run_inprocess
from megatron_mesh.comm.replay import Recorder, ReplayCommunicator
from megatron_mesh.kernels import get_kernel
from megatron_mesh.plan import AttentionShape, Mask, resolve
from megatron_mesh.plan.modes.base import parse_mode_spec
from megatron_mesh.runtime.executor import Executor

CASES = [("ring", None), ("mesh:2x2", None), ("tasp", None), ("a2a+ring:2", None), ("ring", (96, 0))]


def _alone(plan, kernel, shards, rank: int, scale: float):
    """Rank ``rank``'s received messages of one in-process forward and one backward of every rank:
    (forward rounds, backward rounds)."""
    world = plan.world_size
    recorded, saved = {}, [None] * world

    def forward(r, comm):
        rec = Recorder(comm)
        q, k, v, _ = shards[r]
        saved[r] = Executor(plan, rec, kernel, scale).forward(q, k, v)
        recorded.setdefault("forward", {})[r] = rec.received()

    def backward(r, comm):
        rec = Recorder(comm)
        q, k, v, dout = shards[r]
        res = saved[r]
        Executor(plan, rec, kernel, scale).backward(q, k, v, res.out.to(q.dtype), res.lse, dout, res.saved)
        recorded.setdefault("backward", {})[r] = rec.received()

    for fn in (forward, backward):
        run_inprocess(fn, world, serial=True, device=torch.device("cuda"))
    return recorded["forward"][rank], recorded["backward"][rank]


@pytest.mark.gpu
@pytest.mark.parametrize("mode, window", CASES, ids=[f"{m}{'-window' if w else ''}" for m, w in CASES])
def test_graph_replay_equals_eager_bitwise(mode, window):
    from megatron_mesh.runtime.graphs import PlanGraphs

    world, T, heads, kv_heads, d = 4, 256, 8, 2, 64
    name, settings = parse_mode_spec(mode)
    shape = AttentionShape(T, 1, heads, kv_heads, d, 2)
    mask = Mask(causal=True, window=window) if window else None
    plan = resolve(name, world, shape, **settings).build(shape, mask)
    kernel, scale = get_kernel("auto", torch.device("cuda")), d ** -0.5
    g = torch.Generator().manual_seed(0)
    # [B, H, T, D] views of token-major [T, B, H, D] tensors: the layout Megatron hands the executor
    mk = lambda h: torch.randn(T, 1, h, d, generator=g).to("cuda", torch.bfloat16).permute(1, 2, 0, 3)  # noqa: E731
    shards = [(mk(heads), mk(kv_heads), mk(kv_heads), mk(heads)) for _ in range(world)]
    for rank in (0, world - 1):
        rounds = _alone(plan, kernel, shards, rank, scale)
        q, k, v, dout = shards[rank]

        def eager(q, k, v, dout):
            fwd = Executor(plan, ReplayCommunicator(rank, world, rounds[0]), kernel, scale)
            bwd = Executor(plan, ReplayCommunicator(rank, world, rounds[1]), kernel, scale)
            res = fwd.forward(q, k, v)
            out = res.out.to(q.dtype)
            return (out.clone(), *(x.clone() for x in bwd.backward(q, k, v, out, res.lse, dout, res.saved)))

        want = eager(q, k, v, dout)
        graphs = PlanGraphs(Executor(plan, ReplayCommunicator(rank, world, rounds[0]), kernel, scale),
                            Executor(plan, ReplayCommunicator(rank, world, rounds[1]), kernel, scale), q, k, v, dout)
        for step in range(2):
            out, _ = graphs.forward()
            got = (out, *graphs.backward())
            torch.cuda.synchronize()
            for what, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                assert torch.equal(a, b), (mode, window, rank, step, what)
        # other values in the same static tensors: what eager gives on them (the same messages)
        new = tuple(x * 0.5 for x in (q, k, v, dout))
        graphs.load(*new)
        out, _ = graphs.forward()
        got = (out, *graphs.backward())
        for what, a, b in zip(("out", "dq", "dk", "dv"), got, eager(*new)):
            assert torch.equal(a, b), (mode, window, rank, "loaded", what)


@pytest.mark.gpu
def test_triton_merge_matches_the_torch_ops():
    """The fused merge on CUDA (one Triton kernel where Triton is there) against merge_partial_'s
    torch ops: the same rows exactly where they are exact (unreached rows stay 0 / -inf, a row a
    block reaches first becomes the block's), within fp32 rounding elsewhere, on strided views
    (token-major accumulators, a bf16 block)."""
    from megatron_mesh.runtime.fused import merge_, triton_merge_available
    from megatron_mesh.runtime.merge import merge_partial_

    g = torch.Generator().manual_seed(0)
    out = torch.randn(64, 1, 4, 32, generator=g).cuda().permute(1, 2, 0, 3)  # token-major storage
    lse = torch.randn(1, 4, 64, generator=g).cuda()
    lse[0, 0, :4], out[0, 0, :4] = float("-inf"), 0
    blk_out = torch.randn(1, 4, 64, 32, generator=g).cuda().bfloat16()
    blk_lse = torch.randn(1, 4, 64, generator=g).cuda()
    blk_lse[0, 0, 0] = float("-inf")
    a = (out.clone(), lse.clone())
    b = (out.clone(), lse.clone())
    merge_partial_(*a, blk_out, blk_lse)
    merge_(*b, blk_out, blk_lse)
    torch.testing.assert_close(b[0], a[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(b[1], a[1], rtol=1e-6, atol=1e-6)
    assert b[1][0, 0, 0] == float("-inf") and (b[0][0, 0, 0] == 0).all()
    assert torch.equal(b[0][0, 0, 1:4], blk_out[0, 0, 1:4].float())
    again = (out.clone(), lse.clone())
    merge_(*again, blk_out, blk_lse)
    assert torch.equal(again[0], b[0]) and torch.equal(again[1], b[1])  # deterministic
    assert triton_merge_available() == (importlib.util.find_spec("triton") is not None)

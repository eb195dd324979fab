"""The block-kernel contract (kernels/base.py) for TorchAttentionKernel and MathKernel against dense
fp64 math: (out, lse) of causal and full blocks, GQA/MQA, strided inputs, fp32/bf16/fp16; the
backward given the *global* lse and delta (the block gradients of a split sum to the full
gradient); the stand-in output; merge_partial_ (including rows no key has reached). The CUDA ops
(flash / efficient / cuDNN) run the same checks under ``-m gpu``; on the CPU their argument
plumbing and output shapes are checked on meta tensors."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_mesh.kernels import MathKernel, TorchAttentionKernel, get_kernel
from megatron_mesh.kernels.torch_sdpa import CUDA_OPS, stand_in_output
from megatron_mesh.runtime.merge import merge_partial_

import cases

HEADS = {"MHA": (4, 4), "GQA": (4, 2), "MQA": (4, 1)}
CPU_KERNELS = {"torch-cpu": lambda: TorchAttentionKernel("cpu"), "math": MathKernel}


def tolerance(dtype, heads=4, kv_heads=4):
    return cases.tolerance(dtype, heads, kv_heads)  # Transformer Engine's CP test tolerances


def dense(q, k, v, causal, scale):
    """fp64 attention of one block: (out, lse), top-left causal mask, GQA by repeating KV heads."""
    g = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhqk,bhkd->bhqd", torch.exp(s - lse[..., None]), v), lse


def inputs(heads, kv_heads, sq, sk, dtype, device="cpu", d=16, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h, s: torch.randn(batch, h, s, d, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return mk(heads, sq), mk(kv_heads, sk), mk(kv_heads, sk), mk(heads, sq)  # q, k, v, dout


def assert_close(got, want, dtype, heads=4, kv_heads=4, what=""):
    atol, rtol = tolerance(dtype, heads, kv_heads)
    err = (got.double() - want.double()).abs()
    ratio = (err / (atol + rtol * want.double().abs())).max().item()
    assert ratio <= 1.0, f"{what}: max error {err.max().item():.2e} is {ratio:.2f}x the tolerance ({dtype})"


def check_forward(kernel, dtype, causal, heads, device="cpu", sq=24, sk=40, d=16):
    h, g = HEADS[heads]
    sk = sq if causal else sk  # causal blocks are diagonal: the plan only masks square blocks
    q, k, v, _ = inputs(h, g, sq, sk, dtype, device, d)
    scale = 1 / math.sqrt(d)
    out, lse = kernel.forward(q, k, v, causal=causal, scale=scale)
    want_out, want_lse = dense(q, k, v, causal, scale)  # the reference sees the same rounded inputs
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32), lse.dtype
    assert_close(out, want_out, dtype, h, g, f"{kernel.name} out")
    assert_close(lse, want_lse, dtype, h, g, f"{kernel.name} lse")


def blocks(t: int, causal: bool):
    """A split of the (q rows x kv rows) square into blocks, as the plan cuts it: causal: the
    zigzag pattern (front x front diagonal, back x front full, back x back diagonal); full: three
    uneven KV blocks against two query halves."""
    h = t // 2
    if causal:
        return [(slice(0, h), slice(0, h), True), (slice(h, t), slice(0, h), False), (slice(h, t), slice(h, t), True)]
    cuts = [0, 5, 16, t]
    return [(rows, slice(a, b), False) for rows in (slice(0, h), slice(h, t)) for a, b in zip(cuts, cuts[1:])]


def check_backward_from_global_stats(kernel, dtype, causal, heads, device="cpu", t=32, d=16):
    """Block gradients given the global lse / delta sum to the full attention's gradients, and
    LSE-merging the block outputs gives the full output."""
    h, g = HEADS[heads]
    q, k, v, dout = inputs(h, g, t, t, dtype, device, d, seed=1)
    scale = 1 / math.sqrt(d)
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    out, lse = dense(q64, k64, v64, causal, scale)
    out.backward(dout.double())
    delta = (dout.double() * out.detach()).sum(-1)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=device) for x in (q, k, v))
    m_out = torch.zeros(q.shape, dtype=acc, device=device)
    m_lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=device)
    for rows, cols, blk_causal in blocks(t, causal):
        b_out, b_lse = kernel.forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], causal=blk_causal, scale=scale)
        merge_partial_(m_out[:, :, rows], m_lse[:, :, rows], b_out, b_lse)
        gq, gk, gv = kernel.backward(dout[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols],
                                     lse[:, :, rows].to(acc), delta[:, :, rows].to(acc), causal=blk_causal, scale=scale)
        assert gq.shape == q[:, :, rows].shape and gk.shape == gv.shape == k[:, :, cols].shape
        dq[:, :, rows] += gq
        dk[:, :, cols] += gk
        dv[:, :, cols] += gv
    assert_close(m_out, out.detach(), dtype, h, g, f"{kernel.name} merged out")
    assert_close(m_lse, lse.detach(), dtype, h, g, f"{kernel.name} merged lse")
    for name, got, want in (("dq", dq, q64.grad), ("dk", dk, k64.grad), ("dv", dv, v64.grad)):
        assert_close(got, want, dtype, h, g, f"{kernel.name} {name}")


# -- CPU: the contract -----------------------------------------------------------------------------------
CPU_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("name", CPU_KERNELS)
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", HEADS)
def test_forward_matches_dense(name, dtype, causal, heads):
    check_forward(CPU_KERNELS[name](), dtype, causal, heads)


@pytest.mark.parametrize("name", CPU_KERNELS)
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", ["MHA", "GQA"])
def test_backward_from_global_stats_sums_to_full_gradient(name, dtype, causal, heads):
    check_backward_from_global_stats(CPU_KERNELS[name](), dtype, causal, heads)


@pytest.mark.parametrize("name", CPU_KERNELS)
def test_strided_inputs_give_the_same_result(name):
    """The executor passes row slices of a chunk ([B, H, T, D] narrowed along T) and views of
    the caller's layout; results equal those of contiguous copies bitwise."""
    kernel = CPU_KERNELS[name]()
    g = torch.Generator().manual_seed(3)
    big_q = torch.randn(2, 4, 48, 16, generator=g)
    big_kv = torch.randn(40, 2, 2, 16, generator=g).permute(1, 2, 0, 3)  # sbhd storage seen as bhsd
    q, k, v, dout = big_q[:, :, 8:32], big_kv[:, :, 4:28], big_kv[:, :, 12:36], big_q[:, :, 20:44]
    assert not any(x.is_contiguous() for x in (q, k, v, dout))
    lse = torch.randn(2, 4, 24)
    delta = torch.randn(2, 4, 24)
    for causal in (True, False):
        strided = kernel.forward(q, k, v, causal=causal, scale=0.3)
        packed = kernel.forward(q.contiguous(), k.contiguous(), v.contiguous(), causal=causal, scale=0.3)
        assert all(torch.equal(a, b) for a, b in zip(strided, packed))
        strided = kernel.backward(dout, q, k, v, lse, delta, causal=causal, scale=0.3)
        packed = kernel.backward(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), lse, delta,
                                 causal=causal, scale=0.3)
        assert all(torch.equal(a, b) for a, b in zip(strided, packed))
        out = kernel.forward(q, k, v, causal=causal, scale=0.3)[0]
        assert_close(out, dense(q, k, v, causal, 0.3)[0], torch.float32, what=f"{kernel.name} strided")


# -- the stand-in output ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_stand_in_output_reproduces_delta(dtype):
    g = torch.Generator().manual_seed(4)
    dout = torch.randn(2, 3, 10, 16, generator=g).to(dtype)
    out = torch.randn(2, 3, 10, 16, generator=g).to(dtype)
    dout[0, 0, 3] = 0  # a row without gradient: stand-in 0, whatever delta is
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    delta = (dout.to(wide) * out.to(wide)).sum(-1)
    stand_in = stand_in_output(dout, delta)
    assert stand_in.dtype == dtype and stand_in.shape == dout.shape
    assert torch.equal(stand_in[0, 0, 3], torch.zeros(16, dtype=dtype))
    # rowsum(dout * o') == delta up to the rounding of o' to dtype
    got = (dout.to(wide) * stand_in.to(wide)).sum(-1)
    eps = torch.finfo(dtype).eps
    bound = 4 * eps * (dout.to(wide).abs() * stand_in.to(wide).abs()).sum(-1) + 1e-30
    assert ((got - delta).abs() <= bound).all()
    # |o'| <= |o| per row (Cauchy-Schwarz): the stand-in cannot overflow where the output did not
    assert (stand_in.to(wide).norm(dim=-1) <= out.to(wide).norm(dim=-1) * (1 + 4 * eps)).all()


def test_stand_in_output_survives_extreme_rows():
    dout = torch.tensor([[1e-30, 0.0], [3e38, 3e38], [1e-45, 1e-45]], dtype=torch.float32)
    delta = torch.tensor([1e-30, 1e38, 0.0])
    o = stand_in_output(dout, delta)
    assert torch.isfinite(o).all()


def test_backward_with_stand_in_equals_backward_with_real_output():
    """TorchAttentionKernel passes the stand-in to the CPU op; the op given the real output gives
    the same gradients (fp64: equal to rounding)."""
    q, k, v, dout = inputs(4, 2, 24, 24, torch.float64)
    scale = 0.25
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
    real = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, False, scale=scale)
    delta = (dout * out).sum(-1)
    got = TorchAttentionKernel("cpu").backward(dout, q, k, v, lse, delta, causal=False, scale=scale)
    for a, b in zip(got, real):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# -- merge_partial_ --------------------------------------------------------------------------------------
def test_merge_of_two_key_sets_is_the_full_attention():
    q, k, v, _ = inputs(4, 4, 12, 20, torch.float64)
    full_out, full_lse = dense(q, k, v, False, 0.4)
    out, lse = dense(q, k[:, :, :7], v[:, :, :7], False, 0.4)
    b_out, b_lse = dense(q, k[:, :, 7:], v[:, :, 7:], False, 0.4)
    merge_partial_(out, lse, b_out, b_lse)
    torch.testing.assert_close(out, full_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, full_lse, rtol=1e-12, atol=1e-12)


def test_merge_rows_no_key_has_reached_stay_empty_never_nan():
    out = torch.zeros(1, 1, 4, 2)
    lse = torch.full((1, 1, 4), float("-inf"))
    blk_out = torch.tensor([[[[0.0, 0.0], [1.0, 2.0], [0.0, 0.0], [3.0, 4.0]]]])
    blk_lse = torch.tensor([[[float("-inf"), 0.5, float("-inf"), -2.0]]])
    merge_partial_(out, lse, blk_out, blk_lse)
    assert not out.isnan().any() and not lse.isnan().any()
    # empty + empty stays empty; empty + block is the block, exactly
    assert torch.equal(out[0, 0, 0], torch.zeros(2)) and lse[0, 0, 0] == float("-inf")
    assert torch.equal(out[0, 0, 1], torch.tensor([1.0, 2.0])) and lse[0, 0, 1] == 0.5
    # block without keys merged into a filled row leaves it unchanged
    before_out, before_lse = out.clone(), lse.clone()
    merge_partial_(out, lse, torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    assert torch.equal(out, before_out) and torch.equal(lse, before_lse)


def test_merge_into_strided_views_touches_only_those_rows():
    """The executor merges into row halves of a chunk's accumulator, from a lower-precision block."""
    out = torch.zeros(2, 3, 8, 4)
    lse = torch.full((2, 3, 8), float("-inf"))
    blk_out = torch.randn(2, 3, 4, 4).to(torch.bfloat16)
    blk_lse = torch.randn(2, 3, 4)
    merge_partial_(out[:, :, 4:], lse[:, :, 4:], blk_out, blk_lse)
    assert torch.equal(out[:, :, :4], torch.zeros(2, 3, 4, 4)) and lse[:, :, :4].isneginf().all()
    assert torch.equal(out[:, :, 4:], blk_out.float()) and torch.equal(lse[:, :, 4:], blk_lse)


# -- CUDA ops: plumbing on meta tensors (CPU), numbers on a GPU ----------------------------------------------
@pytest.mark.parametrize("op", CUDA_OPS)
@pytest.mark.parametrize("heads", HEADS)
def test_cuda_op_plumbing_on_meta_tensors(op, heads):
    """The CUDA ops' argument lists and output shapes (lse unpadded, GQA gradients folded back to
    the KV heads), checked with torch's meta implementations: no GPU needed."""
    h, g = HEADS[heads]
    kernel = TorchAttentionKernel("cuda", op)
    assert kernel.name == f"torch-{op}"
    q = torch.empty(2, h, 40, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, g, 72, 64, device="meta", dtype=torch.bfloat16)
    for causal in (False, True):
        kv = k[:, :, :40] if causal else k
        out, lse = kernel.forward(q, kv, kv, causal=causal, scale=0.125)
        assert out.shape == q.shape and lse.shape == (2, h, 40) and lse.dtype == torch.float32
        dq, dk, dv = kernel.backward(out, q, kv, kv, lse, lse, causal=causal, scale=0.125)
        assert dq.shape == q.shape and dk.shape == dv.shape == kv.shape


def test_backend_names_and_bad_backends():
    assert get_kernel("auto", torch.device("cpu")).name == "torch-cpu"
    assert get_kernel("math", torch.device("cpu")).name == "math"
    with pytest.raises(ValueError, match="unknown kernel backend 'flash'"):
        get_kernel("flash", torch.device("cpu"))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_kernel("torch-flash", torch.device("cpu"))


GPU_DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.gpu
@pytest.mark.parametrize("op", CUDA_OPS)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("heads", ["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_forward_matches_dense(op, dtype, heads, d):
    kernel = TorchAttentionKernel("cuda", op)
    for causal in (True, False):
        check_forward(kernel, dtype, causal, heads, device="cuda", sq=136, sk=200, d=d)  # not multiples of 32/64


@pytest.mark.gpu
@pytest.mark.parametrize("op", CUDA_OPS)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("heads", ["MHA", "GQA"])
def test_cuda_backward_from_global_stats(op, dtype, heads):
    kernel = TorchAttentionKernel("cuda", op)
    for causal in (True, False):
        check_backward_from_global_stats(kernel, dtype, causal, heads, device="cuda", t=256, d=128)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_cuda_auto_backend_picks_an_available_op_and_names_it(dtype):
    """"auto" on CUDA names a torch CUDA op and that op runs the given dtype (fp32 included:
    flash has no fp32 kernel, so "auto" must not pick it there)."""
    kernel = get_kernel("auto", torch.device("cuda"))
    assert kernel.name in {f"torch-{op}" for op in CUDA_OPS}, kernel.name
    check_forward(kernel, dtype, True, "GQA", device="cuda", sq=128, d=128)
    check_backward_from_global_stats(kernel, dtype, True, "GQA", device="cuda", t=128, d=128)


@pytest.mark.gpu
def test_cuda_strided_block_inputs():
    """Row halves of a chunk and sbhd views, as the executor passes them, on each CUDA op."""
    for op in CUDA_OPS:
        kernel = TorchAttentionKernel("cuda", op)
        big = torch.randn(256, 2, 4, 128, device="cuda", dtype=torch.bfloat16).permute(1, 2, 0, 3)
        q, k, v = big[:, :, 128:], big[:, :, :128], big[:, :, 64:192]
        for causal in (True, False):
            out, lse = kernel.forward(q, k, v, causal=causal, scale=128 ** -0.5)
            want_out, want_lse = dense(q, k, v, causal, 128 ** -0.5)
            assert_close(out, want_out, torch.bfloat16, what=f"{op} strided out")
            assert_close(lse, want_lse, torch.bfloat16, what=f"{op} strided lse")



# -- the kernel benchmark ----------------------------------------------------------------------------------
def test_bench_kernels_runs_on_tiny_shapes(tmp_path, capsys, monkeypatch):
    """scripts/bench_kernels.py end to end on tiny CPU shapes (odd P, ring and column plans): it
    names the kernel backend, prints the table, writes JSON, and its tiled runs reproduce the
    fused results."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_kernels.py"
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_kernels", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    out_json = tmp_path / "bench.json"
    result = bench.main(["--device", "cpu", "--seq-local", "8", "16", "--world", "3", "--tiles", "1x3", "3x1",
                         "--heads", "2", "--kv-heads", "1", "--head-dim", "8", "--iters", "1", "--warmup", "0",
                         "--dtype", "fp32", "--json", str(out_json)])
    printed = capsys.readouterr().out
    assert "kernel backend: torch-cpu" in printed and "| 16 | mesh 3x1 | bwd |" in printed
    assert json.loads(out_json.read_text()) == json.loads(json.dumps(result))
    assert result["meta"]["kernel"] == "torch-cpu"
    cal = result["meta"]["calibration"]
    assert cal["seq_local"] == 16 and cal["attention_flops"] > 0 and cal["attention_flops_backward"] > 0
    rows = result["rows"]
    assert [(r["seq_local"], r["mode"], r["direction"]) for r in rows] == [
        (s, m, d) for s in (8, 16) for m in ("fused", "ring 1x3", "mesh 3x1") for d in ("forward", "backward")]
    for r in rows:
        assert r["ms_per_rank"] > 0 and r["tflops"] > 0 and r["efficiency"] > 0, r
        assert r["peak_mib_per_rank"] is None  # not measured on the CPU
        if r["mode"] != "fused":
            assert max(r["max_abs_err"].values()) < 1e-5, r
    with pytest.raises(SystemExit, match="tile 2x2 does not fit CP size 3"):
        bench.main(["--device", "cpu", "--world", "3", "--tiles", "2x2"])

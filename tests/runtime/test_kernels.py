"""The block-kernel contract (kernels/base.py) for TorchAttentionKernel and MathKernel against dense
fp64 math: (out, lse) of full, causal and masked blocks (``BlockMask``; masked rows with no allowed
key give lse -inf and out 0), GQA/MQA, strided inputs (row slices, permuted sbhd views),
fp32/bf16/fp16; the backward given the *global* lse and delta (the block gradients of a split sum
to the full gradient); the stand-in output, also with dout scaled by 1e-30 .. 1e19 through a real
2x2 Mesh run; merge_partial_ (including rows no key has reached). The CUDA ops (flash / efficient /
cuDNN) run the same checks under ``-m gpu``; on the CPU their argument plumbing and output shapes
are checked on meta tensors."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_mesh.comm.inprocess import run_inprocess
from megatron_mesh.kernels import CAUSAL, FULL, BlockMask, MathKernel, TorchAttentionKernel, get_kernel
from megatron_mesh.kernels.torch_sdpa import CUDA_OPS, stand_in_output
from megatron_mesh.plan import build_mesh_plan
from megatron_mesh.runtime.api import forward_backward
from megatron_mesh.runtime.merge import merge_partial_

import cases
from helpers import tolerance

HEADS = cases.HEADS
CPU_KERNELS = {"torch-cpu": lambda: TorchAttentionKernel("cpu"), "math": MathKernel}
NEG_INF = float("-inf")


def allowed_of(mask: BlockMask, sq: int, sk: int, device="cpu") -> torch.Tensor | None:
    if mask.kind == "full":
        return None
    if mask.kind == "causal":
        return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()
    return mask.allowed


def dense(q, k, v, mask: BlockMask, scale):
    """fp64 attention of one block: (out, lse); rows with no allowed key give out 0 and lse -inf.
    GQA by repeating KV heads. Differentiable (no NaN gradients through empty rows)."""
    g = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    allowed = allowed_of(mask, s.shape[-2], s.shape[-1], s.device)
    if allowed is not None:
        s = s.masked_fill(~allowed, NEG_INF)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(lse.isneginf(), 0.0)[..., None])
    return torch.einsum("bhqk,bhkd->bhqd", p, v), lse


def inputs(heads, kv_heads, sq, sk, dtype, device="cpu", d=16, batch=2, seed=0, dv=None):
    """q, k, v, dout; v and dout of head dim ``dv`` (None: ``d``)."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda h, s, w=d: torch.randn(batch, h, s, w, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return mk(heads, sq), mk(kv_heads, sk), mk(kv_heads, sk, dv or d), mk(heads, sq, dv or d)


def random_allowed(sq: int, sk: int, seed: int, empty_rows=(), device="cpu") -> torch.Tensor:
    """A random [sq, sk] allowed matrix (about half the pairs) with the given rows empty."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.rand(sq, sk, generator=g) < 0.5
    allowed[list(empty_rows)] = False
    return allowed.to(device)


def assert_close(got, want, dtype, heads=4, kv_heads=4, what=""):
    atol, rtol = tolerance(dtype, heads, kv_heads)
    got, want = got.double(), want.double()
    assert torch.equal(got.isneginf(), want.isneginf()), f"{what}: -inf in other places than the reference"
    finite = ~want.isneginf()
    err = (got[finite] - want[finite]).abs()
    ratio = (err / (atol + rtol * want[finite].abs())).max().item() if err.numel() else 0.0
    assert ratio <= 1.0, f"{what}: max error {err.max().item():.2e} is {ratio:.2f}x the tolerance ({dtype})"


def check_forward(kernel, dtype, mask: BlockMask, heads, device="cpu", sq=24, sk=40, d=16, dv=None):
    h, g = HEADS[heads]
    sk = sq if mask.causal else sk  # causal blocks are diagonal: the plan only uses them on square blocks
    if mask.kind == "masked":
        sq, sk = mask.allowed.shape
    q, k, v, dout = inputs(h, g, sq, sk, dtype, device, d, dv=dv)
    scale = 1 / math.sqrt(d)
    out, lse = kernel.forward(q, k, v, mask=mask, scale=scale)
    want_out, want_lse = dense(q, k, v, mask, scale)  # the reference sees the same rounded inputs
    assert out.shape == dout.shape and lse.shape == q.shape[:3]
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32), lse.dtype
    assert_close(out, want_out, dtype, h, g, f"{kernel.name} out")
    assert_close(lse, want_lse, dtype, h, g, f"{kernel.name} lse")
    return out, lse


def blocks(t: int, kind: str, seed: int = 0, device="cpu"):
    """A split of the (q rows x kv rows) square into (rows, cols, block mask), as the plan cuts it:
    causal: the zigzag pattern (front x front diagonal, back x front full, back x back diagonal);
    full: three uneven KV blocks against two query halves; masked: the same uneven cut with a
    random allowed matrix per block, where some rows have no key in a block and rows 1 and t - 1
    none in any block (their global lse is -inf)."""
    h = t // 2
    if kind == "causal":
        return [(slice(0, h), slice(0, h), CAUSAL), (slice(h, t), slice(0, h), FULL),
                (slice(h, t), slice(h, t), CAUSAL)]
    cuts = [0, 5, 16, t]
    out = []
    for i, (rows, (a, b)) in enumerate((r, c) for r in (slice(0, h), slice(h, t)) for c in zip(cuts, cuts[1:])):
        if kind == "full":
            out.append((rows, slice(a, b), FULL))
            continue
        empty = {x - rows.start for x in (1, t - 1, 2 + i, h + 3 + i) if rows.start <= x < rows.stop}
        allowed = random_allowed(rows.stop - rows.start, b - a, seed + i, sorted(empty), device)
        out.append((rows, slice(a, b), BlockMask("masked", allowed)))
    return out


def full_allowed(t: int, parts) -> torch.Tensor:
    allowed = torch.zeros(t, t, dtype=torch.bool)
    for rows, cols, mask in parts:
        allowed[rows, cols] = True if mask.kind == "full" else allowed_of(mask, rows.stop - rows.start,
                                                                          cols.stop - cols.start).cpu()
    return allowed


def check_backward_from_global_stats(kernel, dtype, kind: str, heads, device="cpu", t=32, d=16, dv=None):
    """Block gradients given the global lse / delta sum to the full attention's gradients, and
    LSE-merging the block outputs gives the full output (rows without any key: out 0, lse -inf,
    gradients 0). ``dv``: the value head dim (None: ``d``)."""
    h, g = HEADS[heads]
    q, k, v, dout = inputs(h, g, t, t, dtype, device, d, seed=1, dv=dv)
    scale = 1 / math.sqrt(d)
    parts = blocks(t, kind, device=device)
    whole = BlockMask("masked", full_allowed(t, parts).to(device))
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    out, lse = dense(q64, k64, v64, whole, scale)
    out.backward(dout.double())
    assert all(torch.isfinite(x.grad).all() for x in (q64, k64, v64))
    delta = (dout.double() * out.detach()).sum(-1)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=device) for x in (q, k, v))
    m_out = torch.zeros(dout.shape, dtype=acc, device=device)
    m_lse = torch.full(q.shape[:3], NEG_INF, dtype=acc, device=device)
    for rows, cols, mask in parts:
        b_out, b_lse = kernel.forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], mask=mask, scale=scale)
        merge_partial_(m_out[:, :, rows], m_lse[:, :, rows], b_out, b_lse)
        gq, gk, gv = kernel.backward(dout[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols],
                                     lse[:, :, rows].to(acc), delta[:, :, rows].to(acc), mask=mask, scale=scale)
        assert gq.shape == q[:, :, rows].shape and gk.shape == k[:, :, cols].shape and gv.shape == v[:, :, cols].shape
        dq[:, :, rows] += gq
        dk[:, :, cols] += gk
        dv[:, :, cols] += gv
    assert_close(m_out, out.detach(), dtype, h, g, f"{kernel.name} merged out")
    assert_close(m_lse, lse.detach(), dtype, h, g, f"{kernel.name} merged lse")
    for name, got, want in (("dq", dq, q64.grad), ("dk", dk, k64.grad), ("dv", dv, v64.grad)):
        assert_close(got, want, dtype, h, g, f"{kernel.name} {name}")
    if kind == "masked":  # rows 1 and t - 1 attend nothing anywhere: exactly zero, not just close
        for r in (1, t - 1):
            assert m_lse[:, :, r].isneginf().all() and not m_out[:, :, r].any() and not dq[:, :, r].any()


# -- CPU: the contract -----------------------------------------------------------------------------------
CPU_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("name", CPU_KERNELS)
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["causal", "full"])
@pytest.mark.parametrize("heads", HEADS)
def test_forward_matches_dense(name, dtype, kind, heads):
    check_forward(CPU_KERNELS[name](), dtype, {"causal": CAUSAL, "full": FULL}[kind], heads)


@pytest.mark.parametrize("name", CPU_KERNELS)
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["causal", "full", "masked"])
@pytest.mark.parametrize("heads", ["MHA", "GQA"])
def test_backward_from_global_stats_sums_to_full_gradient(name, dtype, kind, heads):
    check_backward_from_global_stats(CPU_KERNELS[name](), dtype, kind, heads)


@pytest.mark.parametrize("name", CPU_KERNELS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dv", [8, 24])
def test_value_head_dim_other_than_the_query_key_one(name, dtype, dv):
    """MLA's head dims (192 / 128 scaled down: values of 8 against queries and keys of 16; and
    values wider than keys, 24): forward and the backward from global statistics of causal, full
    and masked blocks, GQA and MQA, against fp64 math -- within 1e-10 in fp64. The CPU op takes
    equal dims only: the kernel pads the narrower side with zeros and cuts the result back."""
    kernel = CPU_KERNELS[name]()
    for kind in ("causal", "full", "masked"):
        check_backward_from_global_stats(kernel, dtype, kind, "GQA", dv=dv)
    for mask in (CAUSAL, FULL):
        check_forward(kernel, dtype, mask, "MQA", dv=dv)


def test_kernels_that_cannot_take_a_value_head_dim_say_so():
    """On CUDA flash and cuDNN (asked for by name) refuse values of another head dim, naming
    themselves; "auto" and the efficient op take them (auto picks efficient), as do the CPU op
    and the math kernel."""
    from megatron_mesh.kernels import check_head_dims

    for op in ("flash", "cudnn"):
        with pytest.raises(ValueError, match=rf"kernel backend torch-{op} cannot take a value head dim \(128\) other "
                                             r"than the query/key head dim \(192\); use 'auto' or 'torch-efficient'"):
            check_head_dims(TorchAttentionKernel("cuda", op), 192, 128)
        check_head_dims(TorchAttentionKernel("cuda", op), 128, 128)
    for kernel in (TorchAttentionKernel("cuda"), TorchAttentionKernel("cuda", "efficient"), TorchAttentionKernel("cpu"),
                   MathKernel()):
        check_head_dims(kernel, 192, 128)
    q = torch.empty(2, 4, 40, 64, device="meta", dtype=torch.bfloat16)
    v = torch.empty(2, 2, 40, 32, device="meta", dtype=torch.bfloat16)
    auto = TorchAttentionKernel("cuda")
    assert auto._op(q, v) == "efficient" and auto._op(q, q) == "flash"


def test_cuda_efficient_op_plumbing_with_a_value_head_dim_on_meta_tensors():
    """The efficient op (and "auto", which takes it) with values of another head dim: output and
    gradients shaped like v (GQA folded back), on torch's meta implementations."""
    q = torch.empty(2, 4, 40, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 2, 40, 64, device="meta", dtype=torch.bfloat16)
    v = torch.empty(2, 2, 40, 32, device="meta", dtype=torch.bfloat16)
    lse = torch.empty(2, 4, 40, device="meta")
    for kernel in (TorchAttentionKernel("cuda"), TorchAttentionKernel("cuda", "efficient")):
        out, lse = kernel.forward(q, k, v, mask=CAUSAL, scale=0.125)
        assert out.shape == (2, 4, 40, 32) and kernel.name == "torch-efficient"
        dq, dk, dv = kernel.backward(out, q, k, v, lse, lse, mask=CAUSAL, scale=0.125)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


# -- masked blocks -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masked_forward_matches_math_kernel_in_fp64(dtype, heads, seed):
    """The CPU kernel on a random allowed matrix with empty rows (first, middle, last) and an
    empty column, against MathKernel in fp64 on the same rounded inputs: lse -inf and out exactly
    0 on the empty rows."""
    h, g = HEADS[heads]
    sq, sk = 24, 40
    allowed = random_allowed(sq, sk, seed, empty_rows=(0, 7 + seed, sq - 1))
    allowed[:, 3] = False
    mask = BlockMask("masked", allowed)
    q, k, v, _ = inputs(h, g, sq, sk, dtype, seed=seed)
    out, lse = TorchAttentionKernel("cpu").forward(q, k, v, mask=mask, scale=0.3)
    want_out, want_lse = MathKernel(torch.float64).forward(q, k, v, mask=mask, scale=0.3)
    assert want_lse.dtype == torch.float64
    assert_close(out, want_out, dtype, h, g, "out")
    assert_close(lse, want_lse, dtype, h, g, "lse")
    empty = ~allowed.any(-1)
    assert empty.sum() == 3
    assert lse[:, :, empty].isneginf().all() and not lse[:, :, ~empty].isneginf().any()
    assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
    # the fp64 MathKernel is itself the dense rule
    assert_close(want_out, dense(q, k, v, mask, 0.3)[0], torch.float64, what="math vs dense")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", ["MHA", "GQA", "MQA"])
def test_masked_backward_matches_math_kernel_in_fp64(dtype, heads):
    """Backward of a masked block given global statistics, against MathKernel in fp64: rows empty
    in this block but not globally (finite lse: gradient 0 from this block) and rows empty
    everywhere (lse -inf: gradient 0, not NaN)."""
    h, g = HEADS[heads]
    sq, sk = 24, 40
    allowed = random_allowed(sq, sk, 5, empty_rows=(0, 11, sq - 1))
    mask = BlockMask("masked", allowed)
    q, k, v, dout = inputs(h, g, sq, sk, dtype, seed=6)
    gen = torch.Generator().manual_seed(7)
    # global row statistics: this block's keys and others (log-sum-exp of the others ~ N(0, 1))
    _, block_lse = MathKernel(torch.float64).forward(q, k, v, mask=mask, scale=0.3)
    lse = torch.logaddexp(block_lse, torch.randn(2, h, sq, generator=gen, dtype=torch.float64)).float()
    delta = torch.randn(2, h, sq, generator=gen)
    lse[:, :, sq - 1] = NEG_INF  # this row attends nothing in the whole attention
    got = TorchAttentionKernel("cpu").backward(dout, q, k, v, lse, delta, mask=mask, scale=0.3)
    want = MathKernel(torch.float64).backward(dout, q, k, v, lse.double(), delta.double(), mask=mask, scale=0.3)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), name
        assert_close(a, b, dtype, h, g, name)
    dq = got[0]
    for r in (0, 11, sq - 1):
        assert not dq[:, :, r].any(), f"row {r} has no key in the block: its dq must be 0"
    assert not got[1][:, :, ~allowed.any(0)].any()  # keys no row attends get no gradient


@pytest.mark.parametrize("name", CPU_KERNELS)
def test_strided_inputs_give_the_same_result(name):
    """The executor passes row slices of a chunk ([B, H, T, D] narrowed along T) and permuted views
    of the caller's [S, B, H, D] tensors; results equal those of contiguous copies bitwise, for
    every mask kind."""
    kernel = CPU_KERNELS[name]()
    g = torch.Generator().manual_seed(3)
    big_q = torch.randn(48, 2, 4, 16, generator=g).permute(1, 2, 0, 3)  # sbhd storage seen as bhsd
    big_kv = torch.randn(40, 2, 2, 16, generator=g).permute(1, 2, 0, 3)
    q, k, v, dout = big_q[:, :, 8:32], big_kv[:, :, 4:28], big_kv[:, :, 12:36], big_q[:, :, 20:44]
    assert not any(x.is_contiguous() for x in (q, k, v, dout)) and q.stride(-1) == 1
    lse = torch.randn(2, 4, 24)
    delta = torch.randn(2, 4, 24)
    masked = BlockMask("masked", random_allowed(24, 24, 9, empty_rows=(4,)))
    for mask in (CAUSAL, FULL, masked):
        strided = kernel.forward(q, k, v, mask=mask, scale=0.3)
        packed = kernel.forward(q.contiguous(), k.contiguous(), v.contiguous(), mask=mask, scale=0.3)
        assert all(torch.equal(a, b) for a, b in zip(strided, packed)), mask.kind
        strided = kernel.backward(dout, q, k, v, lse, delta, mask=mask, scale=0.3)
        packed = kernel.backward(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), lse, delta,
                                 mask=mask, scale=0.3)
        assert all(torch.equal(a, b) for a, b in zip(strided, packed)), mask.kind
        out, blk_lse = kernel.forward(q, k, v, mask=mask, scale=0.3)
        want_out, want_lse = dense(q, k, v, mask, 0.3)
        assert_close(out, want_out, torch.float32, what=f"{kernel.name} strided {mask.kind} out")
        assert_close(blk_lse, want_lse, torch.float32, what=f"{kernel.name} strided {mask.kind} lse")


def test_block_mask_rejects_inconsistent_arguments():
    with pytest.raises(ValueError, match="block mask kind must be one of full, causal, masked, got 'band'"):
        BlockMask("band")
    with pytest.raises(ValueError, match="a 'masked' block mask needs its allowed matrix"):
        BlockMask("masked")
    with pytest.raises(ValueError, match="a 'masked' block mask needs its allowed matrix"):
        BlockMask("full", torch.ones(2, 2, dtype=torch.bool))


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
    dout = torch.tensor([[1e-30, 0.0], [1e-45, 1e-45], [0.0, 0.0]], dtype=torch.float32)  # 1e-45: subnormal
    delta = torch.tensor([1e-30, 2e-45, 0.0])
    o = stand_in_output(dout, delta)
    assert torch.isfinite(o).all() and not o[2].any()
    got = (dout.double() * o.double()).sum(-1)
    assert got[0] == pytest.approx(1e-30, rel=1e-6)


def test_stand_in_output_near_the_fp32_maximum():
    """dout entries near the fp32 maximum (|dout|^2 overflows, and so does max|dout| * |u|^2):
    the stand-in must still reproduce delta."""
    dout = torch.tensor([[3e38, 3e38]], dtype=torch.float32)
    delta = torch.tensor([1e38])
    o = stand_in_output(dout, delta)
    assert torch.isfinite(o).all()
    assert (dout.double() * o.double()).sum(-1).item() == pytest.approx(1e38, rel=1e-6)


@pytest.mark.parametrize("scale", [1e-30, 1e-20, 1e19, 1e30])
def test_stand_in_output_reproduces_delta_of_tiny_and_huge_rows(scale):
    """Rows whose |dout|^2 under- or overflows fp32 still reproduce delta (relative 1e-5)."""
    g = torch.Generator().manual_seed(5)
    dout = torch.randn(3, 16, generator=g) * scale
    out = torch.randn(3, 16, generator=g)
    delta = (dout.double() * out.double()).sum(-1)
    o = stand_in_output(dout, delta.float())
    assert torch.isfinite(o).all()
    got = (dout.double() * o.double()).sum(-1)
    assert torch.allclose(got, delta, rtol=1e-5, atol=0), (got, delta)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_stand_in_output_leaves_its_inputs_alone(dtype):
    """It works in place on its own copy only: a dout already in the wide dtype is not touched."""
    dout = torch.randn(2, 5, 8, dtype=dtype)
    delta = torch.randn(2, 5, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    before = dout.clone(), delta.clone()
    stand_in_output(dout, delta)
    assert torch.equal(dout, before[0]) and torch.equal(delta, before[1])


def test_merge_and_stand_in_launch_few_kernels():
    """A merge runs per forward block and a stand-in output per backward block; on a GPU every
    elementwise op is a kernel launch, which at a few thousand tokens per rank costs as much as
    the block (docs/performance.md, "Measured on GPU"). Their op counts stay at what they are
    now (views left out): 5 (6 with a bf16 block: its cast) and 12, from 10 and 20 before stop 28
    and 9 before stop 46."""
    from torch.utils._python_dispatch import TorchDispatchMode

    views = {"slice", "unsqueeze", "squeeze", "view", "permute", "expand", "transpose", "select", "alias"}

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func.overloadpacket.__name__ not in views
            return func(*args, **(kwargs or {}))

    out, blk_out = torch.zeros(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    lse, blk_lse = torch.full((1, 2, 8), float("-inf")), torch.randn(1, 2, 8)
    with Ops() as merge:
        merge_partial_(out, lse, blk_out, blk_lse)
    blk_bf16 = blk_out.to(torch.bfloat16)
    with Ops() as merge_bf16:
        merge_partial_(out, lse, blk_bf16, blk_lse)
    dout, delta = torch.randn(1, 2, 8, 4, dtype=torch.bfloat16), torch.randn(1, 2, 8)
    with Ops() as stand_in:
        stand_in_output(dout, delta)
    assert (merge.n, merge_bf16.n, stand_in.n) == (5, 6, 12)


def test_backward_with_stand_in_equals_backward_with_real_output():
    """TorchAttentionKernel passes the stand-in to the CPU op; the op given the real output gives
    the same gradients (fp64: equal to rounding)."""
    q, k, v, dout = inputs(4, 2, 24, 24, torch.float64)
    scale = 0.25
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
    real = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, False, scale=scale)
    delta = (dout * out).sum(-1)
    got = TorchAttentionKernel("cpu").backward(dout, q, k, v, lse, delta, mask=FULL, scale=scale)
    for a, b in zip(got, real):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _mesh_2x2_gradients(p: cases.Problem, dout_scale: float):
    """dq, dk, dv of every rank of a 2x2 Mesh run (in-process, P = 4) with dout scaled by
    ``dout_scale`` before the cast to the input dtype, as fp64 on the CPU."""
    Q, K, V, dO = cases.make_inputs(p)
    plan = build_mesh_plan(4, (2, 2), p.shape)

    def fn(rank, comm):
        q, k, v, do = (p.shard(x, rank) for x in (Q, K, V, dO * dout_scale))
        _, dq, dk, dv = forward_backward(*(x.to(p.dtype) for x in (q, k, v, do)), plan, comm=comm)
        return [g.double() for g in (dq, dk, dv)]

    return run_inprocess(fn, 4, timeout=60)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dout_scale", [1e-20, 1e-30, 1e19])
def test_gradients_scale_with_dout_through_a_mesh_run(dtype, dout_scale):
    """Regression: a tiny or huge dout (loss scaling, vanishing gradients) gives the same gradients,
    relative to dout, as an unscaled one. In a 2x2 Mesh, blocks of remote query chunks run the
    kernel backward with the stand-in output; |dout|^2 under- or overflowed there and the
    gradients came out wrong (relative error 1.2 - 1.6) without any error or NaN."""
    p = cases.Problem(4, 4, 2, True, dtype)
    ref = cases.dense_reference(p)  # fp64, unscaled: gradients are linear in dout
    atol, rtol = tolerance(dtype, p.heads, p.kv_heads)
    for rank, grads in enumerate(_mesh_2x2_gradients(p, dout_scale)):
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref.wanted[1:]):
            want = p.shard(want, rank)
            assert torch.isfinite(got).all(), (rank, name)
            rel = got / dout_scale
            ratio = ((rel - want).abs() / (atol + rtol * want.abs())).max().item()
            assert ratio <= 1.0, f"rank {rank} {name}: gradient / dout scale off by {ratio:.2f}x the tolerance"


# -- merge_partial_ --------------------------------------------------------------------------------------
def test_merge_of_two_key_sets_is_the_full_attention():
    q, k, v, _ = inputs(4, 4, 12, 20, torch.float64)
    full_out, full_lse = dense(q, k, v, FULL, 0.4)
    out, lse = dense(q, k[:, :, :7], v[:, :, :7], FULL, 0.4)
    b_out, b_lse = dense(q, k[:, :, 7:], v[:, :, 7:], FULL, 0.4)
    merge_partial_(out, lse, b_out, b_lse)
    torch.testing.assert_close(out, full_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, full_lse, rtol=1e-12, atol=1e-12)


def test_merge_rows_no_key_has_reached_stay_empty_never_nan():
    out = torch.zeros(1, 1, 4, 2)
    lse = torch.full((1, 1, 4), NEG_INF)
    blk_out = torch.tensor([[[[0.0, 0.0], [1.0, 2.0], [0.0, 0.0], [3.0, 4.0]]]])
    blk_lse = torch.tensor([[[NEG_INF, 0.5, NEG_INF, -2.0]]])
    merge_partial_(out, lse, blk_out, blk_lse)
    assert not out.isnan().any() and not lse.isnan().any()
    # empty + empty stays empty; empty + block is the block, exactly
    assert torch.equal(out[0, 0, 0], torch.zeros(2)) and lse[0, 0, 0] == NEG_INF
    assert torch.equal(out[0, 0, 1], torch.tensor([1.0, 2.0])) and lse[0, 0, 1] == 0.5
    # block without keys merged into a filled row leaves it unchanged
    before_out, before_lse = out.clone(), lse.clone()
    merge_partial_(out, lse, torch.zeros_like(out), torch.full_like(lse, NEG_INF))
    assert torch.equal(out, before_out) and torch.equal(lse, before_lse)


def test_merge_takes_blocks_of_other_dtypes():
    """A block in a narrower dtype (bf16 out from a fused op) or a wider one (a kernel computing
    in fp64 for fp32 accumulators) merges as its values in the accumulator's dtype."""
    q, k, v, _ = inputs(4, 2, 6, 10, torch.float64)
    full_out, full_lse = dense(q, k, v, FULL, 0.5)
    a_out, a_lse = dense(q, k[:, :, :4], v[:, :, :4], FULL, 0.5)
    b_out, b_lse = dense(q, k[:, :, 4:], v[:, :, 4:], FULL, 0.5)
    for blk_dtype in (torch.bfloat16, torch.float64):
        out, lse = a_out.float(), a_lse.float()
        merge_partial_(out, lse, b_out.to(blk_dtype), b_lse)  # b_lse fp64: wider than lse
        assert out.dtype == lse.dtype == torch.float32
        tol = 1e-2 if blk_dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(out, full_out.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(lse, full_lse.float(), rtol=1e-6, atol=1e-6)


def test_merge_into_strided_views_touches_only_those_rows():
    """The executor merges into row halves of a chunk's accumulator, from a lower-precision block."""
    out = torch.zeros(2, 3, 8, 4)
    lse = torch.full((2, 3, 8), NEG_INF)
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
    the KV heads), checked with torch's meta implementations: no GPU needed. A masked block's
    backward goes to the efficient kernel with its attn_bias, whatever op was asked for (its
    forward needs real values: which rows are empty)."""
    h, g = HEADS[heads]
    kernel = TorchAttentionKernel("cuda", op)
    assert kernel.name == f"torch-{op}"
    q = torch.empty(2, h, 40, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, g, 72, 64, device="meta", dtype=torch.bfloat16)
    for mask in (FULL, CAUSAL):
        kv = k[:, :, :40] if mask.causal else k
        out, lse = kernel.forward(q, kv, kv, mask=mask, scale=0.125)
        assert out.shape == q.shape and lse.shape == (2, h, 40) and lse.dtype == torch.float32
        dq, dk, dv = kernel.backward(out, q, kv, kv, lse, lse, mask=mask, scale=0.125)
        assert dq.shape == q.shape and dk.shape == dv.shape == kv.shape
    masked = BlockMask("masked", torch.empty(40, 72, dtype=torch.bool, device="meta"))
    lse = torch.empty(2, h, 40, device="meta")
    dq, dk, dv = kernel.backward(q, q, k, k, lse, lse, mask=masked, scale=0.125)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape


@pytest.mark.parametrize("op", CUDA_OPS)
def test_cuda_backward_arguments_that_the_gpu_needs(op, monkeypatch):
    """What the first run on an H100 (torch 2.11) showed, checked on meta tensors: an absent
    tensor argument is None, never an empty tensor (flash takes defined offsets for a varlen call
    and fails on their dtype; efficient and cuDNN take an empty bias for a bias and fail on its
    shape), and the efficient backward gets dout, q, k, v and out in [B, S, H, D] memory (in
    any other layout it returns wrong gradients, NaN included, without an error). Flash gets
    grouped KV heads as they are, both ways (no repeated copy of K and V)."""
    calls = {}

    class Spy:  # records the call; anything else (torch asks for the op's overloads) goes to the op
        def __init__(self, name):
            self.name, self.real = name, getattr(torch.ops.aten, name)

        def __call__(self, *args, **kwargs):
            calls[self.name] = args
            return self.real(*args, **kwargs)

        def __getattr__(self, attr):
            return getattr(self.real, attr)

    def spy(name):
        monkeypatch.setattr(torch.ops.aten, name, Spy(name))

    for name in ("_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_efficient_attention_backward",
                 "_scaled_dot_product_cudnn_attention_backward", "_scaled_dot_product_flash_attention"):
        spy(name)
    kernel = TorchAttentionKernel("cuda", op)
    q = torch.empty(2, 4, 40, 64, device="meta", dtype=torch.bfloat16)  # contiguous [B, H, S, D]
    k = torch.empty(2, 2, 40, 64, device="meta", dtype=torch.bfloat16)
    lse = torch.empty(2, 4, 40, device="meta")
    masked = BlockMask("masked", torch.empty(40, 40, dtype=torch.bool, device="meta"))
    for mask in (CAUSAL, masked):
        calls.clear()
        kernel.backward(q, q, k, k, lse, lse, mask=mask, scale=0.125)
        (name, args), = calls.items()
        if "flash" in name:
            assert args[6] is None and args[7] is None, "cumulative offsets"
            # grouped KV heads go in as they are: no copy of K and V repeated to the query heads
            assert args[2] is k and args[3] is k, "K/V expanded for flash"
        elif "cudnn" in name:
            assert args[8] is None and args[9] is None and args[10] is None, "bias and offsets"
        else:
            assert (args[4] is None) == (mask is CAUSAL), "bias"
            for i, what in zip((0, 1, 2, 3, 5), ("dout", "q", "k", "v", "out")):
                assert args[i].transpose(1, 2).is_contiguous(), f"{what} not in [B, S, H, D] memory"
    if op == "flash":
        calls.clear()
        kernel.forward(q, k, k, mask=CAUSAL, scale=0.125)
        (name, args), = calls.items()
        assert args[1] is k and args[2] is k, "K/V expanded for the flash forward"


def test_backend_names_and_bad_backends():
    assert get_kernel("auto", torch.device("cpu")).name == "torch-cpu"
    assert get_kernel("math", torch.device("cpu")).name == "math"
    with pytest.raises(ValueError, match="unknown kernel backend 'flash'"):
        get_kernel("flash", torch.device("cpu"))
    with pytest.raises(ValueError, match="kernel backend 'torch-flash' needs a CUDA device"):
        get_kernel("torch-flash", torch.device("cpu"))
    with pytest.raises(ValueError, match="kernel must be a backend name"):
        get_kernel(3, torch.device("cpu"))


GPU_DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.gpu
@pytest.mark.parametrize("op", CUDA_OPS)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("heads", ["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_forward_matches_dense(op, dtype, heads, d):
    kernel = TorchAttentionKernel("cuda", op)
    for mask in (CAUSAL, FULL, BlockMask("masked", random_allowed(136, 200, 0, (0, 77), device="cuda"))):
        check_forward(kernel, dtype, mask, heads, device="cuda", sq=136, sk=200, d=d)  # not multiples of 32/64


@pytest.mark.gpu
@pytest.mark.parametrize("op", CUDA_OPS)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("heads", ["MHA", "GQA"])
def test_cuda_backward_from_global_stats(op, dtype, heads):
    kernel = TorchAttentionKernel("cuda", op)
    for kind in ("causal", "full", "masked"):
        check_backward_from_global_stats(kernel, dtype, kind, heads, device="cuda", t=256, d=128)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_cuda_auto_backend_picks_an_available_op_and_names_it(dtype):
    """"auto" on CUDA names a torch CUDA op and that op runs the given dtype (fp32 included:
    flash has no fp32 kernel, so "auto" must not pick it there)."""
    kernel = get_kernel("auto", torch.device("cuda"))
    assert kernel.name in {f"torch-{op}" for op in CUDA_OPS}, kernel.name
    check_forward(kernel, dtype, CAUSAL, "GQA", device="cuda", sq=128, d=128)
    check_backward_from_global_stats(kernel, dtype, "causal", "GQA", device="cuda", t=128, d=128)


@pytest.mark.gpu
def test_cuda_strided_block_inputs():
    """Row halves of a chunk and sbhd views, as the executor passes them, on each CUDA op."""
    for op in CUDA_OPS:
        kernel = TorchAttentionKernel("cuda", op)
        big = torch.randn(256, 2, 4, 128, device="cuda", dtype=torch.bfloat16).permute(1, 2, 0, 3)
        q, k, v = big[:, :, 128:], big[:, :, :128], big[:, :, 64:192]
        masked = BlockMask("masked", random_allowed(128, 128, 1, (5,), device="cuda"))
        for mask in (CAUSAL, FULL, masked):
            out, lse = kernel.forward(q, k, v, mask=mask, scale=128 ** -0.5)
            want_out, want_lse = dense(q, k, v, mask, 128 ** -0.5)
            assert_close(out, want_out, torch.bfloat16, what=f"{op} strided {mask.kind} out")
            assert_close(lse, want_lse, torch.bfloat16, what=f"{op} strided {mask.kind} lse")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_cuda_value_head_dim(dtype):
    """MLA's head dims (192 for queries and keys, 128 for values) on the ops that take them: "auto"
    (the efficient op for these) and "torch-efficient", causal, full and masked blocks, GQA."""
    for kernel in (get_kernel("auto", torch.device("cuda")), TorchAttentionKernel("cuda", "efficient")):
        for kind in ("causal", "full", "masked"):
            check_backward_from_global_stats(kernel, dtype, kind, "GQA", device="cuda", t=256, d=192, dv=128)
        check_forward(kernel, dtype, CAUSAL, "MQA", device="cuda", sq=136, d=192, dv=128)

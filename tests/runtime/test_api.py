"""Public API on one process (no process group: CP size 1): exactness, layout helpers, and every
bad argument raising an error that names the value and what is allowed."""

import pytest
import torch

import megatron_mesh as mm
from megatron_mesh.kernels import reference_attention
from megatron_mesh.plan import Mask, ThdLayout, ZigzagLayout

MODES = [
    lambda q, k, v, **kw: mm.mesh_attention(q, k, v, **kw),
    lambda q, k, v, **kw: mm.ring_attention(q, k, v, **kw),
    lambda q, k, v, **kw: mm.tasp_attention(q, k, v, **kw),
    lambda q, k, v, **kw: mm.hybrid_attention(q, k, v, ulysses_size=1, **kw),
]


def qkv(s=8, b=2, h=4, g=2, d=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(s, b, h, d, generator=gen, dtype=dtype), torch.randn(s, b, g, d, generator=gen, dtype=dtype),
            torch.randn(s, b, g, d, generator=gen, dtype=dtype))


def _grads(out, ref, inputs):
    g = torch.randn_like(out)
    return torch.autograd.grad(out, inputs, g), torch.autograd.grad(ref, inputs, g)


@pytest.mark.parametrize("fn", MODES)
@pytest.mark.parametrize("mask", [dict(causal=True), dict(causal=False), dict(window=(2, 0)),
                                  dict(cu_seqlens=[0, 3, 8]), dict(causal=False, window=(1, 2), cu_seqlens=[0, 5, 8])])
def test_cp1_equals_dense_attention(fn, mask):
    q, k, v = (x.double().requires_grad_() for x in qkv())
    out = fn(q, k, v, **mask)
    m = Mask.from_cu_seqlens(mask.get("cu_seqlens", [0, 8]), 8, mask.get("causal", True), mask.get("window"))
    ref = reference_attention(q, k, v, mask=m)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    for a, b in zip(*_grads(out, ref, (q, k, v))):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_cu_seqlens_may_be_a_generator():
    """Read once: checking the boundaries must not use up the generator the mask is built from."""
    q, k, v = qkv()
    want = mm.ring_attention(q, k, v, cu_seqlens=[0, 3, 8])
    assert torch.equal(mm.ring_attention(q, k, v, cu_seqlens=(c for c in [0, 3, 8])), want)


@pytest.mark.parametrize("scale", [1e-30, 1e-20, 1e19])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_are_right_for_tiny_and_huge_dout(scale, dtype):
    """The kernels' backward rebuilds delta from a stand-in output; a dout scaled by 1e-30 or
    1e19 once under/overflowed |dout|^2 and gave relative errors above 1."""
    q, k, v = (x.to(dtype).requires_grad_() for x in qkv())
    out = mm.mesh_attention(q, k, v)
    g = torch.randn_like(out, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), (g * scale).to(dtype))
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(reference_attention(*ref_in), ref_in, g * scale)
    for a, b in zip(got, want):
        rel = ((a.double() - b).norm() / b.norm()).item()
        assert rel < (1e-5 if dtype == torch.float32 else 2e-2), (scale, dtype, rel)


def test_output_has_q_shape_dtype_and_a_contiguous_layout():
    q, k, v = (x.bfloat16() for x in qkv())
    out = mm.mesh_attention(q, k, v)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert out.is_contiguous()  # Megatron reshapes it to [s, b, h * d]: no copy


@pytest.mark.parametrize("bad, match", [
    (dict(tile=(2, 2)), r"tile 2x2 does not fit CP size 1.*allowed tiles: 1x1"),
    (dict(tile="2by2"), "must be 'AxB'"),
    (dict(tile=(2.7, 2.2)), r"tile sides must be integers, got \(2\.7, 2\.2\)"),
    (dict(schedule="fastest"), r"schedule must be one of greedy, lockstep, got 'fastest'"),
    (dict(backward_chunks="cache"), r"backward_chunks must be one of refetch, keep, auto, got 'cache'"),
    (dict(contiguous="rows"), r"contiguous must be one of q, kv, auto, got 'rows'"),
    (dict(kernel="flash3"), "unknown kernel backend 'flash3'"),
    (dict(causal="False"), r"causal must be True or False, got 'False'"),
    (dict(softmax_scale="0.1"), r"softmax_scale must be a finite number > 0 \(or None for 1/sqrt\(head_dim\)\), got '0\.1'"),
    (dict(softmax_scale=-1.0), r"softmax_scale must be a finite number > 0.*got -1\.0"),
    (dict(softmax_scale=True), r"softmax_scale must be a finite number > 0.*got True"),
    (dict(window=(4, 2)), r"window right 2 > 0 with causal attention"),
    (dict(window=(-1, 0)), r"window left must be an int >= 0 or None \(unlimited\), got -1"),
    (dict(window=3), r"window must be \(left, right\) with ints >= 0 or None, got 3"),
    (dict(cu_seqlens=[0, 5, 4, 8]), r"cu_seqlens must be strictly increasing from 0 to the global sequence length 8"),
    (dict(cu_seqlens=[0, 5]), r"to the global sequence length 8, got \[0, 5\]"),
    (dict(cu_seqlens=[0, 2.5, 8]), r"cu_seqlens must hold integers, got \[0, 2\.5, 8\]"),
    (dict(cu_seqlens=torch.tensor([0.0, 8.0])), r"cu_seqlens must be a 1-D integer tensor or sequence"),
    (dict(cu_seqlens=8), r"cu_seqlens must be a 1-D integer tensor or sequence, got 8"),
    (dict(cu_seqlens=torch.tensor([0, 8], device="meta")), r"cu_seqlens is on the meta device, which holds no values"),
    (dict(layout="thd"), r"layout must be None \(Megatron's zigzag\) or a megatron_mesh layout \(BalancedLayout from "
     r"balanced_layout\(\), ThdLayout\), got str"),
    (dict(layout=ThdLayout(1, (0, 4, 10))), r"ThdLayout over 1 ranks x 10 tokens per rank does not match"),
])
def test_bad_options_raise_naming_the_value(bad, match):
    with pytest.raises(ValueError, match=match):
        mm.mesh_attention(*qkv(), **bad)


@pytest.mark.parametrize("call, match", [
    (lambda: mm.tasp_attention(*qkv(), transport="mpi"), r"transport must be one of p2p, alltoall, got 'mpi'"),
    (lambda: mm.tasp_attention(*qkv(), gpus_per_node=0), r"CP ranks per node \(gpus_per_node\) must be a positive divisor of the CP size 1, got 0"),
    (lambda: mm.hybrid_attention(*qkv(), ulysses_size=2), r"ulysses_size 2 must be a positive divisor of the CP size 1"),
    (lambda: mm.hybrid_attention(*qkv(), ulysses_size=1, inner="a2a"),
     r"inner must be a mode with a Ulysses hybrid, one of mesh, tasp, ring; got 'a2a'"),
    (lambda: mm.hybrid_attention(*qkv(), ulysses_size=1, inner="ring", tile=(1, 1)),
     r"CP mode 'a2a\+ring' takes no setting tile"),
    (lambda: mm.hybrid_attention(*qkv(), ulysses_size=1, inner="tasp", transport="alltoall"),
     r"transport 'alltoall': CP mode 'a2a\+tasp' runs its all-to-all and the inner tasp rounds point-to-point "
     r"\(allowed: 'p2p'\)"),
    (lambda: mm.attention(*qkv(), mode="a2a+tasp", ulysses_size=1, transport="alltoall"),
     r"transport 'alltoall': CP mode 'a2a\+tasp' runs its all-to-all"),
    (lambda: mm.attention(*qkv(), mode="ulysses"), r"unknown CP mode 'ulysses'; allowed: ring, mesh, tasp, a2a\+mesh"),
    (lambda: mm.attention(*qkv(), mode="ring", tile=(1, 1)), r"CP mode 'ring' takes no setting tile"),
    (lambda: mm.mesh_attention(*qkv(), cu_seqlens=[0, 8], layout=ThdLayout(1, (0, 8))),
     r"cu_seqlens and a ThdLayout both give documents"),
    (lambda: mm.mesh_attention(*qkv(), cu_seqlens=[0, 8], layout=mm.balanced_layout([0, 3, 8], 1)),
     r"cu_seqlens and a BalancedLayout both give documents: the layout's documents are the ones attention sees"),
    (lambda: mm.mesh_attention(*qkv(), tile={"a": 1}),
     r"setting tile must be a number, a string or a sequence of them, got \{'a': 1\}"),
    (lambda: mm.mesh_attention(*qkv(), schedule={"greedy"}), r"setting schedule must be a number, a string"),
    (lambda: mm.attention(*qkv(), mode="mesh", tile_auto="no"), r"tile_auto must be True or False, got 'no'"),
    (lambda: mm.attention(*qkv(), mode="mesh", gpus_per_node=1, ranks_per_node=1),
     r"pass gpus_per_node or ranks_per_node \(the same setting\), not both"),
])
def test_bad_mode_options_raise_naming_the_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("args, match", [
    (((0, 16.5, 32),), r"cu_seqlens_padded must hold integers, got 16\.5 in \(0, 16\.5, 32\)"),
    (((0, 16.0, 32),), r"cu_seqlens_padded must hold integers, got 16\.0"),
    (((0, 16, 32), (16, 7.5)), r"seq_lens must hold integers, got 7\.5 in \(16, 7\.5\)"),
    (((0, True, 2),), r"cu_seqlens_padded must hold integers, got True"),
])
def test_thd_layout_refuses_non_integer_boundaries(args, match):
    """Never truncated (16.5 -> 16 would shift every later document); integer tensors and numpy
    integers pass."""
    with pytest.raises(ValueError, match=match):
        ThdLayout(1, *args)
    assert ThdLayout(1, torch.tensor([0, 16, 32]), torch.tensor([16, 7])) == ThdLayout(1, (0, 16, 32), (16, 7))


def test_bad_tensors_raise_naming_the_value():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"s_local \(7\) must be even"):
        mm.mesh_attention(*qkv(s=7))
    with pytest.raises(ValueError, match=r"query heads \(4\) must be divisible by kv heads \(3\)"):
        mm.mesh_attention(*qkv(h=4, g=3))
    with pytest.raises(ValueError, match=r"k must have batch, heads and head_dim >= 1, got shape \(8, 2, 0, 8\)"):
        mm.mesh_attention(q, k[:, :, :0], v[:, :, :0])
    with pytest.raises(ValueError, match="same dtype"):
        mm.mesh_attention(q, k.double(), v)
    with pytest.raises(ValueError, match=r"k and v must agree in s_local, batch and kv heads, got k \(8, 2, 2, 8\) and "
                                         r"v \(8, 1, 2, 8\)"):
        mm.mesh_attention(q, k, v[:, :1])
    with pytest.raises(ValueError, match="must agree in s_local, batch and head_dim"):
        mm.mesh_attention(q, k[:4], v[:4])
    with pytest.raises(ValueError, match="4-D"):
        mm.mesh_attention(q[0], k, v)
    allowed = r"q, k, v must be one of torch.float16, torch.bfloat16, torch.float32, torch.float64, got "
    with pytest.raises(ValueError, match=allowed + "torch.int64"):
        mm.mesh_attention(q.long(), k.long(), v.long())
    with pytest.raises(ValueError, match=allowed + "torch.float8_e4m3fn"):  # floating point, but no kernel takes it
        mm.mesh_attention(*(x.to(torch.float8_e4m3fn) for x in (q, k, v)), kernel="math")
    with pytest.raises(ValueError, match=allowed + "torch.complex64"):
        mm.mesh_attention(*(x.to(torch.complex64) for x in (q, k, v)))
    with pytest.raises(ValueError, match=r"same device, got cpu, meta, cpu"):
        mm.mesh_attention(q, k.to("meta"), v)


def test_bad_softmax_offsets_and_value_head_dims_raise_naming_the_value():
    """Attention sinks: an offset of the wrong type, shape, dtype or device is refused naming it
    and what is allowed; values of another head dim than q and k run (the output has v's), but a
    kernel that cannot take them refuses by name, before anything runs."""
    from megatron_mesh.kernels import TorchAttentionKernel

    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"softmax_offset must be None or a tensor of shape \[4\] \(one logit per "
                                         r"query head\), got list"):
        mm.ring_attention(q, k, v, softmax_offset=[0.0] * 4)
    with pytest.raises(ValueError, match=r"softmax_offset must have shape \[4\] \(one logit per query head of q\), "
                                         r"got \[2\]"):
        mm.mesh_attention(q, k, v, softmax_offset=torch.zeros(2))
    with pytest.raises(ValueError, match=r"softmax_offset must have shape \[4\].*got \[1, 4\]"):
        mm.tasp_attention(q, k, v, softmax_offset=torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"softmax_offset must be one of torch.float16, torch.bfloat16, torch.float32, "
                                         r"torch.float64, got torch.int64"):
        mm.attention(q, k, v, softmax_offset=torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"softmax_offset must be on the inputs' device cpu, got meta"):
        mm.hybrid_attention(q, k, v, ulysses_size=1, softmax_offset=torch.zeros(4, device="meta"))
    out = mm.ring_attention(q, k, v[..., :6], softmax_offset=torch.zeros(4, dtype=torch.bfloat16))
    assert out.shape == (8, 2, 4, 6) and out.dtype == q.dtype
    for op in ("flash", "cudnn"):
        with pytest.raises(ValueError, match=rf"kernel backend torch-{op} cannot take a value head dim \(6\) other "
                                             r"than the query/key head dim \(8\)"):
            mm.ring_attention(q, k, v[..., :6], kernel=TorchAttentionKernel("cuda", op))


def test_balanced_layout_takes_boundaries_in_a_tensor_and_refuses_the_meta_device():
    """A tensor of boundaries gives the list's layout; one on the meta device (no values) is a
    ValueError naming it, not torch's RuntimeError from deep inside (issue 48)."""
    want = mm.balanced_layout([0, 5, 16], 2)
    assert mm.balanced_layout(torch.tensor([0, 5, 16]), 2) == want
    for cu in (torch.tensor([0, 5, 16], device="meta"), [0, torch.tensor(5, device="meta"), 16]):
        with pytest.raises(ValueError, match=r"cu_seqlens must hold integers that can be read here, got .*"
                                             r"device='meta'.*: pass the document boundaries on the CPU"):
            mm.balanced_layout(cu, 2)


def test_double_backward_says_it_is_unsupported():
    q, k, v = (x.requires_grad_() for x in qkv())
    out = mm.mesh_attention(q, k, v)
    (dq,) = torch.autograd.grad(out.sum(), (q,), create_graph=False)
    assert dq.shape == q.shape
    out = mm.mesh_attention(q, k, v)
    with pytest.raises(RuntimeError, match=r"one backward: double backward \(create_graph=True\) is not supported"):
        torch.autograd.grad(out.sum(), (q,), create_graph=True)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_zigzag_shard_unshard_roundtrip(world):
    x = torch.arange(4 * world * 3).view(4 * world, 3)
    chunks = [mm.zigzag_shard(x, r, world) for r in range(world)]
    assert torch.equal(mm.zigzag_unshard(chunks), x)
    assert chunks[0][:2, 0].tolist() == [0, 3] and chunks[0][2:, 0].tolist() == [3 * (4 * world - 2), 3 * (4 * world - 1)]


def test_layout_shard_and_unshard_check_their_inputs():
    """A chunk of the wrong length is an error, not rows silently dropped or a torch index error;
    integer-like ranks (numpy, 0-d tensors) are ranks, a bool is not."""
    import numpy as np

    layout = mm.balanced_layout([0, 3, 16], 2)
    x = torch.arange(16)
    chunks = [mm.layout_shard(x, r, layout) for r in range(2)]
    assert torch.equal(mm.layout_unshard(chunks, layout), x)
    assert torch.equal(mm.layout_shard(x, np.int64(1), layout), chunks[1])
    assert torch.equal(mm.layout_shard(x, torch.tensor(1), layout), chunks[1])
    with pytest.raises(ValueError, match=r"rank must be an integer in 0..1 \(the CP size 2\), got True"):
        mm.layout_shard(x, True, layout)
    with pytest.raises(ValueError, match=r"rank must be an integer in 0..1 .* got 2"):
        mm.layout_shard(x, 2, layout)
    for bad in ([torch.cat([chunks[0], chunks[0]]), chunks[1]], [chunks[0][:7], chunks[1]]):
        with pytest.raises(ValueError, match=r"every rank's chunk must have the layout's 8 tokens along dim 0, got "
                                             r"\[(16|7), 8\]"):
            mm.layout_unshard(bad, layout)
    with pytest.raises(ValueError, match=r"layout must be a megatron_mesh layout .* got NoneType"):
        mm.layout_unshard(chunks, None)
    # a dim the tensor lacks, chunks that disagree elsewhere, no chunks, a non-integer CP size:
    # ValueErrors naming the argument, not torch index / type errors from inside
    with pytest.raises(ValueError, match=r"dim 5 is not a dim of x of shape \(3, 16\)"):
        mm.layout_shard(torch.zeros(3, 16), 0, layout, dim=5)
    with pytest.raises(ValueError, match=r"dim 0 is not a dim of x of shape \(\)"):
        mm.layout_shard(torch.tensor(1.0), 0, layout)
    with pytest.raises(ValueError, match=r"chunks must agree on every dim but 0, got shapes \[\(8, 2\), \(8, 3\)\]"):
        mm.layout_unshard([torch.zeros(8, 2), torch.zeros(8, 3)], layout)
    with pytest.raises(ValueError, match=r"chunks must have one dtype, got \['torch.float32', 'torch.float16'\]"):
        mm.zigzag_unshard([torch.zeros(8), torch.zeros(8, dtype=torch.float16)])
    with pytest.raises(ValueError, match=r"chunks must be on one device, got \['cpu', 'meta'\]"):
        mm.layout_unshard([torch.zeros(8), torch.zeros(8, device="meta")], layout)
    for dim in (0.0, None, "1", True):
        with pytest.raises(ValueError, match=r"dim must be an int \(the sequence dim to split\), got"):
            mm.zigzag_shard(torch.zeros(2, 8), 0, 2, dim=dim)
    with pytest.raises(ValueError, match=r"rank 1's chunk must be a torch.Tensor, got list"):
        mm.layout_unshard([chunks[0], [0] * 8], layout)
    with pytest.raises(ValueError, match=r"zigzag_unshard needs every rank's chunk, got none"):
        mm.zigzag_unshard([])
    with pytest.raises(ValueError, match=r"world_size must be an integer >= 1, got 2.0"):
        mm.zigzag_shard(torch.zeros(8), 0, 2.0)
    with pytest.raises(ValueError, match=r"world_size must be an integer >= 1, got '2'"):
        ZigzagLayout("2", 8)
    with pytest.raises(ValueError, match=r"world_size must be an integer >= 1, got 0"):
        ZigzagLayout(0, 8)
    assert ZigzagLayout(np.int64(2), np.int64(8)) == ZigzagLayout(2, 8)


def test_thd_shard_is_transformer_engines_partition():
    """TE's thd_get_partitioned_indices, written from its documented layout: sequence k (padded to
    a multiple of 2 * CP) is cut into 2 * CP chunks; rank r takes chunks r and 2 * CP - 1 - r of
    every sequence, in sequence order."""
    P, cu = 2, (0, 8, 12, 24)
    layout = ThdLayout(P, cu)
    x = torch.arange(24)
    want = []
    for r in range(P):
        idx = []
        for a, b in zip(cu, cu[1:]):
            n = (b - a) // (2 * P)
            idx += list(range(a + r * n, a + (r + 1) * n)) + list(range(a + (2 * P - 1 - r) * n, a + (2 * P - r) * n))
        want.append(idx)
    chunks = [mm.thd_shard(x, r, layout) for r in range(P)]
    assert [c.tolist() for c in chunks] == want
    assert torch.equal(mm.thd_unshard(chunks, layout), x)
    with pytest.raises(ValueError, match=r"tensor has 23 tokens along dim 0, the ThdLayout 24"):
        mm.thd_shard(x[:23], 0, layout)


def test_comm_counter_is_zero_without_peers():
    with mm.comm_counter() as c:
        mm.ring_attention(*qkv())
    assert (c.bytes_sent, c.bytes_received) == (0, 0)


def test_settings_take_numpy_integers_and_the_wrappers_names():
    """Integer scalars of numpy (a config's arithmetic) are integers, as cu_seqlens and the
    layouts take them; attention() takes gpus_per_node, the wrappers' name. Same result as ints."""
    np = pytest.importorskip("numpy")
    q, k, v = qkv()
    want = mm.mesh_attention(q, k, v, tile=(1, 1), window=(2, 0))
    for got in (mm.mesh_attention(q, k, v, tile=(np.int64(1), np.int64(1)), window=(np.int64(2), 0),
                                  gpus_per_node=np.int64(1)),
                mm.mesh_attention(q, k, v, tile=np.array([1, 1]), window=(2, 0)),
                mm.attention(q, k, v, mode="mesh", tile=(1, 1), window=(2, 0), gpus_per_node=1)):
        assert torch.equal(got, want)
    assert torch.equal(mm.hybrid_attention(q, k, v, ulysses_size=np.int64(1), tile=(1, 1)),
                       mm.hybrid_attention(q, k, v, ulysses_size=1, tile=(1, 1)))


def test_the_wrappers_take_their_options_defaults_and_help_from_the_modes():
    """One owner: each wrapper's mode options are its mode's Options -- every option a user sets
    (``tile_auto`` is set by resolution) with the Options' default and its help in the
    docstring. hybrid_attention passes the inner mode's options on, so their defaults are that
    mode's."""
    import inspect

    from megatron_mesh.plan.modes import get_mode, option_specs

    for fn, mode in ((mm.mesh_attention, "mesh"), (mm.ring_attention, "ring"), (mm.tasp_attention, "tasp")):
        options_type, names = fn.mode_options
        assert options_type is get_mode(mode).Options
        specs = {s.name: s for s in option_specs(options_type)}
        params = inspect.signature(fn).parameters
        assert set(names) == set(specs) - {"tile_auto"} == set(specs) & set(params), mode
        doc = " ".join(fn.__doc__.split())
        for name in names:
            assert params[name].default == specs[name].default, (mode, name)
            assert " ".join(specs[name].help.split()) in doc, (mode, name)
    hybrid = inspect.signature(mm.hybrid_attention).parameters
    inner_options = {s.name for m in ("mesh", "ring", "tasp") for s in option_specs(get_mode(m).Options)}
    assert not inner_options & set(hybrid) and "inner_settings" in hybrid


def test_a_refused_setting_stays_refused_after_an_equal_valid_one():
    """The placement cache must not serve 1.0 or True the plan that 1 left there: lru_cache takes
    them for one key, resolve accepts only the int."""
    q, k, v = qkv()
    mm.hybrid_attention(q, k, v, ulysses_size=1)
    mm.mesh_attention(q, k, v, tile=(1, 1), gpus_per_node=1)
    for call in (lambda: mm.hybrid_attention(q, k, v, ulysses_size=1.0),
                 lambda: mm.hybrid_attention(q, k, v, ulysses_size=True),
                 lambda: mm.mesh_attention(q, k, v, tile=(1.0, 1.0)),
                 lambda: mm.mesh_attention(q, k, v, gpus_per_node=True),
                 lambda: mm.tasp_attention(q, k, v, gpus_per_node=1.0)):
        with pytest.raises(ValueError):
            call()


def test_nested_comm_counters_each_count_their_own_block():
    """Counters compare by value (two fresh ones are equal): closing the inner one must not close
    the outer one, which still counts what its block sends after the inner block."""
    from megatron_mesh.comm.base import active_counters, record_bytes

    with mm.comm_counter() as outer:
        with mm.comm_counter() as inner:
            record_bytes(10, 20, 1, {1: 10})
        record_bytes(100, 200, 1, {1: 100})
        assert [c is outer for c in active_counters()] == [True]
    assert (outer.bytes_sent, outer.bytes_received, outer.sent_to) == (110, 220, {1: 110})
    assert (inner.bytes_sent, inner.bytes_received, inner.sent_to) == (10, 20, {1: 10})
    assert active_counters() == []


class _Group:  # a process group stand-in for the agreement check (only its identity matters)
    pass


class _Comm:
    """Rank 0 of a 2-rank group for prepare() and the agreement check, without processes."""

    rank, world_size, process_group = 0, 2, _Group()


@pytest.fixture()
def collectives(monkeypatch):
    """The agreement check's collectives, recorded: all_reduce leaves the tensor as it is (every
    rank agrees), all_gather_object (only on disagreement) gathers this rank's description."""
    from megatron_mesh.runtime import agreement

    seen = []

    def all_reduce(t, op=None, group=None):
        seen.append(("all_reduce", t.dtype, t.numel(), t.device.type))

    def all_gather_object(out, obj, group=None):
        seen.append(("all_gather_object",))
        out[:] = [obj] * len(out)

    monkeypatch.setattr(agreement.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(agreement.dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(agreement.dist, "get_backend", lambda group=None: "gloo")
    # a group of this test's own: the check remembers groups (whether their ranks agreed to run without it)
    monkeypatch.setattr(_Comm, "process_group", _Group())
    return seen


def _call(tensors=None, **kw):
    """The agreement.Call that rank 0 of a 2-rank group makes (ring attention unless ``mode``)."""
    from megatron_mesh.runtime import agreement
    from megatron_mesh.runtime.api import backward_follows, prepare

    q, k, v = tensors if tensors is not None else qkv(s=4)
    kw.setdefault("mode", "ring")
    p = prepare(q, k, v, comm=_Comm(), **kw)
    return agreement.Call(p.plan, p.placement, tuple(q.shape), tuple(k.shape), q.dtype, p.scale, p.kernel,
                          backward_follows(q, k, v))


def test_every_call_is_checked_with_one_small_all_reduce(collectives):
    """No per-rank cache: a plan reused from the cache is checked again (another rank may hold a
    different one), each time with one all-reduce of two int64 -- nothing else while ranks agree."""
    for _ in range(3):
        _call(cu_seqlens=[0, 3, 8])
    assert collectives == [("all_reduce", torch.int64, 2, "cpu")] * 3


def test_the_check_can_be_turned_off_once_the_ranks_agree_to_it(collectives, monkeypatch):
    """With MEGATRON_MESH_PLAN_AGREEMENT=0 a group's first call still takes part in one check, so
    that a rank with the check off meets the ranks with it on (which would otherwise wait for it in
    their all-reduce); once the group agreed to run without it, no collective runs. A bad value
    joins the check described by its error (the others name it), then raises here."""
    from megatron_mesh.runtime import agreement

    monkeypatch.setenv(agreement.ENV, "0")
    for _ in range(3):
        _call()
    assert collectives == [("all_reduce", torch.int64, 2, "cpu")]
    monkeypatch.setenv(agreement.ENV, "1")  # back on: every call is checked again, and off again agreed again
    _call()
    monkeypatch.setenv(agreement.ENV, "0")
    _call()
    _call()
    assert collectives == [("all_reduce", torch.int64, 2, "cpu")] * 3
    monkeypatch.setenv(agreement.ENV, "yes")
    with pytest.raises(ValueError, match=r"MEGATRON_MESH_PLAN_AGREEMENT must be 1 \(check every attention call, the "
                                         r"default\) or 0 \(no check\), got 'yes'"):
        _call()
    assert collectives == [("all_reduce", torch.int64, 2, "cpu")] * 4  # it joined the check before raising


@pytest.mark.parametrize("env, value, error", [
    ("MEGATRON_MESH_MASK_PIECE", "0", r"MEGATRON_MESH_MASK_PIECE must be a positive integer, got '0'"),
])
def test_a_bad_mask_piece_setting_is_read_where_the_rank_still_joins_the_check(collectives, monkeypatch, env, value,
                                                                             error):
    """Read before the check, even for a call without a masked block: this rank joins the check
    described by its error (its peers raise naming it) instead of failing in the forward, after it."""
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=error):
        _call()
    assert collectives == [("all_reduce", torch.int64, 2, "cpu")]


def test_the_fingerprint_covers_whether_a_backward_follows(collectives):
    """A rank calling under torch.no_grad() (or with inputs that need no gradient) while the others
    train would leave them waiting in the backward: whether one follows is part of the call."""
    from megatron_mesh.runtime import agreement

    train = _call(tensors=tuple(x.requires_grad_() for x in qkv(s=4)))
    with torch.no_grad():
        no_grad = _call(tensors=tuple(x.requires_grad_() for x in qkv(s=4)))
    frozen = _call()
    assert train.digest() != no_grad.digest() and no_grad.digest() == frozen.digest()
    msg = agreement.mismatch_message([train.describe(), no_grad.describe()])
    assert msg.endswith("result): backward: rank 0: yes, rank 1: no (grad mode off, or no input requires grad)"), msg


@pytest.mark.parametrize("change, field", [
    (dict(mode="mesh", tile=(2, 1)), "mode"),
    (dict(mode="mesh", tile=(1, 2), schedule="lockstep"), "mode"),
    (dict(backward_chunks="keep"), "mode"),  # the description says what the backward keeps
    (dict(backward_keep_limit=3.0), "mode"),
    (dict(mode="tasp"), "mode"),
    (dict(mode="tasp", transport="alltoall"), "mode"),
    (dict(causal=False), "mask"),
    (dict(window=(2, 0)), "mask"),
    (dict(cu_seqlens=[0, 3, 8]), "documents"),
    (dict(layout=ThdLayout(2, (0, 4, 8), (4, 3))), "documents"),
    (dict(softmax_scale=0.5), "softmax_scale"),
    (dict(tensors=tuple(x.double() for x in qkv(s=4))), "dtype"),
    (dict(tensors=qkv(s=6)), "local shape [s_local, batch, heads, head_dim]"),
    (dict(tensors=qkv(s=4, b=1)), "local shape [s_local, batch, heads, head_dim]"),
    (dict(tensors=qkv(s=4, h=2)), "local shape [s_local, batch, heads, head_dim]"),
    (dict(tensors=qkv(s=4, g=1)), "local shape [s_local, batch, heads, head_dim]"),
    (dict(tensors=qkv(s=4, d=16), softmax_scale=1 / 8 ** 0.5), "local shape [s_local, batch, heads, head_dim]"),
    (dict(kernel="math"), "kernel"),
])
def test_the_fingerprint_covers_what_changes_the_result_or_the_traffic(collectives, change, field):
    """Changing any one input of a call changes its digest, and the message names that field first."""
    from megatron_mesh.runtime import agreement

    base, other = _call(), _call(**change)
    assert base.digest() != other.digest()
    msg = agreement.mismatch_message([base.describe(), other.describe()])
    assert f"result): {field}: rank 0: " in msg, msg


def test_the_fingerprint_tells_layouts_apart_but_not_the_zigzag_from_itself(collectives):
    """The same documents on the zigzag and on TE's THD layout are different calls (named
    'layout'); one sequence on TE's THD layout puts every token where the zigzag does, so it is
    the same call as no layout at all (the same plan, the same result, the same traffic)."""
    from megatron_mesh.runtime import agreement

    zigzag, thd = _call(cu_seqlens=[0, 4, 8]), _call(layout=ThdLayout(2, (0, 4, 8)))
    assert zigzag.digest() != thd.digest()
    assert "result): layout: rank 0: " in agreement.mismatch_message([zigzag.describe(), thd.describe()])
    assert _call().digest() == _call(layout=ThdLayout(2, (0, 8))).digest()


def test_mismatch_message_names_the_first_differing_run_of_long_layouts(collectives):
    """Real layouts are kilobytes: two that differ only after their first 300 characters are named
    by the part where they first differ -- a rank's runs, with the runs around the first difference
    -- as documents are, not by the plan's digest alone."""
    import random

    from megatron_mesh.runtime import agreement

    rng = random.Random(1)
    cu = [0]
    while cu[-1] < 4096:
        cu.append(min(4096, cu[-1] + rng.randint(1, 100)))
    mine, theirs = mm.balanced_layout(cu, 2), mm.balanced_layout(cu, 2, window=(64, 0))  # same documents
    a, b = mine.text(), theirs.text()
    first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert first > 300 and a != b
    tensors = qkv(s=2048, b=1, h=2, g=1, d=4)
    msg = agreement.mismatch_message([_call(tensors, layout=mine).describe(), _call(tensors, layout=theirs).describe()])
    runs = [r.split(",") for r in a.split("runs=")[1].split(";")], [r.split(",") for r in b.split("runs=")[1].split(";")]
    rank = next(r for r in range(2) if runs[0][r] != runs[1][r])
    at = next(i for i, (x, y) in enumerate(zip(*(rs[rank] for rs in runs))) if x != y)
    assert f"layout: rank 0: balanced P=2 U=1 ({len(a)} characters), runs of rank {rank}: {len(runs[0][rank])} [" in msg
    assert f"rank 1: balanced P=2 U=1 ({len(b)} characters), runs of rank {rank}: {len(runs[1][rank])} [" in msg
    for rs in runs:
        assert f" {rs[rank][at]} " in msg.split("layout: ")[1] or f"[{rs[rank][at]} " in msg, (rs[rank][at], msg)
    assert "digest" not in msg and len(msg) < 800, msg


def test_mismatch_message_names_ranks_and_the_first_differing_documents():
    from megatron_mesh.runtime import agreement

    many = tuple(f"{i}:{i + 1}" for i in range(1000))
    moved = many[:500] + ("500:502",) + many[502:]  # rank 1 lost the boundary at 501
    msg = agreement.mismatch_message([{"documents": d} for d in (many, moved, many, many)])
    assert msg.endswith("documents: ranks 0, 2-3: 1000 [... (#497) 497:498 498:499 499:500 500:501 501:502 502:503 "
                        "503:504 ...], rank 1: 999 [... (#497) 497:498 498:499 499:500 500:502 502:503 503:504 "
                        "504:505 ...]"), msg


def test_ranks_whose_own_block_choices_differ_do_not_agree():
    """Two ranks that made different ``own_first`` choices (:mod:`megatron_mesh.plan.polish`) for
    the same call: their plans' digests differ (the plan header says the choices), so the
    agreement check raises instead of running them; the same choices give the same digest, on a
    plan built again too."""
    from megatron_mesh.plan import AttentionShape, Mask, resolve
    from megatron_mesh.runtime.agreement import plan_digest

    shape, mask = AttentionShape(16, 1, 4, 2, 8, 4), Mask.from_cu_seqlens((0, 20, 64), 64, True)
    placement = resolve("ring", 4, shape)
    one, none, again = (placement.build(shape, mask, own_first=((2, "forward", k),)) for k in (1, 0, 1))
    assert plan_digest(one) != plan_digest(none) and plan_digest(one) == plan_digest(again)


def test_document_boundaries_are_read_once_per_tensor_and_version(monkeypatch):
    """Every layer of a model gets the same cu_seqlens tensor, on a GPU each read of it waits for
    the queued work: host_values reads it once (a second call, another layer's, reads nothing),
    again after an in-place change, and every time for an inference tensor (no version counter);
    a CPU tensor, which numpy may change without a new version, every time -- then the CPU
    stands in for CUDA (``devices``)."""
    from functools import partial

    from megatron_mesh.runtime.inputs import host_values as read

    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or tolist(self))
    cpu = torch.tensor([0, 5, 16])
    assert read(cpu) == [0, 5, 16] and read(cpu) == [0, 5, 16] and len(reads) == 2
    cpu.numpy()[1] = 6  # no new version
    assert read(cpu) == [0, 6, 16]
    reads.clear()
    host_values = partial(read, devices=("cpu",))
    cu = torch.tensor([0, 5, 16])
    assert host_values(cu) == [0, 5, 16] and host_values(cu) == [0, 5, 16] and len(reads) == 1
    cu[1] = 7
    assert host_values(cu) == [0, 7, 16] and len(reads) == 2
    assert host_values(torch.tensor([[0, 5, 16], [0, 9, 16]])) == [[0, 5, 16], [0, 9, 16]] and len(reads) == 3
    with torch.inference_mode():
        frozen = torch.tensor([0, 3, 16])
    assert host_values(frozen) == [0, 3, 16] and host_values(frozen) == [0, 3, 16] and len(reads) == 5

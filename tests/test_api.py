"""Public API on one process (no process group: CP size 1): errors, layout helpers, CP=1 exactness."""

import pytest
import torch

import megatron_mesh as mm
from megatron_mesh.kernels import reference_attention


def qkv(s=8, b=2, h=4, g=2, d=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(s, b, h, d, generator=gen, dtype=dtype), torch.randn(s, b, g, d, generator=gen, dtype=dtype),
            torch.randn(s, b, g, d, generator=gen, dtype=dtype))


@pytest.mark.parametrize("fn", [mm.mesh_attention, mm.ring_attention])
@pytest.mark.parametrize("causal", [True, False])
def test_cp1_equals_dense_attention(fn, causal):
    q, k, v = (x.double().requires_grad_() for x in qkv())
    out = fn(q, k, v, causal=causal)
    ref = reference_attention(q, k, v, causal=causal)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_output_has_q_shape_and_dtype():
    q, k, v = (x.bfloat16() for x in qkv())
    out = mm.mesh_attention(q, k, v)
    assert out.shape == q.shape and out.dtype == torch.bfloat16


@pytest.mark.parametrize("bad, match", [
    (dict(tile=(2, 2)), r"tile 2x2 does not fit CP size 1.*allowed tiles: 1x1"),
    (dict(tile="2by2"), "must be 'AxB'"),
    (dict(schedule="fastest"), "schedule must be one of"),
    (dict(backward_chunks="cache"), "backward_chunks must be one of"),
    (dict(contiguous="rows"), "contiguous must be one of"),
    (dict(kernel="flash3"), "unknown kernel backend 'flash3'"),
])
def test_bad_options_raise_naming_the_value(bad, match):
    with pytest.raises(ValueError, match=match):
        mm.mesh_attention(*qkv(), **bad)


def test_bad_tensors_raise_naming_the_value():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"s_local \(7\) must be even"):
        mm.mesh_attention(*qkv(s=7))
    with pytest.raises(ValueError, match=r"query heads \(4\) must be divisible by kv heads \(3\)"):
        mm.mesh_attention(*qkv(h=4, g=3))
    with pytest.raises(ValueError, match="same dtype"):
        mm.mesh_attention(q, k.double(), v)
    with pytest.raises(ValueError, match="same shape"):
        mm.mesh_attention(q, k, v[:, :1])
    with pytest.raises(ValueError, match="must agree in s_local, batch and head_dim"):
        mm.mesh_attention(q, k[:4], v[:4])
    with pytest.raises(ValueError, match="4-D"):
        mm.mesh_attention(q[0], k, v)
    with pytest.raises(ValueError, match="floating point"):
        mm.mesh_attention(q.long(), k.long(), v.long())
    with pytest.raises(ValueError, match=r"same device, got cpu, meta, cpu"):
        mm.mesh_attention(q, k.to("meta"), v)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_zigzag_shard_unshard_roundtrip(world):
    x = torch.arange(4 * world * 3).view(4 * world, 3)
    chunks = [mm.zigzag_shard(x, r, world) for r in range(world)]
    assert torch.equal(mm.zigzag_unshard(chunks), x)
    assert chunks[0][:2, 0].tolist() == [0, 3] and chunks[0][2:, 0].tolist() == [3 * (4 * world - 2), 3 * (4 * world - 1)]


def test_comm_counter_is_zero_without_peers():
    with mm.comm_counter() as c:
        mm.ring_attention(*qkv())
    assert (c.bytes_sent, c.bytes_received) == (0, 0)

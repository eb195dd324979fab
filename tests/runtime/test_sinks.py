"""Attention sinks (``softmax_offset``) and value head dims other than the query/key head dim (MLA),
in every mode:

* the sink's math (runtime/sinks.py): the worked example, and d offset = -sum exp(o - lse') delta
  against autograd through the dense fp64 reference (Megatron's SoftmaxOne: one more logit);
* on the shared 8-rank gloo spawn (mask_cases.sink_grid): ring, a Mesh tile, TASP and the three
  hybrids at every CP size 1-8, forward and backward (dQ, dK, dV and each rank's share of d
  softmax_offset, summed over the group) against the dense fp64 reference, with masks, both
  layouts, MHA / GQA / MQA, fp32 / bf16, head dims 12 / 8; bytes equal the plan's without sinks;
* in process: rows no key reaches (THD padding) stay finite with a sink (out 0, lse = offset), the
  bytes with and without sinks are the same, and every buffer the executor allocates has the
  bytes the memory model counts at its own head dims.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import megatron_mesh as mm
from megatron_mesh.comm.inprocess import run_inprocess
from megatron_mesh.kernels import dense_mask, reference_attention
from megatron_mesh.plan import AttentionShape, MODES, Mask, ThdLayout, key_bytes, resolve
from megatron_mesh.runtime.api import prepare
from megatron_mesh.runtime.autograd import PlanAttention
from megatron_mesh.runtime.sinks import add_sink_grad_, apply_sink_

import cases
from helpers import tolerance


# -- the math ---------------------------------------------------------------------------------------------
def test_the_worked_example():
    """runtime/sinks.py's example: scores 0 and log 3 (lse = log 4), offset 0 -> weights 1/5, 3/5."""
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    out = (torch.tensor([1.0, 3.0], dtype=torch.float64) / 4 @ v).view(1, 1, 1, 2)
    lse = torch.tensor([4.0], dtype=torch.float64).log().view(1, 1, 1)
    apply_sink_(out, lse, torch.zeros(1, dtype=torch.float64))
    assert torch.allclose(out.flatten(), torch.tensor([0.2, 0.6], dtype=torch.float64))
    assert torch.allclose(lse, torch.tensor(5.0, dtype=torch.float64).log())


@pytest.mark.parametrize("causal", [True, False])
def test_sink_applied_after_the_merge_and_its_gradient_match_autograd(causal):
    """Vanilla attention's (out, lse) with the sink applied afterwards is the dense reference with
    the sink's column; the closed-form d offset (add_sink_grad_: -sum over rows of exp(o - lse')
    * rowsum(dout * out')) equals autograd's, fp64, GQA, head dims 12 / 8, a row no key reaches
    included (its gradient share is 0)."""
    g = torch.Generator().manual_seed(5)
    S, B, H, G = 10, 2, 4, 2
    q, k = (torch.randn(S, B, h, 12, generator=g, dtype=torch.float64) for h in (H, G))
    v = torch.randn(S, B, G, 8, generator=g, dtype=torch.float64)
    dout = torch.randn(S, B, H, 8, generator=g, dtype=torch.float64)
    offset = torch.randn(H, generator=g, dtype=torch.float64).requires_grad_()
    mask = Mask(causal, None, ((0, 1), (1, 4), (4, 10))) if causal else Mask(causal, (2, 1))
    ref = reference_attention(q, k, v, mask=mask, softmax_offset=offset)
    ref.backward(dout)
    plain = reference_attention(q, k, v, mask=mask).permute(1, 2, 0, 3).contiguous()
    kk = k.repeat_interleave(H // G, 2).permute(1, 2, 0, 3)
    s = (q.permute(1, 2, 0, 3) @ kk.transpose(-1, -2)) / 12 ** 0.5
    allowed = dense_mask(mask, S)
    lse = torch.logsumexp(s.masked_fill(~allowed, float("-inf")), -1)
    apply_sink_(plain, lse, offset.detach())
    assert (plain - ref.detach().permute(1, 2, 0, 3)).abs().max() < 1e-14
    grad = torch.zeros(H, dtype=torch.float64)
    add_sink_grad_(grad, dout.permute(1, 2, 0, 3), plain, lse, offset.detach())
    assert (grad - offset.grad).abs().max() < 1e-13, (grad, offset.grad)


# -- every mode on the shared gloo spawn ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def sink_records(dist_results):
    """{CP size: [records of group rank 0, 1, ...]} of mask_cases.sink_grid (one group per size)."""
    merged: dict = {}
    for per_rank in dist_results:
        for size, recs in per_rank["sinks"].items():
            merged.setdefault(size, []).append(recs)
    return merged


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 7, 8])
def test_sinks_and_value_head_dims_match_dense_reference_with_the_bytes_of_no_sinks(sink_records, world):
    per_rank = sink_records[world]
    assert len(per_rank) == world and all(per_rank), "no cases ran"
    bad = [f"group rank {r}: {rec.case}: {name} error {rec.abs_err[name]:.2e} ({ratio:.2f}x tolerance)"
           for r, recs in enumerate(per_rank) for rec in recs for name, ratio in rec.ratios.items() if not ratio <= 1]
    assert not bad, "\n".join(bad[:20])
    # the plan of the same call without sinks (mask_cases.run): a sink adds no byte
    wrong = [f"group rank {r}: {rec.case}: measured {(rec.sent, rec.received)} != planned {rec.planned}"
             for r, recs in enumerate(per_rank) for rec in recs if (rec.sent, rec.received) != rec.planned]
    assert not wrong, "\n".join(wrong[:20])
    modes = {rec.case.split()[1] for rec in per_rank[0]}
    assert modes == {"ring", "mesh", "tasp"} | ({"a2a+ring", "a2a+mesh", "a2a+tasp"} if world % 2 == 0 else set())
    learnable = 0
    for i, rec in enumerate(per_rank[0]):
        if not rec.offset_grad_want:
            continue
        learnable += 1
        shares = torch.tensor([recs[i].offset_grad for recs in per_rank], dtype=torch.float64)
        want = torch.tensor(rec.offset_grad_want, dtype=torch.float64)
        atol, rtol = tolerance(getattr(torch, rec.dtype.split(".")[1]), 4, int(rec.case.split("heads=4/")[1][0]))
        err = (shares.sum(0) - want).abs()
        assert (err <= atol + rtol * want.abs()).all(), (rec.case, shares.sum(0).tolist(), want.tolist())
    assert learnable >= len(modes) // 2, "too few learnable-sink cases"


def test_the_grid_covers_each_mode_with_sinks_masks_layouts_and_head_dims(sink_records):
    """Across the CP sizes every mode meets learnable sinks with and without a window and
    documents, values of another head dim, the balanced layout, GQA and MQA, fp32 and bf16."""
    by_mode: dict = {}
    for per_rank in sink_records.values():
        for rec in per_rank[0]:
            by_mode.setdefault(rec.case.split()[1], []).append(rec.case)
    assert set(by_mode) == set(MODES)
    for mode, labels in by_mode.items():
        learnable = [c for c in labels if "learnable" in c]
        assert any("window" in c for c in learnable) and any("docs" in c for c in learnable), mode
        assert any("window" not in c and "docs" not in c for c in labels), mode
        assert any("head dims 12/8" in c for c in learnable) and any("balanced" in c for c in labels), mode
        assert {"4/2", "4/1"} <= {c.split("heads=")[1][:3] for c in labels}, mode
        assert any("float32" in c for c in labels) and any("bfloat16" in c for c in labels), mode


# -- in process -------------------------------------------------------------------------------------------
def _thd_sink_run(mode: str, settings: dict, offset: torch.Tensor | None):
    """THD over 4 ranks with padding (rows no key reaches), head dims 12 / 8: the layout, the
    global inputs and per rank (out, dq, dk, dv, d offset, (bytes sent, received), the final lse
    of the rank's own rows or None where a Ulysses group keeps it)."""
    lens = (16, 8, 24)
    cu = tuple(itertools.accumulate(lens, initial=0))
    layout = ThdLayout(4, cu, (lens[0] - 1, lens[1], 2))
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(layout.seq_len, 1, h, d, generator=g, dtype=torch.float64)
              for h, d in ((4, 12), (2, 12), (2, 8), (4, 8))]

    def rank_fn(rank, comm):
        q, k, v = (mm.layout_shard(x, rank, layout).requires_grad_() for x in inputs[:3])
        o = None if offset is None else offset.clone().requires_grad_()
        call = prepare(q, k, v, mode=mode, comm=comm, layout=layout, softmax_offset=o, **settings)
        with mm.comm_counter() as c:
            out = PlanAttention.apply(q, k, v, call.executor(), o)
            out.backward(mm.layout_shard(inputs[3], rank, layout))
        lse = call.executor().forward(*(x.detach().permute(1, 2, 0, 3) for x in (q, k, v)), o).lse
        d_offset = None if o is None else o.grad
        return out.detach(), q.grad, k.grad, v.grad, d_offset, (c.bytes_sent, c.bytes_received), lse

    return layout, inputs, run_inprocess(rank_fn, 4, timeout=120)


@pytest.mark.parametrize("mode", ["ring", "a2a+ring"])
def test_rows_no_key_reaches_stay_finite_and_sinks_add_no_bytes(mode):
    """THD padding attends nothing: with a sink its output stays 0 and its lse is the offset (its
    gradients 0), everything else matches the dense fp64 reference, the offset's gradient is the
    sum of the ranks' shares, and the bytes are those of the same call without sinks."""
    settings = {"ulysses_size": 2} if mode.startswith("a2a") else {}
    offset = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    layout, (Q, K, V, dO), got = _thd_sink_run(mode, settings, offset)
    _, _, plain = _thd_sink_run(mode, settings, None)
    sink = offset.clone().requires_grad_()
    Qr, Kr, Vr = (x.clone().requires_grad_() for x in (Q, K, V))
    ref = reference_attention(Qr, Kr, Vr, mask=Mask(True, None, layout.documents()), softmax_offset=sink)
    ref.backward(dO)
    padding = torch.ones(layout.seq_len, dtype=torch.bool)
    for a, b in layout.documents():
        padding[a:b] = False
    assert sum(int(mm.layout_shard(padding, r, layout).sum()) for r in range(4)) > 0
    for rank, (mine, without) in enumerate(zip(got, plain)):
        assert mine[5] == without[5], (rank, mine[5], without[5])
        for name, a, b in zip(("out", "dq", "dk", "dv"), mine[:4], (ref.detach(), Qr.grad, Kr.grad, Vr.grad)):
            assert (a - mm.layout_shard(b, rank, layout)).abs().max() < 1e-12, (rank, name)
        pad = mm.layout_shard(padding, rank, layout)
        assert not mine[0][pad].any() and not mine[1][pad].any()
        if mine[6] is not None:  # the rank's own final lse (a hybrid's lives on its group)
            assert torch.equal(mine[6][..., pad], offset.view(1, -1, 1).expand(1, 4, int(pad.sum())))
    assert (sum(r[4] for r in got) - sink.grad).abs().max() < 1e-12


def test_buffers_have_the_bytes_the_memory_model_counts_at_their_head_dims(monkeypatch):
    """Every buffer the executor makes (in its arena or for the call; K and V at their own head dims, outputs and dout at
    v's, fp32 accumulators) has exactly the bytes plan.accounting.key_bytes gives it, in a plain
    and a hybrid plan with head dims 12 / 8 (what the memory walk and the byte counts add up)."""
    from megatron_mesh.runtime import buffers

    seen = []
    own, view = buffers.Buffers.own, buffers.Buffers.view

    def recording(self, key):
        tensors = own(self, key)
        seen.append((self.plan, key, sum(t.numel() * t.element_size() for t in tensors)))
        return tensors

    def arena_view(self, ident):  # a buffer in the arena
        tensors = view(self, ident)
        seen.append((self.plan, ident[1], sum(t.numel() * t.element_size() for t in tensors)))
        return tensors

    monkeypatch.setattr(buffers.Buffers, "own", recording)
    monkeypatch.setattr(buffers.Buffers, "view", arena_view)
    for mode, settings in (("mesh", {"tile": (2, 2)}), ("a2a+ring", {"ulysses_size": 2})):
        p = cases.Problem(4, 4, 2, True, torch.bfloat16, seq_local=8, head_dim=12, v_head_dim=8, sink=True,
                          cu_seqlens=(0, 5, 21, 32))
        plan = resolve(mode, 4, p.shape, **settings).build(p.shape, p.mask, p.layout)
        seen.clear()
        from test_inprocess_numerics import check, run_case

        check(run_case(p, plan, serial=True))
        assert seen and {k.kind for _, k, _ in seen} >= {"kv", "dkv"}
        for pl, key, n in seen:
            assert n == key_bytes(pl, key, p.shape), (mode, key, n, key_bytes(pl, key, p.shape))


def test_in_process_executor_with_sinks_and_value_head_dims_in_every_mode():
    """forward_backward (no autograd) in every mode at P = 4 and 6: sinks' gradient shares and
    head dims 12 / 8 against the dense fp64 reference (the driver the CUDA tier uses)."""
    from test_inprocess_numerics import _mode_settings, check, run_case

    for mode, world in itertools.product(MODES, (4,)):
        p = cases.Problem(world, 4, 1 if mode == "a2a+tasp" else 2, True, torch.float32, head_dim=12,
                          v_head_dim=8, sink=True, window=(5, 0))
        plan = resolve(mode, world, p.shape, **_mode_settings(mode, world)).build(p.shape, p.mask, p.layout)
        check(run_case(p, plan, label=f"{mode} sinks 12/8"))


def test_shape_of_the_value_head_dim():
    shape = AttentionShape(8, 1, 4, 2, 12, 2, 8)
    assert (shape.dim("qk"), shape.dim("v"), shape.dim("")) == (12, 8, 1)
    assert AttentionShape(8, 1, 4, 2, 12).v_head_dim == 12 and shape.dims_text == "head dim 12 (values 8)"

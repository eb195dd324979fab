"""The public API inside PyTorch's own machinery, on 2 gloo ranks against the fp64 reference
(one spawn for every case; each found broken by a user-style review in stop 79):

* ``torch.compile`` (``aot_eager``, which traces as inductor does, without a C++ build): the
  attention is a graph break and runs eagerly (:func:`~megatron_mesh.runtime.autograd.compiler_boundary`).
  Traced, its arena views came out a quarter of their size and gloo aborted both processes;
* two CP groups run from two threads at once, this process the same rank in both: each group
  has its own arena (:class:`~megatron_mesh.runtime.state.Arenas`); sharing one gave wrong
  results without a word;
* ``torch.autocast``: the inputs in autocast's dtype and the output in it, as torch's own
  attention under autocast; it ran in fp32 before.
"""

from __future__ import annotations

import threading

import pytest
import torch

import megatron_mesh as mm
from megatron_mesh.comm.spawn import spawn

pytestmark = pytest.mark.timeout(300)

S, H, G, D = 128, 2, 2, 16


def _full(seed: int):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(S, 1, h, D, generator=g, dtype=torch.float64) for h in (H, G, G, H))


def _reference(q, k, v, dout):
    """Output and gradients of causal attention over the whole sequence, in fp64, [S, 1, h, D]."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(*(x.permute(1, 2, 0, 3) for x in (q, k, v)),
                                                          is_causal=True).permute(2, 0, 1, 3)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _run(attend, rank: int, world: int, seed: int, dtype=torch.float32):
    """max |error| of out, dq, dk, dv of this rank's zigzag shard against the fp64 reference."""
    full = _full(seed)
    want = _reference(*full)
    q, k, v, dout = (mm.zigzag_shard(x, rank, world).to(dtype) for x in full)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = attend(q, k, v)
    out.backward(dout.to(out.dtype))
    got = (out, q.grad, k.grad, v.grad)
    return [(g.dtype, (g.double() - mm.zigzag_shard(w, rank, world)).abs().max().item()) for g, w in zip(got, want)]


def _cases(rank: int, world: int) -> dict:
    import torch.distributed as dist

    out = {}
    for mode in ("mesh", "ring"):
        compiled = torch.compile(lambda q, k, v: mm.attention(q * 1.0, k, v, mode=mode) + 0.0, backend="aot_eager")
        out[f"compile {mode}"] = [_run(compiled, rank, world, seed) for seed in (0, 1)]  # a second call: cached
    # two groups of the same two ranks, each run from its own thread at once, several steps each
    groups = {"A": dist.group.WORLD, "B": dist.new_group([0, 1])}
    threaded: dict = {}

    def steps(name):
        threaded[name] = [_run(lambda q, k, v: mm.ring_attention(q, k, v, group=groups[name]), rank, world, i)
                          for i in range(4)]
    threads = [threading.Thread(target=steps, args=(n,)) for n in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["threads"] = threaded
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out["autocast"] = _run(lambda q, k, v: mm.mesh_attention(q, k, v), rank, world, 2)
    out["plan"] = _run(_through_a_plan_text, rank, world, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out["plan autocast"] = _run(_through_a_plan_text, rank, world, 4)
    return out


def _through_a_plan_text(q, k, v):
    """plan_attention on the Mesh plan this rank would run, written out as text and read back."""
    from megatron_mesh.plan.ir.plan import Plan
    from megatron_mesh.runtime import plan_attention
    from megatron_mesh.runtime.api import prepare

    call = prepare(q, k, v, mode="mesh")
    return plan_attention(q, k, v, Plan.from_text(call.plan.to_text()), comm=call.comm)


@pytest.fixture(scope="module")
def results():
    return spawn(_cases, 2, timeout=280)


@pytest.mark.parametrize("mode", ["mesh", "ring"])
def test_a_compiled_model_runs_the_attention_eagerly_and_exactly(results, mode):
    for rank in results:
        for errors in rank[f"compile {mode}"]:
            assert all(dt == torch.float32 and e < 2e-6 for dt, e in errors), errors


def test_two_groups_from_two_threads_at_once_each_get_their_own_bytes(results):
    for rank in results:
        for name, runs in rank["threads"].items():
            for errors in runs:
                assert all(e < 2e-6 for _, e in errors), (name, errors)


def test_autocast_runs_the_attention_in_its_dtype(results):
    for rank in results:
        (out_dtype, out_err), *grads = rank["autocast"]
        assert out_dtype == torch.bfloat16 and out_err < 3e-2, rank["autocast"]
        assert all(dt == torch.float32 and e < 3e-2 for dt, e in grads), grads  # fp32 inputs get fp32 gradients


def test_an_explicit_plan_runs_exactly_and_under_autocast_in_its_dtype(results):
    """plan_attention (an explicit plan, here read back from its text) against fp64, forward and
    backward; under autocast it casts as attention() does (it ran in the inputs' dtype)."""
    for rank in results:
        assert all(dt == torch.float32 and e < 2e-6 for dt, e in rank["plan"]), rank["plan"]
        (out_dtype, out_err), *grads = rank["plan autocast"]
        assert out_dtype == torch.bfloat16 and out_err < 3e-2, rank["plan autocast"]
        assert all(dt == torch.float32 and e < 3e-2 for dt, e in grads), grads


def test_autocast_leaves_fp64_inputs_as_they_are():
    # autocast's own rule (torch's attention keeps fp64 under it too): an fp64 reference stays one
    q, k, v = (torch.randn(16, 1, 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = mm.attention(q, k, v)
    assert got.dtype == torch.float64 and torch.equal(got, mm.attention(q, k, v))

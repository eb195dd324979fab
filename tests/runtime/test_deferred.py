"""The executor's fewer ops per step: its queue of copies and adds (runtime/deferred.py), issued as
a few ``_foreach_*`` calls, and its merge as one dispatched op (runtime/fused.py) -- each bitwise
what issuing the ops one by one gives."""

from __future__ import annotations

import collections
import random

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_mesh.runtime import deferred
from megatron_mesh.plan.hostops import _overlap
from megatron_mesh.runtime.deferred import Deferred
from megatron_mesh.runtime.fused import merge_
from megatron_mesh.runtime.merge import merge_partial_


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_queued_writes_give_bitwise_what_one_by_one_gives_in_fewer_calls(monkeypatch):
    """Random copies and adds (fp32 accumulators, bf16 and fp32 sources) into random rows of three
    buffers: the queue's calls give bitwise the one-by-one result, no call holds two writes into
    shared rows, and the calls are fewer than the writes."""
    calls_seen = []
    real = deferred.write_calls

    def recording(writes):
        got = real(writes)
        calls_seen.append(got)
        return got

    monkeypatch.setattr(deferred, "write_calls", recording)
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        accs = [torch.randn(2, 3, 16, 4, generator=g) for _ in range(3)]
        mine = [a.clone() for a in accs]
        queue, n = Deferred(), rng.randint(2, 12)
        for _ in range(n):
            b, a = rng.randrange(3), rng.randrange(15)
            stop = rng.randint(a + 1, 16)
            src = torch.randn(2, 3, stop - a, 4, generator=g).to(rng.choice([torch.float32, torch.bfloat16]))
            add = rng.random() < 0.6
            (accs[b][:, :, a:stop].add_ if add else accs[b][:, :, a:stop].copy_)(src)
            queue.put(add, mine[b][:, :, a:stop], src, (b, 0, a, stop, 0, 3), dst_id=None)
        calls_seen.clear()
        wheres = [w.where for w in queue.writes]
        queue.flush()
        assert all(torch.equal(x, y) for x, y in zip(accs, mine)), trial
        (issued,) = calls_seen
        assert len(issued) <= n and sorted(i for c in issued for i in c) == list(range(n))
        for group in issued:
            for a, i in enumerate(group):
                assert not any(_overlap(wheres[i], wheres[j]) for j in group[a + 1:]), trial
        assert not queue and not queue.written


def test_one_ring_step_is_two_calls():
    """The module's worked example: a block's dQ add and its dK/dV copies, then the received
    partial added into dK/dV -- four tensors written, two ops."""
    dq, dk, dv = torch.zeros(1, 4, 8, 2), torch.zeros(1, 2, 8, 2), torch.zeros(1, 2, 8, 2)
    q = Deferred()
    q.put(True, dq, torch.ones_like(dq), ("dq3", 0, 0, 8, 0, 4))
    q.put(False, dk, torch.ones_like(dk), ("dkv2", 0, 0, 8, 0, 2))
    q.put(False, dv, torch.ones_like(dv), ("dkv2", 1, 0, 8, 0, 2))
    q.put(True, dk, torch.ones_like(dk), ("dkv2", 0, 0, 8, 0, 2), src_key="dkv2'")
    q.put(True, dv, torch.ones_like(dv), ("dkv2", 1, 0, 8, 0, 2), src_key="dkv2'")
    assert q.touches(["dkv2'"]) and q.touches(["dq3"]) and not q.touches(["kv2"])
    with _Count() as counted:
        q.flush()
    assert sum(counted.ops.values()) == 2, counted.ops
    assert (dq == 1).all() and (dk == 2).all() and (dv == 2).all()


def test_a_write_reading_what_the_queue_writes_issues_it_first():
    a, b = torch.zeros(4), torch.zeros(4)
    q = Deferred()
    q.put(False, a, torch.ones(4), ("a", 0, 0, 4, 0, 1))
    q.put(True, b, a, ("b", 0, 0, 4, 0, 1), src_key="a")  # reads a: the copy into a goes first
    assert len(q.writes) == 1
    q.flush()
    assert (b == 1).all()


def test_fused_merge_is_one_op_and_bitwise_the_torch_merge():
    """On the CPU the fused op runs merge_partial_'s torch ops: bitwise its result (rows no key
    reached stay 0 / -inf; rows a block reaches first become the block's), counted as one op."""
    g = torch.Generator().manual_seed(1)
    for blk_dtype in (torch.float32, torch.bfloat16):
        out = torch.randn(1, 2, 6, 4, generator=g)
        lse = torch.randn(1, 2, 6, generator=g)
        lse[0, 0, :2] = float("-inf")
        out[0, 0, :2] = 0
        blk_out = torch.randn(1, 2, 6, 4, generator=g).to(blk_dtype)
        blk_lse = torch.randn(1, 2, 6, generator=g)
        blk_lse[0, 0, 0] = float("-inf")  # neither side reached: stays 0 / -inf
        a_out, a_lse, b_out, b_lse = out.clone(), lse.clone(), out.clone(), lse.clone()
        merge_partial_(a_out, a_lse, blk_out, blk_lse)
        with _Count() as counted:
            merge_(b_out, b_lse, blk_out, blk_lse)
        assert dict(counted.ops) == {"merge_": 1}
        assert torch.equal(a_out, b_out) and torch.equal(a_lse, b_lse)
        assert b_lse[0, 0, 0] == float("-inf") and (b_out[0, 0, 0] == 0).all()
        assert torch.equal(b_out[0, 0, 1], blk_out[0, 0, 1].float())  # reached first: the block's
    meta = [torch.empty(1, 2, 6, 4, device="meta"), torch.empty(1, 2, 6, device="meta")]
    merge_(*meta, *meta)  # shapes only (count_host_ops --bytes)


def test_two_layers_share_the_arena_and_keep_what_each_saved():
    """Megatron's order -- forward of layer 1, forward of layer 2, backward of layer 2, backward
    of layer 1 -- on one arena per rank: what each layer's forward keeps for its backward (a
    Ulysses group's output and head slices, its input cuts at degree 1; Mesh's chunks kept with
    backward_chunks="keep") lives
    outside the arena, so layer 2 cannot overwrite layer 1's. Both layers' outputs and gradients
    match the dense fp64 reference."""
    import cases
    import megatron_mesh as mm
    from megatron_mesh.comm.inprocess import run_inprocess

    world = 4
    p = cases.Problem(world, 4, 2, True, torch.float64, seq_local=8, cu_seqlens=(0, 5, 21, 32))
    ref = cases.dense_reference(p)
    layers = [dict(mode="a2a+ring", ulysses_size=1), dict(mode="a2a+ring", ulysses_size=2),
              dict(mode="mesh", tile=(2, 2), backward_chunks="keep")]

    def rank_fn(rank, comm):
        Q, K, V, dO = ref.inputs
        outs, ins = [], []
        for n, settings in enumerate(layers):  # the forwards, then autograd runs the backwards in reverse
            q, k, v = (p.shard(x, rank).clone().requires_grad_() for x in (Q, K, V))
            ins.append((q, k, v))
            outs.append(mm.attention(q, k, v, comm=comm, **p.mask_args(), **settings))
        sum((o * p.shard(dO, rank)).sum() for o in outs).backward()
        return [(o.detach(), *(x.grad for x in i)) for o, i in zip(outs, ins)]

    for rank, got in enumerate(run_inprocess(rank_fn, world, timeout=120)):
        for layer in got:
            errors, ratios = cases.compare(p, layer, ref, rank)
            assert max(ratios.values()) <= 1, (rank, errors)


def test_a_write_over_several_buffers_orders_the_writes_into_each():
    """A backward block's new dK partials of two buffers lying one after another are written by one
    copy over both (where: a list); an add into one of them then comes after it."""
    run = torch.zeros(8)
    a, b = run[:4], run[4:]
    q = Deferred()
    q.put(False, run, torch.ones(8), [("a", 0, 0, 4, 0, 1), ("b", 0, 0, 4, 0, 1)])
    q.put(True, b, torch.ones(4), ("b", 0, 0, 4, 0, 1), src_key="b'")
    q.put(True, torch.zeros(3), torch.ones(3), ("c", 0, 0, 3, 0, 1))
    q.flush()
    assert (a == 1).all() and (b == 2).all()

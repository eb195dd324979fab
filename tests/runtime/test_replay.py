"""One rank alone (comm/replay.py): its rounds recorded in a full in-process run and replayed,
it computes bitwise what it computed among its peers -- every mode, odd P, packed documents on
the balanced layout -- and again on every step of a loop; a replay whose receives do not fit its
recording (count, sender, shape, dtype) is an error, not a silent wrong answer."""

from __future__ import annotations

import pytest
import torch

from megatron_mesh.comm.inprocess import run_inprocess
from megatron_mesh.comm.replay import Recorder, ReplayCommunicator
from megatron_mesh.plan import AttentionShape, balanced_layout, resolve
from megatron_mesh.plan.modes.base import parse_mode_spec
from megatron_mesh.runtime.autograd import forward_backward
from megatron_mesh.runtime.inputs import attention_mask
from megatron_mesh.runtime.sharding import layout_shard

CASES = [  # (mode, P, documents (cu_seqlens) or None, balanced layout)
    ("ring", 3, None, False),
    ("mesh:2x2", 4, None, False),
    ("tasp", 4, None, False),
    ("a2a+ring:2", 4, None, False),
    ("mesh:auto", 5, (0, 7, 40, 41, 80), True),
    ("ring", 4, (0, 30, 31, 64), True),
]


def _setup(mode, P, docs, balanced, s_local=16, heads=4, kv_heads=2, head_dim=8):
    shape = AttentionShape(s_local, 1, heads, kv_heads, head_dim, 4)
    name, settings = parse_mode_spec(mode)
    placement = resolve(name, P, shape, **settings)
    layout = balanced_layout(docs, P, group=placement.ulysses) if balanced else None
    mask, layout = attention_mask(P, shape, causal=True, cu_seqlens=None if layout else docs, layout=layout)
    plan = placement.build(shape, mask, layout)
    g = torch.Generator().manual_seed(P)
    S = P * s_local
    mk = lambda h: torch.randn(S, 1, h, head_dim, generator=g)  # noqa: E731 -- sbhd
    whole = (mk(heads), mk(kv_heads), mk(kv_heads), mk(heads))
    return plan, [tuple(layout_shard(x, r, layout, dim=0) for x in whole) for r in range(P)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode,P,docs,balanced", CASES, ids=[f"{c[0]}-P{c[1]}{'-docs' if c[2] else ''}" for c in CASES])
def test_a_rank_replayed_alone_computes_what_it_computed_with_its_peers(mode, P, docs, balanced):
    plan, shards = _setup(mode, P, docs, balanced)
    recorders = [None] * P

    def rank_fn(rank, comm):
        recorders[rank] = Recorder(comm)
        return forward_backward(*shards[rank], plan, comm=recorders[rank], kernel="math")

    together = run_inprocess(rank_fn, P, timeout=60)
    for rank in range(P):
        alone = ReplayCommunicator(rank, P, recorders[rank].received())
        for step in range(2):  # the second step starts the recording again
            got = forward_backward(*shards[rank], plan, comm=alone, kernel="math")
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, together[rank]):
                assert torch.equal(a, b), (mode, P, rank, step, name)
        assert alone.next == 0


def test_a_replay_that_does_not_fit_its_recording_is_an_error():
    plan, shards = _setup("ring", 3, None, False)
    recorders = [None] * 3

    def rank_fn(rank, comm):
        recorders[rank] = Recorder(comm)
        return forward_backward(*shards[rank], plan, comm=recorders[rank], kernel="math")

    run_inprocess(rank_fn, 3, timeout=60)
    rounds = recorders[0].received()
    other, other_shards = _setup("ring", 3, None, False, head_dim=4)  # smaller messages than recorded
    with pytest.raises(ValueError, match=r"rank 0, replayed round 0: receive from rank \d is .* recorded"):
        forward_backward(*other_shards[0], other, comm=ReplayCommunicator(0, 3, rounds), kernel="math")
    with pytest.raises(ValueError, match="rank 1 has no recorded rounds to replay"):
        ReplayCommunicator(1, 3, [])
    with pytest.raises(ValueError, match=r"rank must be in 0..2 \(world_size 3\), got 3"):
        ReplayCommunicator(3, 3, rounds)
    with pytest.raises(ValueError, match="rank 0, replayed round 0: 1 receives, 2 recorded"):
        ReplayCommunicator(0, 3, rounds).start([], [(2, torch.empty_like(rounds[0][0][1]))])
    (sender, t), *rest = rounds[0]
    with pytest.raises(ValueError, match=rf"rank 0, replayed round 0: receive from rank {3 - sender} is .* recorded "
                                         rf"from rank {sender}"):  # the same sizes, from another rank
        ReplayCommunicator(0, 3, rounds).start([], [(3 - sender, torch.empty_like(t)),
                                                    *[(p, torch.empty_like(x)) for p, x in rest]])
    never = Recorder(ReplayCommunicator(0, 3, rounds))
    never.start([], [(p, torch.empty_like(t)) for p, t in rounds[0]])  # posted, never waited
    with pytest.raises(ValueError, match="round 0 of rank 0 was never waited for"):
        never.received()


def test_a_recorder_is_its_communicator_to_the_executor_s_checks():
    """Wrapped around a torch.distributed communicator, a Recorder still offers its process group
    (the plan-agreement check all-reduces over it: a rank without one would skip it and leave its
    peers waiting); a round waited twice is recorded once, as it first arrived."""
    class WithGroup(ReplayCommunicator):
        process_group = object()

    rounds = [[(1, torch.arange(4.0))]]
    rec = Recorder(WithGroup(0, 2, rounds))
    assert rec.process_group is WithGroup.process_group
    buf = torch.empty(4)
    work = rec.start([], [(1, buf)])
    work.wait()
    buf.fill_(7.0)  # the executor reuses the buffer
    work.wait()
    assert len(rec.received()) == 1 and rec.received()[0][0][0] == 1
    assert torch.equal(rec.received()[0][0][1], torch.arange(4.0))

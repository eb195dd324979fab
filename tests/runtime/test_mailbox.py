"""The in-process transport's mailbox (megatron_mesh.comm.inprocess): messages matched in posting
order per channel, hangs and failures turned into errors that name who waits for whom, the timed
mailbox's byte count, and bad arguments."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import megatron_mesh as mm
from megatron_mesh.comm.inprocess import InProcessCommunicator, InProcessError, Mailbox, run_inprocess
from megatron_mesh.plan import MeshFacts, Plan, Post, RankPlan, build_mesh_plan, plan_bytes
from megatron_mesh.runtime.api import forward_backward

import cases


def test_messages_match_in_posting_order_per_channel():
    """Two sends in one round and one in the next, received in the same order; a receive posted
    before its send; and traffic in both directions at once."""
    def fn(rank, comm):
        if rank == 0:
            comm.start([(1, torch.full((2,), 1.0)), (1, torch.full((3,), 2.0)), (2, torch.full((2,), 7.0))], []).wait()
            comm.start([(1, torch.full((2,), 3.0))], []).wait()
            back = torch.empty(1)
            comm.start([], [(1, back)]).wait()
            return back.tolist()
        if rank == 1:
            a, b, c = torch.empty(2), torch.empty(3), torch.empty(2)
            w = comm.start([], [(0, a), (0, b)])
            time.sleep(0.05)  # rank 0 posts round 2 meanwhile: its message must not overtake
            w.wait()
            comm.start([(0, torch.full((1,), 9.0))], [(0, c)]).wait()
            return a.tolist() + b.tolist() + c.tolist()
        d = torch.empty(2)
        comm.start([], [(0, d)]).wait()  # posted before or after rank 0's send
        return d.tolist()

    r0, r1, r2 = run_inprocess(fn, 3, timeout=30)
    assert r0 == [9.0]
    assert r1 == [1.0, 1.0, 2.0, 2.0, 2.0, 3.0, 3.0]
    assert r2 == [7.0, 7.0]


def test_peer_that_never_posts_is_a_deadlock_error():
    def fn(rank, comm):
        if rank == 0:
            comm.start([], [(1, torch.empty(4))]).wait()

    t0 = time.monotonic()
    with pytest.raises(InProcessError, match=r"deadlock: rank 0 waits for message #0 \(receive from rank 1\)"):
        run_inprocess(fn, 2, timeout=30)
    assert time.monotonic() - t0 < 5  # found at once, not at the timeout


def test_ring_of_waiting_ranks_is_a_deadlock_error():
    """Every rank waits for a receive that its peer only posts after its own wait."""
    def fn(rank, comm):
        comm.start([], [((rank + 1) % 3, torch.empty(1))]).wait()
        comm.start([((rank - 1) % 3, torch.ones(1))], []).wait()

    with pytest.raises(InProcessError, match=r"deadlock: rank 0 waits for message #0 \(receive from rank 1\); "
                                             r"rank 1 waits .*rank 2 waits for message #0 \(receive from rank 0\)"):
        run_inprocess(fn, 3, timeout=30)


def test_hang_in_compute_times_out():
    release = threading.Event()

    def fn(rank, comm):
        if rank == 1:
            release.wait(60)  # stuck in "compute": no transport can tell, only the timeout
        if rank == 0:
            comm.start([], [(1, torch.empty(1))]).wait()

    t0 = time.monotonic()
    try:
        with pytest.raises(InProcessError, match=r"timed out after 1 s.*ranks still running: \[0, 1\].*rank 0 waits"):
            run_inprocess(fn, 2, timeout=1.0)
        assert time.monotonic() - t0 < 5
    finally:
        release.set()


def test_failure_on_one_rank_stops_the_others():
    def fn(rank, comm):
        if rank == 2:
            raise ValueError("bad input on rank 2")
        comm.start([], [(2, torch.empty(1))]).wait()

    t0 = time.monotonic()
    with pytest.raises(InProcessError, match="failed on virtual rank 2: ValueError: bad input on rank 2") as e:
        run_inprocess(fn, 3, timeout=30)
    assert set(e.value.errors) == {2} and isinstance(e.value.errors[2], ValueError)
    assert time.monotonic() - t0 < 5


def test_mismatched_message_and_unreceived_send_are_errors():
    def mismatch(rank, comm):
        if rank == 0:
            comm.start([(1, torch.ones(3))], []).wait()
        else:
            comm.start([], [(0, torch.empty(4))]).wait()

    with pytest.raises(InProcessError, match=r"message #0 from rank 0 to rank 1 does not match its receive: "
                                             r"sent \(3,\) torch.float32, receive buffer \(4,\) torch.float32"):
        run_inprocess(mismatch, 2, timeout=30)

    def unreceived(rank, comm):
        if rank == 0:
            comm.start([(1, torch.ones(1))], [])  # never waited, never received

    with pytest.raises(InProcessError, match=r"never matched: send #0 between ranks 0 and 1 \(posted by rank 0\)"):
        run_inprocess(unreceived, 2, timeout=30)


def test_plan_whose_peer_never_posts_fails_within_the_timeout():
    """Rank 1 runs a ring plan with its rounds removed: its peers wait for transfers it never
    posts (and it misses buffers): the run fails quickly instead of hanging."""
    p = cases.Problem(3, 4, 2, True, torch.float32)
    good = build_mesh_plan(3, (1, 3), p.shape, causal=True)

    def rank_plan(r: int) -> RankPlan:
        rp = good.rank(r)
        if r != 1:
            return rp
        strip = lambda ops: tuple(op for op in ops if not isinstance(op, Post))  # noqa: E731
        return RankPlan(rp.rank, rp.seq_local, strip(rp.forward), strip(rp.backward), rp.forward_inputs,
                        rp.backward_inputs, rp.output, rp.grad_q, rp.grad_kv, rp.saved)

    broken = Plan("mesh", 3, p.seq_local, rank_plan, facts=MeshFacts((1, 3), "q"))
    Q, K, V, dO = cases.make_inputs(p)

    def fn(rank, comm):
        q, k, v, do = (p.shard(x, rank).float() for x in (Q, K, V, dO))
        forward_backward(q, k, v, do, broken, comm=comm)

    t0 = time.monotonic()
    with pytest.raises(InProcessError, match="failed on virtual rank 1: KeyError"):
        run_inprocess(fn, 3, timeout=30)
    assert time.monotonic() - t0 < 10


def test_timed_mailbox_counts_every_copied_byte():
    p = cases.Problem(4, 4, 2, True, torch.float32)
    Q, K, V, dO = cases.make_inputs(p)
    box = Mailbox(4, timed=True)
    plan = build_mesh_plan(4, (2, 2), p.shape)

    def fn(rank, comm):
        q, k, v, do = (p.shard(x, rank).float() for x in (Q, K, V, dO))
        forward_backward(q, k, v, do, plan, comm=comm)

    run_inprocess(fn, 4, mailbox=box)
    assert box.copied_bytes == sum(r.received for r in plan_bytes(plan, p.shape)) > 0
    assert box.copy_seconds() > 0
    with pytest.raises(ValueError, match="must be a fresh Mailbox of 4 ranks, got an already used one"):
        run_inprocess(fn, 4, mailbox=box)
    with pytest.raises(ValueError, match="copy times are measured only by a Mailbox"):
        Mailbox(2).copy_seconds()


def test_serial_run_times_each_rank_s_own_work():
    """In a serial run each rank's turn time is its own work, waits excluded: a ring of 3 ranks,
    each working before and after an exchange (rank 1 ten times longer); the turns add up to the
    wall time, and a parallel run records none. The margins (a tenth of a second per rank and in
    all) hold on a loaded CI machine, where this runs at nice 10 beside the multi-process tests, and
    are still half the 0.3 s of rank 1's work that a wait counted as work would add."""
    work = {0: (0.03, 0.06), 1: (0.3, 0.6), 2: (0.06, 0.03)}

    def fn(rank, comm):
        time.sleep(work[rank][0])
        got = torch.empty(1)
        comm.start([((rank + 1) % 3, torch.full((1,), float(rank)))], [((rank - 1) % 3, got)]).wait()
        time.sleep(work[rank][1])
        return got.item()

    box = Mailbox(3, turns=True)
    start = time.perf_counter()
    assert run_inprocess(fn, 3, serial=True, mailbox=box) == [2.0, 0.0, 1.0]
    wall = time.perf_counter() - start
    for rank, (before, after) in work.items():
        assert before + after <= box.busy[rank] < before + after + 0.15, (rank, box.busy)
    assert sum(box.busy) <= wall < sum(box.busy) + 0.25
    parallel = Mailbox(3, turns=True)
    run_inprocess(fn, 3, mailbox=parallel)
    assert parallel.busy == [0.0] * 3


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        run_inprocess(lambda r, c: None, 0)
    with pytest.raises(ValueError, match="timeout must be > 0 seconds, got 0"):
        run_inprocess(lambda r, c: None, 2, timeout=0)
    with pytest.raises(ValueError, match="streams=True needs a CUDA device, got device=None"):
        run_inprocess(lambda r, c: None, 2, streams=True)
    with pytest.raises(ValueError, match="rank 3 out of range for a mailbox of 2 ranks"):
        InProcessCommunicator(Mailbox(2), 3)
    with pytest.raises(ValueError, match=r"rank 0 cannot transfer with peer 0 \(group of 2\)"):
        InProcessCommunicator(Mailbox(2), 0).start([(0, torch.ones(1))], [])
    with pytest.raises(ValueError, match="transfers need contiguous tensors"):
        InProcessCommunicator(Mailbox(2), 0).start([(1, torch.ones(2, 2).t())], [])
    q = torch.zeros(4, 1, 2, 8)
    with pytest.raises(ValueError, match=r"dout must be shaped like the output \(4, 1, 2, 8\) \(q's heads, v's head dim\), "
                                         r"got \(2, 1, 2, 8\)"):
        forward_backward(q, q, q, q[:2], lambda P, shape: build_mesh_plan(P, (1, 1), shape),
                         comm=InProcessCommunicator(Mailbox(1), 0))


def test_comm_counter_counts_only_this_virtual_rank():
    """comm_counter() is per thread: each virtual rank sees its own bytes, not its peers'."""
    def fn(rank, comm):
        with mm.comm_counter() as c:
            if rank == 0:
                comm.start([(1, torch.ones(3))], [(1, torch.empty(5))]).wait()
            else:
                comm.start([(0, torch.ones(5))], [(0, torch.empty(3))]).wait()
        return c.bytes_sent, c.bytes_received

    assert run_inprocess(fn, 2, timeout=30) == [(12, 20), (20, 12)]

"""The in-process transport (all P ranks of a plan as threads of one process): the dense fp64
reference checks of test_mesh_attention.py on it, bytes equal to the plan's, results bitwise equal
to the gloo transport, hangs and failures turned into errors, buffer-pool steady state, and the
same checks on CUDA (``-m gpu``)."""

from __future__ import annotations

import collections
import itertools
import threading
import time

import pytest
import torch

import megatron_mesh as mm
from megatron_mesh.comm.inprocess import InProcessCommunicator, InProcessError, Mailbox, forward_backward, run_inprocess
from megatron_mesh.launch import spawn
from megatron_mesh.plan import AttentionShape, Plan, Post, RankPlan, build_mesh_plan, plan_bytes, tile_shapes
from megatron_mesh.runtime import executor as executor_module

import cases

try:  # TASP is added by another change; its tests run once it exists
    from megatron_mesh.plan.tasp import build_tasp_plan
except ImportError:  # pragma: no cover - depends on the tree
    build_tasp_plan = None


def mesh_builder(tile, causal, **kw):
    return lambda world, shape: build_mesh_plan(world, tile, shape, causal=causal, **kw)


def run_case(p: cases.Problem, build, *, device="cpu", kernel="auto", softmax_scale=None, serial=False,
             streams=False, ref=None):
    """Forward + backward of ``build`` on P virtual ranks; per rank: allclose ratios and max abs
    errors vs the dense fp64 reference, bytes sent/received, and the outputs (on the CPU)."""
    Q, K, V, dO, out_ref, dQ, dK, dV = ref if ref is not None else cases.dense_reference(p)
    atol, rtol = cases.tolerance(p.dtype, p.heads, p.kv_heads)

    def rank_fn(rank, comm):
        shard = lambda x: mm.zigzag_shard(x, rank, p.world)  # noqa: E731
        q, k, v, do = (shard(x).to(device=device, dtype=p.dtype) for x in (Q, K, V, dO))
        with mm.comm_counter() as c:
            got = forward_backward(q, k, v, do, build, comm=comm, kernel=kernel, softmax_scale=softmax_scale)
        got = [g.cpu() for g in got]
        ratios, abs_err = {}, {}
        for name, g, want in zip(("out", "dq", "dk", "dv"), got, (out_ref, dQ, dK, dV)):
            want = shard(want)
            assert g.shape == want.shape and g.dtype == p.dtype, (name, g.shape, g.dtype)
            err = (g.double() - want).abs()
            abs_err[name] = err.max().item()
            ratios[name] = (err / (atol + rtol * want.abs())).max().item()
        return dict(ratios=ratios, abs_err=abs_err, bytes=(c.bytes_sent, c.bytes_received), outputs=got)

    return run_inprocess(rank_fn, p.world, timeout=120, serial=serial, device=device, streams=streams)


def assert_close(records, case):
    bad = [f"{case} rank {r}: {name} error {rec['abs_err'][name]:.2e} ({ratio:.2f}x tolerance)"
           for r, rec in enumerate(records) for name, ratio in rec["ratios"].items() if not ratio <= 1.0]
    assert not bad, "\n".join(bad)


def assert_plan_bytes(records, plan: Plan, p: cases.Problem):
    shape = AttentionShape(p.seq_local, p.batch, p.heads, p.kv_heads, p.head_dim,
                           torch.tensor([], dtype=p.dtype).element_size())
    planned = plan_bytes(plan, shape)
    for r, rec in enumerate(records):
        assert rec["bytes"] == (planned[r].sent, planned[r].received), (r, rec["bytes"], planned[r])


# -- dense reference, every tile -------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 7, 8])
def test_mesh_matches_dense_reference(world):
    """Every tile of P (ring 1xP included), causal/full, MHA/GQA in fp32; MQA and bf16 on the ring
    and on the most square tile. Bytes moved equal the plan's bytes."""
    tiles = tile_shapes(world)
    square = min(tiles, key=lambda t: abs(t[0] - t[1]))
    cases_ = [(t, c, h, torch.float32) for t, c, h in itertools.product(tiles, (True, False), ("MHA", "GQA"))]
    cases_ += [(t, True, h, torch.bfloat16) for t in {(1, world), square} for h in ("GQA", "MQA")]
    for tile, causal, heads, dtype in cases_:
        h, g = cases.HEADS[heads]
        p = cases.Problem(world, h, g, causal, dtype)
        build = mesh_builder(tile, causal)
        records = run_case(p, build)
        assert_close(records, f"P={world} tile={tile} causal={causal} {heads} {dtype}")
        shape = AttentionShape(p.seq_local, p.batch, h, g, p.head_dim, 4)
        assert_plan_bytes(records, build(world, shape), p)


def test_mesh_variants_on_odd_tile():
    """Schedules, backward modes, contiguous groups, kernels and softmax scale on a 2x3 tile."""
    p = cases.Problem(6, 4, 2, True, torch.float32, seed=1)
    ref = cases._scaled_reference(p, 0.3)
    for schedule, backward_chunks, contiguous, kernel in itertools.product(
            ("greedy", "lockstep"), ("refetch", "keep"), ("q", "kv"), ("auto", "math")):
        build = mesh_builder((2, 3), True, schedule=schedule, backward_chunks=backward_chunks, contiguous=contiguous)
        records = run_case(p, build, kernel=kernel, softmax_scale=0.3, ref=ref)
        assert_close(records, f"{schedule} {backward_chunks} contiguous={contiguous} kernel={kernel}")


@pytest.mark.skipif(build_tasp_plan is None, reason="megatron_mesh.plan.tasp is not in this tree yet")
@pytest.mark.parametrize("world", [3, 4, 5, 6])
def test_tasp_matches_dense_reference(world):
    for causal, heads, dtype in [(True, "GQA", torch.float32), (False, "MHA", torch.float32),
                                 (True, "MQA", torch.bfloat16)]:
        h, g = cases.HEADS[heads]
        p = cases.Problem(world, h, g, causal, dtype)
        build = lambda w, shape: build_tasp_plan(w, shape, causal=causal)  # noqa: E731
        records = run_case(p, build)
        assert_close(records, f"TASP P={world} causal={causal} {heads} {dtype}")
        assert_plan_bytes(records, build(world, AttentionShape(p.seq_local, p.batch, h, g, p.head_dim, 4)), p)


@pytest.mark.skipif(build_tasp_plan is None, reason="megatron_mesh.plan.tasp is not in this tree yet")
def test_tasp_two_nodes_matches_dense_reference():
    """The hierarchical decomposition: 8 ranks as 2 nodes of 4."""
    p = cases.Problem(8, 4, 2, True, torch.float32)
    build = lambda w, shape: build_tasp_plan(w, shape, causal=True, gpus_per_node=4)  # noqa: E731
    records = run_case(p, build)
    assert_close(records, "TASP P=8 as 2 nodes x 4")
    assert_plan_bytes(records, build(8, AttentionShape(p.seq_local, p.batch, p.heads, p.kv_heads, p.head_dim, 4)), p)


# -- identical to gloo and to the public autograd path -----------------------------------------------
GLOO_CASES = [((1, 4), True, "GQA", torch.float32), ((4, 1), False, "MHA", torch.float32),
              ((1, 4), True, "MQA", torch.bfloat16), ((2, 2), True, "GQA", torch.float32),
              ((1, 4), False, "GQA", torch.bfloat16), ((2, 2), True, "MHA", torch.bfloat16)]


def gloo_outputs(rank: int, world: int) -> list:
    """(Runs in spawned gloo ranks.) out, dq, dk, dv of the public API for GLOO_CASES of this world."""
    results = []
    for tile, causal, heads, dtype in GLOO_CASES:
        if tile[0] * tile[1] != world:
            continue
        h, g = cases.HEADS[heads]
        p = cases.Problem(world, h, g, causal, dtype)
        *_, outputs = cases.run_local(rank, p, lambda q, k, v: mm.mesh_attention(q, k, v, tile=tile, causal=causal))
        results.append([t.detach().contiguous() for t in outputs])
    return results


def test_bitwise_equal_to_gloo_and_autograd():
    """Same inputs, same plan: the in-process transport gives bitwise the outputs and gradients
    of the gloo transport (public autograd API in spawned processes), and forward_backward gives
    bitwise what the public autograd API gives on the same virtual ranks."""
    world = 4  # one spawn: process start-up dominates
    gloo = spawn(gloo_outputs, world, timeout=300)
    mine = [c for c in GLOO_CASES if c[0][0] * c[0][1] == world]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the spawned ranks run with one thread: same kernels, same sums
    try:
        for i, (tile, causal, heads, dtype) in enumerate(mine):
            h, g = cases.HEADS[heads]
            p = cases.Problem(world, h, g, causal, dtype)
            ref = cases.dense_reference(p)
            records = run_case(p, mesh_builder(tile, causal), ref=ref)
            autograd = run_inprocess(lambda rank, comm: cases.run_local(
                rank, p, lambda q, k, v: mm.mesh_attention(q, k, v, tile=tile, causal=causal, comm=comm), ref)[3],
                world, timeout=120)
            for r in range(world):
                for name, a, b, c in zip(("out", "dq", "dk", "dv"), records[r]["outputs"], gloo[r][i], autograd[r]):
                    assert torch.equal(a, b), f"{tile} {heads} {dtype} rank {r} {name}: in-process != gloo"
                    assert torch.equal(a, c), f"{tile} {heads} {dtype} rank {r} {name}: driver != autograd"
    finally:
        torch.set_num_threads(threads)


def test_serial_mode_gives_the_same_results():
    p = cases.Problem(5, 4, 1, True, torch.float32)
    ref = cases.dense_reference(p)
    a = run_case(p, mesh_builder((1, 5), True), ref=ref)
    b = run_case(p, mesh_builder((1, 5), True), ref=ref, serial=True)
    for ra, rb in zip(a, b):
        assert all(torch.equal(x, y) for x, y in zip(ra["outputs"], rb["outputs"]))


def test_comm_counter_counts_a_backward_run_on_another_thread():
    """On CUDA, autograd runs backward on its own device thread; comm_counter() of the thread
    that ran the forward must still see the backward's bytes (here: backward on a new thread)."""
    p = cases.Problem(4, 4, 2, True, torch.float32)
    build = mesh_builder((2, 2), True)

    def rank_fn(rank, comm):
        q, k, v, do = (mm.zigzag_shard(x, rank, p.world).to(p.dtype) for x in cases.make_inputs(p))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        with mm.comm_counter() as c:
            out = mm.mesh_attention(q, k, v, tile=(2, 2), causal=True, comm=comm)
            errors = []
            worker = threading.Thread(target=lambda: _run_catching(errors, out.backward, do))
            worker.start()
            worker.join()
        assert not errors, errors
        return dict(bytes=(c.bytes_sent, c.bytes_received))

    records = run_inprocess(rank_fn, p.world, timeout=120)
    assert_plan_bytes(records, build(p.world, AttentionShape(p.seq_local, p.batch, p.heads, p.kv_heads,
                                                              p.head_dim, 4)), p)


def _run_catching(errors: list, fn, *args):
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 - reported by the caller
        errors.append(e)


# -- the mailbox ---------------------------------------------------------------------------------------
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

    with pytest.raises(InProcessError, match="deadlock"):
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

    with pytest.raises(InProcessError, match=r"message #0 from rank 0 to rank 1 does not match its receive"):
        run_inprocess(mismatch, 2, timeout=30)

    def unreceived(rank, comm):
        if rank == 0:
            comm.start([(1, torch.ones(1))], [])  # never waited, never received

    with pytest.raises(InProcessError, match=r"never matched: send #0 between ranks 0 and 1"):
        run_inprocess(unreceived, 2, timeout=30)


def test_plan_whose_peer_never_posts_fails_within_the_timeout():
    """Rank 1 runs a ring plan with its rounds removed: its peers wait for transfers it never
    posts (and it misses buffers): the run fails quickly instead of hanging."""
    p = cases.Problem(3, 4, 2, True, torch.float32)
    shape = AttentionShape(p.seq_local, p.batch, p.heads, p.kv_heads, p.head_dim, 4)
    good = build_mesh_plan(3, (1, 3), shape, causal=True)

    def rank_plan(r: int) -> RankPlan:
        rp = good.rank(r)
        if r != 1:
            return rp
        strip = lambda ops: tuple(op for op in ops if not isinstance(op, Post))  # noqa: E731
        return RankPlan(rp.rank, rp.seq_local, strip(rp.forward), strip(rp.backward), rp.forward_inputs,
                        rp.backward_inputs, rp.output, rp.grad_q, rp.grad_kv, rp.saved)

    broken = Plan("mesh", 3, p.seq_local, True, rank_plan, tile=(1, 3))
    t0 = time.monotonic()
    with pytest.raises(InProcessError, match="virtual rank 1"):
        run_case(p, broken)
    assert time.monotonic() - t0 < 10


def test_timed_mailbox_counts_every_copied_byte():
    p = cases.Problem(4, 4, 2, True, torch.float32)
    Q, K, V, dO = cases.make_inputs(p)
    box = Mailbox(4, timed=True)
    build = mesh_builder((2, 2), True)

    def fn(rank, comm):
        q, k, v, do = (mm.zigzag_shard(x, rank, 4).float() for x in (Q, K, V, dO))
        forward_backward(q, k, v, do, build, comm=comm)

    run_inprocess(fn, 4, mailbox=box)
    shape = AttentionShape(p.seq_local, p.batch, p.heads, p.kv_heads, p.head_dim, 4)
    assert box.copied_bytes == sum(r.received for r in plan_bytes(build(4, shape), shape))
    assert box.copy_seconds() > 0
    with pytest.raises(ValueError, match="must be a fresh Mailbox of 4 ranks, got an already used one"):
        run_inprocess(fn, 4, mailbox=box)
    with pytest.raises(ValueError, match="only by a Mailbox"):
        Mailbox(2).copy_seconds()


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        run_inprocess(lambda r, c: None, 0)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        run_inprocess(lambda r, c: None, 2, timeout=0)
    with pytest.raises(ValueError, match="streams=True needs a CUDA device"):
        run_inprocess(lambda r, c: None, 2, streams=True)
    with pytest.raises(ValueError, match="rank 3 out of range for a mailbox of 2 ranks"):
        InProcessCommunicator(Mailbox(2), 3)
    with pytest.raises(ValueError, match="cannot transfer with peer 0"):
        InProcessCommunicator(Mailbox(2), 0).start([(0, torch.ones(1))], [])
    q = torch.zeros(4, 1, 2, 8)
    with pytest.raises(ValueError, match="dout must be shaped like q"):
        forward_backward(q, q, q, q[:2], mesh_builder((1, 1), True), comm=InProcessCommunicator(Mailbox(1), 0))


# -- overlap readiness: the executor's buffer pool reaches a steady state ------------------------------
def _count_allocations(monkeypatch, world: int, tile, phase_counts):
    """Pool allocations (``_Buffers._new``) per virtual rank, phase and buffer kind."""
    orig = executor_module._Buffers._new
    lock = threading.Lock()
    calls = itertools.count()

    def counting_new(self, kind, tokens):
        with lock:
            if not hasattr(self, "_call_number"):  # one _Buffers per forward / backward call (ids get reused)
                self._call_number = next(calls)
            phase_counts[(self._call_number, kind)] += 1
        return orig(self, kind, tokens)

    monkeypatch.setattr(executor_module._Buffers, "_new", counting_new)
    p = cases.Problem(world, 4, 2, True, torch.float32)
    run_case(p, mesh_builder(tile, True))
    monkeypatch.undo()


def _per_rank_max(counts) -> dict:
    # allocations of one forward or backward call on one rank, per kind: the max over calls
    most: dict[str, int] = {}
    for (_call, kind), n in counts.items():
        most[kind] = max(most.get(kind, 0), n)
    return most


@pytest.mark.parametrize("orient", ["ring", "column"])
def test_buffer_pool_reaches_steady_state(monkeypatch, orient):
    """Ring (1xP) and column (Px1) plans allocate a fixed number of buffers per call however many
    rounds they run: every round after the first few reuses freed buffers (refetch mode)."""
    seen = {}
    for world in (4, 6, 8):
        counts = collections.Counter()
        _count_allocations(monkeypatch, world, (1, world) if orient == "ring" else (world, 1), counts)
        seen[world] = _per_rank_max(counts)
    assert seen[4] == seen[6] == seen[8], seen
    # kv / q: double buffering; dkv / dq: own accumulator + one in flight + incoming + current
    assert max(seen[8].values()) <= 4, seen[8]


# -- CUDA tier -------------------------------------------------------------------------------------------
GPU_DTYPES = [(torch.bfloat16, "auto"), (torch.float16, "auto"), (torch.float32, "torch-efficient")]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 3, 4, 6])
@pytest.mark.parametrize("dtype,kernel", GPU_DTYPES, ids=["bf16", "fp16", "fp32-efficient"])
def test_cuda_mesh_matches_dense_reference(world, dtype, kernel):
    """Every tile, causal/full, MHA/GQA on one GPU with CUDA kernels (head_dim 64, 64-token halves)."""
    for tile, causal, heads in itertools.product(tile_shapes(world), (True, False), ("MHA", "GQA")):
        h, g = cases.HEADS[heads]
        p = cases.Problem(world, h, g, causal, dtype, seq_local=128, head_dim=64)
        records = run_case(p, mesh_builder(tile, causal), device="cuda", kernel=kernel)
        assert_close(records, f"CUDA P={world} tile={tile} causal={causal} {heads} {dtype} {kernel}")
        shape = AttentionShape(p.seq_local, p.batch, h, g, p.head_dim, torch.tensor([], dtype=dtype).element_size())
        assert_plan_bytes(records, mesh_builder(tile, causal)(world, shape), p)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["torch-flash", "torch-efficient", "torch-cudnn"])
def test_cuda_each_op_on_streams_and_deterministic(kernel):
    """Each CUDA op through a 2x2 mesh, virtual ranks on their own streams (the mailbox's events
    order the copies), twice with bitwise equal results."""
    p = cases.Problem(4, 4, 2, True, torch.bfloat16, seq_local=256, head_dim=128)
    ref = cases.dense_reference(p)
    first = run_case(p, mesh_builder((2, 2), True), device="cuda", kernel=kernel, streams=True, ref=ref)
    second = run_case(p, mesh_builder((2, 2), True), device="cuda", kernel=kernel, streams=True, ref=ref)
    assert_close(first, f"{kernel} streams")
    for a, b in zip(first, second):
        assert all(torch.equal(x, y) for x, y in zip(a["outputs"], b["outputs"])), kernel


@pytest.mark.gpu
@pytest.mark.skipif(build_tasp_plan is None, reason="megatron_mesh.plan.tasp is not in this tree yet")
@pytest.mark.parametrize("world", [4, 5])
def test_cuda_tasp_matches_dense_reference(world):
    p = cases.Problem(world, 4, 2, True, torch.bfloat16, seq_local=128, head_dim=64)
    records = run_case(p, lambda w, shape: build_tasp_plan(w, shape, causal=True), device="cuda")
    assert_close(records, f"CUDA TASP P={world}")


@pytest.mark.gpu
def test_cuda_step_loop_has_no_host_sync():
    """torch's sync debug mode raises on any operation that synchronises the host with the GPU
    (``.item()``, device-to-host copies, ...): the executor's step loop and the kernels have none."""
    p = cases.Problem(4, 4, 2, True, torch.bfloat16, seq_local=128, head_dim=64)
    Q, K, V, dO = (x.to("cuda", torch.bfloat16) for x in cases.make_inputs(p))

    def fn(rank, comm):
        q, k, v, do = (mm.zigzag_shard(x, rank, 4) for x in (Q, K, V, dO))
        return forward_backward(q, k, v, do, mesh_builder((2, 2), True), comm=comm)[0].shape

    torch.cuda.set_sync_debug_mode("error")  # process-wide: covers every virtual rank's thread
    try:
        shapes = run_inprocess(fn, 4, device="cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert shapes == [torch.Size([128, 2, 4, 64])] * 4

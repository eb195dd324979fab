"""Rows one kernel call writes and nothing else go straight into the result in the inputs' dtype
(megatron_mesh/plan/single_writes.py, runtime/results.py): which rows they are, row by
row against a count of every write; that a bf16 run through them equals the fp32 path bit for bit
and the dense fp64 reference, at odd CP sizes, forward and backward; and that the simulator
prices them and the casts they save."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import megatron_mesh.runtime.results as results_module
from megatron_mesh.plan import resolve
from megatron_mesh.plan.ir import Attend, AttendBackward
from megatron_mesh.plan.mask import BlockKind, mask_pieces
from megatron_mesh.plan.single_writes import cast_rows, result_keys, single_writes

import cases
from test_inprocess_numerics import check, run_case


def _rows(plan, key_buf, sel) -> list[int]:
    segs = sel if sel is not None else ((0, plan.tokens(key_buf)),)
    return [r for a, b in segs for r in range(a, b)]


def _counted(plan, rank: int, direction: str, piece: int) -> dict:
    """{op index: {result: rows}} by counting, row by row, every write of every op (a kernel call of
    a block once per row it covers, any other write twice) and keeping the rows one call wrote."""
    ops = plan.rank(rank).ops(direction)
    results = set(result_keys(plan, rank, direction)) - set(plan.rank(rank).saved)
    results -= {k for op in ops for k in op.reads() if k not in op.writes()}
    count: dict = {}  # (key, row) -> [writes, op index]

    def write(key, row, n, i):
        c = count.setdefault((key, row), [0, i])
        c[0] += n

    for i, op in enumerate(ops):
        if type(op) in (Attend, AttendBackward):
            sides = [(op.out if type(op) is Attend else op.dq, _rows(plan, op.q, op.rows))]
            cols = []
            if type(op) is AttendBackward:
                for j, (dkv, kv) in enumerate(zip(op.dkv, op.kv)):
                    cols += [(dkv, r) for r in _rows(plan, kv, op.col(j))]
            if op.mask == BlockKind.MASKED:
                q_runs = tuple(plan.positions(op.q, op.rows))
                k_runs = tuple(r for j, k in enumerate(op.kv) for r in plan.positions(k, op.col(j)))
                calls = [(r, c) for _, r, c in mask_pieces(plan.mask, q_runs, k_runs, piece)]
            else:
                calls = [((0, len(sides[0][1])), (0, len(cols)))]
            for (r0, r1), (c0, c1) in calls:
                for r in sides[0][1][r0:r1]:
                    write(sides[0][0], r, 1, i)
                for key, r in (cols[c0:c1] if type(op) is AttendBackward else ()):
                    write(key, r, 1, i)
        else:
            for key in op.writes():
                into = getattr(op, "into", None)
                for r in _rows(plan, key, into if into is not None and not getattr(op, "heads", None) else None):
                    write(key, r, 2, -1)
    out: dict = {}
    for (key, row), (n, i) in count.items():
        if key in results and n == 1:
            out.setdefault(i, {}).setdefault(key, set()).add(row)
    return out


def _problems(world: int):
    """Documents (one over several ranks) on the zigzag and balanced layouts, causal and not, MHA /
    GQA / MQA, windows; the last: a document per zigzag chunk of 6 under a window of 3, whose own
    block runs as several calls (pieces of 4) that write some rows twice, nothing else touching them."""
    S = world * 12
    docs = (0, 3, 7, 13, S - 5, S)
    for heads, balanced, causal, window, cu in (("MHA", False, True, None, docs), ("GQA", True, True, None, docs),
                                                ("MQA", False, False, None, docs), ("GQA", True, True, (5, 0), docs),
                                                ("MHA", False, True, (3, 0), tuple(range(0, S + 1, 6)))):
        yield heads, cases.Problem(world, *cases.HEADS[heads], causal, torch.bfloat16, seq_local=12,
                                   cu_seqlens=cu, balanced=balanced, window=window)


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 7, 8])
def test_single_writes_are_the_rows_one_call_writes(world):
    """Every rank and direction of ring, TASP, Mesh and a Ulysses hybrid on documents (zigzag and
    balanced layouts, causal and not, a window): :func:`single_writes` equals a row-by-row count
    of every write at mask pieces of 4 and 512 tokens (a masked block's rows that two of its calls
    cover are left out), and :func:`cast_rows` is the rest of each such result. A hybrid's results
    are cast inside its plan: none."""
    found = 0
    for (heads, p), (mode, settings) in itertools.product(_problems(world), [("ring", {}), ("tasp", {}), ("mesh", {}),
                                                                          ("a2a+ring", {"ulysses_size": 2})]):
        if settings and (world % 2 or world < 4 or p.balanced):
            continue
        plan = resolve(mode, world, p.shape, **settings).build(p.shape, p.mask, p.layout)
        for rank, direction, piece in itertools.product(range(world), ("forward", "backward"), (4, 512)):
            got = single_writes(plan, rank, direction, piece)
            want = _counted(plan, rank, direction, piece)
            as_rows = {i: {k: {r for a, b in sel for r in range(a, b)} for k, sel in d.items()} for i, d in got.items()}
            assert as_rows == want, (mode, heads, rank, direction, piece)
            if settings:
                assert got == {}
            for key, rest in cast_rows(plan, rank, direction, piece).items():
                done = {r for d in as_rows.values() for r in d.get(key, ())}
                assert {r for a, b in rest for r in range(a, b)} == set(range(plan.tokens(key))) - done
            found += sum(len(rows) for d in as_rows.values() for rows in d.values())
    assert found > 0


def _no_single_writes(monkeypatch) -> None:
    monkeypatch.setattr(results_module, "single_writes", lambda *a: {})
    monkeypatch.setattr(results_module, "cast_rows", lambda *a: {})


@pytest.mark.parametrize("world", [3, 5, 6, 7])
def test_results_written_straight_match_the_reference_and_the_fp32_path(world, monkeypatch):
    """bf16, ring / TASP / Mesh on documents (zigzag and balanced, causal and not, a window,
    MHA / GQA / MQA; and with learnable attention sinks, also through the math kernel, whose results
    are fp32), mask pieces of 4 tokens: outputs and
    gradients (the sinks' too) within tolerance of the fp64 reference, bytes the plan's, and bitwise
    equal to the same run with every row accumulated in fp32 and cast at the end; some rank wrote
    rows straight into its results."""
    monkeypatch.setenv("MEGATRON_MESH_MASK_PIECE", "4")
    straight = 0
    made = []  # the results the runtime made in the inputs' dtype (it wrote rows straight into them)
    own = results_module._own_result
    monkeypatch.setattr(results_module, "_own_result", lambda bufs, key: made.append(key) or own(bufs, key))
    problems = [(heads, p, "auto") for heads, p in _problems(world)]
    sinks = dataclasses.replace(problems[0][1], kv_heads=2, sink=True)
    # (the math kernel returns fp32 results of bf16 inputs: a sink's scaling must not round twice)
    problems += [("GQA sinks", sinks, "auto"), ("GQA sinks", sinks, "math")]
    for (heads, p, kernel), mode in itertools.product(problems, ("ring", "tasp", "mesh")):
        plan = resolve(mode, world, p.shape).build(p.shape, p.mask, p.layout)
        straight += sum(bool(single_writes(plan, r, d, 4)) for r in range(world) for d in ("forward", "backward"))
        ref = cases.dense_reference(p)
        made.clear()
        got = run_case(p, plan, ref=ref, kernel=kernel, label=f"{mode} {heads} {kernel} P={world}")
        check(got)
        went = len(made)
        with monkeypatch.context() as m:
            _no_single_writes(m)
            fp32 = run_case(p, plan, ref=ref, kernel=kernel, label=f"{mode} {heads} {kernel} P={world} (fp32 path)")
        assert len(made) == went  # none made on the fp32 path
        # a rank with rows one call writes made its results in bf16 (forward and backward)
        assert went == sum(len(cast_rows(plan, r, d, 4)) for r in range(world) for d in ("forward", "backward"))
        for a, b in zip(got, fp32):
            for x, y in zip(a.outputs, b.outputs):
                assert x.dtype == y.dtype == torch.bfloat16 and torch.equal(x, y), (mode, heads)
    assert straight > 0


def test_the_simulator_prices_rows_written_straight():
    """Ring on documents on the balanced layout, bf16: a block's accumulator traffic drops by
    (4 - 2) bytes per element of each row it writes straight into the result (read in bf16, written
    in bf16, where a first write into fp32 wrote 4 bytes and the cast read them again), its lse
    unchanged; a rank's casts cover only its results' other rows."""
    import megatron_mesh.plan.costs as costs
    from megatron_mesh.plan import Topology
    from megatron_mesh.plan.costs import block_cost_parts, fresh_rows, result_casts

    p = next(pr for _, pr in _problems(4) if pr.balanced)
    plan = resolve("ring", 4, p.shape).build(p.shape, p.mask, p.layout)
    topo, sh = Topology.for_cp(4), p.shape
    priced = 0
    for rank, direction in itertools.product(range(4), ("forward", "backward")):
        single = single_writes(plan, rank, direction, topo.mask_piece)
        first = plan.first_writes(rank, direction)
        for i, op in enumerate(plan.rank(rank).ops(direction)):
            if i not in single:
                continue
            fresh = fresh_rows(op, first.get(i), single.get(i))
            assert fresh[2] <= fresh[0] and fresh[3] <= fresh[1] and fresh[2] + fresh[3] > 0
            straight = block_cost_parts(plan, op, sh, topo, fresh)[2]
            through_fp32 = block_cost_parts(plan, op, sh, topo, fresh[:2] + (0, 0))[2]
            h, g = plan.head_counts(op.q, sh.heads, sh.kv_heads)
            d, dv = sh.head_dim, sh.v_head_dim
            want = sh.batch * (h * fresh[2] * 2 * (dv if type(op) is Attend else d) + g * fresh[3] * 2 * (d + dv))
            assert (through_fp32 - straight) * topo.memory_bandwidth == pytest.approx(want), op
            priced += 1
        want = 0.0
        for key in result_keys(plan, rank, direction):
            done = sum(b - a for s in single.values() for a, b in s.get(key, ()))
            want += costs._cast_bytes(plan, key, costs._CAST_TO[key.kind], sh) * (1 - done / plan.tokens(key))
        assert result_casts(plan, rank, direction, sh, topo) * topo.memory_bandwidth == pytest.approx(want)
    assert priced > 0

"""The plan IR: keys and ops print as text and parse back, a whole plan's text is lossless (the
parsed plan validates, simulates, counts bytes, memory and work exactly like the original: dense,
masked, THD and hybrid plans), a plan's facts are typed per mode family (a family of one's own is
one class), a hand-written plan validates, every consumer of the op set handles every op type, and
the plan layer never imports torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

import megatron_mesh.plan.ir.ops as ops_module
from megatron_mesh.plan import (OP_TYPES, AttentionShape, Key, Mask, Plan, PlanError, ThdLayout, Topology, ZigzagLayout,
                                buffer_memory, build_mesh_plan, build_tasp_plan, parse_op, plan_bytes, rank_work,
                                layout_from_text, resolve, simulate, validate_plan)
from megatron_mesh.plan import Facts, MaskAwareFacts, MeshFacts, TaspFacts, UlyssesFacts
from megatron_mesh.plan.ir import facts as facts_module
from megatron_mesh.plan.ir.facts import register_facts
from megatron_mesh.plan.sel import Segment, relative_selection, sub_selection

SHAPE = AttentionShape(seq_local=4, batch=1, heads=4, kv_heads=2, head_dim=8, itemsize=2)


@pytest.mark.parametrize("text", ["kv3", "kv3.2", "q0*2/h1", "o1'", "dkv12*4.3/h0'", "do0/h7"])
def test_key_text_round_trip(text):
    assert str(Key.parse(text)) == text


def test_bad_key_text_names_the_text():
    with pytest.raises(ValueError, match=r"not a buffer key: 'x3'"):
        Key.parse("x3")


@pytest.mark.parametrize("text, message", [
    ("zigzag P=4 S=x", r"not a zigzag layout: 'P=4 S=x' \(e.g. 'zigzag P=4 S=16'\)"),
    ("zigzag P=4", r"not a zigzag layout: 'P=4'"),
    ("thd P=4 S=64", r"not a thd layout: 'P=4 S=64' \(e.g. 'thd P=2 cu=0,4,8 lens=3,4'\)"),
    ("thd P=2 cu=0,4,8", r"not a thd layout"),
    ("ring P=2", r"unknown layout 'ring' in 'ring P=2'; known: balanced, (.+, )?span, thd, zigzag"),  # and a test's own (test_layouts.py)
])
def test_bad_layout_text_names_the_text_and_an_example(text, message):
    """A layout line that does not parse is a ValueError quoting it and a well-formed example (it
    comes from plan text and from users' files: megatron-mesh-plan / compare_attention --layout-file)."""
    with pytest.raises(ValueError, match=message):
        layout_from_text(text)
    for layout in (ZigzagLayout(4, 16), ThdLayout(2, (0, 4, 8), (3, 4))):
        assert layout_from_text(layout.text()) == layout


def test_selection_helpers_compose():
    segs = (Segment(10, 14), Segment(20, 24))
    assert sub_selection(segs, (Segment(2, 6),)) == ((12, 14), (20, 22))
    assert relative_selection(((12, 14), (20, 22)), segs) == ((2, 6),)
    with pytest.raises(ValueError, match="not inside"):
        relative_selection(((5, 6),), segs)


DOCS = Mask.from_cu_seqlens([0, 5, 19, 32], 32, True, (6, 0))
SHAPE8 = AttentionShape(seq_local=8, batch=1, heads=4, kv_heads=2, head_dim=8, itemsize=2)
BUILDS = {
    "mesh 2x2": lambda: build_mesh_plan(4, (2, 2), SHAPE),
    "mesh 2x2 keep, full": lambda: build_mesh_plan(4, (2, 2), SHAPE, backward_chunks="keep", causal=False),
    "tasp P=3": lambda: build_tasp_plan(3, AttentionShape(seq_local=8)),
    "a2a+mesh U=2": lambda: resolve("a2a+mesh", 4, SHAPE, ulysses_size=2, tile=(1, 2)).build(SHAPE),
    "mesh 2x2, documents + window": lambda: resolve("mesh", 4, SHAPE8, tile="2x2").build(SHAPE8, DOCS),
    "tasp, documents + window": lambda: resolve("tasp", 4, SHAPE8).build(SHAPE8, DOCS),
    "ring, THD": lambda: resolve("ring", 2, SHAPE8).build(SHAPE8, layout=ThdLayout(2, (0, 4, 16), (3, 10))),
    "a2a+ring U=2, documents": lambda: resolve("a2a+ring", 4, SHAPE8, ulysses_size=2).build(SHAPE8, DOCS),
    "a2a+tasp U=2, THD": lambda: resolve("a2a+tasp", 4, SHAPE8, ulysses_size=2).build(
        SHAPE8, layout=ThdLayout(4, (0, 8, 32), (7, 20))),
}


def _shape_of(plan: Plan) -> AttentionShape:
    return SHAPE if plan.seq_local == SHAPE.seq_local and plan.facts.heads in (None, (4, 2)) else \
        AttentionShape(seq_local=plan.seq_local, heads=4, kv_heads=2, head_dim=8)


@pytest.mark.parametrize("name", BUILDS)
def test_plan_text_is_lossless(name):
    """from_text(to_text(p)) is p for every consumer: the same text, validation passes, the same
    simulated times and bytes (every rank), the same bytes, buffer memory and work per rank."""
    plan = BUILDS[name]()
    for rp in plan.ranks:
        for op in (*rp.forward, *rp.backward):
            assert parse_op(str(op)) == op, str(op)
    text = plan.to_text()
    again = Plan.from_text(text)
    assert again.to_text() == text
    validate_plan(again)
    shape = _shape_of(plan)
    topo = Topology(nodes=2, gpus_per_node=-(-plan.world_size // 2))
    assert simulate(again, shape, topo) == simulate(plan, shape, topo)
    assert plan_bytes(again, shape) == plan_bytes(plan, shape)
    assert buffer_memory(again, shape) == buffer_memory(plan, shape)
    for direction in ("forward", "backward"):
        assert rank_work(again, direction) == rank_work(plan, direction)
    for field in ("mode", "mask", "backward_chunks", "kernel_calls", "rings", "notes"):
        assert getattr(again, field) == getattr(plan, field), field
    assert type(again.facts) is type(plan.facts) and again.facts.header() == plan.facts.header()
    for fact in ("tile", "contiguous", "assignment", "direct", "last_round", "ranks_per_node", "ulysses", "heads",
                 "tile_placed"):
        assert getattr(again.facts, fact) == getattr(plan.facts, fact), fact
    assert again.layout.text() == plan.layout.text()
    assert (again.facts.inner is None) == (plan.facts.inner is None)
    if plan.facts.inner is not None:  # a hybrid's inner plan: its own typed facts
        assert again.facts.inner.facts == plan.facts.inner.facts


def test_the_op_docstring_example_is_the_builders_plan():
    """The op text example of megatron_mesh.plan.ir.ops (and docs/design.md) is rank 1 of the
    4-rank 2x2 Mesh forward, as the builder makes it."""
    doc = ops_module.__doc__.split("forward\n(the plan docs/design.md prints; tests/plan/test_plan_ir.py checks it against "
                                   "the builder)::\n\n")[1]
    example = [ln.strip() for ln in doc.split('"""')[0].strip().splitlines()]
    got = [ln.strip() for ln in build_mesh_plan(4, (2, 2), SHAPE).describe([1]).split("rank 1 backward")[0]
           .splitlines()[2:]]
    assert got == example
    design = open(__file__.replace("tests/plan/test_plan_ir.py", "docs/design.md")).read()
    assert "\n".join(example) in design


def test_plan_facts_are_typed_per_mode_family():
    """Each builder's plan carries its family's facts (typed values, Literal-checked when read
    back); a hybrid answers with its inner plan's placement; the facts module's example header is
    the 2x2 Mesh plan's."""
    docs = Mask.from_cu_seqlens([0, 5, 19, 32], 32, True)
    mesh = build_mesh_plan(4, (2, 2), SHAPE)
    masked = resolve("mesh", 4, SHAPE8, tile="2x2").build(SHAPE8, docs)
    hybrid = resolve("a2a+mesh", 4, SHAPE8, ulysses_size=2, tile=(2, 1)).build(SHAPE8, docs)
    tasp = build_tasp_plan(4, AttentionShape(seq_local=8), ranks_per_node=2)
    assert mesh.facts == MeshFacts((2, 2), "q", "greedy") and mesh.facts.tile_placed == (2, 2)
    assert tasp.facts == TaspFacts(2) and (tasp.facts.tile, tasp.facts.assignment) == (None, "rings")
    assert type(masked.facts) is MaskAwareFacts and masked.facts.direct and masked.facts.last_round is not None
    assert masked.facts.tile == (2, 2) and masked.facts.tile_placed in (None, (2, 2))
    assert type(hybrid.facts) is UlyssesFacts and (hybrid.facts.ulysses, hybrid.facts.heads) == (2, (4, 2))
    inner = hybrid.facts.inner.facts
    assert (hybrid.facts.tile, hybrid.facts.direct, hybrid.facts.last_round) == (inner.tile, True, None)
    example = " ".join(facts_module.__doc__.split("header of a dense 2x2 Mesh plan::")[1].split())
    assert mesh.header().endswith(example)


@pytest.mark.parametrize("header, message", [
    ("tile=1x2 schedule=greedy direct=yes", r"plan header direct=yes: a MeshFacts plan says direct=no"),
    ("tile=1x2 schedule=spiral", r"no plan facts family for 'spiral' \(the header's schedule; known: -, greedy, "),
    ("tile=1x2 contiguous=z", r"contiguous must be one of q, kv, got 'z'"),
    ("tile=1x2 kernel_calls=bulk", r"kernel_calls must be one of varlen, piece, block, got 'bulk'"),
    ("tile=1x2 schedule=greedy turns=3", r"plan header turns=3: a MeshFacts plan says no turns"),
    ("schedule=rings tile=1x2", r"plan header tile=1x2: a TaspFacts plan says tile=-"),
])
def test_a_header_its_family_would_not_print_is_refused(header, message):
    with pytest.raises(ValueError, match=message):
        Plan.from_text(HAND_WRITTEN.replace("plan mesh P=2 seq_local=4 tile=1x2", f"plan mesh P=2 seq_local=4 {header}"))


def test_a_facts_family_of_ones_own_is_one_class():
    """A family defined here alone (a fact no header key names: ``turns``) prints its keys, reads
    back to equal facts and the same text; a single rank's plan (rings without a ring) too."""

    @register_facts
    @dataclass(frozen=True)
    class SpiralFacts(Facts):
        schedules = ("toy-spiral",)
        assignment = "spiral"
        turns: int = 1

        def header(self):
            return {"schedule": "toy-spiral", "assignment": self.assignment, "turns": str(self.turns)}

        @classmethod
        def from_header(cls, head, inner):
            return cls(int(head["turns"]))

    plan = dataclasses.replace(build_mesh_plan(2, (1, 2), SHAPE), facts=SpiralFacts(3), _cache={})
    text = plan.to_text()
    assert " schedule=toy-spiral " in text and text.splitlines()[0].endswith("kernel_calls=varlen turns=3")
    again = Plan.from_text(text)
    assert again.facts == SpiralFacts(3) and again.to_text() == text
    single = build_tasp_plan(1, AttentionShape(seq_local=8))
    assert "\nring kv \n" in single.to_text() and Plan.from_text(single.to_text()).to_text() == single.to_text()


HAND_WRITTEN = """
# ring attention over 2 ranks, written by hand: rank 0 holds positions [0, 1, 6, 7], rank 1 [2..5]
plan mesh P=2 seq_local=4 tile=1x2
rank 0: output o0 grad_q dq0 grad_kv dkv0
  forward_input q0
  forward_input kv0
  backward_input q0
  backward_input kv0
  backward_input do0
  forward:
    post 1: send kv0->1 | recv kv1<-1
    attend q0 x kv0 causal -> o0
    wait 1
    attend q0[2:4] x kv1 full -> o0
  backward:
    post 1: send kv0->1 | recv kv1<-1
    attend_bwd q0 do0 x kv0 causal -> dq0 | dkv0
    wait 1
    attend_bwd q0[2:4] do0 x kv1 full -> dq0 | dkv1
    post 2: send dkv1->1 | recv dkv0'<-1
    wait 2
    add dkv0' -> dkv0
rank 1: output o1 grad_q dq1 grad_kv dkv1
  forward_input q1
  forward_input kv1
  backward_input q1
  backward_input kv1
  backward_input do1
  forward:
    post 1: send kv1->0 | recv kv0<-0
    attend q1 x kv1 causal -> o1
    wait 1
    attend q1 x kv0[0:2] full -> o1
  backward:
    post 1: send kv1->0 | recv kv0<-0
    attend_bwd q1 do1 x kv1 causal -> dq1 | dkv1
    wait 1
    attend_bwd q1 do1 x kv0[0:2] full -> dq1 | dkv0
    post 2: send dkv0->0 | recv dkv1'<-0
    wait 2
    add dkv1' -> dkv1
"""


def test_a_hand_written_plan_validates():
    plan = Plan.from_text(HAND_WRITTEN)
    validate_plan(plan)
    assert plan.rank(1).forward[3].cols == ((Segment(0, 2),),)


def test_a_hand_written_plan_with_a_wrong_block_is_rejected():
    bad = HAND_WRITTEN.replace("attend q1 x kv0[0:2] full -> o1", "attend q1 x kv0 full -> o1")
    with pytest.raises(PlanError, match=r"forward: query token 2: rank 1 computes keys \[6, 8\) in attend q1 x kv0 "
                                        r"full -> o1, but the mask allows \[0, 3\)"):
        validate_plan(Plan.from_text(bad))


def test_every_consumer_handles_every_op_type():
    """One handler per op type in the executor, the validator and the memory walk; and a plan that
    uses every op type validates, simulates and is priced (the simulator's costs cover them)."""
    import importlib

    memory, validate = (importlib.import_module(f"megatron_mesh.plan.{m}") for m in ("memory", "validate"))
    from megatron_mesh.runtime.executor import Executor

    ops = set(OP_TYPES.values())
    assert set(Executor.HANDLERS) == ops
    assert set(validate._DATAFLOW) == ops
    assert set(memory._WALK) == ops
    plan = resolve("a2a+mesh", 8, SHAPE8, ulysses_size=2, tile="2x2").build(SHAPE8)
    used = {type(op) for rp in plan.ranks for op in (*rp.forward, *rp.backward)}
    assert used == ops, ops - used
    validate_plan(plan)
    sim = simulate(plan, SHAPE8, Topology(nodes=1, gpus_per_node=8))
    assert sim.forward.time > 0 and sim.backward.time > 0 and sim.compute > 0


def test_unknown_op_text_names_the_allowed_ops():
    with pytest.raises(ValueError, match=r"unknown op 'jump'.*ops: post, wait, attend"):
        parse_op("jump 3")
    with pytest.raises(ValueError, match=r"block mask 'diag'.*not one of full, causal, masked"):
        parse_op("attend q1 x kv0 diag -> o1")


def test_first_writes_of_a_ring_plan_and_the_docstring_example():
    """``Plan.first_writes``: the rows of each accumulator a block writes before any other op --
    where the runtime copies instead of merging or adding, and the simulator prices a copy. Each
    row of an accumulator is written first at most once, by a block that writes it; a dense ring
    rank's first forward block writes all of its output, the others none."""
    from megatron_mesh.plan import Attend, AttendBackward, Free, Segment
    from megatron_mesh.plan.ir.writes import first_writes

    o1 = Key.parse("o1")
    ops = [Attend(Key.parse("q1"), (Key.parse("kv1"),), o1, None, None, "causal"),
           Attend(Key.parse("q1"), (Key.parse("kv0.5"),), o1, None, None, "full")]
    assert first_writes(ops, lambda key: 4) == {0: {o1: (Segment(0, 4),)}}
    assert first_writes([*ops[:1], Free(o1), ops[1]], lambda key: 4) == {0: {o1: ((0, 4),)}, 2: {o1: ((0, 4),)}}
    plan = build_mesh_plan(4, (1, 4), SHAPE, causal=True)
    for r in range(4):
        for direction in ("forward", "backward"):
            ops = plan.rank(r).ops(direction)
            first = plan.first_writes(r, direction)
            seen: dict = {}
            for i, writes in first.items():
                assert type(ops[i]) in (Attend, AttendBackward)
                for key, sel in writes.items():
                    assert key in ops[i].writes()
                    for a, b in sel:
                        assert all(x not in seen.setdefault(key, set()) for x in range(a, b))
                        seen[key].update(range(a, b))
            if direction == "forward":
                blocks = [i for i, op in enumerate(ops) if type(op) is Attend]
                out = ops[blocks[0]].out
                assert first[blocks[0]] == {out: ((0, plan.tokens(out)),)}, r
                assert all(out not in first.get(i, {}) for i in blocks[1:]), r


def test_creation_fills_the_docstring_examples_copies_and_every_plan():
    """``creation_fills``: which rows of an accumulator the runtime sets to their initial values
    when a block or copy creates it -- only those no block's first write or whole copy covers
    before anything reads it. The docstring's examples; a block naming one buffer for two column
    ranges writes both first; a copy of fewer tensors (a finished output into a partial one)
    covers nothing, head-slice copies cover the rows whose every head they write; a send reads
    what is covered so far, a block only its rows and columns.
    On real plans: the rows filled at creation and the rows blocks write first never overlap, and
    together they are the whole buffer wherever a block or whole copy created it."""
    from megatron_mesh.plan import Attend, AttendBackward, Copy, Free, Post, Segment, Transfer
    from megatron_mesh.plan.ir.writes import creation_fills, first_writes

    q1, kv1, o1 = Key.parse("q1"), Key.parse("kv1"), Key.parse("o1")
    four = lambda key: 4  # noqa: E731
    send = Post(3, (Transfer(0, o1),), ())
    whole = Attend(q1, (kv1,), o1, None, None, "causal")
    part = Attend(q1, (kv1,), o1, ((0, 2),), None, "causal")
    assert creation_fills([whole, send], four) == {0: {o1: ()}}
    assert creation_fills([part, send], four) == {0: {o1: (Segment(2, 4),)}}
    assert creation_fills([part, send, whole], four) == {0: {o1: (Segment(2, 4),)}}  # sent before [2, 4) was
    assert creation_fills([part, Free(o1), whole], four) == {0: {o1: (Segment(2, 4),)}, 2: {o1: ()}}
    assert creation_fills([whole], four, live=[o1]) == {}  # it exists: nothing creates it
    # one key/value buffer named for two column ranges: both are first writes
    dq1, dkv1, do1 = Key.parse("dq1"), Key.parse("dkv1"), Key.parse("do1")
    bwd = AttendBackward(q1, do1, (kv1, kv1), dq1, (dkv1, dkv1), None, (((0, 1),), ((2, 4),)), "full")
    assert first_writes([bwd], four)[0][dkv1] == (Segment(0, 1), Segment(2, 4))
    assert creation_fills([bwd], four)[0] == {dq1: (), dkv1: (Segment(1, 2),)}
    # copies: all heads of rows `into` cover them; a head slice, or fewer tensors, covers nothing
    y0, o0, o0h = Key.parse("y0"), Key.parse("o0"), Key.parse("o0/h1")
    counts = lambda key: {"y": 1, "o": 2}[key.kind]  # noqa: E731
    assert creation_fills([Copy(o0h, o1, None, ((0, 2),), None), Copy(o0h, o1, None, ((2, 4),), None)], four,
                          live=[o0h], tensor_counts=counts) == {0: {o1: ()}}
    assert creation_fills([Copy(o0h, o1, None, None, (0, 2))], four, live=[o0h], tensor_counts=counts) == \
        {0: {o1: (Segment(0, 4),)}}
    assert creation_fills([Copy(y0, o0, None, None, None)], four, live=[y0], tensor_counts=counts) == \
        {0: {o0: (Segment(0, 4),)}}
    # head slices that together write every head of rows [0, 4) (given the buffer's heads) cover them
    halves = [Copy(o0h, o1, None, None, (0, 2)), Copy(o0h, o1, None, ((0, 3),), (2, 4))]
    assert creation_fills(halves, four, live=[o0h], heads_of=lambda key: 4) == {0: {o1: (Segment(3, 4),)}}
    # a buffer assembled in rounds: a block reads only the rows in so far
    q2, q0a, q0b = Key.parse("q0*2"), Key.parse("q0.0"), Key.parse("q1.0")
    rounds = [Copy(q0a, q2, None, ((0, 2),)), Attend(q2, (kv1,), o1, ((0, 2),), None, "causal"),
              Copy(q0b, q2, None, ((2, 4),)), Attend(q2, (kv1,), o1, ((2, 4),), None, "causal")]
    assert creation_fills(rounds, four, live=[q0a, q0b, kv1]) == {0: {q2: ()}, 1: {o1: ()}}
    assert creation_fills(rounds[:2] + rounds[3:], four, live=[q0a, q0b, kv1])[0] == {q2: (Segment(2, 4),)}

    masked = Mask(True, (None, None), ((0, 3), (3, 9), (9, 16)))
    plans = [build_mesh_plan(4, (2, 2), SHAPE, causal=True),
             resolve("ring", 4, SHAPE).build(SHAPE, masked),
             resolve("a2a+ring", 4, SHAPE, ulysses_size=2).build(SHAPE, masked)]
    for plan in plans:
        for r in range(4):
            for direction in ("forward", "backward"):
                ops, first = plan.rank(r).ops(direction), plan.first_writes(r, direction)
                for i, fills in [*plan.creation_fills(r, direction).items(),
                                 *plan.creation_fills(r, direction, 4, 2).items()]:
                    assert type(ops[i]) in (Attend, AttendBackward, Copy)
                    for key, rows in fills.items():
                        written = set().union(*(range(a, b) for a, b in first.get(i, {}).get(key, ())))
                        filled = set().union(*(range(a, b) for a, b in rows))
                        assert not written & filled, (plan.notes, r, direction, i, key)
                        if type(ops[i]) is not Copy:
                            later = set().union(*(range(a, b) for j, w in first.items() if j > i
                                                  for a, b in w.get(key, ())))
                            assert written | filled | later >= set(range(plan.tokens(key))), (r, i, key)


def test_a_copied_first_write_costs_one_accumulator_pass_less_than_a_merge():
    """The simulator prices an accumulator's first write as a copy (read the result, write the
    accumulator), a merge or add as three passes (read and write the fp32 accumulator, read the
    result, which the kernel returns in bf16): the costs module's worked example."""
    from megatron_mesh.plan import Attend
    from megatron_mesh.plan.costs import block_cost_parts

    shape = AttentionShape(seq_local=4096, batch=1, heads=32, kv_heads=32, head_dim=128, itemsize=2)
    plan = build_mesh_plan(1, (1, 1), shape, causal=True)
    op = next(op for op in plan.rank(0).ops("forward") if type(op) is Attend)
    topo = Topology.for_cp(1)
    _, _, merged = block_cost_parts(plan, op, shape, topo)
    _, _, copied = block_cost_parts(plan, op, shape, topo, (4096, 0))
    assert merged == pytest.approx(32 * 4096 * (2 * 129 * 4 + 128 * 2 + 4) / topo.memory_bandwidth)
    assert copied == pytest.approx(32 * 4096 * (129 * 4 + 128 * 2 + 4) / topo.memory_bandwidth)
    assert merged * 1e3 == pytest.approx(0.0505, abs=5e-4) and copied * 1e3 == pytest.approx(0.0303, abs=5e-4)
    assert plan.first_writes(0, "forward")  # the one block writes the whole output first

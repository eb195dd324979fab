"""The plan IR: keys and ops print as text and parse back, a hand-written plan validates, every
consumer of the op set handles every op type, and the plan layer never imports torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_mesh.plan import (OP_TYPES, AttentionShape, Key, Plan, PlanError, build_mesh_plan, build_tasp_plan,
                                parse_op, resolve, validate_plan)
from megatron_mesh.plan.ir import Segment, relative_selection, sub_selection

SHAPE = AttentionShape(seq_local=4, batch=1, heads=4, kv_heads=2, head_dim=8, itemsize=2)


def test_plan_package_never_imports_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import megatron_mesh.plan as p, megatron_mesh.tools.planner, megatron_mesh.tools.plan_cli\n"
            "import pkgutil, importlib\n"
            "for m in pkgutil.walk_packages(p.__path__, 'megatron_mesh.plan.'):\n"
            "    importlib.import_module(m.name)\n"
            "assert 'torch' not in [k for k, v in sys.modules.items() if v is not None]\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("text", ["kv3", "kv3.2", "q0*2/h1", "o1<", "dkv12*4.3/h0<", "do0/h7"])
def test_key_text_round_trip(text):
    assert str(Key.parse(text)) == text


def test_bad_key_text_names_the_text():
    with pytest.raises(ValueError, match=r"not a buffer key: 'x3'"):
        Key.parse("x3")


def test_selection_helpers_compose():
    segs = (Segment(10, 14), Segment(20, 24))
    assert sub_selection(segs, (Segment(2, 6),)) == ((12, 14), (20, 22))
    assert relative_selection(((12, 14), (20, 22)), segs) == ((2, 6),)
    with pytest.raises(ValueError, match="not inside"):
        relative_selection(((5, 6),), segs)


@pytest.mark.parametrize("build", [
    lambda: build_mesh_plan(4, (2, 2), SHAPE),
    lambda: build_mesh_plan(4, (2, 2), SHAPE, backward_chunks="keep", causal=False),
    lambda: build_tasp_plan(3, AttentionShape(seq_local=8)),
    lambda: resolve("a2a+mesh", 4, SHAPE, ulysses_size=2, tile=(1, 2)).build(SHAPE),
])
def test_every_op_prints_and_parses_back(build):
    plan = build()
    for rp in plan.ranks:
        for op in (*rp.forward, *rp.backward):
            assert parse_op(str(op)) == op, str(op)
    text = plan.to_text()
    again = Plan.from_text(text)
    assert again.to_text() == text
    validate_plan(again)


HAND_WRITTEN = """
# ring attention over 2 ranks, written by hand: rank 0 holds positions [0, 1, 6, 7], rank 1 [2..5]
plan mesh P=2 seq_local=4 mask=causal tile=1x2 schedule=- heads_split=1
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
    post 2: send dkv1->1 | recv dkv0<<-1
    wait 2
    add dkv0< -> dkv0
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
    post 2: send dkv0->0 | recv dkv1<<-0
    wait 2
    add dkv1< -> dkv1
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
    import importlib

    memory, simulate, validate = (importlib.import_module(f"megatron_mesh.plan.{m}") for m in ("memory", "simulate", "validate"))
    from megatron_mesh.runtime.executor import Executor

    ops = set(OP_TYPES.values())
    assert set(Executor.HANDLERS) == ops
    assert set(validate._DATAFLOW) == ops
    assert set(memory._WALK) == ops
    assert set(simulate._COSTS) | set(simulate._NO_COMPUTE) == ops
    assert not set(simulate._COSTS) & set(simulate._NO_COMPUTE)


def test_unknown_op_text_names_the_allowed_ops():
    with pytest.raises(ValueError, match=r"unknown op 'jump'.*ops: post, wait, attend"):
        parse_op("jump 3")
    with pytest.raises(ValueError, match=r"block mask 'diag'.*not one of full, causal, masked"):
        parse_op("attend q1 x kv0 diag -> o1")

"""The validator catches broken plans, each with a message naming what is wrong."""

from __future__ import annotations

import dataclasses
import re

import pytest

from megatron_mesh.plan import (Attend, AttentionShape, Copy, Key, Mask, Plan, PlanError, Post,
                                Wait, build_mesh_plan, resolve, validate_plan)
from megatron_mesh.plan.ir import Segment

SHAPE = AttentionShape(seq_local=4, batch=1, heads=4, kv_heads=2, head_dim=8, itemsize=2)


def _tampered(plan: Plan, rank: int, direction: str, edit) -> Plan:
    rp = plan.rank(rank)
    ops = list(rp.ops(direction))
    edit(ops)
    new = dataclasses.replace(rp, **{direction: tuple(ops)})
    ranks = {r: (new if r == rank else plan.rank(r)) for r in range(plan.world_size)}
    return dataclasses.replace(plan, build_rank=ranks.__getitem__, build_rounds=None, _cache={})


def _index(ops, kind, nth: int = 0):
    return [i for i, op in enumerate(ops) if isinstance(op, kind)][nth]


def test_validator_catches_a_missing_block():
    """Really drop a block (rank 1's last forward Attend): its pairs are computed 0 times."""
    plan = build_mesh_plan(4, (2, 2), SHAPE)
    ops = plan.rank(1).forward
    last = max(i for i, op in enumerate(ops) if isinstance(op, Attend))
    assert isinstance(ops[last], Attend)
    bad = _tampered(plan, 1, "forward", lambda o: o.pop(last))
    with pytest.raises(PlanError, match=r"forward: query token \d+: keys \[\d+, \d+\) computed 0 times \(expected 1\)"):
        validate_plan(bad, dataflow=False)


def test_validator_catches_a_duplicated_block():
    plan = build_mesh_plan(4, (2, 2), SHAPE, causal=False)
    bad = _tampered(plan, 2, "forward", lambda ops: ops.insert(_index(ops, Attend), ops[_index(ops, Attend)]))
    with pytest.raises(PlanError, match=r"computed 2 times \(again by rank 2 in attend"):
        validate_plan(bad, dataflow=False)


def test_validator_catches_a_block_over_masked_pairs():
    plan = build_mesh_plan(2, (1, 2), SHAPE)  # rank 1 attends only the front half of chunk 0

    def widen(ops):
        i = _index(ops, Attend, 1)
        ops[i] = ops[i]._replace(cols=None)
    with pytest.raises(PlanError, match=r"computes keys \[6, 8\) in attend q1 x kv0 full -> o1, but the mask "
                                        r"allows \[0, 3\)"):
        validate_plan(_tampered(plan, 1, "forward", widen), dataflow=False)


def test_validator_catches_mismatched_transfers():
    plan = build_mesh_plan(4, (1, 4), SHAPE)

    def drop_recv(ops):
        i = _index(ops, Post)
        ops[i] = ops[i]._replace(recvs=())
    with pytest.raises(PlanError, match=r"forward round 1: rank 3 sends \['kv3'\] to rank 0, which receives \[\] "
                                        "from it"):
        validate_plan(_tampered(plan, 0, "forward", drop_recv), dataflow=False, cover=False)


def test_validator_catches_a_deadlock():
    """Rank 1 of a 3-rank ring posts and waits its round 2 before its round 1: every transfer
    still matches, but rank 1 waits for peers that wait for it."""
    plan = build_mesh_plan(3, (1, 3), SHAPE)

    def reorder(ops):
        rounds = [op for op in ops if isinstance(op, (Post, Wait))]
        ops[:] = [rounds[2], rounds[3], rounds[0], rounds[1]]  # post 2, wait 2, post 1, wait 1
    with pytest.raises(PlanError, match=r"forward deadlocks: ranks stuck at \{0: 'wait 1', 1: 'wait 2', 2: 'wait 1'\}"):
        validate_plan(_tampered(plan, 1, "forward", reorder), cover=False, dataflow=False)


def test_validator_catches_waiting_for_a_round_never_posted():
    plan = build_mesh_plan(2, (1, 2), SHAPE)

    def wait_before_post(ops):
        i, j = _index(ops, Post), _index(ops, Wait)
        ops.insert(i, ops.pop(j))
    with pytest.raises(PlanError, match=r"rank 0 forward: waits for round 1, which is not open"):
        validate_plan(_tampered(plan, 0, "forward", wait_before_post), cover=False)


def test_validator_catches_reading_before_arrival():
    plan = build_mesh_plan(2, (1, 2), SHAPE)

    def compute_early(ops):  # move the block on the received chunk before its Wait
        j = _index(ops, Wait)
        k = max(i for i, op in enumerate(ops) if isinstance(op, Attend))
        ops.insert(j, ops.pop(k))
    with pytest.raises(PlanError, match=r"rank 1 forward: attend q1 x kv0\[0:2\] full -> o1 reads kv0 while its "
                                        r"receive \(round 1\) is in flight"):
        validate_plan(_tampered(plan, 1, "forward", compute_early))


def test_validator_catches_a_selection_outside_its_buffer():
    plan = build_mesh_plan(2, (1, 2), SHAPE)

    def overrun(ops):
        i = _index(ops, Attend)
        ops[i] = ops[i]._replace(rows=(Segment(2, 6),))
    with pytest.raises(PlanError, match=r"row selection \[2:6\] is not disjoint ranges inside q0 \(4 tokens\)"):
        validate_plan(_tampered(plan, 0, "forward", overrun))

    def overlap(ops):  # rows read twice: in any order, ranges must not overlap
        i = _index(ops, Attend)
        ops[i] = ops[i]._replace(rows=(Segment(2, 4), Segment(0, 3)))
    with pytest.raises(PlanError, match=r"row selection \[2:4,0:3\] is not disjoint ranges inside q0"):
        validate_plan(_tampered(plan, 0, "forward", overlap))


def test_validator_catches_a_copy_onto_other_positions():
    shape = AttentionShape(seq_local=4, heads=2, kv_heads=2, head_dim=4)
    plan = resolve("a2a+ring", 4, shape, ulysses_size=2).build(shape)

    def swap(ops):
        i = _index(ops, Copy)
        ops[i] = ops[i]._replace(into=(Segment(2, 4), Segment(4, 6)))
    with pytest.raises(PlanError, match=r"copy q0/h1 -> q0\*2/h1\[2:4,4:6\] moves positions \[\(0, 2\), \(14, 2\)\] "
                                        r"\(start, length\) onto positions \[\(2, 2\), \(12, 2\)\]"):
        validate_plan(_tampered(plan, 1, "forward", swap))


def test_validator_catches_a_head_slice_on_the_wrong_heads():
    shape = AttentionShape(seq_local=4, heads=4, kv_heads=2, head_dim=4)
    plan = resolve("a2a+ring", 4, shape, ulysses_size=2).build(shape)

    def shift(ops):  # rank 1's own head slice (1) of its rows, copied straight into its output
        i = max(i for i, op in enumerate(ops) if isinstance(op, Copy) and op.src.heads == 1 and op.heads)
        ops[i] = ops[i]._replace(heads=(1, 3))
    with pytest.raises(PlanError, match=r"head slice 1 of q heads is heads \(2, 4\), not \(1, 3\)"):
        validate_plan(_tampered(plan, 1, "forward", shift))


def test_validator_catches_a_masked_block_computed_twice():
    plan = resolve("ring", 4, AttentionShape(seq_local=8)).build(AttentionShape(seq_local=8), Mask(True, (2, 0)))
    last = [op for op in plan.rank(1).ops("forward") if isinstance(op, Attend)][-1]
    assert last.mask == "masked"
    bad = _tampered(plan, 1, "forward", lambda o: o.append(last))
    with pytest.raises(PlanError, match=r"forward: query token \d+: keys \[\d+, \d+\) computed 2 times"):
        validate_plan(bad, dataflow=False)


def test_validator_rejects_receiving_into_an_existing_buffer():
    plan = build_mesh_plan(2, (1, 2), SHAPE)

    def clobber(ops):
        i = _index(ops, Post)
        ops[i] = ops[i]._replace(recvs=(ops[i].recvs[0]._replace(key=Key("kv", 0)),))
    with pytest.raises(PlanError, match=r"rank 0 forward: round 1 receives into kv0, which already exists"):
        validate_plan(_tampered(plan, 0, "forward", clobber), cover=False)


def test_validator_rejects_writing_into_an_input_or_a_saved_buffer():
    """An input buffer may be a view of the caller's tensor (one token range) and a saved one is
    what autograd keeps: an op writing either changes them (a hybrid of degree 1 once copied a
    rank's chunk onto itself, which bumped the caller's key's version and broke its backward)."""
    shape = AttentionShape(seq_local=4, heads=2, kv_heads=2, head_dim=4)
    plan = resolve("a2a+ring", 4, shape, ulysses_size=2).build(shape)

    def onto_itself(ops):
        ops.insert(0, Copy(Key("q", 1, heads=1), Key("q", 1, heads=1)))
    with pytest.raises(PlanError, match=r"rank 1 forward: copy q1/h1 -> q1/h1 writes q1/h1, an input or saved buffer"):
        validate_plan(_tampered(plan, 1, "forward", onto_itself), cover=False)
    saved = sorted(plan.rank(1).saved, key=str)[0]

    def into_saved(ops):
        ops.insert(0, Copy(saved, saved))
    with pytest.raises(PlanError, match=rf"rank 1 backward: copy {re.escape(str(saved))} -> .* writes .*an input or "
                                        r"saved buffer"):
        validate_plan(_tampered(plan, 1, "backward", into_saved), cover=False)


def test_validator_catches_an_all_to_all_round_a_member_posts_otherwise():
    """An all-to-all round (``Post.group``) is one collective: every member of its group posts it
    as one over that group, and it moves data with members only."""
    plan = resolve("a2a+ring", 4, SHAPE, ulysses_size=2).build(SHAPE)
    assert all(op.group == (0, 1) for op in plan.rank(0).ops("forward") if isinstance(op, Post) and op.group)

    def point_to_point(ops):
        i = _index(ops, Post)
        ops[i] = ops[i]._replace(group=())
    with pytest.raises(PlanError, match=r"forward round 1: rank 0 posts it as an all-to-all over ranks \(0, 1\), "
                                        "rank 1 as point-to-point"):
        validate_plan(_tampered(plan, 1, "forward", point_to_point), dataflow=False, cover=False)

    def outside(ops):
        i = _index(ops, Post)
        ops[i] = ops[i]._replace(group=(0, 2))
    with pytest.raises(PlanError, match=r"round 1 is an all-to-all over \(0, 2\) but moves data with ranks \[1\]"):
        validate_plan(_tampered(plan, 0, "forward", outside), cover=False)


def test_an_all_to_all_round_reads_back_from_its_text():
    post = Post.parse("post 2: send q0/h1->1 kv0/h1->1 | recv q1/h0<-1 kv1/h0<-1 | all-to-all 0,1")
    assert post.group == (0, 1) and Post.parse(str(post)) == post
    assert Post.parse("post 1: send kv1->3 | recv kv3<-3").group == ()
    for bad in ("x", "1,,2", "", "3"):
        with pytest.raises(ValueError, match=rf"an all-to-all names its group's ranks, e.g. '\| all-to-all 0,1', not "
                                             rf"'{re.escape(bad)}'"):
            Post.parse(f"post 1: send - | recv - | all-to-all {bad}")

"""Runs of the arena (:mod:`.arena`): the buffers the executor makes or moves together, one op per
tensor instead of one per buffer.

* **Input cuts** (:func:`cut_keys`, :func:`cut_groups`): which inputs are copied into the arena
  (several token ranges, or a head slice something other than a copy reads) and which of them are
  cut together -- one kind and head slice, and consecutive head slices of one kind with the same
  tokens (a Ulysses rank's sends to its peers: one gather per tensor, not one per peer).
* **Copy runs** (:class:`CopyRun`, :func:`copy_run_candidates`, :func:`copy_runs`): consecutive
  copies between a run of whole arena buffers and consecutive rows (or head slices) of one buffer,
  issued as one copy per tensor. The candidates are read off the ops alone (the host model,
  :mod:`.hostops`, counts them); the arena keeps those whose buffers do lie side by side.

Worked example (a Ulysses group of 4, rank 0, one round of a layout balanced for the groups): its
sends of q to ranks 1-3, ``q0.j/h1 q0.j/h2 q0.j/h3``, are one cut group of three head slices; the
three buffers it receives, ``q1.j/h0 q2.j/h0 q3.j/h0``, copied into consecutive rows of the
group's buffer, are one copy (:class:`CopyRun`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from .ir import KINDS, Copy, Free, Key, Plan, Post, RankPlan, op_keys

__all__ = ["CopyRun", "RUN_VIEWS", "copied_only", "cut_keys", "cut_groups", "copy_run_candidates", "rank_copy_runs",
           "copy_runs"]

# views per tensor the executor makes for a run of copies in a step, by way (the runs of the arena
# are views made once per arena): a range of one buffer one, a range of its head slices three (its
# rows, its heads, the heads split by buffer) -- what the host model counts (:mod:`.hostops`)
RUN_VIEWS = {"gather": 1, "scatter": 1, "heads": 3}


class CopyRun(NamedTuple):
    """Consecutive :class:`~.ir.Copy` ops (``ops``: their indices; only ``Free`` ops between) that
    move one run of memory into another, issued as one copy per tensor at the first of them.

    Either side is a run of whole arena buffers lying one after another (``src`` / ``dst``: each
    tensor's :class:`~.arena.TensorPlace` of the run) or consecutive rows of one buffer (``src_rows`` /
    ``dst_rows``: (first, stop), the buffer being the first op's). Worked example (a Ulysses
    group of 4, rank 0's round j): ``copy q1.j/h0 -> q0*4/h0[10:20]``, ``copy q2.j/h0 ->
    q0*4/h0[20:30]``, ``copy q3.j/h0 -> q0*4/h0[30:40]`` -- the three received buffers lie one
    after another in the round's block of the arena -- are one copy of that block into rows
    [10, 40) of the group's buffer: two views instead of six, one write queued instead of three.
    The return is the mirror: ``copy o0*4/h0[10:20] -> y1.j/h0``, ... into buffers the arena places
    together, which the all-to-all then sends as they lie. And the output
    assembled from the members' head slices, ``copy y0.j/h1 -> y0[rows]{h2:4}``, ``copy y0.j/h2
    -> y0[rows]{h4:6}``, ..., is one copy of their round's block into heads 2.. of those rows.
    """

    ops: tuple[int, ...]
    src: tuple | None
    src_rows: tuple[int, int] | None
    dst: tuple | None
    dst_rows: tuple[int, int] | None
    heads: tuple[int, int] | None = None  # copies of whole buffers into consecutive head slices of one


def copied_only(rank_plan: RankPlan, direction: str) -> frozenset:
    """The input buffers of ``direction`` that only :class:`Copy` ops read (a Ulysses group
    member's own head slice, copied into the group's tokens): cutting them as a contiguous
    copy first would move their bytes twice. A buffer that is sent or that a block reads
    stays contiguous (a send needs it; kernels read it many times)."""
    inputs = rank_plan.forward_inputs if direction == "forward" else rank_plan.backward_inputs
    ops = rank_plan.ops(direction)
    copied = {op.src for op in ops if type(op) is Copy}.intersection(inputs)
    if not copied:  # (most plans copy no input: no need to walk every op's keys)
        return frozenset()
    others = {key for op in ops if type(op) is not Copy for key in op_keys(op)}
    others |= {op.dst for op in ops if type(op) is Copy}  # a view must never be written into
    return frozenset(key for key in inputs if key in copied and key not in others)


def cut_keys(rank_plan: RankPlan, direction: str) -> list[Key]:
    """The inputs the executor copies: several token ranges, or one head slice that something
    other than a copy reads (:func:`copied_only`). Those the forward keeps for the backward are
    copied outside the arena (the backward takes its bytes over)."""
    inputs = rank_plan.forward_inputs if direction == "forward" else rank_plan.backward_inputs
    views = copied_only(rank_plan, direction)
    return [k for k, segs in inputs.items() if len(segs) > 1 or (k.heads >= 0 and k not in views)]


def cut_groups(plan: Plan, rank_plan: RankPlan, direction: str, heads: int, kv_heads: int, keep=(),
               order=None) -> list[tuple[tuple[Key, ...], int]]:
    """The input cuts the executor makes together, one copy or gather per tensor: (their keys in
    the arena's order, the head slices among them). A group is the cuts of one kind and head
    slice (``order``: their order in it, a sort key; default as the plan lists them), and
    consecutive head slices of one kind whose heads follow each other, with the same tokens in
    the same order, are one group laid out slice after slice (a Ulysses rank's sends of q, k
    and v: one gather per tensor, not one per peer). ``keep``: cuts made outside the arena.

    Worked example (U = 4, rank 1 of its group, q cut into two rounds' rows for each peer):
    q1.0/h0 q1.2/h0 | q1.0/h2 q1.2/h2 q1.0/h3 q1.2/h3 -- head slice 1 is its own (a view, not a
    cut), so slices 2 and 3 make one group of two slices and slice 0 one of its own."""
    inputs = rank_plan.forward_inputs if direction == "forward" else rank_plan.backward_inputs
    cut = [k for k in cut_keys(rank_plan, direction) if k not in keep]
    out: list[tuple[tuple[Key, ...], int]] = []
    for kind, h in dict.fromkeys((k.kind, k.heads) for k in cut):
        keys = [k for k in cut if (k.kind, k.heads) == (kind, h)]
        if order is not None:
            keys = sorted(keys, key=order)
        if out and _next_slice(plan, inputs, out[-1], keys, heads, kv_heads):
            out[-1] = (out[-1][0] + tuple(keys), out[-1][1] + 1)
        else:
            out.append((tuple(keys), 1))
    return out


def _next_slice(plan: Plan, inputs: dict, group: tuple, keys: list[Key], heads: int, kv_heads: int) -> bool:
    """Whether cuts ``keys`` (one kind and head slice) continue ``group`` as its next head slice."""
    have, slices = group
    n = len(have) // slices
    last = have[-n:]
    if len(keys) != n or keys[0].heads < 0 or keys[0].kind != last[0].kind or keys[0].heads != last[0].heads + 1:
        return False
    if any(k != x._replace(heads=k.heads) or inputs[k] != inputs[x] for k, x in zip(keys, last)):
        return False
    a, b = plan.head_range(last[0], heads, kv_heads), plan.head_range(keys[0], heads, kv_heads)
    if a is None or b is None:
        return False
    return a[1] == b[0] and a[1] - a[0] == b[1] - b[0]


def _one(sel) -> tuple[int, int] | None:
    """The one range of a selection (None where it has several)."""
    return (sel[0][0], sel[0][1]) if sel is not None and len(sel) == 1 else None


def _copied(op) -> int:
    """The tensors a copy moves (a cast to a finished kind keeps the leading ones)."""
    return min(len(KINDS[op.src.kind].tensors), len(KINDS[op.dst.kind].tensors))


def _way(op, came: dict, made: set) -> str | None:
    """How a copy may join a run (:func:`copy_run_candidates`): "gather" (a whole buffer that
    arrived in a round into one range of rows), "heads" (the same into head slices), "scatter"
    (one range of rows into a new whole buffer), or None. A row statistic (lse, delta: [B, H, T]
    in memory) of several buffers is no run: only token-major tensors join; a copy finishing an
    output (``o`` -> ``y``, its rows' sink added on the way) joins only a scatter, the one way
    :func:`~megatron_mesh.runtime.moves.MoveOps._copy_run` finishes rows in."""
    if any(not dim for _, dim, _ in KINDS[op.dst.kind].tensors[:_copied(op)]):
        return None
    finishing = op.src.kind == "o" and op.dst.kind == "y"  # its rows' sink is added as they go: runtime/moves.py
    if op.heads is not None:
        if finishing:
            return None
        return "heads" if op.rows is None and came.get(op.src) is not None and (op.into is None or _one(op.into)) \
            else None
    if op.rows is None and came.get(op.src) is not None and _one(op.into) is not None and not finishing:
        return "gather"
    if op.into is None and _one(op.rows) is not None and op.dst not in made:
        return "scatter"
    return None


def _joins(plan: Plan, way: str, prev, op, rounds: tuple) -> bool:
    """Whether copy ``op`` continues a run of ``way`` whose last copy is ``prev`` (``rounds``:
    the rounds their sources arrived in)."""
    if (op.src.kind, op.dst.kind) != (prev.src.kind, prev.dst.kind):
        return False
    if way == "gather":
        return op.dst == prev.dst and rounds[0] == rounds[1] and _one(prev.into)[1] == _one(op.into)[0]
    if way == "heads":
        return (op.dst == prev.dst and rounds[0] == rounds[1] and op.into == prev.into
                and prev.heads[1] == op.heads[0] and op.heads[1] - op.heads[0] == prev.heads[1] - prev.heads[0]
                and plan.tokens(op.src) == plan.tokens(prev.src))
    return op.src == prev.src and _one(prev.rows)[1] == _one(op.rows)[0]


def copy_run_candidates(plan: Plan, ops) -> list[tuple[str, list[int]]]:
    """Runs of consecutive copies (``Free`` ops between) that one copy per tensor can do, read off
    the ops alone: (way, op indices) -- whole buffers that arrived in one round (the arena puts
    them side by side, in the order they are first read) into consecutive rows or head slices
    of one buffer, or consecutive rows of one buffer into new buffers (the arena places them
    together). :func:`copy_runs` keeps the parts whose buffers do lie side by side; the host
    model (:mod:`.hostops`) counts these (``tests/plan/test_arena.py`` holds the two equal on
    the hybrids' plans)."""
    out: list[tuple[str, list[int]]] = []
    came: dict = {}  # buffer -> the Post it arrived with
    made: set = set()  # buffers an op of the direction made
    arrived: dict[int, int | None] = {}  # copy index -> the Post its source arrived with
    run: list[int] = []
    way = None

    def close():
        if len(run) > 1:
            out.append((way, list(run)))
        run.clear()

    for i, op in enumerate(ops):
        kind = type(op)
        if kind is Free:
            came.pop(op.key, None)
            continue
        k = _way(op, came, made) if kind is Copy else None
        if k is not None:
            arrived[i] = came.get(op.src)
        if not (run and k is not None and k == way and _joins(plan, way, ops[run[-1]], op, (arrived[run[-1]], arrived[i]))
                and (way != "scatter" or op.dst not in {ops[j].dst for j in run})):
            close()
            way = k
        if k is not None:
            run.append(i)
        if kind is Post:
            came.update((t.key, i) for t in op.recvs)
            made.update(t.key for t in op.recvs)
        else:
            made.update(op.writes())
    close()
    return out


def rank_copy_runs(plan: Plan, rank: int, direction: str) -> list[tuple[str, list[int]]]:
    """:func:`copy_run_candidates` of ``rank``'s ``direction``, made once per plan: the arena, the
    host model and the simulator all read them."""
    return plan.memo(("copy run candidates", rank, direction),
                     lambda: copy_run_candidates(plan, plan.rank(rank).ops(direction)))


def _follows(a: tuple, b: tuple, tensors: int) -> bool:
    """Whether the first ``tensors`` tensors of buffer ``b`` each start where ``a``'s end, in rows
    of one kind (None: a buffer outside the arena)."""
    return a is not None and b is not None and all(
        q.offset == p.offset + p.nbytes and (q.batch, q.heads, q.width, q.itemsize) ==
        (p.batch, p.heads, p.width, p.itemsize) for p, q in zip(a[:tensors], b[:tensors]))


def copy_runs(plan: Plan, ops, candidates, copies: dict[int, tuple]) -> dict[int, CopyRun]:
    """The :class:`CopyRun` of each op of a run: the parts of each candidate
    (:func:`copy_run_candidates`) whose arena buffers lie side by side (``copies``: each copy's
    source's and destination's places in the arena)."""
    out: dict[int, CopyRun] = {}
    for way, cand in candidates:
        side = 1 if way == "scatter" else 0
        parts = [[cand[0]]]
        for i in cand[1:]:
            prev = parts[-1][-1]
            if _follows(copies[prev][side], copies[i][side], _copied(ops[i])):
                parts[-1].append(i)
            else:
                parts.append([i])
        for run in parts:
            if len(run) < 2:
                continue
            first, last = ops[run[0]], ops[run[-1]]
            n = _copied(first)
            size = sum(plan.tokens(ops[j].dst if way == "scatter" else ops[j].src) for j in run)
            places = tuple(replace(p, tokens=size) for p in copies[run[0]][side][:n])
            if way == "scatter":
                got = CopyRun(tuple(run), None, (_one(first.rows)[0], _one(last.rows)[1]), places, None)
            elif way == "gather":
                got = CopyRun(tuple(run), places, None, None, (_one(first.into)[0], _one(last.into)[1]))
            else:
                got = CopyRun(tuple(run), places, None, None, _one(first.into), (first.heads[0], last.heads[1]))
            out.update((j, got) for j in run)
    return out

"""How many torch ops a rank's host issues for each op of its plan: the executor's per-op cost model.

On a GPU every torch op costs the host its Python and dispatch time (~23 us on the H200 of
docs/performance.md; a view, which launches nothing, ~3 us), whatever the device does; at a few
thousand tokens per rank that is the step's pace. The simulator (:mod:`.timeline`) gives each
rank a host that issues its ops in order at ``Topology.host_op_time`` per launch and
point-to-point call and ``Topology.host_view_time`` per view, the device waiting where the host is
behind -- with the counts this module reads off the plan, as the executor
(:mod:`megatron_mesh.runtime.executor`) issues them in a step after the plan's first:

* ``Attend``: per kernel call one op and one merge (or the copy of a first write), about two
  views each; its key/value pieces joined by one gather (two concatenations where k and v are
  not side by side; none where they follow each other in the arena); a new accumulator outside
  the arena (the rank's output) two allocations;
* ``AttendBackward``: per kernel call one op (two for a masked piece's) and about six views; the pieces as above; one op
  zeroing its new accumulators' unwritten rows; the rows' statistics once per ``do`` buffer (one
  op for a rank's own rows, a dozen for a stand-in output); its gradients go to the executor's
  queue, as do ``AddGrad`` and ``Copy``: the queue is issued in as few ``_foreach_*`` calls as its
  writes allow (:func:`write_calls`, the same grouping the runtime uses) where something reads
  what it writes and at the end of a direction;
* ``MergeOut``: one op per token range; ``RowStats``: about four per range;
* ``Post``: one host call per tensor it sends or receives (``transfers``: NCCL's point-to-point
  calls; no torch op, the buffers' views being made once);
* per direction, the inputs' and results' views and casts (a few ops).

Kernel calls are counted as the runtime makes them (:func:`~.mask.mask_pieces` with the device's
piece, grouped by :func:`~.mask.call_groups`): ``varlen=False`` counts a kernel without
variable-length calls (torch's CPU op: one call per piece), which is what
``scripts/count_host_ops.py`` counts on a CPU. ``tests/tools/test_scripts.py`` holds the model to
that count within :data:`TOLERANCE` on dense and masked plans of every mode.

Worked example (ring, P = 8, rank 3, one causal document): the forward's 8 blocks are 8 kernel
calls and 8 merges or copies (16 ops, ~20 views) plus the output's 2 allocations; the backward's
8 kernel calls, 3 zero fills, the own rows' lse (1), the gradients' queue issued as 15
``_foreach_*`` calls, 2 allocations: about 48 ops and ~80 views per layer -- 124 before this
model's executor (issue 52).
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

from .arena_runs import RUN_VIEWS, cut_groups, cut_keys, rank_copy_runs
from .ir import KINDS, AddGrad, Attend, AttendBackward, Copy, Free, MergeOut, Plan, Post, RowStats, Wait, op_keys
from .costs import masked_block
from .mask import MASK_PIECE, BlockKind
from .sel import minus_intervals, sel_len
from .single_writes import cast_rows, single_writes

__all__ = ["HostOps", "host_ops", "step_host_ops", "write_calls", "wire_tensors", "wire_copies", "side_by_side",
           "TOLERANCE"]

TOLERANCE = 0.25  # the model's ops per rank and direction against count_host_ops.py's (tests/tools/test_scripts.py)

# views per kernel call, per block of a direction (measured on the CPU: their Python is the same on a GPU)
_ATTEND_VIEWS, _BACKWARD_VIEWS = 2.5, 6
_PIECE_VIEWS = 5  # per key/value piece of a backward block whose pieces are parts of their buffers
_PIECED = 5  # more views per kernel call of a masked block: each call's rows and columns cut from it
_STAND_IN = 12  # ops of a stand-in output for rows computed for another rank (kernels/torch_sdpa.py)
_FIXED = {"forward": (1, 4), "backward": (2, 7)}  # per direction: (launches, views) of inputs and results


class HostOps(NamedTuple):
    """Torch ops of one plan op on the host: ``launches`` (ops that run on the device; on a CPU the
    non-view ops), ``views`` (views made, no device work) and ``transfers`` (the transport's calls:
    one point-to-point call per tensor a round sends or receives; an all-to-all round's collective
    call, the pack of its sends and the unpack of its receives), ``wire_views`` (the transport's
    views: an all-to-all round's receive buffer split into its tensors)."""

    launches: float
    views: float
    transfers: int
    wire_views: float = 0.0

    @property
    def total(self) -> float:
        return self.launches + self.views + self.transfers + self.wire_views

    def seconds(self, op_time: float, view_time: float) -> float:
        """The host's time issuing them: ``op_time`` per launch and per transport call,
        ``view_time`` per view (``Topology.host_op_time``, ``host_view_time``)."""
        return (self.launches + self.transfers) * op_time + (self.views + self.wire_views) * view_time


def wire_tensors(transfers) -> int:
    """The tensors ``transfers`` move (a kv buffer: k and v)."""
    return sum(len(KINDS[t.key.kind].tensors) for t in transfers)


def side_by_side(plan: Plan, rank: int, direction: str, heads: tuple[int, int] | None = None) -> frozenset:
    """:func:`_side_by_side` of ``rank``'s ``direction``, made once per plan (the host model and
    the simulator read it)."""
    return plan.memo(("side by side", rank, direction, heads), lambda: _side_by_side(plan, rank, direction, heads))


def _side_by_side(plan: Plan, rank: int, direction: str, heads: tuple[int, int] | None) -> frozenset:
    """The buffers (tuples of keys, in order) the arena places one after another, one tensor each
    (:mod:`.arena`): the destinations of a run of copies (:func:`~.arena_runs.copy_run_candidates`) of a
    one-tensor kind -- a Ulysses group's output rows going home, placed together in the run's
    order -- the receives of a round of one one-tensor kind that are first read in the order
    they arrive -- its output coming home into its head slices (a round's receives are placed
    together, by kind, in the order ops first read them) -- and, given the ``heads`` the slices
    are cut from, a group of input cuts
    (:func:`~.arena_runs.cut_groups`) of one buffer per head slice: dout going out to the peers."""
    rank_plan = plan.rank(rank)
    ops = rank_plan.ops(direction)
    out = set()
    for way, run in rank_copy_runs(plan, rank, direction):
        op = ops[run[0]]
        if way == "scatter" and len(KINDS[op.dst.kind].tensors) == 1:
            out.add(tuple(ops[i].dst for i in run))
    if heads is not None:  # a group of input cuts, one buffer per head slice
        keep = set(rank_plan.saved) if direction == "forward" else set()
        for keys, slices in cut_groups(plan, rank_plan, direction, heads[0], heads[1], keep):
            if slices == len(keys) > 1 and len(KINDS[keys[0].kind].tensors) == 1:
                out.add(keys)
    for i, op in enumerate(ops):
        if type(op) is not Post or not op.group or len(op.recvs) < 2:
            continue
        keys = tuple(t.key for t in op.recvs)
        if len({k.kind for k in keys}) > 1 or len(KINDS[keys[0].kind].tensors) > 1:
            continue
        first = {}  # each buffer's first read (a send aside) after it arrived
        for j in range(i + 1, len(ops)):
            if type(ops[j]) is not Post:
                for key in ops[j].reads():
                    if key in keys:
                        first.setdefault(key, j)
            if len(first) == len(keys):
                break
        reads = [first.get(k, len(ops)) for k in keys]
        if reads == sorted(reads):
            out.add(keys)
    return frozenset(out)


def wire_copies(op: Post, runs: frozenset) -> tuple[bool, bool]:
    """Whether an all-to-all round's transport packs its sends and unpacks its receives
    (:func:`~megatron_mesh.comm.torch_dist.all_to_all_round`): not where one tensor is all of
    them, nor where they lie side by side in the order they go (``runs``: :func:`side_by_side`)."""
    return tuple(wire_tensors(ts) > 1 and tuple(t.key for t in ts) not in runs for ts in (op.sends, op.recvs))


def _collective(op: Post, launches: float, runs: frozenset = frozenset()) -> HostOps:
    """An all-to-all round (``Post.group``) as :func:`~megatron_mesh.comm.torch_dist.all_to_all_round`
    issues it: one ``all_to_all_single``, its sends packed by one ``cat`` (none where one tensor
    is all), its receives into a buffer made for them and split (a view) and copied out by one
    ``_foreach_copy_`` (none where one tensor is all); the tensors' byte views are made once per
    buffer, not per step. Worked example: U = 4, a rank's forward q/kv round sends q, k and v to 3
    peers and receives as many: 4 calls (the collective, the cat, the buffer, the copy) and one
    view, where the point-to-point round was 12 calls (a call per q or kv buffer); at U = 8, 4
    calls against 28."""
    pack, unpack = wire_copies(op, runs)
    return HostOps(launches, 0.0, 1 + pack + 2 * unpack, float(unpack))


_NOTHING = HostOps(0.0, 0.0, 0)  # an op that issues nothing (a Wait, a Free)


def write_calls(writes) -> list[list[int]]:
    """The executor's grouping of queued writes into ``_foreach_*`` calls: ``writes`` as
    (kind, where) pairs -- kind: whether it adds, and what it writes into (a copy into a result in
    the inputs' dtype is a call of its own kind: one ``_foreach_copy_`` writes one dtype, see
    :mod:`~megatron_mesh.runtime.results`); where: (buffer, tensor, first row, stop row, first head,
    stop head), or a list of them for a write over several buffers' memory --
    each in the first call of its kind after every call holding a write into its rows, or the
    same read backwards (each write in the *last* such call), whichever needs fewer calls.
    Returns the writes' indices per call, in issue order (a call keeps its writes' order)."""
    forward = _calls(list(enumerate(writes)))
    backward = [c[::-1] for c in _calls(list(enumerate(writes))[::-1])[::-1]]
    return min(forward, backward, key=len)


def _overlap(a: tuple, b: tuple) -> bool:
    """Whether two writes' (buffer, tensor, first row, stop row, first head, stop head) share memory."""
    return a[:2] == b[:2] and a[2] < b[3] and b[2] < a[3] and a[4] < b[5] and b[4] < a[5]


def _calls(writes) -> list[list[int]]:
    calls: list[list[int]] = []
    by_mode: dict = {}  # the calls of each kind, in order
    # (buffer, tensor) -> [(call, first row, stop row, first head, stop head)]: only writes into one
    # tensor can share rows (the overlap test inlined: the simulator walks millions of writes)
    placed: dict = {}
    for i, (kind, where) in writes:
        wheres = where if isinstance(where, list) else [where]  # a write over several buffers: all of them
        after = -1  # the last call holding a write into its rows
        for x in wheres:
            _, _, a, b, h0, h1 = x
            for j, c, d, g0, g1 in placed.get(x[:2], ()):
                if j > after and a < d and c < b and h0 < g1 and g0 < h1:
                    after = j
        mine = by_mode.setdefault(kind, [])
        k = bisect.bisect_right(mine, after)
        if k < len(mine):
            j = mine[k]
        else:
            j = len(calls)
            calls.append([])
            mine.append(j)
        calls[j].append(i)
        for x in wheres:
            placed.setdefault(x[:2], []).append((j, *x[2:]))
    return calls


class _Queue:
    """The executor's queue of copies and adds, by keys and rows only (its calls counted)."""

    def __init__(self):
        self.writes: list = []
        self.written: set = set()
        self.read: set = set()
        self.calls = 0

    def put(self, add: bool, key, rows, src=None) -> None:
        if (src is not None and src in self.written) or key in self.read:
            self.flush()
        for a, b in rows:
            self.writes.append((add, (key, 0, a, b, 0, 1)))
        self.written.add(key)
        if src is not None:
            self.read.add(src)

    def touches(self, keys) -> bool:
        return bool(self.writes) and not (self.written.isdisjoint(keys) and self.read.isdisjoint(keys))

    def flush(self) -> int:
        n = len(write_calls(self.writes)) if self.writes else 0
        self.writes, self.written, self.read = [], set(), set()
        return n


def _calls_of(plan: Plan, op, piece: int, varlen: bool) -> int:
    """A block's kernel calls: the simulator's count (:func:`~.costs.masked_block`, cached per
    mask and positions: a polished plan's trials walk the same blocks again)."""
    if op.mask != BlockKind.MASKED:
        return 1
    return masked_block(plan.mask, plan.positions(op.q, op.rows),
                        tuple(r for i, k in enumerate(op.kv) for r in plan.positions(k, op.col(i))), piece,
                        plan.kernel_calls if varlen else "piece")[1]


def host_ops(plan: Plan, rank: int, direction: str, *, varlen: bool = True, piece: int | None = None,
             heads: tuple[int, int] | None = None, narrow: bool = False) -> tuple[tuple[HostOps, ...], HostOps]:
    """The host ops of each op of ``rank``'s ``direction`` (in op order) and those issued around
    them (inputs, results, the queue's last calls). ``heads``: (query, key/value heads), for the
    copies of head slices that together fill a buffer (no fill then); ``narrow``: inputs narrower
    than the fp32 accumulators, whose results some rows are written into straight
    (:func:`~.single_writes.cast_rows`: the rest is cast in as one op of two views per range and tensor,
    where a plain cast of the whole accumulator took one)."""
    walk = _Walk(plan, rank, direction, MASK_PIECE["cuda"] if piece is None else piece, varlen, heads, narrow)
    out = tuple(walk.op(i, op) for i, op in enumerate(walk.ops))
    fixed_l, fixed_v = _FIXED[direction]
    cut_l, cut_v = _input_cuts(plan, rank, direction, heads)
    rest_v = 0
    if narrow:
        for key, rest in cast_rows(plan, rank, direction, walk.piece).items():
            rest_v += 2 * len(rest) * sum(1 for _, dim, _ in KINDS[key.kind].tensors if dim)
    return out, HostOps(fixed_l + cut_l + walk.queue.flush(), fixed_v + cut_v + rest_v, 0)


def _input_cuts(plan: Plan, rank: int, direction: str, heads: tuple[int, int] | None) -> tuple[float, float]:
    """(launches, views) of a direction's input cuts as :mod:`megatron_mesh.runtime.cuts` makes
    them: per group of cuts (:func:`~.arena_runs.cut_groups`) and tensor one copy or gather, the group's
    heads narrowed, the source seen token-major (and split by head slice where it holds several),
    one range cut by a slice (a row statistic: a copy per buffer); every other input a view (its
    head slice, its range); those the forward keeps for the backward copied outside the arena
    (an allocation, a copy per tensor, a concatenation per tensor of several ranges).
    ``heads``: (query, key/value heads), where head slices may be one group (None: the plan's)."""
    rp = plan.rank(rank)
    forward = direction == "forward"
    inputs = rp.forward_inputs if forward else rp.backward_inputs
    keep = set(rp.saved) if forward else set()
    heads = heads or getattr(plan.facts, "heads", None) or (0, 0)
    groups = cut_groups(plan, rp, direction, heads[0], heads[1], keep) if heads[0] else \
        [((k,), 1) for k in cut_keys(rp, direction) if k not in keep]
    launches = views = 0.0
    grouped = set()
    for keys, slices in groups:
        grouped.update(keys)
        sliced = keys[0].heads >= 0
        one = sum(len(inputs[k]) for k in keys[:len(keys) // slices]) == 1
        for _, dim, _ in KINDS[keys[0].kind].tensors:
            if dim:
                launches += 1
                views += sliced + 1 + (slices > 1) + one
            else:
                launches += len(keys)
                views += len(keys) * (sliced + 1)
    for key, segs in inputs.items():
        if key in grouped:
            continue
        tensors = len(KINDS[key.kind].tensors)
        whole = len(segs) == 1 and segs[0][0] == 0 and segs[0][1] == plan.tokens(key)
        views += tensors * ((key.heads >= 0) + (len(segs) == 1 and not whole) + (len(segs) > 1) * len(segs))
        if key in keep and (len(segs) > 1 or key.heads >= 0):  # kept for the backward: copied for the call
            launches += 2 + tensors * (len(segs) > 1)
            views += 3 * tensors
    return launches, views


class _Walk:
    """One rank's direction walked as the executor runs it (what :func:`host_ops` counts)."""

    def __init__(self, plan: Plan, rank: int, direction: str, piece: int, varlen: bool, heads, narrow: bool = False):
        rp = self.rp = plan.rank(rank)
        self.plan, self.piece, self.varlen = plan, piece, varlen
        self.ops = rp.ops(direction)
        self.first = plan.first_writes(rank, direction)
        self.fills = plan.creation_fills(rank, direction, *(heads or (None, None)))
        self.own = {rp.output} if direction == "forward" else {rp.grad_q, rp.grad_kv}
        self.singles = single_writes(plan, rank, direction, piece) if narrow else {}  # (runtime/results.py)
        self.live = set(rp.forward_inputs if direction == "forward" else (*rp.backward_inputs, *rp.saved))
        self.own_rows = set(rp.backward_inputs) | {op.dst for op in self.ops if type(op) is RowStats}
        self.made_rows: set = set()
        self.came: dict = {k: -1 for k in cut_keys(rp, direction)}  # buffer -> the Post it came with (-1: a cut)
        self.queue = _Queue()
        # copies issued as one per tensor (arena_runs.CopyRun): op index -> (first op, views per tensor)
        copies = any(type(op) is Copy for op in self.ops)
        self.runs = {i: (run[0], RUN_VIEWS[way]) for way, run in rank_copy_runs(plan, rank, direction)
                     for i in run} if copies else {}
        self.side_by_side = side_by_side(plan, rank, direction, heads or getattr(plan.facts, "heads", None)) \
            if copies else frozenset()

    def op(self, i: int, op) -> HostOps:
        kind = type(op)
        if kind is Wait:  # (a third of a plan's ops: nothing issued, nothing written)
            return _NOTHING
        if kind is Free:
            self.live.discard(op.key)
            self.came.pop(op.key, None)
            return _NOTHING
        launches = 0.0
        if kind is not AddGrad and kind is not Copy and self.queue.writes and \
                self.queue.touches(op.reads() if kind is AttendBackward else op_keys(op)):
            launches += self.queue.flush()
        if kind is not Post:
            new = [k for k in dict.fromkeys(op.writes()) if k not in self.live]
            if new:
                self.live.update(new)
                launches += sum((2 if k.kind == "o" else 1) for k in new if k in self.own)  # own allocations (an output: two)
        else:
            self.live.update(t.key for t in op.recvs)
            self.came.update((t.key, i) for t in op.recvs)
            if op.group:
                return _collective(op, launches, self.side_by_side)
            return HostOps(launches, 0.0, len(op.sends) + len(op.recvs))
        if kind is Attend:
            calls = _calls_of(self.plan, op, self.piece, self.varlen)
            launches += 2 * calls + _join(op, self.came) + _fills(self.fills.get(i, {}))
            return HostOps(launches, (_ATTEND_VIEWS + _PIECED * (op.mask == BlockKind.MASKED)) * calls, 0)
        elif kind is AttendBackward:
            got = self.backward_block(i, op)
            return HostOps(launches + got.launches, got.views, 0)
        elif kind in (AddGrad, Copy):
            return HostOps(launches + (_fills(self.fills.get(i, {})) if kind is Copy else 0), self.queued(i, op), 0)
        elif kind is MergeOut:
            launches += len(_rows(op.into, self.plan.tokens(op.dst)))
        elif kind is RowStats:
            launches += 2 * len(_rows(op.rows, self.plan.tokens(op.dst))) + 1
        return HostOps(launches, 0.0, 0)

    def backward_block(self, i: int, op) -> HostOps:
        plan = self.plan
        calls = _calls_of(plan, op, self.piece, self.varlen)
        launches = calls * (1 + (op.mask == BlockKind.MASKED)) + _join(op, self.came) + \
            (1 if any(self.fills.get(i, {}).values()) else 0)
        if op.do not in self.made_rows:
            self.made_rows.add(op.do)
            launches += 1 if op.do in self.own_rows else _STAND_IN
        views = (_BACKWARD_VIEWS + _PIECED * (op.mask == BlockKind.MASKED)) * calls
        pieces = sum(len(op.col(j)) if op.col(j) is not None else 1 for j in range(len(op.kv)))
        if pieces > 1 and any(op.col(j) is not None for j in range(len(op.kv))):
            views += _PIECE_VIEWS * pieces  # each piece's gradients cut into its buffer's columns
        fresh, single = self.first.get(i, {}), self.singles.get(i, {})
        for key, sel in ((op.dq, op.rows), *((key, op.col(j)) for j, key in enumerate(op.dkv))):
            rows = _rows(sel, plan.tokens(key))
            if single.get(key):  # rows written straight into the result: a call of their own kind
                self.queue.put("result", key, single[key])
                rows = minus_intervals(rows, single[key])
            if rows:
                self.queue.put(_add(fresh, key, sel, plan.tokens(key)), key, rows)
        return HostOps(launches, views, 0)

    def queued(self, i: int, op) -> float:
        """An AddGrad's or Copy's writes into the queue; their views (a run of copies: its views
        at its first op, the arena's runs being views made once)."""
        kind = type(op)
        rows = _rows(op.into, self.plan.tokens(op.dst))
        self.queue.put(kind is AddGrad, op.dst, rows, op.src)
        tensors = min(len(KINDS[op.src.kind].tensors), len(KINDS[op.dst.kind].tensors))
        run = self.runs.get(i)
        if run is not None:
            return tensors * run[1] if run[0] == i else 0.0
        ranges = max(len(rows), len(op.rows) if kind is Copy and op.rows is not None else 1)
        cut = ranges > 1 or rows != ((0, self.plan.tokens(op.dst)),)  # a whole buffer is its own view
        return tensors * (2 * ranges * cut + (op.heads is not None))


def _join(op, came: dict) -> int:
    """Launches joining a block's key/value pieces (the arena's layout, :mod:`.arena`, in short):
    none for one piece, or for whole buffers that arrived in one round (they lie one after
    another); one gather (k and v together) for parts of such buffers; else a concatenation of
    k and of v. ``came``: the round (Post index) each buffer arrived in."""
    pieces = sum(len(op.col(j)) if op.col(j) is not None else 1 for j in range(len(op.kv)))
    if pieces < 2:
        return 0
    rounds = {came.get(k) for k in op.kv}
    if len(rounds) > 1 or None in rounds:
        return 2
    return 0 if all(op.col(j) is None for j in range(len(op.kv))) else 1


def _fills(fills: dict) -> int:
    """Ops filling new accumulators' rows (their zeros in one op, each other value one)."""
    if not fills:
        return 0
    return 2 if any(rows for rows in fills.values()) else 0


def _rows(sel, tokens: int):
    return tuple(sel) if sel is not None else ((0, tokens),)


def _add(fresh: dict, key, sel, tokens: int) -> bool:
    """Whether a block's write into ``key`` adds (some rows written before) or copies."""
    return sel_len(fresh.get(key), tokens) < sel_len(sel, tokens) if key in fresh else True


def step_host_ops(plan: Plan, rank: int, direction: str, shape=None, *, varlen: bool = True,
                  piece: int | None = None) -> tuple[tuple[HostOps, ...], HostOps]:
    """:func:`host_ops`, made once per plan (``shape``: the heads, for copies of head slices)."""
    def make():
        heads = None if shape is None else (shape.heads, shape.kv_heads)
        narrow = shape is not None and shape.itemsize < 4
        return host_ops(plan, rank, direction, varlen=varlen, piece=piece, heads=heads, narrow=narrow)
    return plan.memo(("host ops", rank, direction, shape, varlen, piece), make)

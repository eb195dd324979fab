"""Plan validator: a plan that passes runs without deadlock and computes exact attention.

Checks (each raises :class:`PlanError` naming the rank, op and buffer):

1. **Dataflow, per rank** -- every buffer is read only once it exists (a local input, a received
   buffer after its round's Wait, or an accumulator created by a compute); nothing writes a
   buffer while a send of it is in flight or reads one while its receive is; selections stay
   inside their buffers; every posted round is waited.
2. **Matching** -- in every round, the sends from rank r to rank p and the receives on p from r
   are the same buffers in the same order (transports match P2P messages by order).
3. **Dry run** -- all ranks are stepped together; a Wait completes only when every peer of that
   round has posted it and the rank's earlier rounds completed (NCCL runs a rank's rounds in
   order). If no rank can move before all have finished, the plan deadlocks.
4. **Exact cover** -- over all ranks and every head slice, every (query token, key token) pair
   the plan's mask allows is computed exactly once, forward and backward, and no masked pair is
   computed: for each query token, the key intervals its blocks compute are disjoint and their
   union is exactly the keys the mask allows it (:meth:`~.mask.Mask.key_intervals`).

The per-rank check dispatches on the op type through :data:`_DATAFLOW` (one entry per op type of
:data:`~.ir.OP_TYPES`; a test checks none is missing).
"""

from __future__ import annotations

from collections import defaultdict

from .ir import (CASTS, KINDS, AddGrad, Attend, AttendBackward, Copy, Free, Key, MergeOut, Plan, Post, RankPlan,
                 RowStats, Wait)
from .mask import BlockKind
from .sel import sel_len, sel_text

__all__ = ["PlanError", "validate_plan", "check_dataflow", "check_matching", "dry_run", "check_cover"]


class PlanError(ValueError):
    """A plan that would deadlock, race or compute the wrong result."""


def validate_plan(plan: Plan, cover: bool = True, dataflow: bool = True) -> None:
    """Run the checks. ``cover=False`` skips exact cover and ``dataflow=False`` the per-rank
    dataflow check (both read every block; matching and the dry run read only the rounds)."""
    if dataflow:
        for rp in plan.ranks:
            for direction in ("forward", "backward"):
                check_dataflow(plan, rp, direction)
    for direction in ("forward", "backward"):
        check_matching(plan, direction)
        dry_run(plan, direction)
        if cover:
            check_cover(plan, direction)


class _RankState:
    """One rank's buffers while its op list is walked."""

    def __init__(self, plan: Plan, rp: RankPlan, direction: str):
        self.plan, self.rp, self.where = plan, rp, f"rank {rp.rank} {direction}"
        self.present = set(rp.forward_inputs) if direction == "forward" else set(rp.backward_inputs) | set(rp.saved)
        # the caller's tensors (a cut of one token range is a view of them) and the forward's saved
        # buffers: an op writing into one would change the caller's input or what autograd saved
        self.read_only = set(self.present)
        self.in_flight_send: dict[Key, int] = {}
        self.in_flight_recv: dict[Key, int] = {}
        self.open_rounds: dict[int, Post] = {}
        self.last_round = 0

    def fail(self, msg: str) -> None:
        raise PlanError(f"{self.where}: {msg}")

    def need(self, key: Key, op) -> None:
        if key in self.in_flight_recv:
            self.fail(f"{op} reads {key} while its receive (round {self.in_flight_recv[key]}) is in flight")
        if key not in self.present:
            self.fail(f"{op} reads {key}, which does not exist there")

    def write(self, key: Key, op, create: bool) -> None:
        if key in self.in_flight_send:
            self.fail(f"{op} writes {key} while round {self.in_flight_send[key]} is sending it")
        if key in self.in_flight_recv:
            self.fail(f"{op} writes {key} while its receive is in flight")
        if not create and key not in self.present:
            self.fail(f"{op} writes {key}, which does not exist there")
        if key in self.read_only:
            self.fail(f"{op} writes {key}, an input or saved buffer (the caller's tensors or what autograd keeps)")
        self.present.add(key)

    def inside(self, key: Key, sel, op, what: str) -> None:
        """``sel``: non-empty, disjoint ranges of ``key``'s tokens. Their order is the order the op
        reads them, not necessarily the buffer's: a fused call takes its columns in position order,
        which differs from a buffer's where the layout's local order is not position order (a
        Ulysses group's set order read by a plain mode, a hand-built layout)."""
        if sel is None:
            return
        n, pos = self.plan.tokens(key), 0
        for s in sorted(sel):
            if not (pos <= s.start < s.stop <= n):
                self.fail(f"{op}: {what} selection {sel_text(sel)} is not disjoint ranges inside {key} ({n} tokens)")
            pos = s.stop

    # -- one handler per op type ------------------------------------------------------------------
    def post(self, op: Post) -> None:
        if op.round <= self.last_round:
            self.fail(f"round {op.round} posted after round {self.last_round}")
        self.last_round = op.round
        for t in op.sends + op.recvs:
            if t.peer == self.rp.rank or not 0 <= t.peer < self.plan.world_size:
                self.fail(f"round {op.round} has peer {t.peer} (self or out of range)")
        if op.group:
            if self.rp.rank not in op.group or list(op.group) != sorted(set(op.group)) or \
                    not 0 <= op.group[0] <= op.group[-1] < self.plan.world_size:
                self.fail(f"round {op.round}'s all-to-all group {op.group} must be sorted distinct ranks holding "
                          f"this one")
            outside = sorted({t.peer for t in op.sends + op.recvs} - set(op.group))
            if outside:
                self.fail(f"round {op.round} is an all-to-all over {op.group} but moves data with ranks {outside}")
        for t in op.sends:
            self.need(t.key, op)
            if t.key.incoming:
                self.fail(f"round {op.round} sends {t.key}: an incoming buffer is merged, not forwarded")
            self.in_flight_send[t.key] = op.round
        for t in op.recvs:
            if t.key in self.present or t.key in self.in_flight_recv:
                self.fail(f"round {op.round} receives into {t.key}, which already exists")
            self.in_flight_recv[t.key] = op.round
        self.open_rounds[op.round] = op

    def wait(self, op: Wait) -> None:
        if op.round not in self.open_rounds:
            self.fail(f"waits for round {op.round}, which is not open")
        post = self.open_rounds.pop(op.round)
        for t in post.sends:
            self.in_flight_send.pop(t.key, None)
        for t in post.recvs:
            self.in_flight_recv.pop(t.key)
            self.present.add(t.key)

    def _block(self, op, q_side: tuple[Key, ...], outs: tuple[Key, ...]) -> None:
        for k in (*q_side, *op.kv):
            self.need(k, op)
        if op.mask not in tuple(BlockKind):
            self.fail(f"{op} has unknown mask {op.mask!r}")
        self.inside(op.q, op.rows, op, "row")
        if op.cols is not None and len(op.cols) != len(op.kv):
            self.fail(f"{op} gives {len(op.cols)} column selections for {len(op.kv)} key/value buffers")
        for i, k in enumerate(op.kv):
            self.inside(k, op.col(i), op, "column")
        for k in outs:
            if k.incoming:
                self.fail(f"{op} writes into the incoming buffer {k}")
            self.write(k, op, create=True)

    def attend(self, op: Attend) -> None:
        if op.out.kind != "o" or op.out.base._replace(kind="q") != op.q:
            self.fail(f"{op} writes the output of another buffer ({op.out} for {op.q})")
        self._block(op, (op.q,), (op.out,))

    def attend_backward(self, op: AttendBackward) -> None:
        if op.do._replace(kind="q") != op.q or op.dq._replace(kind="q") != op.q:
            self.fail(f"{op}: do / dq must name the rows of {op.q}")
        if len(op.dkv) != len(op.kv) or any(d._replace(kind="kv") != k for d, k in zip(op.dkv, op.kv)):
            self.fail(f"{op} dK/dV targets do not match its KV buffers")
        self._block(op, (op.q, op.do), (op.dq, *op.dkv))

    def merge(self, op: MergeOut) -> None:
        self._combine(op, op.src, op.dst, op.into, None, ("o",))

    def add(self, op: AddGrad) -> None:
        self._combine(op, op.src, op.dst, op.into, op.heads, ("dq", "dkv"))

    def copy(self, op: Copy) -> None:
        self.need(op.src, op)
        if op.src.kind != op.dst.kind and (op.src.kind, op.dst.kind) not in CASTS:
            self.fail(f"{op} copies a {op.src.kind} buffer into a {op.dst.kind} buffer (allowed: the same kind, or "
                      f"finishing {', '.join(f'{a} -> {b}' for a, b in sorted(CASTS))})")
        self.inside(op.src, op.rows, op, "source row")
        self.inside(op.dst, op.into, op, "destination row")
        if sel_len(op.rows, self.plan.tokens(op.src)) != sel_len(op.into, self.plan.tokens(op.dst)):
            self.fail(f"{op} moves {sel_len(op.rows, self.plan.tokens(op.src))} tokens into "
                      f"{sel_len(op.into, self.plan.tokens(op.dst))}")
        self.same_tokens(op, op.src, op.rows, op.dst, op.into)
        self.same_heads(op, op.src, op.dst, op.heads)
        self.write(op.dst, op, create=True)

    def _combine(self, op, src: Key, dst: Key, into, heads, kinds) -> None:
        self.need(src, op)
        if src.kind not in kinds or dst.kind != src.kind:
            self.fail(f"{op} combines a {src.kind} buffer into a {dst.kind} buffer (allowed: {', '.join(kinds)})")
        self.inside(dst, into, op, "destination row")
        if sel_len(into, self.plan.tokens(dst)) != self.plan.tokens(src):
            self.fail(f"{op} adds {self.plan.tokens(src)} tokens into {sel_len(into, self.plan.tokens(dst))}")
        self.same_tokens(op, src, None, dst, into)
        self.same_heads(op, src, dst, heads)
        self.write(dst, op, create=True)

    def same_tokens(self, op, src: Key, rows, dst: Key, into) -> None:
        """Data moves between buffers only onto the same global positions."""
        a, b = self.plan.positions(src, rows), self.plan.positions(dst, into)
        if a != b:
            self.fail(f"{op} moves positions {list(a)} (start, length) onto positions {list(b)}")

    def same_heads(self, op, src: Key, dst: Key, heads) -> None:
        """A head slice lands on its own heads (checked when the plan records its head counts)."""
        if heads is None:
            if src.heads != dst.heads and dst.heads >= 0:
                self.fail(f"{op} moves head slice {src.heads} into head slice {dst.heads}")
            if src.heads != dst.heads and dst.heads < 0:
                self.fail(f"{op} moves head slice {src.heads} into all heads without a head range")
            return
        if dst.heads >= 0 or src.heads < 0:
            self.fail(f"{op}: a head range places one head slice into a buffer of all heads")
        if self.plan.facts.heads is None:
            self.fail(f"{op} places a head slice, but the plan records no head counts to check it against")
        want = self.plan.head_range(src, *self.plan.facts.heads)
        if tuple(heads) != want:
            self.fail(f"{op}: head slice {src.heads} of {KINDS[src.kind].side} heads is heads {want}, not "
                      f"{tuple(heads)}")

    def rowstats(self, op: RowStats) -> None:
        self.need(op.dout, op)
        self.need(op.out, op)
        if (op.dout.kind, op.out.kind, op.dst.kind) != ("dy", "o", "do"):
            self.fail(f"{op} must read a dy and an o buffer and write a do buffer")
        self.same_tokens(op, op.dout, None, op.out, None)
        self.same_tokens(op, op.dout, None, op.dst, None)
        if not op.dout.heads == op.out.heads == op.dst.heads:
            self.fail(f"{op} mixes head slices")
        self.write(op.dst, op, create=True)

    def free(self, op: Free) -> None:
        self.need(op.key, op)
        if op.key in self.in_flight_send:
            self.fail(f"frees {op.key} while round {self.in_flight_send[op.key]} sends it")
        self.present.discard(op.key)
        self.read_only.discard(op.key)  # a later buffer of that name is a new one


_DATAFLOW = {Post: _RankState.post, Wait: _RankState.wait, Attend: _RankState.attend,
             AttendBackward: _RankState.attend_backward, MergeOut: _RankState.merge, AddGrad: _RankState.add,
             Copy: _RankState.copy, RowStats: _RankState.rowstats, Free: _RankState.free}


def check_dataflow(plan: Plan, rp: RankPlan, direction: str) -> None:
    st = _RankState(plan, rp, direction)
    for key, segs in (rp.forward_inputs | rp.backward_inputs).items():
        if key.kind not in KINDS:
            st.fail(f"input {key} has unknown kind")
        if sum(s.stop - s.start for s in segs) != plan.tokens(key):
            st.fail(f"input {key} segments {segs} do not hold {plan.tokens(key)} tokens")
    for op in rp.ops(direction):
        handler = _DATAFLOW.get(type(op))
        if handler is None:
            st.fail(f"unknown op {op!r}")
        handler(st, op)
    if st.open_rounds:
        st.fail(f"rounds {sorted(st.open_rounds)} are never waited")


def check_matching(plan: Plan, direction: str) -> None:
    sends: dict[tuple[int, int, int], list[Key]] = defaultdict(list)
    recvs: dict[tuple[int, int, int], list[Key]] = defaultdict(list)
    for r in range(plan.world_size):
        for post in plan.round_ops(r, direction):
            if type(post) is not Post:
                continue
            for t in post.sends:
                sends[(post.round, r, t.peer)].append(t.key.base)
            for t in post.recvs:
                recvs[(post.round, t.peer, r)].append(t.key.base)
    # an all-to-all round is one collective: every member of its group posts it, naming that group
    groups: dict[tuple[int, int], tuple[int, ...]] = {}
    for r in range(plan.world_size):
        for post in plan.round_ops(r, direction):
            if type(post) is Post:
                groups[(post.round, r)] = post.group
    for (rnd, r), group in groups.items():
        for x in group:
            if groups.get((rnd, x)) != group:
                raise PlanError(f"{direction} round {rnd}: rank {r} posts it as an all-to-all over ranks {group}, "
                                f"rank {x} " + ("does not post it" if (rnd, x) not in groups else
                                                f"as {'one over ' + str(groups[(rnd, x)]) if groups[(rnd, x)] else 'point-to-point'}"))
    for link in sends.keys() | recvs.keys():
        if sends.get(link, []) != recvs.get(link, []):
            rnd, src, dst = link
            names = [[str(k) for k in d.get(link, [])] for d in (sends, recvs)]
            raise PlanError(f"{direction} round {rnd}: rank {src} sends {names[0]} to rank {dst}, "
                            f"which receives {names[1]} from it")


def dry_run(plan: Plan, direction: str) -> int:
    """Step all ranks together until every rank has finished; returns the number of ops stepped.

    Event-driven: a rank runs until it blocks on a Wait, and is looked at again when one of the
    peers it waits for posts a round.
    """
    # computes never block, so the Post/Wait ops of each rank decide whether the plan deadlocks
    programs = [plan.round_ops(r, direction) for r in range(plan.world_size)]
    pc = [0] * plan.world_size
    posted: list[set[int]] = [set() for _ in programs]
    order: list[list[Post]] = [[] for _ in programs]  # rounds in posting order
    done_upto = [0] * plan.world_size  # rounds order[r][:done_upto[r]] have completed
    completed: list[set[int]] = [set() for _ in programs]
    waiting_on: list[set[int]] = [set() for _ in programs]  # ranks to wake when r posts
    work = list(range(plan.world_size))
    steps = 0
    while work:
        r = work.pop()
        ops = programs[r]
        while pc[r] < len(ops):
            op = ops[pc[r]]
            if type(op) is Post:
                posted[r].add(op.round)
                order[r].append(op)
                work.extend(waiting_on[r])
                waiting_on[r].clear()
            elif type(op) is Wait:
                # rounds complete in posting order, each once all its peers have posted it
                while done_upto[r] < len(order[r]):
                    post = order[r][done_upto[r]]
                    missing = [x for x in (*(t.peer for t in post.sends + post.recvs), *post.group)
                               if post.round not in posted[x]]
                    if missing:
                        for p in missing:
                            waiting_on[p].add(r)
                        break
                    completed[r].add(post.round)
                    done_upto[r] += 1
                if op.round not in completed[r]:
                    break
            pc[r] += 1
            steps += 1
    stuck = {r: str(programs[r][pc[r]]) for r in range(plan.world_size) if pc[r] < len(programs[r])}
    if stuck:
        raise PlanError(f"{direction} deadlocks: ranks stuck at {stuck}")
    return steps


# -- exact cover -----------------------------------------------------------------------------------------
def _expand(runs) -> list[int]:
    return [p for a, n in runs for p in range(a, a + n)]


def _intervals(positions: list[int]) -> list[tuple[int, int]]:
    """Sorted positions as maximal [a, b) intervals."""
    out: list[list[int]] = []
    for p in sorted(positions):
        if out and out[-1][1] == p:
            out[-1][1] = p + 1
        else:
            out.append([p, p + 1])
    return [(a, b) for a, b in out]


def _union(ivs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(ivs):
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def check_cover(plan: Plan, direction: str) -> None:
    """Check 4 of the module docstring (every query token of the global sequence, every head slice)."""
    seq_len = plan.layout.seq_len
    slices = range(plan.facts.ulysses) if plan.facts.ulysses > 1 else (-1,)
    got: dict[tuple[int, int], list] = defaultdict(list)  # (slice, query) -> (a, b, rank, op) key intervals
    for rp in plan.ranks:
        for op in rp.blocks(direction):
            qpos = _expand(plan.positions(op.q, op.rows))
            kvpos = [p for i, k in enumerate(op.kv) for p in _expand(plan.positions(k, op.col(i)))]
            # a head slice is one of U; at U = 1 (a hybrid of degree 1) its only slice is all heads
            heads = list(slices) if op.q.heads < 0 or plan.facts.ulysses == 1 else [op.q.heads]
            if any(k.heads != op.q.heads for k in op.kv):
                raise PlanError(f"rank {rp.rank} {direction}: {op} mixes head slices")
            if op.mask == BlockKind.CAUSAL:
                if qpos != kvpos or any(a >= b for a, b in zip(qpos, qpos[1:])):
                    raise PlanError(f"rank {rp.rank} {direction}: causal block {op} is not on the same, increasing "
                                    "query and key tokens")
                per_row = [_intervals(kvpos[:r + 1]) for r in range(len(qpos))]
            elif op.mask == BlockKind.FULL:
                ivs = _intervals(kvpos)
                per_row = [ivs] * len(qpos)
            else:
                per_row = []
                for x in qpos:
                    allowed = plan.mask.key_intervals(x, seq_len)
                    per_row.append(_intervals([p for p in kvpos if any(a <= p < b for a, b in allowed)]))
            for h in heads:
                for x, ivs in zip(qpos, per_row):
                    got[(h, x)].extend((a, b, rp.rank, op) for a, b in ivs)
    for h in slices:
        for x in range(seq_len):
            _check_row(direction, x, h, plan.mask.key_intervals(x, seq_len), got.get((h, x), ()))


def _check_row(direction: str, x: int, h: int, allowed: tuple, computed) -> None:
    """The key intervals computed for query ``x`` are disjoint and cover exactly ``allowed``."""
    where = f"{direction}: query token {x}" + (f" (head slice {h})" if h >= 0 else "")
    ivs = sorted(computed, key=lambda t: (t[0], t[1]))
    for (a, b, rank, op), nxt in zip(ivs, ivs[1:]):
        if nxt[0] < b:
            raise PlanError(f"{where}: keys [{nxt[0]}, {min(b, nxt[1])}) computed 2 times (again by rank {nxt[2]} in "
                            f"{nxt[3]})")
    text = ", ".join(f"[{a}, {b})" for a, b in allowed) or "none"
    for a, b, rank, op in ivs:
        if not any(lo <= a and b <= hi for lo, hi in allowed):
            raise PlanError(f"{where}: rank {rank} computes keys [{a}, {b}) in {op}, but the mask allows {text}")
    done = _union([(a, b) for a, b, _, _ in ivs])
    missing = _union([(a, b) for a, b in _subtract(list(allowed), done)])
    if missing:
        a, b = missing[0]
        raise PlanError(f"{where}: keys [{a}, {b}) computed 0 times (expected 1)")


def _subtract(allowed: list[tuple[int, int]], done: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of the ``allowed`` intervals no ``done`` interval covers."""
    out = []
    for lo, hi in allowed:
        pos = lo
        for a, b in done:
            if b <= pos or a >= hi:
                continue
            if a > pos:
                out.append((pos, a))
            pos = max(pos, b)
        if pos < hi:
            out.append((pos, hi))
    return out

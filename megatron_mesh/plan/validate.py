"""Plan validator: a plan that passes runs without deadlock and computes exact attention.

Checks (each raises :class:`PlanError` naming the rank, op and buffer):

1. **Dataflow, per rank** -- every buffer is read only once it exists (a local input, a received
   buffer after its round's Wait, or an accumulator created by a compute); nothing writes a
   buffer while a send of it is in flight or reads one while its receive is; every posted round
   is waited; the plan ends with its output / gradient buffers present.
2. **Matching** -- in every round, the sends from rank r to rank p and the receives on p from r
   are the same buffers in the same order (transports match P2P messages by order).
3. **Dry run** -- all ranks are stepped together; a Wait completes only when every peer of that
   round has posted it and the rank's earlier rounds completed (NCCL runs a rank's rounds in
   order). If no rank can move before all have finished, the plan deadlocks.
4. **Exact cover** -- over all ranks, every (query token, key token) pair the mask allows is
   computed exactly once, forward and backward, with the causal mask used only on diagonal
   blocks whose query and key tokens coincide. Checked at the granularity of token *atoms* (the
   coarsest cut of the sequence that every buffer segment respects).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter, defaultdict

from .ir import (AddGrad, Attend, AttendBackward, Free, Key, MergeOut, Plan, Post, RankPlan, Segment,
                 Wait)
from .layout import ZigzagLayout

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


def check_dataflow(plan: Plan, rp: RankPlan, direction: str) -> None:
    where = f"rank {rp.rank} {direction}"
    if direction == "forward":
        present = set(rp.forward_inputs)
    else:
        present = set(rp.backward_inputs) | set(rp.saved)
    for key, segs in (rp.forward_inputs | rp.backward_inputs).items():
        if sum(s.stop - s.start for s in segs) != plan.tokens(key):
            raise PlanError(f"{where}: input {key} segments {segs} do not hold {plan.tokens(key)} tokens")
    in_flight_send: dict[Key, int] = {}
    in_flight_recv: dict[Key, int] = {}
    open_rounds: dict[int, Post] = {}
    last_round = 0

    def need(key: Key, op) -> None:
        if key in in_flight_recv:
            raise PlanError(f"{where}: {op} reads {key} while its receive (round {in_flight_recv[key]}) is in flight")
        if key not in present:
            raise PlanError(f"{where}: {op} reads {key}, which does not exist there")

    def write(key: Key, op, create: bool) -> None:
        if key in in_flight_send:
            raise PlanError(f"{where}: {op} writes {key} while round {in_flight_send[key]} is sending it")
        if key in in_flight_recv:
            raise PlanError(f"{where}: {op} writes {key} while its receive is in flight")
        if not create and key not in present:
            raise PlanError(f"{where}: {op} writes {key}, which does not exist there")
        present.add(key)

    def halves_ok(key: Key, half: str, op) -> None:
        if half not in ("all", "front", "back"):
            raise PlanError(f"{where}: {op} uses unknown half {half!r}")
        if half != "all" and plan.tokens(key) % 2:
            raise PlanError(f"{where}: {op} takes the {half} half of {key}, whose length is odd")

    for op in rp.ops(direction):
        if isinstance(op, Post):
            if op.round <= last_round:
                raise PlanError(f"{where}: round {op.round} posted after round {last_round}")
            last_round = op.round
            for t in op.sends + op.recvs:
                if t.peer == rp.rank or not 0 <= t.peer < plan.world_size:
                    raise PlanError(f"{where}: round {op.round} has peer {t.peer} (self or out of range)")
            for t in op.sends:
                need(t.key, op)
                in_flight_send[t.key] = op.round
            for t in op.recvs:
                if t.key in present or t.key in in_flight_recv:
                    raise PlanError(f"{where}: round {op.round} receives into {t.key}, which already exists")
                in_flight_recv[t.key] = op.round
            open_rounds[op.round] = op
        elif isinstance(op, Wait):
            if op.round not in open_rounds:
                raise PlanError(f"{where}: waits for round {op.round}, which is not open")
            post = open_rounds.pop(op.round)
            for t in post.sends:
                in_flight_send.pop(t.key, None)
            for t in post.recvs:
                in_flight_recv.pop(t.key)
                present.add(t.key)
        elif isinstance(op, Attend):
            need(op.q, op)
            halves_ok(op.q, op.q_half, op)
            for k in op.kv:
                need(k, op)
                halves_ok(k, op.kv_half, op)
            if op.out.chunk != op.q.chunk or op.out.kind != "o":
                raise PlanError(f"{where}: {op} writes the output of another chunk")
            write(op.out, op, create=True)
        elif isinstance(op, AttendBackward):
            for k in (op.q, op.do, *op.kv):
                need(k, op)
            halves_ok(op.q, op.q_half, op)
            for k in op.kv:
                halves_ok(k, op.kv_half, op)
            if len(op.dkv) != len(op.kv) or any(d.chunk != k.chunk or d.slot != k.slot for d, k in zip(op.dkv, op.kv)):
                raise PlanError(f"{where}: {op} dK/dV targets do not match its KV buffers")
            for k in (op.dq, *op.dkv):
                write(k, op, create=True)
        elif isinstance(op, (MergeOut, AddGrad)):
            need(op.src, op)
            need(op.dst, op)
            write(op.dst, op, create=False)
        elif isinstance(op, Free):
            need(op.key, op)
            if op.key in in_flight_send:
                raise PlanError(f"{where}: frees {op.key} while round {in_flight_send[op.key]} sends it")
            present.discard(op.key)
        else:
            raise PlanError(f"{where}: unknown op {op!r}")
    if open_rounds:
        raise PlanError(f"{where}: rounds {sorted(open_rounds)} are never waited")
    final = [rp.output] if direction == "forward" else [rp.grad_q, rp.grad_kv]
    for key in final:
        if key not in present:
            raise PlanError(f"{where}: ends without its result buffer {key}")


def check_matching(plan: Plan, direction: str) -> None:
    sends: dict[tuple[int, int, int], list[Key]] = defaultdict(list)
    recvs: dict[tuple[int, int, int], list[Key]] = defaultdict(list)
    for r in range(plan.world_size):
        for post in plan.round_ops(r, direction):
            if not isinstance(post, Post):
                continue
            for t in post.sends:
                sends[(post.round, r, t.peer)].append(t.key[:3])
            for t in post.recvs:
                recvs[(post.round, t.peer, r)].append(t.key[:3])
    for link in sends.keys() | recvs.keys():
        if sends.get(link, []) != recvs.get(link, []):
            rnd, src, dst = link
            names = [[str(Key(*k)) for k in d.get(link, [])] for d in (sends, recvs)]
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
            if isinstance(op, Post):
                posted[r].add(op.round)
                order[r].append(op)
                work.extend(waiting_on[r])
                waiting_on[r].clear()
            elif isinstance(op, Wait):
                # rounds complete in posting order, each once all its peers have posted it
                while done_upto[r] < len(order[r]):
                    post = order[r][done_upto[r]]
                    missing = [t.peer for t in post.sends + post.recvs if post.round not in posted[t.peer]]
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


def _key_segments(plan: Plan, rp: RankPlan, key: Key) -> tuple[Segment, ...]:
    """Local token segments (of chunk ``key.chunk``) that buffer ``key`` holds. Slot layouts are
    the same on every rank, so the owner's input table tells us."""
    owner = plan.rank(key.chunk)
    base = key._replace(incoming=False)
    for table in (owner.forward_inputs, owner.backward_inputs):
        for k, segs in table.items():
            if k.chunk == key.chunk and k.slot == key.slot:
                return segs
    if key.slot < 0:
        return (Segment(0, plan.seq_local),)
    raise PlanError(f"rank {rp.rank}: no layout known for buffer {base}")


def _half(segs: tuple[Segment, ...], half: str) -> list[Segment]:
    """The front/back half of the tokens of a buffer made of ``segs`` (concatenated)."""
    if half == "all":
        return list(segs)
    n = sum(s.stop - s.start for s in segs)
    lo, hi = (0, n // 2) if half == "front" else (n // 2, n)
    out, pos = [], 0
    for s in segs:
        a, b = max(lo, pos), min(hi, pos + s.stop - s.start)
        if a < b:
            out.append(Segment(s.start + a - pos, s.start + b - pos))
        pos += s.stop - s.start
    return out


def check_cover(plan: Plan, direction: str) -> None:
    P, T = plan.world_size, plan.seq_local
    layout = ZigzagLayout(P, P * T)
    h = layout.half_len
    blocks = []  # (q global intervals, kv global intervals, causal)
    boundaries: set[int] = {0, P * T}

    def to_global(chunk: int, segs: list[Segment]) -> list[tuple[int, int]]:
        out = []
        for s in segs:
            # split at the half boundary of the chunk (local h) and map each piece
            for a, b in ((s.start, min(s.stop, h)), (max(s.start, h), s.stop)):
                if a < b:
                    half = layout.halves(chunk)[0 if a < h else 1]
                    off = half * h - (0 if a < h else h)
                    out.append((a + off, b + off))
        return out

    for rp in plan.ranks:
        for op in rp.blocks(direction):
            q = to_global(op.q.chunk, _half(_key_segments(plan, rp, op.q), op.q_half))
            kv = [iv for k in op.kv for iv in to_global(k.chunk, _half(_key_segments(plan, rp, k), op.kv_half))]
            if op.causal and q != kv:
                raise PlanError(f"rank {rp.rank} {direction}: causal block {op} on different query and key tokens")
            if op.causal and any(x[0] >= y[0] for x, y in zip(q, q[1:])):
                raise PlanError(f"rank {rp.rank} {direction}: causal block {op} is not in position order")
            blocks.append((q, kv, op.causal))
            for a, b in q + kv:
                boundaries.update((a, b))
    cuts = sorted(boundaries)

    def atoms(ivs: list[tuple[int, int]]) -> list[int]:
        return [i for a, b in ivs for i in range(bisect_left(cuts, a), bisect_left(cuts, b))]

    full: Counter = Counter()
    diag: Counter = Counter()
    for q, kv, causal in blocks:
        qa, ka = atoms(q), atoms(kv)
        if causal:
            for i, x in enumerate(qa):
                diag[x] += 1
                for y in qa[:i]:
                    full[(x, y)] += 1
        else:
            for x in qa:
                for y in ka:
                    full[(x, y)] += 1
    n = len(cuts) - 1
    for x in range(n):
        for y in range(n):
            want_full = (x > y) if plan.causal else True
            got = full.get((x, y), 0)
            if got != (1 if want_full else 0):
                raise PlanError(
                    f"{direction}: query tokens [{cuts[x]}, {cuts[x + 1]}) x key tokens [{cuts[y]}, {cuts[y + 1]}) "
                    f"computed {got} times as a full block (expected {1 if want_full else 0})"
                )
        want_diag = 1 if plan.causal else 0
        if diag.get(x, 0) != want_diag:
            raise PlanError(f"{direction}: diagonal tokens [{cuts[x]}, {cuts[x + 1]}) computed causally "
                            f"{diag.get(x, 0)} times (expected {want_diag})")

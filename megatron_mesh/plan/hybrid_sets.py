"""A Ulysses hybrid's all-to-all in rounds by document (:mod:`.hybrid`), on a layout balanced for
its groups (:func:`~.balance.balanced_layout` with ``group`` U): each rank holds 1/U of each set
of :data:`~.balance.SETS` -- the documents that cross into another group, and those inside it
that run first, the others, those that run last -- and each set is gathered and goes home in a
round of its own, so the inner plan's own block runs in four parts, each once its round is in
(:class:`SetLowering`).

Example (U = 2, a group whose span chunk holds 6 crossing tokens and 10 of the others, without
``hide``): ``chunk_rows`` of the chunk is ([0:6), (), [6:16), ()) -- rounds A and B move tokens,
rounds F and L are empty and not posted.
"""

from __future__ import annotations

from itertools import accumulate

from .balance import SETS
from .ir import Attend, AttendBackward, Copy, Key, Op, Post, RowStats, Transfer, Wait
from .mask import BlockKind
from .sel import Segment, Sel

__all__ = ["SET_ROUNDS", "SetRows", "SetLowering"]

# the rounds before a hybrid's inner plan on a layout balanced for its groups: the all-to-all's
# four gather rounds, one per set, and the first documents' return
SET_ROUNDS = len(SETS) + 1


class SetRows:
    """Which rows of each span chunk, and of each rank, travel in each all-to-all round."""

    def __init__(self, layout, U: int, span_segments):
        self.layout, self.U, self.span_segments = layout, U, span_segments
        self._rows: dict[int, tuple[Sel, ...]] = {}
        self._members: dict[int, list] = {}

    def chunk_rows(self, m: int) -> tuple[Sel, ...]:
        """Span chunk m's rows of each all-to-all round (:data:`~.balance.SETS`, in the chunk in
        that order, :meth:`~.balance.BalancedLayout.runs`): the documents that cross into another
        group, then those inside it run first, the others, those run last (the first and last
        empty without ``hide``)."""
        got = self._rows.get(m)
        if got is None:
            ends = list(accumulate(self.layout.set_tokens(m), initial=0))
            got = self._rows[m] = tuple((Segment(x, y),) if x < y else () for x, y in zip(ends, ends[1:]))
        return got

    def member_sets(self, x: int) -> list[tuple[Sel, Sel]]:
        """For each round: (rank x's local rows in it, where they go in its span chunk)."""
        got = self._members.get(x)
        if got is None:
            got, local = [([], []) for _ in SETS], 0
            for seg in self.span_segments[x]:
                for j, rows in enumerate(self.chunk_rows(x // self.U)):
                    for r in rows:
                        a, b = max(seg.start, r.start), min(seg.stop, r.stop)
                        if a < b:
                            got[j][0].append(Segment(local + a - seg.start, local + b - seg.start))
                            got[j][1].append(Segment(a, b))
                local += seg.stop - seg.start
            got = self._members[x] = [(tuple(a), tuple(b)) for a, b in got]
        return got


def _restrict(op, rows: Sel):
    """The part of an own block (its chunk's rows against its chunk's keys) whose rows and columns
    both lie in ``rows`` (None: nothing there). Exact only when no allowed pair joins ``rows`` to
    the rest: ``rows`` is whole documents."""
    def cut(sel):
        out = []
        for a, b in (sel if sel is not None else ((0, 1 << 62),)):
            out += [Segment(max(a, r.start), min(b, r.stop)) for r in rows if max(a, r.start) < min(b, r.stop)]
        return tuple(out)
    mine = cut(op.rows)
    cols = tuple(cut(op.col(i)) for i in range(len(op.kv)))
    if not mine or not all(cols):
        return None
    return op._replace(rows=mine, cols=cols, mask=BlockKind.MASKED)


class SetLowering:
    """The all-to-all in four rounds, by document (:data:`~.balance.SETS`; each rank holds 1/U
    of each, :func:`~.balance.balanced_layout`): A the tokens of the documents that cross into
    another group, then three of documents inside the group: F run first, B, L run last.
    Blocks never mix the sets (a document's tokens are in one), so the inner plan's own block
    runs in four parts, each once its round is in. F's part hides round A (the layout gives it
    the pairs to), A's part and B's hide the inner plan's rounds, B's rows -- no other group's
    keys reach them -- go home while the A rows' blocks with other groups' keys run (forward)
    or the A part runs (backward), and L's part hides A's rows going home. What stays exposed
    is F's gather and L's return (the layout keeps them small).

    Forward: gather F, A, B, L | wait F | own block on F | F home | wait A | own block on A |
    wait B | own block on B | the inner plan's blocks with other groups' keys | B home | A home
    | wait L | own block on L | L home. Backward: the same, with the blocks with other groups'
    keys (A rows: their keys kept from the forward) before B's part and A's part after it, A's
    rows going home once the dK/dV partials of other groups are added."""

    def __init__(self, h, g: int, direction: str):
        # h: the hybrid's lowering (its inner plan's ops, the home and assemble steps, the set rows)
        self.h, self.g, self.backward = h, g, direction == "backward"
        U = h.U
        self.m, self.u = m, u = divmod(g, U)
        self.group = [m * U + p for p in range(U)]
        self.peers = [x for x in self.group if x != g]
        self.sets = {x: h.set_rows.member_sets(x) for x in self.group}
        self.in_kinds = ("dy",) if self.backward else ("q", "kv")
        self.span = {k: Key(k, m, heads=u, span=U) for k in ("q", "kv", "o", "dy", "do")}
        A, F, B, L = range(len(SETS))
        self.gathered = (F, A, B, L)  # rounds 1-4, in this order; F home is round 5
        last = h.last_round[direction] + SET_ROUNDS + 1  # the first round after the inner plan's
        self.home_round = {F: len(self.gathered) + 1, B: last, A: last + 1, L: last + 2}
        self.outs = (("dq", "gq"), ("dkv", h.grad_kv)) if self.backward else (("o", "y"),)

    def gather(self, j: int) -> Post:
        g, m, u, sets, kinds = self.g, self.m, self.u, self.sets, self.in_kinds
        return Post(1 + self.gathered.index(j), tuple(Transfer(x, Key(k, g, slot=j, heads=x - m * self.h.U))
                                                      for x in self.peers for k in kinds if sets[g][j][0]),
                    tuple(Transfer(x, Key(k, x, slot=j, heads=u)) for x in self.peers for k in kinds if sets[x][j][0]),
                    tuple(self.group))

    def arrive(self, j: int) -> list[Op]:
        ops: list[Op] = [Wait(1 + self.gathered.index(j))]
        for k in self.in_kinds:
            ops += [Copy(Key(k, x, slot=j, heads=self.u), self.span[k], into=self.sets[x][j][1])
                    for x in self.group if self.sets[x][j][0]]
        rows = self.h.set_rows.chunk_rows(self.m)[j]
        if self.backward and rows:  # the row statistics come from the output this rank kept
            ops.append(RowStats(self.span["dy"], self.span["o"], self.span["do"], rows=rows))
        return ops

    def home(self, j: int) -> list[Op]:  # round j's rows, finished, to their ranks
        return self.h._home(self.g, self.group, self.outs, self.home_round[j], True, slot=j)

    def own_parts(self, inner: list[Op]) -> tuple[list[int], dict[int, list[Op]]]:
        """The indices of the inner plan's own block calls, and their part in each set's rows."""
        span = self.span
        own = [i for i, op in enumerate(inner) if type(op) in (Attend, AttendBackward) and op.q == span["q"]
               and op.kv == (span["kv"],)]
        if not own:
            raise ValueError(f"inner rank {self.m}'s plan has no own block to split over the all-to-all rounds")
        return own, {j: [p for i in own if (p := _restrict(inner[i], rows)) is not None]
                     for j, rows in enumerate(self.h.set_rows.chunk_rows(self.m))}

    def ops(self) -> list[Op]:
        h, m, u, backward, home, arrive = self.h, self.m, self.u, self.backward, self.home, self.arrive
        A, F, B, L = range(len(SETS))
        inner = h.head_slices.ops(m, u, "backward" if backward else "forward", True)
        own, part = self.own_parts(inner)
        ops: list[Op] = [self.gather(j) for j in self.gathered]
        ops += arrive(F) + part[F] + home(F) + arrive(A)
        rp = h.inner.rank(m)  # the inner plan's own input cuts (its slots) come from round A's tokens
        for key, segs in (rp.backward_inputs if backward else rp.forward_inputs).items():
            if key.slot >= 0:
                ops.append(Copy(h.head_slices.key(key._replace(slot=-1), u), h.head_slices.key(key, u), rows=segs))
        before, after = inner[:own[0]], inner[own[-1] + 1:]
        # what the inner plan runs between the calls of its own block (its rounds), in order
        middle = [op for i, op in enumerate(inner[own[0]:own[-1] + 1], own[0]) if i not in own]
        if backward:
            # the inner plan's blocks that wait for nothing (other groups' keys kept from the
            # forward, on A rows) while round B arrives, then B's part, then the rest
            first_wait = next((i for i, op in enumerate(before) if type(op) is Wait), len(before))
            seq = before[:first_wait] + arrive(B) + part[B]
            b_end = len(seq)
            seq += before[first_wait:] + middle + part[A] + after
        else:
            seq = before + part[A] + middle + arrive(B) + part[B]
            b_end = len(seq)
            seq += after
        # B home once its part ran and after the inner plan's last post (rounds are posted in order)
        at = max(b_end, max((i + 1 for i, op in enumerate(seq) if type(op) is Post), default=0))
        ops += seq[:at] + home(B) + seq[at:]
        # F's and B's rows went home while A's ran: their buffers go before A's are made; A's rows
        # go home while L's part runs
        ops += [Wait(self.home_round[F]), Wait(self.home_round[B]), *home(A), *arrive(L), *part[L], *home(L),
                Wait(self.home_round[A]), Wait(self.home_round[L])]
        # a round that moves nothing for this rank (an empty set: no first or last documents without
        # hide, no crossing ones) is not posted; the others keep their numbers
        idle = {op.round for op in ops if type(op) is Post and not op.sends and not op.recvs}
        ops = [op for op in ops if type(op) not in (Post, Wait) or op.round not in idle]
        return ops + h._assemble(self.g, self.outs, [(j, rows) for j, (rows, _) in enumerate(self.sets[self.g]) if rows])

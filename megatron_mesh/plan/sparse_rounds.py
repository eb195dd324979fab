"""The rounds of a mask-aware plan (:mod:`.sparse`, step 3): which slots each rank pulls and
sends in which round, and in which round the partial outputs and gradients go home.

Ring and Mesh pull by *shift* -- in round d, rank x receives from x - d and sends to x + d, and the
partials of shift d go home in round P + d. TASP pulls in *bursts*: each group of a rank's remote
chunks (about equal work, :meth:`Rounds.groups_of`) in one round over every link, its partials in
round 1 + G + group. Both sides of a transfer derive its round from the needs, so they agree.

Example (the window example of :mod:`.sparse`, P = 4, shifts): rank 1 receives chunk 0's columns
in round 1 (shift 1) and chunk 2's in round 3 (shift -1 = 3), and sends its own to rank 2 in round
1 and to rank 0 in round 3; its dK/dV partials of chunks 0 and 2 go home in rounds 5 and 7.
"""

from __future__ import annotations

from .ir import AddGrad, Key, MergeOut, Transfer
from .sparse_blocks import Blocks
from .sparse_needs import Keeps
from .tunables import Tunables

__all__ = ["Rounds"]


class Rounds:
    """The pull and return rounds of every rank of one mask-aware plan (module docstring)."""

    def __init__(self, P: int, needs, index: Blocks, keeps: Keeps, burst: bool, tunables: Tunables):
        self.P, self.needs, self.index, self.keeps, self.burst = P, needs, index, keeps, burst
        self.group_tokens = tunables.group_tokens
        # burst: pulls in rounds 1 .. G, returns in G+1 .. 2G (one per group, :meth:`groups_of`);
        # shifts: pulls in rounds 1 .. P-1, returns in P+1 .. 2P-1 (one per shift)
        self.groups, self.final_round = (tunables.burst_groups, 2 * tunables.burst_groups) if burst else (1, 2 * P - 1)
        self._group_memo: dict[int, dict[int, int]] = {}
        self._moves_memo: dict[str, bool] = {}

    def shift(self, x: int, peer: int, sending: bool) -> int:
        """Round of a pull between x and ``peer``: the shift d with peer = x + d (x sends) or
        x - d (x receives); in burst mode 1 + the receiver's group of the sender's chunk."""
        if self.burst:  # the receiver's group of the sender's chunk (:meth:`groups_of`)
            return 1 + (self.groups_of(peer)[x] if sending else self.groups_of(x)[peer])
        return (peer - x) % self.P if sending else (x - peer) % self.P

    def moves(self, direction: str) -> bool:
        """Whether any rank moves anything in ``direction``: where none does (every document inside
        one rank), the collective rounds would be posted empty on every rank -- so none are."""
        got = self._moves_memo.get(direction)
        if got is None:
            got = self._moves_memo[direction] = any(
                r[0] or r[1] for y in range(self.P)
                for r in (*self.pulls(y, direction).values(), *self.returns(y, direction).values()))
        return got

    def pulls(self, x: int, direction: str) -> dict[int, tuple[list, list]]:
        """Round -> (sends, recvs) of the pulls of ``direction``."""
        backward = direction == "backward"

        def row_kinds(reader: int, chunk: int) -> tuple[str, ...]:  # what moves of ``chunk``'s rows ``reader`` needs
            return (("do",) if self.keeps(reader, chunk) else ("q", "do")) if backward else ("q",)

        def col_kinds(reader: int, chunk: int) -> tuple[str, ...]:
            return (() if self.keeps(reader, chunk) else ("kv",)) if backward else ("kv",)
        rounds: dict[int, tuple[list, list]] = {}
        for y in self.needs.row_needers(x):  # my rows others need
            for kind in row_kinds(y, x):
                rounds.setdefault(self.shift(x, y, True), ([], []))[0].append(Transfer(y, Key(kind, x, y)))
        for y in self.needs.col_needers(x):
            for kind in col_kinds(y, x):
                rounds.setdefault(self.shift(x, y, True), ([], []))[0].append(Transfer(y, Key(kind, x, self.P + y)))
        for c in sorted(self.needs.rows(x)):
            for kind in row_kinds(x, c):
                rounds.setdefault(self.shift(x, c, False), ([], []))[1].append(Transfer(c, Key(kind, c, x)))
        for c in sorted(self.needs.cols(x)):
            for kind in col_kinds(x, c):
                rounds.setdefault(self.shift(x, c, False), ([], []))[1].append(Transfer(c, Key(kind, c, self.P + x)))
        return rounds

    def groups_of(self, x: int) -> dict[int, int]:
        """Burst mode: the group (0 .. groups-1) of each chunk rank x computes blocks of (other
        than its own) -- the round its slots come in and its partials go home: chunks by shift
        (x - c) mod P, cut into groups of about equal work (allowed pairs of their blocks). Both
        sides of a transfer derive it from the needs."""
        got = self._group_memo.get(x)
        if got is None:
            work: dict[int, int] = {}
            for i, j in self.needs.blocks(x):
                pairs = self.index.summary(i, j)[1]
                for c in {i, j} - {x}:
                    work[c] = work.get(c, 0) + pairs
            # groups of at least group_tokens pulled tokens: a round's latency and a call's merge
            # are then small against the transfer and the compute they overlap
            pulled = sum(b - a for sel in self.needs.rows(x).values() for a, b in sel) + \
                sum(b - a for sel in self.needs.cols(x).values() for a, b in sel)
            n = max(1, min(self.groups, pulled // self.group_tokens))
            chunks = sorted(work, key=lambda c: (x - c) % self.P)
            total, acc, got = sum(work.values()), 0, {}
            for c in chunks:  # a chunk's group: where the work before it (and half its own) falls
                got[c] = min(n - 1, int(n * (acc + work[c] / 2) / max(1, total)))
                acc += work[c]
            self._group_memo[x] = got
        return got

    def block_group(self, x: int, b: tuple[int, int]) -> int:
        """A block's return group on rank x: the latest of its remote chunks'."""
        groups = self.groups_of(x)
        return max((groups[c] for c in b if c != x), default=0)

    def return_round(self, sender: int, owner: int) -> int:
        """Round in which ``sender`` returns its partials of chunk ``owner``'s tokens: in burst
        mode one per return group (:meth:`groups_of`), after the pull round; else one per shift
        d = sender - owner, after every pull round. Each goes home as soon as the blocks writing it
        ran, and sender and owner agree on it."""
        if self.burst:
            return 1 + self.groups + self.groups_of(sender)[owner]
        return self.P + (sender - owner) % self.P

    def returns(self, x: int, direction: str) -> dict[int, tuple[list, list, list, set]]:
        """Return round -> (sends, recvs, merges, chunks): my partials of others' tokens go home;
        theirs of mine arrive (and are merged / added at the listed segments); ``chunks``: the
        owners of what I send (its blocks must have run before the round is posted)."""
        backward = direction == "backward"
        kind = "dq" if backward else "o"
        rounds: dict[int, tuple[list, list, list, set]] = {}

        def at(t: int) -> tuple[list, list, list, set]:
            r = rounds.get(t)  # (not setdefault: it would build the four containers at every call)
            if r is None:
                r = rounds[t] = ([], [], [], set())
            return r
        for c in sorted(self.needs.rows(x)):
            r = at(self.return_round(x, c))
            r[0].append(Transfer(c, Key(kind, c, x)))
            r[3].add(c)
        if backward:
            for c in sorted(self.needs.cols(x)):
                r = at(self.return_round(x, c))
                r[0].append(Transfer(c, Key("dkv", c, self.P + x)))
                r[3].add(c)
        for y in self.needs.row_needers(x):
            k = Key(kind, x, y, incoming=True)
            r = at(self.return_round(y, x))
            r[1].append(Transfer(y, k))
            r[2].append((AddGrad if backward else MergeOut)(k, Key(kind, x), self.needs.rows(y)[x]))
        if backward:
            for y in self.needs.col_needers(x):
                k = Key("dkv", x, self.P + y, incoming=True)
                r = at(self.return_round(y, x))
                r[1].append(Transfer(y, k))
                r[2].append(AddGrad(k, Key("dkv", x), self.needs.cols(y)[x]))
        return rounds

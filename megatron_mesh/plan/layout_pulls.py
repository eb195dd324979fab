"""What the units of a layout pull from each other, and what that costs
(:func:`~.choice.layout_cost`'s pair-level parts): each unit's runs cut at document edges
(:func:`_portions`), its allowed pairs and, per pair of units, the tokens one pulls from the other
and the rows that read them (:func:`_work_and_pulls`), the kernel calls and merges those add to the
compute (:func:`_overheads`), and the rounds that move them (:class:`_Rounds`).

``pulls[g]``: unit -> (tokens, rows) -- what unit g pulls from each unit it reads (K/V of a
document's tokens before g's last row of it, and g's rows of the document after the holder's
first token). Looked up by puller, then holder: at 256 ranks the balanced layout's pulls run to
8-27K pairs of units on 16K-token documents and to every pair (65,280) where one document holds a
third of the tokens (seed 8 of ``lognormal:16384``); a pair's tuple as a dictionary key cost a
fifth of each pass. Every loop here runs once per pair at most; ``tests/plan/test_choice.py`` and
``tests/plan/test_layout_pulls.py`` check each against its plain form. The ring shifts' rounds,
the one pass that looks up neighbours' pulls (1 us a pull), are walked only where a lower bound
from per-unit sums does not already decide the choice (:meth:`_Rounds.bound`).
"""

from __future__ import annotations

import bisect
import operator

from .accounting import buffer_bytes
from .docwork import document_work
from .layout import Layout
from .shape import AttentionShape
from .sparse_needs import first_fits
from .topology import Topology
from .tunables import TUNABLES

__all__: list[str] = []  # the parts of choice.py's price; choice.py and its tests read them


def _portions(layout: Layout, units: int, span: int, docs) -> dict[int, dict[int, list[tuple[int, int]]]]:
    """document -> unit -> its (start, stop) intervals, document-relative."""
    starts = [a for a, _ in docs]
    out: dict[int, dict[int, list[tuple[int, int]]]] = {}
    for u in range(units):
        for d, pos, stop in _document_pieces(layout, u, span, docs, starts):
            a = docs[d][0]
            out.setdefault(d, {}).setdefault(u, []).append((pos - a, stop - a))
    return out


def _document_pieces(layout: Layout, unit: int, span: int, docs, starts):
    """Unit ``unit``'s runs in its buffer's order, cut where a document of ``docs`` ends: (document,
    start, stop) in global positions (``starts``: the documents' starts)."""
    for _, s, n in layout.runs(unit, span):
        pos, end = s, s + n
        while pos < end:
            d = bisect.bisect_right(starts, pos) - 1
            stop = min(end, docs[d][1])
            yield d, pos, stop
            pos = stop


def _work_and_pulls(portions, docs, units: int) -> tuple[list[int], list[dict[int, tuple[int, int]]]]:
    """Each unit's allowed pairs (causal documents), and per unit g what it pulls from each unit h:
    ``pulls[g][h]`` = (h's tokens of a document before g's last row of it, g's rows of it after h's
    first token -- the rows that read them and merge the result)."""
    work = [0] * units
    pulls: list[dict[int, tuple[int, int]]] = [{} for _ in range(units)]
    at = bisect.bisect_right
    for d, holders in portions.items():
        length = docs[d][1] - docs[d][0]
        span = []  # (unit, first token, last token, tokens, its runs' starts, stops and tokens before each)
        for u, runs in holders.items():
            for a, b in runs:
                work[u] += document_work(a, b, length)
            starts, stops, before = _counts(runs)
            span.append((u, starts[0], stops[-1] - 1, before[-1], starts, stops, before))  # runs disjoint
        if len(span) < 2:
            continue
        # a unit's tokens before x, written out (thousands of pairs of a long document's holders,
        # no call but the bisection): before[i] + min(x, stops[i]) - starts[i], i its last run
        # starting at or before x
        for h, h_first, h_last, h_tokens, h_starts, h_stops, h_before in span:
            x = h_first + 1
            for g, g_first, y, g_tokens, g_starts, g_stops, g_before in span:  # g's last row y reads h's tokens before it
                if y <= h_first or g == h:
                    continue
                if y > h_last:
                    n = h_tokens
                else:
                    i = at(h_starts, y) - 1
                    stop = h_stops[i]
                    n = h_before[i] + (y if y < stop else stop) - h_starts[i]
                if g_first > h_first:
                    rows = g_tokens
                else:
                    i = at(g_starts, x) - 1
                    stop = g_stops[i]
                    rows = g_tokens - (g_before[i] + (x if x < stop else stop) - g_starts[i])
                got = pulls[g]
                old = got.get(h)  # a pair of units rarely shares two documents
                got[h] = (n, rows) if old is None else (old[0] + n, old[1] + rows)
    return work, pulls


def _counts(runs) -> tuple[list[int], list[int], list[int]]:
    """The starts and stops of ``runs`` ((start, stop), ...) in order, and how many of their tokens
    lie before each (and, last, all of them): x has before[i] + min(x, stops[i]) - starts[i] before
    it, i the last run starting at or before x."""
    ordered = sorted(runs)
    before = [0]
    for a, b in ordered:
        before.append(before[-1] + b - a)
    return [a for a, _ in ordered], [b for _, b in ordered], before


_tokens = operator.itemgetter(0)  # of a pull (tokens, rows)


class _PullSums:
    """What the passes over a layout's pulls count, per unit: as a puller its kernel calls (a
    block's pieces), rows and tokens (``calls``, ``rows``, ``pulled``) and how many units it pulls
    from (``peers_pulled``); as a holder the tokens pulled from it and by how many (``held``,
    ``peers_pulling``) -- :func:`_pull_sums`, what the compute and the host read -- and, once
    :meth:`linked` (where the transfers are priced), the units whose K/V it keeps for the backward
    (``kept``) and per link class ([within its node, across nodes]) the tokens it pulls (``into``)
    and that are pulled from it (``out``), how many pulls each (``n_into``, ``n_out``), and the
    same of the pulls made again in the backward (``again_*``: not kept)."""

    classed = ("into", "n_into", "out", "n_out", "again_into", "n_again_into", "again_out", "n_again_out")

    def __init__(self, pulls, node, keeps):
        units = len(pulls)
        self.pulls, self.node, self.keeps, self.done, self.near_done = pulls, node, keeps, False, False
        self.calls, self.rows, self.kept, self.partial = [0] * units, [0] * units, [frozenset()] * units, [False] * units
        self.every = {name: [0] * units for name in self.classed}  # every pull, whatever its class
        self.near = {name: [0] * units for name in self.classed}  # the pulls within a node
        self.pulled, self.held = self.every["into"], self.every["out"]  # tokens
        self.peers_pulled, self.peers_pulling = self.every["n_into"], self.every["n_out"]  # units

    def __getattr__(self, name: str):
        if name not in _PullSums.classed or not self.done:
            raise AttributeError(name)
        if not self.near_done:  # counted on the first look: the ring shifts' walk reads none of it
            _count_near(self)
            self.near_done = True
        return [[a, b - a] for a, b in zip(self.near[name], self.every[name])]

    def linked(self) -> "_PullSums":
        """These sums with what each unit keeps, and the link classes: the pulls made again are
        their pullers' pulls less the pulls they keep (far fewer: at most what fits in the keep
        limit); on the first look at a class, one pass over the few pulls within a node (a unit's
        node mates: at most 7 at 8 GPUs a node; where every pair of 256 ranks pulls, 248 of a
        unit's 255 pulls cross nodes)."""
        if self.done:
            return self
        every, again_out, n_again_out = self.every, self.every["again_out"], self.every["n_again_out"]
        for g, got in enumerate(self.pulls):
            if not self.partial[g]:
                self.kept[g] = frozenset(got)
                continue
            keep = self.kept[g] = self.keeps(g, got, list(map(_tokens, got.values())))
            again = every["into"][g]
            for h in keep:
                n = got[h][0]
                again -= n
                again_out[h] -= n
                n_again_out[h] -= 1
            every["again_into"][g], every["n_again_into"][g] = again, len(got) - len(keep)
        self.done = True
        return self


def _pull_sums(pulls, node, piece: int, fits, keeps) -> _PullSums:
    """:class:`_PullSums` of ``pulls`` over units on nodes ``node``, a block of R rows and C columns
    priced as ceil(max(R, 1) / ``piece``) x ceil(C / ``piece``) calls; ``fits(g, tokens)``: unit g
    keeps all it pulls (``tokens`` in all), ``keeps(g, got, sizes)`` (where not): the units whose
    K/V it keeps of its pulls ``got`` (``sizes``: their tokens, in ``got``'s order). One pass over
    every pull (at 256 ranks 4-65K of them) of two adds to lists."""
    s = _PullSums(pulls, node, keeps)
    every, units = s.every, len(pulls)
    out, n_out = [0] * units, [0] * units  # what the pullers keeping all they pull pull
    again_out, n_again_out = every["again_out"], every["n_again_out"]  # and the others: less what they keep, once linked
    for g, got in enumerate(pulls):
        tokens = sum(map(_tokens, got.values()))
        partial = s.partial[g] = not fits(g, tokens)  # some pulled again
        tally, count = (again_out, n_again_out) if partial else (out, n_out)
        calls, rows = len(got), 0  # a call per pull (n >= 1), more where a block is over a piece a side
        for h, (n, r) in got.items():
            if r > piece or n > piece:
                calls += ((r - 1) // piece + 1 if r > 1 else 1) * -(-n // piece) - 1
            rows += r
            tally[h] += n
            count[h] += 1
        s.calls[g], s.rows[g], every["into"][g], every["n_into"][g] = calls, rows, tokens, len(got)
    every["out"][:] = [a + b for a, b in zip(out, again_out)]
    every["n_out"][:] = [a + b for a, b in zip(n_out, n_again_out)]
    return s


def _count_near(s: _PullSums) -> None:
    """The pulls between node mates, counted into ``s.near``."""
    node, mates = s.node, {}
    for u in range(len(s.pulls)):
        mates.setdefault(node[u], []).append(u)
    near = s.near
    for g, got in enumerate(s.pulls):
        keep = s.kept[g]
        for h in mates[node[g]]:
            pull = got.get(h)
            if pull is None:
                continue
            names = ("into", "n_into", "out", "n_out") + (("again_into", "n_again_into", "again_out", "n_again_out")
                                                          if h not in keep else ())
            for name, unit, x in zip(names, (g, g, h, h) * 2, (pull[0], 1) * 4):
                near[name][unit] += x


def _sums_of(pulls, units: int, shape: AttentionShape, topo: Topology, span: int, keep_limit: float) -> _PullSums:
    """:func:`_pull_sums` on ``topo`` (``units`` of ``span`` ranks), each unit keeping what fits in
    ``keep_limit`` x its own Q, K and V (:func:`_kept`)."""
    kv, q = buffer_bytes("kv", 1, shape), buffer_bytes("q", 1, shape)
    budget = keep_limit * shape.seq_local * (q + kv)
    return _pull_sums(pulls, [topo.node(u * span) for u in range(units)], topo.mask_piece,
                      lambda g, tokens: tokens * kv <= budget, lambda g, got, sizes: _kept(g, got, sizes, kv, budget))


def _overheads(s: _PullSums, shape: AttentionShape, topo: Topology) -> tuple[list[float], list[float]]:
    """Per unit, forward and backward seconds its remote blocks add to the compute stream (``s``:
    its pulls' sums): their kernel calls (one per piece of at most ``topo.mask_piece`` rows and
    columns); the merge of their partial outputs into its rows (fp32 accumulator read and written,
    the result read), of dQ, the copy of the pulled columns' dK/dV partials; on the holder, the
    add of the partials it gets back (:mod:`.costs` prices the same)."""
    acc, e, d = max(4, shape.itemsize), shape.itemsize, shape.head_dim
    h, g = shape.batch * shape.heads, shape.batch * shape.kv_heads
    row_f = h * (2 * acc * (d + 1) + e * d + 4) / topo.memory_bandwidth
    row_b = h * (2 * acc * d + e * d) / topo.memory_bandwidth
    col_puller, col_holder = 2 * g * (acc + e) * d / topo.memory_bandwidth, 3 * 2 * g * acc * d / topo.memory_bandwidth
    latency = topo.kernel_latency
    return ([c * latency + r * row_f for c, r in zip(s.calls, s.rows)],
            [c * latency + r * row_b + n * col_puller + x * col_holder
             for c, r, n, x in zip(s.calls, s.rows, s.pulled, s.held)])


class _Rounds:
    """The rounds that move a layout's pulls (:func:`~.choice.layout_cost`'s communication;
    ``sums``: theirs, :func:`_sums_of`): the busiest unit's forward seconds (K/V) and backward
    seconds (dK/dV partials back, K/V again where not kept). :meth:`exact` walks the rounds;
    :meth:`bound` is a lower bound of it from the sums, without another pass over the pulls --
    where every pair of units pulls (seed 8 of ``lognormal:16384`` at 256 ranks: 65,280 pulls)
    within 1-3 % of the walk -- and for TASP's rounds, which are priced from the sums, the same
    as :meth:`exact`."""

    def __init__(self, sums: _PullSums, shape: AttentionShape, topo: Topology, burst: bool):
        self.sums, self.burst = sums.linked(), burst
        self.pulls, self.units = sums.pulls, len(sums.pulls)
        self.kv, self.dkv = buffer_bytes("kv", 1, shape), buffer_bytes("dkv", 1, shape)
        self.node, self.link = self.sums.node, [(topo.latency(c), topo.bandwidth(c)) for c in ("intra", "inter")]

    def exact(self) -> tuple[float, float]:
        """The busiest unit's forward and backward seconds (:func:`_shift_rounds`, :func:`_burst_of`)."""
        if self.burst:
            return self.bound()
        return _busiest(_shift_rounds(self.pulls, self.units, self.kv, self.dkv, self.node, self.link, self.sums.kept))

    def bound(self) -> tuple[float, float]:
        """At most :meth:`exact`'s (equal for TASP): in a ring shift's round a unit sends to one peer
        and receives from another, and each of its pulls, and each pull from it, has a round of its
        own -- so its rounds of a kind take at least all it receives and at least all it sends,
        each transfer its link's latency + bytes / bandwidth.

        Worked example (3 units of one node, l the latency, b the seconds a token): unit 1 pulls 5
        tokens from unit 0 (shift 1) and unit 0 pulls 20 from unit 1 (shift 2: 1 + 2 = 0 mod 3).
        Unit 1's forward rounds, walked: shift 1 receives 5, shift 2 sends 20 -- 2l + 25b; bounded:
        max(l + 5b, l + 20b) = l + 20b. Where each unit sends and receives in most rounds, as where
        every pair of units pulls, the two come close (``tests/plan/test_layout_pulls.py``)."""
        s, kv, dkv, link = self.sums, self.kv, self.dkv, self.link
        if self.burst:
            return _busiest(_burst_of(s, kv, dkv, link))

        def busier(size, into, n_into, out, n_out):
            return [max(sum(n[c] * link[c][0] + x[c] * size / link[c][1] for c in (0, 1)),
                        sum(m[c] * link[c][0] + y[c] * size / link[c][1] for c in (0, 1)))
                    for x, n, y, m in zip(into, n_into, out, n_out)]
        into, n_into, out, n_out = s.into, s.n_into, s.out, s.n_out
        return _busiest((busier(kv, into, n_into, out, n_out),
                         busier(dkv, into, n_into, out, n_out),  # partials: a unit sends one per pull it made
                         busier(kv, s.again_into, s.n_again_into, s.again_out, s.n_again_out)))


def _busiest(rounds) -> tuple[float, float]:
    """The busiest unit's forward seconds and backward seconds (its partials' and again's rounds)."""
    forward, back, again = rounds
    return max(forward, default=0.0), max((a + b for a, b in zip(back, again)), default=0.0)


def _kept(g: int, got: dict, sizes: list[int], kv: int, budget: float) -> frozenset:
    """The units whose K/V unit g keeps for the backward of its pulls ``got`` (``sizes``: their
    tokens, in ``got``'s order): :func:`~.sparse_needs.kept_chunks` of them (n tokens x ``kv``
    bytes each) within ``budget`` bytes, in tokens (n x kv <= budget exactly where n <=
    floor(budget) // kv) -- no dict of bytes for each of 256 units' 255 pulls where one document
    lies on every rank of 256."""
    if sum(sizes) * kv <= budget:  # all of it fits
        return frozenset(got)
    order = list(got)
    if order != sorted(order):  # a puller's pulls are made in units' order: sorted already, mostly
        order = sorted(order)
        sizes = [got[h][0] for h in order]
    at = bisect.bisect_right(order, g)  # by shift: (g - h) mod units, the units below g first
    return first_fits(order[at - 1::-1] + order[:at - 1:-1], sizes[at - 1::-1] + sizes[:at - 1:-1], int(budget) // kv)


def _shift_rounds(pulls, units: int, kv: int, dkv: int, node, link, kept: list) -> tuple[list[float], ...]:
    """Each unit's seconds in ring-shift rounds, per kind of round: the forward's K/V, the dK/dV
    partials back, K/V again to the units that do not keep them (``kept[g]``: the units whose K/V
    unit g keeps). In the round of shift d a unit sends to u + d and receives from u - d at once,
    each transfer its link's latency + bytes / bandwidth, and the slower of the two decides. One
    pass serves all three kinds: a partial goes back over its pull's pair the other way (shift -d),
    so what the forward looks up for a pull src -> dst -- what src receives that round, what dst
    sends -- is what the backward needs."""
    forward, back, again = [0.0] * units, [0.0] * units, [0.0] * units
    for dst, got in enumerate(pulls):
        for src, (n, _) in got.items():
            lat, bw = link[node[src] != node[dst]]
            t, r = lat + n * kv / bw, lat + n * dkv / bw
            d = dst - src
            prev, nxt = (src - d) % units, (dst + d) % units
            into = pulls[src].get(prev)  # what src receives in the round it sends this: its K/V's time
            if into is not None:
                lat, bw = link[node[prev] != node[src]]
                into = lat + into[0] * kv / bw
            out = pulls[nxt].get(dst)  # what dst sends in it: its partials' time back (in this pull's return round)
            if out is not None:
                lat, bw = link[node[dst] != node[nxt]]
                out = lat + out[0] * dkv / bw
            forward[src] += t if into is None or into <= t else into
            if out is None:  # dst sends nothing that round: it only receives
                forward[dst] += t
            back[dst] += r if out is None or out <= r else out
            if into is None:
                back[src] += r
            if src not in kept[dst]:  # pulled again in the backward: the forward's rounds less the kept pulls
                other = None if into is None or prev in kept[src] else into
                again[src] += t if other is None or other <= t else other
                if out is None or dst in kept[nxt]:
                    again[dst] += t
    return forward, back, again


def _burst_of(s: _PullSums, kv: int, dkv: int, link) -> tuple[list[float], ...]:
    """Each unit's seconds in TASP's rounds, per kind of round (as :func:`_shift_rounds`): every
    peer at once, in up to ``TUNABLES.burst_groups`` groups, the busier direction of each link
    class deciding -- priced from the linked sums ``s``, each unit's tokens out and in and its
    peers per link class, of every pull and of those pulled again: a kind's bytes are its tokens x
    the K/V's or the partials' bytes a token, the partials going back the way their K/V came."""
    def peers(a, b):
        return [[x[0] + y[0], x[1] + y[1]] for x, y in zip(a, b)]
    every, again = peers(s.n_into, s.n_out), peers(s.n_again_into, s.n_again_out)
    return (_burst_seconds(s.out, s.into, every, kv, link), _burst_seconds(s.into, s.out, every, dkv, link),
            _burst_seconds(s.again_out, s.again_into, again, kv, link))


def _burst_seconds(sent, received, peers, size: int, link) -> list[float]:
    """Per unit: per link class its peers' latency (up to ``TUNABLES.burst_groups`` rounds) + the
    busier direction's bytes (``sent`` / ``received`` tokens x ``size``) / bandwidth; the slower class."""
    groups = TUNABLES.burst_groups
    return [max((link[c][0] * min(groups, p[c]) + max(s[c] * size, r[c] * size) / link[c][1] for c in (0, 1) if p[c]),
                default=0.0) for s, r, p in zip(sent, received, peers)]

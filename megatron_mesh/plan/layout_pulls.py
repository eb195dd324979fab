"""What the units of a layout pull from each other, and what that costs
(:func:`~.choice.layout_cost`'s pair-level parts): each unit's runs cut at document edges
(:func:`_portions`), its allowed pairs and, per pair of units, the tokens one pulls from the other
and the rows that read them (:func:`_work_and_pulls`), the kernel calls and merges those add to the
compute (:func:`_overheads`), and the rounds that move them (:func:`_comm`).

``pulls[g]``: unit -> (tokens, rows) -- what unit g pulls from each unit it reads (K/V of a
document's tokens before g's last row of it, and g's rows of the document after the holder's
first token). Looked up by puller, then holder: at 256 ranks the balanced layout's pulls run to
8-27K pairs of units on 16K-token documents and to every pair (65,280) where one document holds a
third of the tokens (seed 8 of ``lognormal:16384``); a pair's tuple as a dictionary key cost a
fifth of each pass. Every loop here runs once per pair; ``tests/plan/test_choice.py`` checks each
against its plain form.
"""

from __future__ import annotations

import bisect

from .accounting import buffer_bytes
from .docwork import document_work
from .layout import Layout
from .shape import AttentionShape
from .sparse_needs import kept_chunks
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


def _overheads(pulls, units: int, shape: AttentionShape, topo: Topology) -> tuple[list[float], list[float]]:
    """Per unit, forward and backward seconds its remote blocks add to the compute stream: their
    kernel calls (one per piece of at most ``topo.mask_piece`` rows and columns); the merge of their partial outputs into its rows (fp32
    accumulator read and written, the result read), of dQ, the copy of the pulled columns' dK/dV
    partials; on the holder, the add of the partials it gets back (:mod:`.costs` prices the same)."""
    acc, e, d = max(4, shape.itemsize), shape.itemsize, shape.head_dim
    h, g = shape.batch * shape.heads, shape.batch * shape.kv_heads
    row_f = h * (2 * acc * (d + 1) + e * d + 4) / topo.memory_bandwidth
    row_b = h * (2 * acc * d + e * d) / topo.memory_bandwidth
    col_puller, col_holder = 2 * g * (acc + e) * d / topo.memory_bandwidth, 3 * 2 * g * acc * d / topo.memory_bandwidth
    forward, backward = [0.0] * units, [0.0] * units
    piece, latency = topo.mask_piece, topo.kernel_latency
    for dst, got in enumerate(pulls):
        for src, (cols, rows) in got.items():
            # a masked block runs as kernel calls on pieces of at most mask_piece x mask_piece tokens
            # (ceil(max(rows, 1) / piece) written out: the call to max was a quarter of this loop)
            launches = ((rows - 1) // piece + 1 if rows > 1 else 1) * -(-cols // piece) * latency
            forward[dst] += launches + rows * row_f
            backward[dst] += launches + rows * row_b + cols * col_puller
            backward[src] += cols * col_holder
    return forward, backward


def _comm(pulls, units: int, shape: AttentionShape, topo: Topology, span: int, burst: bool,
          keep_limit: float) -> tuple[float, float]:
    """The busiest unit's forward and backward communication (module docstring): the forward pulls
    K/V; the backward returns dK/dV partials and pulls K/V again where they are not kept (what fits
    in ``keep_limit`` x a unit's own Q, K and V is)."""
    kv, dkv, q = (buffer_bytes(k, 1, shape) for k in ("kv", "dkv", "q"))
    budget = keep_limit * shape.seq_local * (q + kv)
    kept = [kept_chunks(g, units, {h: n * kv for h, (n, _) in got.items()}, budget) for g, got in enumerate(pulls)]
    node = [topo.node(u * span) for u in range(units)]
    link = [(topo.latency(c), topo.bandwidth(c)) for c in ("intra", "inter")]
    # each unit's seconds per kind of round: K/V forward, dK/dV partials back, K/V again (the
    # forward's transfers to the units that do not keep them: every unit's, often)
    forward, back, again = (_burst_rounds if burst else _shift_rounds)(pulls, units, kv, dkv, node, link, kept)
    return max(forward, default=0.0), max((a + b for a, b in zip(back, again)), default=0.0)


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


def _burst_rounds(pulls, units: int, kv: int, dkv: int, node, link, kept: list) -> tuple[list[float], ...]:
    """Each unit's seconds in TASP's rounds, per kind of round (as :func:`_shift_rounds`): every
    peer at once, in up to ``TUNABLES.burst_groups`` groups, the busier direction of each link
    class deciding. One pass counts each unit's tokens out and in and its peers per link class, of
    every pull and of those pulled again: a kind's bytes are its tokens x the K/V's or the
    partials' bytes a token, the partials going back the way their K/V came."""
    out, into, peers, out_again, into_again, peers_again = ([[0, 0] for _ in range(units)] for _ in range(6))
    for g, got in enumerate(pulls):
        for h, (n, _) in got.items():
            c = node[h] != node[g]
            out[h][c] += n
            into[g][c] += n
            peers[h][c] += 1
            peers[g][c] += 1
            if h not in kept[g]:
                out_again[h][c] += n
                into_again[g][c] += n
                peers_again[h][c] += 1
                peers_again[g][c] += 1
    return (_burst_seconds(out, into, peers, kv, link), _burst_seconds(into, out, peers, dkv, link),
            _burst_seconds(out_again, into_again, peers_again, kv, link))


def _burst_seconds(sent, received, peers, size: int, link) -> list[float]:
    """Per unit: per link class its peers' latency (up to ``TUNABLES.burst_groups`` rounds) + the
    busier direction's bytes (``sent`` / ``received`` tokens x ``size``) / bandwidth; the slower class."""
    groups = TUNABLES.burst_groups
    return [max((link[c][0] * min(groups, p[c]) + max(s[c] * size, r[c] * size) / link[c][1] for c in (0, 1) if p[c]),
                default=0.0) for s, r, p in zip(sent, received, peers)]

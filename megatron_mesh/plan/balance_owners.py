"""A balanced layout whose blocks are computed where it names (``BalancedLayout.owners``), built in
tens of milliseconds for a few ranks (:func:`owners_layout`; issue 53 item 2).

Under the query owner a document on k ranks makes each of its tokens read by every holder of a
later row, so even perfectly balanced the busiest rank sends 1.3-1.5x the query-owner bound
(:mod:`.bound`); choosing the rank that computes each block goes below it. The layouts are those of
:mod:`.owner_model` (long documents in contiguous portions poured along the ranks, short ones whole)
and are scored by its model, which counts what Mesh's plan of them moves:

1. **Starts.** (a) Each long document on k ranks of its own in equal portions: k among the 3
   choices with the fewest bytes, max over the documents of L (1 - 1/k) (every block ships one
   portion, each rank takes part in k - 1 blocks), whose ranks compute at most
   :data:`LONG_SHARE` x the mean work with ceil((k - 1) / 2) blocks each; (b) the long documents
   poured over work / (alpha x mean) ranks' worth, alpha in :data:`ALPHAS`. The short documents,
   longest first, go to the rank with the most tokens and work left, then single moves and swaps
   bring each rank's tokens and work towards what the long portions leave (a).
2. **Owners of a pour** (:func:`_orient`): largest block first on whichever end stays under
   :data:`ORIENT_LIMIT` x the mean (else the less loaded; the fewer shipped tokens breaking
   ties), then single flips while they lower the work above that limit, then the busiest rank's
   shipped tokens.
3. **Descent over the short documents** (:func:`_descend`): from the :data:`STARTS` best starts, a
   short document moved or two swapped, each candidate re-poured and its owners chosen again --
   what balances the work: with the owners kept, a rank holding a large short document cannot
   shed its blocks -- :data:`EVALUATIONS` candidates in all.
4. **Polish** (:func:`_steepest`): :data:`POLISH` candidates of steepest descent on the model's
   exact bytes (a block to its other end or a least-loaded rank, a short document moved or
   swapped at the busiest ranks).

Worked example (P = 3 ranks of 8 tokens, documents of 12, 4, 4 and 4 tokens; work 78 + 3 x 10,
mean 36): the long document on 2 ranks would give one of them 6 x 6 / 2 + 6 + 36 = 57 pairs, so
it goes on 3 in portions of 4, each rank beside one short document; each rank computes one of the
three blocks (16 pairs): 10 + 10 + 16 = 36 pairs each, work max/mean 1.00 (the query owner: 20,
36 and 52), and each rank sends one portion of 4 tokens for each of its two blocks -- K/V,
dK/dV, Q and dO, or O and dQ (``tests/plan/test_balance_owners.py``).

On the CPU problem (8 ranks, 64K tokens of ``lognormal:4096,1.0``, seeds 0-9) the busiest rank
sends a median 1.24x the query-owner bound (the work-balanced layout: 2.93x) at work max/mean <=
1.045, in 41-95 ms per sample (docs/performance.md has the table). On seeds 0-39, 5 samples
would exceed 1.05 (1.05-1.14) -- a block is computed whole on one rank, and a long document's
portions are set by the whole short documents around them: there it raises, and the
work-balanced layout (:func:`~.balance.balanced_layout`) is the one to use. Its cost grows with
the pairs of ranks (one candidate: 0.1 ms at 8 ranks, 27 ms at 256) and its choice of k with the
long documents, so it refuses more than :data:`MAX_RANKS` ranks or :data:`MAX_LONG` long
documents; its layouts run on Mesh's plans (ring and TASP refuse owners).
"""

from __future__ import annotations

import itertools
import math
import random

from .balance import BalancedLayout
from .owner_model import Problem, State, layout_of, pairs
from .sparse_needs import KEEP_LIMIT, check_keep_limit
from .shape import AttentionShape

__all__ = ["owners_layout", "MAX_RANKS", "MAX_LONG"]

MAX_RANKS = 8  # one candidate costs ~0.1 ms at 8 ranks: the defaults fit ~100 ms there
MAX_LONG = 6  # the starts try every k per long document: 6 choices each
LONG_SHARE = 0.9  # a start's long portions leave each rank 10 % of the mean work for short documents
ALPHAS = (0.6, 0.8, 1.0)
ORIENT_LIMIT = 1.04
EVALUATIONS = 800
STARTS = 4
POLISH = 100
PENALTY = 1e4  # MB per unit of work above the bound (summed over ranks): balance first


def _equal_targets(problem: Problem, ks) -> tuple[list[float], list[float]]:
    """Each rank's long tokens and long work: document d on ks[d] consecutive ranks in equal
    portions, rank n of its k computing (k - 1) / 2 blocks (k odd; k / 2 or k / 2 - 1 even)."""
    P = problem.P
    x, u, r = [0.0] * P, [0.0] * P, 0
    for d, k in zip(problem.long, ks):
        p = problem.lengths[d] / k
        for n in range(k):
            blocks = (k - 1) / 2 if k % 2 else (k / 2 - 1 if n >= k // 2 else k / 2)
            x[r] += p
            u[r] += p * p / 2 + blocks * p * p
            r += 1
    return x, u


def _poured_targets(problem: Problem, alpha: float) -> tuple[list[float], list[float]]:
    """Each rank's long tokens and long work: the long documents poured along the ranks, document
    d over max(work_d / (alpha x mean), L_d / T) ranks' worth (scaled down to P in all)."""
    P, T, M = problem.P, problem.T, problem.mean
    f = [max(pairs(problem.lengths[d]) / (alpha * M), problem.lengths[d] / T) for d in problem.long]
    f = [v * min(1.0, P / sum(f)) for v in f]
    x, u, at = [0.0] * P, [0.0] * P, 0.0
    for d, fd in zip(problem.long, f):
        L = problem.lengths[d]
        for r in range(int(at), min(P, math.ceil(at + fd))):
            share = (min(at + fd, r + 1) - max(at, r)) / fd
            x[r] += L * share
            u[r] += pairs(L) * share
        at += fd
    return x, u


def _k_choices(problem: Problem, top: int = 3) -> list[tuple[int, ...]]:
    """Ranks per long document for the equal starts: sum at most P, those whose ranks stay under
    LONG_SHARE x the mean first, then the fewest busiest bytes max_d L_d (1 - 1/k_d)."""
    P, T, M = problem.P, problem.T, problem.mean
    ranges = [range(max(2, math.ceil(problem.lengths[d] / T)), max(2, math.ceil(problem.lengths[d] / T)) + 6)
              for d in problem.long]
    combos = []
    for ks in itertools.product(*ranges):
        if sum(ks) > P:
            continue
        sent = max(problem.lengths[d] * (1 - 1 / k) for d, k in zip(problem.long, ks))
        worst = max((p * p / 2 + math.ceil((k - 1) / 2) * p * p) / M
                    for p, k in ((problem.lengths[d] / k, k) for d, k in zip(problem.long, ks)))
        combos.append((worst > LONG_SHARE, sent, ks))
    return [ks for _, _, ks in sorted(combos)[:top]]


def _place_shorts(problem: Problem, x, u) -> dict[int, int]:
    """The short documents, longest first, each on the rank (among those it fits) with the most
    tokens and work left after the long portions' ``x`` tokens and ``u`` work."""
    T, M = problem.T, problem.mean
    tok, wk, room = [T - v for v in x], [M - v for v in u], [T] * problem.P
    home = {}
    for d in sorted(problem.short, key=lambda d: (-problem.lengths[d], d)):
        n = problem.lengths[d]
        fits = [r for r in range(problem.P) if tok[r] >= n] or [r for r in range(problem.P) if room[r] >= n]
        if not fits:
            return {}
        r = max(fits, key=lambda r: (tok[r] / T + wk[r] / M, -r))
        home[d] = r
        tok[r] -= n
        room[r] -= n
        wk[r] -= pairs(n)
    return home


def _polish_shorts(problem: Problem, home, x, u, tok_weight: float = 4.0, passes: int = 6) -> dict[int, int]:
    """Single moves and swaps of short documents, each the one that most lowers the squared misses
    of each rank's short tokens (T - x) and short work (mean - u), until none does."""
    P, T, M = problem.P, problem.T, problem.mean
    st, sw = [0] * P, [0] * P
    for d, r in home.items():
        st[r] += problem.lengths[d]
        sw[r] += pairs(problem.lengths[d])

    def miss(r, dt=0, dw=0):
        a, b = (st[r] + dt - T + x[r]) / T, (sw[r] + dw - M + u[r]) / M
        return tok_weight * a * a + b * b + (1e3 if st[r] + dt > T else 0.0)

    home = dict(home)
    shorts = sorted(problem.short, key=lambda d: -problem.lengths[d])
    for _ in range(passes):
        moved = False
        for d in shorts:
            n, w, r = problem.lengths[d], pairs(problem.lengths[d]), home[d]
            best, swap = 1e-12, None
            for e in [None] + shorts:  # None: d alone to rank t
                for t in (range(P) if e is None else (home[e],)):
                    if t == r:
                        continue
                    m, v = (0, 0) if e is None else (problem.lengths[e], pairs(problem.lengths[e]))
                    gain = miss(r) + miss(t) - miss(r, m - n, v - w) - miss(t, n - m, w - v)
                    if gain > best:
                        best, swap = gain, (e, t, m, v)
            if swap is not None:
                e, t, m, v = swap
                st[r], sw[r], st[t], sw[t] = st[r] + m - n, sw[r] + v - w, st[t] + n - m, sw[t] + w - v
                home[d] = t
                if e is not None:
                    home[e] = r
                moved = True
        if not moved:
            break
    return home


def _blocks(problem: Problem, ranks) -> tuple[list[int], dict[tuple[int, int], list[int]]]:
    """Each rank's own pairs, and per block (i, j) of the long documents' portions: [pairs, i's
    rows, j's columns]."""
    work = [sum(pairs(b - a) for _, a, b in pcs) for pcs in ranks]
    where: dict[int, list] = {}
    for r, pcs in enumerate(ranks):
        for d, a, b in pcs:
            if d in problem.long_set:
                where.setdefault(d, []).append((r, a, b))
    blocks: dict[tuple[int, int], list[int]] = {}
    for pcs in where.values():
        for i, a, b in pcs:
            for j, c, e in pcs:
                if i != j and e <= a:
                    blk = blocks.setdefault((i, j), [0, 0, 0])
                    blk[0] += (b - a) * (e - c)
                    blk[1] += b - a
                    blk[2] += e - c
    return work, blocks


def _orient(problem: Problem, home, order, passes: int = 3):
    """(cost, owners) of the pour of ``home``: each block on one of its two ranks (the module
    docstring, step 2); the cost is the work above ORIENT_LIMIT x the mean (1e5 per mean) plus
    the busiest rank's shipped tokens. None where the homes overfill a rank."""
    ranks = problem.portions(State(home, order, {}))
    if ranks is None:
        return None
    P, lim, scale = problem.P, ORIENT_LIMIT * problem.mean, 1e5 / problem.mean
    work, blocks = _blocks(problem, ranks)
    sent, own = [0] * P, {}
    keys = sorted(blocks, key=lambda k: (-blocks[k][0], k))
    for i, j in keys:
        w, pi, pj = blocks[i, j]
        top = max(sent[i], sent[j])
        h, ship = min((max(0.0, work[i] + w - lim), top + pj, work[i], i, pj),
                      (max(0.0, work[j] + w - lim), top + pi, work[j], j, pi))[3:]
        own[i, j] = h
        work[h] += w
        sent[i] += ship
        sent[j] += ship
    over = sum(v - lim for v in work if v > lim) * scale
    cost = over + max(sent)
    for _ in range(passes):
        flipped = False
        for i, j in keys:
            w, pi, pj = blocks[i, j]
            h = own[i, j]
            g = j if h == i else i
            delta = (pj if g == i else pi) - (pj if h == i else pi)
            d_over = (max(0.0, work[h] - w - lim) - max(0.0, work[h] - lim)
                      + max(0.0, work[g] + w - lim) - max(0.0, work[g] - lim)) * scale
            sent[i] += delta
            sent[j] += delta
            if over + d_over + max(sent) < cost - 1e-9:
                over, own[i, j], flipped = over + d_over, g, True
                cost = over + max(sent)
                work[h] -= w
                work[g] += w
            else:
                sent[i] -= delta
                sent[j] -= delta
        if not flipped:
            break
    return cost, own


def _descend(problem: Problem, home, order, evaluations: int, rng: random.Random):
    """First-improvement descent over the short documents' ranks (step 3): (home, owners)."""
    P, shorts = problem.P, list(problem.short)
    cost, own = _orient(problem, home, order)
    used, improved = 0, True
    while improved and used < evaluations:
        improved = False
        moves = [(d, t, None) for d in shorts for t in range(P) if t != home[d]]
        moves += [(d, None, e) for n, d in enumerate(shorts) for e in shorts[n + 1:] if home[d] != home[e]]
        rng.shuffle(moves)
        for d, t, e in moves[:evaluations - used]:
            nxt = dict(home)
            if e is None:
                nxt[d] = t
            else:
                nxt[d], nxt[e] = home[e], home[d]
            got = _orient(problem, nxt, order)
            used += 1
            if got is not None and got[0] < cost - 1e-9:
                (cost, own), home, improved = got, nxt, True
                break
    return home, own


def _cost(result, max_balance: float) -> float:
    """MB the busiest rank sends, plus PENALTY per unit of work above max_balance (summed over ranks)."""
    if result is None:
        return math.inf
    mean = sum(result[3]) / len(result[3])
    return result[0] / 1e6 + PENALTY * sum(max(0.0, w / mean - max_balance) for w in result[3])


def _candidates(problem: Problem, state: State, result, lows: int = 3) -> list[State]:
    """Every move at the busiest-work and busiest-sending ranks: a block they take part in or
    compute to another end or one of the ``lows`` least-loaded ranks; a short document of theirs
    to a least-loaded rank, or swapped with one there."""
    P, (sent, work, ranks) = problem.P, result[2:5]
    hi, top = max(range(P), key=work.__getitem__), max(range(P), key=sent.__getitem__)
    low = sorted(range(P), key=work.__getitem__)[:lows]
    out = []
    for i, j in sorted(_blocks(problem, ranks)[1]):
        h = state.owner(i, j)
        if {hi, top} & {i, j, h}:
            for g in sorted({i, j, *low} - {h}):
                out.append(State(state.home, state.order, {**state.owners, (i, j): g}))
    for src in sorted({hi, top}):
        for d in [d for d, r in state.home.items() if r == src]:
            for t in low:
                if t != src:
                    out.append(State({**state.home, d: t}, state.order, state.owners))
                    out += [State({**state.home, d: t, e: src}, state.order, state.owners)
                            for e, r in state.home.items() if r == t]
    return out


def _steepest(problem: Problem, state: State, result, budget: int, max_balance: float):
    """Steepest descent on the model's exact cost (step 4), at most ``budget`` candidates."""
    cost, used = _cost(result, max_balance), 0
    while used < budget:
        best = None
        for nxt in _candidates(problem, state, result)[:budget - used]:
            got = problem.score(nxt)
            used += 1
            c = _cost(got, max_balance)
            if c < cost and (best is None or c < best[0]):
                best = (c, nxt, got)
        if best is None:
            break
        cost, state, result = best
    return cost, state, result


def _check(cu_seqlens, world_size: int, shape: AttentionShape, keep_limit: float) -> Problem:
    if not isinstance(world_size, int) or not 2 <= world_size <= MAX_RANKS:
        raise ValueError(f"world_size must be an integer from 2 to {MAX_RANKS} (MAX_RANKS: the builder's cost grows "
                         f"with the pairs of ranks), got {world_size!r}")
    cu = list(cu_seqlens)
    if cu[:1] != [0] or any(b <= a for a, b in zip(cu, cu[1:])) or cu[-1] != world_size * shape.seq_local:
        raise ValueError(f"cu_seqlens must rise from 0 to world_size x shape.seq_local = "
                         f"{world_size * shape.seq_local}, got {cu[:4]}...{cu[-2:]}")
    problem = Problem(world_size, [b - a for a, b in zip(cu, cu[1:])], shape, keep_limit)
    if not 1 <= len(problem.long) <= MAX_LONG:
        raise ValueError(f"the builder needs 1 to {MAX_LONG} long documents (work above the mean per rank, or more "
                         f"than {shape.seq_local} tokens), got {len(problem.long)}; balanced_layout lays out the others")
    return problem


def owners_layout(cu_seqlens, world_size: int, shape: AttentionShape, *, max_balance: float = 1.05,
                  evaluations: int = EVALUATIONS, polish: int = POLISH, seed: int = 0,
                  keep_limit: float = KEEP_LIMIT) -> BalancedLayout:
    """The layout of the documents ``cu_seqlens`` (causal, no window) over ``world_size`` ranks of
    ``shape.seq_local`` tokens, with the owner of each block (module docstring); deterministic for
    a ``seed``. ValueError, naming the value, where it would exceed ``max_balance`` work max/mean
    (the CPU problem's mix: 5 of seeds 0-39), more than MAX_RANKS ranks or MAX_LONG long documents,
    or none. ``keep_limit``: what Mesh's backward will keep (``backward_keep_limit``), which the
    bytes it minimises count."""
    check_keep_limit("keep_limit", keep_limit)
    problem = _check(cu_seqlens, world_size, shape, keep_limit)
    order = list(range(world_size))
    homes = []
    for ks in _k_choices(problem):
        x, u = _equal_targets(problem, ks)
        home = _place_shorts(problem, x, u)
        homes.append(_polish_shorts(problem, home, x, u) if home else home)
    homes += [_place_shorts(problem, *_poured_targets(problem, alpha)) for alpha in ALPHAS]
    starts = sorted((got[0], n, home) for n, home in enumerate(homes)
                    if (home or not problem.short) and (got := _orient(problem, home, order)) is not None)
    if not starts:
        raise ValueError(f"the short documents of {list(cu_seqlens)[:6]}... fit on no start of {world_size} ranks")
    rng, best = random.Random(seed), None
    for _, _, home in starts[:STARTS]:
        home, own = _descend(problem, home, order, evaluations // STARTS, rng)
        state = State(home, order, own)
        got = _steepest(problem, state, problem.score(state), polish, max_balance - 0.005)
        if best is None or got[0] < best[0]:
            best = got
    _, state, result = best
    if result[1] > max_balance:  # the family cannot always balance (a block is computed whole on one rank)
        raise ValueError(f"the owner-choosing builder reached work max/mean {result[1]:.3f} on these documents, above "
                         f"max_balance {max_balance}; balanced_layout balances them")
    return layout_of(problem, list(cu_seqlens), state, result[4])

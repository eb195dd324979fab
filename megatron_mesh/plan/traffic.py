"""What one direction's communication costs: each round's duration (its slowest rank, or every
rank's own for mask-aware plans) and the bytes each rank sends over each link class -- the
communication half of :func:`~.simulate.simulate` (its approximations 1 and 3).

A round takes ``latency + max(egress, ingress) / bandwidth`` per link class ("intra"/"inter",
:class:`~.topology.Topology`), the slower class deciding: transfers of a round that leave (enter)
a GPU on the same class share its egress (ingress) bandwidth, e.g. TASP's seven NVLink sends of
one step, or one NIC per GPU.

Worked example (ring attention, P = 2, one node): round 1 of the forward sends one KV chunk each
way between ranks 0 and 1, so its duration is ``intra latency + KV chunk bytes / intra bandwidth``
and each rank sends one KV chunk.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from .accounting import key_bytes
from .hybrid import inner_shape
from .ir import Plan, Post
from .shape import AttentionShape
from .topology import LINK_CLASSES, Topology

__all__ = ["RoundTraffic", "round_traffic"]


@dataclass(frozen=True)
class RoundTraffic:
    """What the communication of one direction costs, over all ranks.

    ``duration[t]``: round t's duration on the slowest rank; ``sent[r]`` / ``inter[r]``: bytes
    rank r sends in total / across nodes (``None`` when only summarised); ``mean_*``/``max_*``
    summarise over all ranks.
    """

    duration: dict[int, float]
    bytes_sent: int
    mean_intra: float
    mean_inter: float
    max_inter: int
    sent: tuple[int, ...] | None = None
    received: tuple[int, ...] | None = None
    inter: tuple[int, ...] | None = None
    per_rank: dict[tuple[int, int], float] | None = None  # (rank, round) -> that rank's round duration


def _round_time(loads: dict[tuple[str, bool], int], topo: Topology) -> float:
    """Duration of one rank's round from its bytes per (link class, is_send)."""
    t = 0.0
    for link in LINK_CLASSES:
        out, inc = loads.get((link, True), 0), loads.get((link, False), 0)
        if out or inc:
            t = max(t, topo.latency(link) + max(out, inc) / topo.bandwidth(link))
    return t


def _posts(ops) -> list[Post]:
    return [op for op in ops if isinstance(op, Post)]


def _nbytes(plan: Plan, key, shape: AttentionShape, cache: dict) -> int:
    # slots that differ per chunk: mask-aware plans', and a hybrid's all-to-all rounds by document
    per_chunk = key.slot >= 0 and (plan.slots_vary or plan.facts.inner is not None and key.span == 1)
    ck = (key.kind, key.slot, key.span, key.heads, key.chunk if per_chunk else 0)
    n = cache.get(ck)
    if n is None:
        n = cache[ck] = key_bytes(plan, key, shape)
    return n


def _post_loads(plan: Plan, r: int, post: Post, shape: AttentionShape, topo: Topology,
                cache: dict) -> tuple[Counter, int, int, int]:
    """Rank r's bytes in one round per (link class, is_send), and its bytes sent, sent across
    nodes and received."""
    loads: Counter = Counter()
    sent = inter = received = 0
    for t in post.sends:
        n = _nbytes(plan, t.key, shape, cache)
        link = topo.link(r, t.peer)
        loads[(link, True)] += n
        sent += n
        inter += n if link == "inter" else 0
    for t in post.recvs:
        n = _nbytes(plan, t.key, shape, cache)
        loads[(topo.link(t.peer, r), False)] += n
        received += n
    return loads, sent, inter, received


def round_traffic(plan: Plan, shape: AttentionShape, topo: Topology, direction: str,
                  exact: bool = False) -> RoundTraffic:
    """Per-round durations and link bytes of ``direction`` (see :class:`RoundTraffic`).

    ``exact``: read every rank's rounds (O(P x rounds) op objects); otherwise derive them from
    rank 0's rounds and ``plan.rings`` (approximation 3 of the module docstring), falling back to
    the exact reading when rank 0's transfers do not follow the plan's rings.
    """
    topo.check(plan.world_size)
    if not exact:
        if plan.facts.inner is not None:
            return _composed_traffic(plan, shape, topo, direction)
        if plan.facts.direct:  # ranks move different tokens to different peers: every rank is read
            return _exact_traffic(plan, shape, topo, direction)
        fast = _RingTraffic.build(plan, shape, topo, direction)
        if fast is not None:
            return fast
    return _exact_traffic(plan, shape, topo, direction)


def _inner_shift(plan: Plan, direction: str) -> int:
    """How far a hybrid shifts its inner plan's rounds (the all-to-all rounds before them): CP rank
    m * U runs inner rank m's rounds, relabelled; the first inner rank that moves anything says."""
    U = plan.facts.ulysses
    for m in range(plan.facts.inner.world_size):
        theirs = next((op.round for op in plan.facts.inner.round_ops(m, direction)
                       if type(op) is Post and (op.sends or op.recvs)), None)
        ours = next((op.round for op in plan.round_ops(m * U, direction) if type(op) is Post
                     and any(x.key.span == U for x in op.sends + op.recvs)), None) if theirs is not None else None
        if ours is not None:
            return ours - theirs
    return 1  # the inner plan moves nothing: no round of it to place


def _composed_traffic(plan: Plan, shape: AttentionShape, topo: Topology, direction: str) -> RoundTraffic:
    """A Ulysses hybrid: its all-to-all rounds (every rank sends one head slice to each of its
    group peers) plus the inner plan's traffic, priced on the inner group of head slice 0 (CP ranks
    m * U; every slice's group sits on the same nodes) with its rounds shifted by the all-to-all
    rounds before them (one, or one per set of a layout balanced for the groups). The all-to-all
    is priced per rank where the inner plan is (its rounds' sizes differ by group on a balanced
    layout), else on rank 0 and rank P-1 (Megatron's zigzag: the same on every rank).

    Where every rank is read, CP rank r's bytes are its own all-to-all bytes plus inner rank
    r // U's, and the busiest rank is the maximum of those totals: once documents make rounds
    uneven, the rank with the most all-to-all bytes is not the one with the most inner bytes."""
    U = plan.facts.ulysses
    inner = plan.facts.inner
    sub = inner_shape(shape, U)
    inner_topo = replace(topo, node_of=tuple(topo.node(m * U) for m in range(inner.world_size)))
    t = round_traffic(inner, sub, inner_topo, direction)
    shift = _inner_shift(plan, direction)
    duration = {r + shift: d for r, d in t.duration.items()}
    per_rank = None
    if t.per_rank is not None:  # every head slice's inner group runs the same rounds on its own ranks
        per_rank = {(m * U + u, rnd + shift): d for (m, rnd), d in t.per_rank.items() for u in range(U)}
    ranks = range(plan.world_size) if per_rank is not None else (0, plan.world_size - 1)
    cache: dict = {}
    a2a = [_a2a_rank(plan, r, shape, topo, direction, duration, per_rank, cache) for r in ranks]
    if per_rank is None or t.sent is None:  # the same all-to-all and inner bytes on every rank
        a2a_sent, a2a_inter = max(x[0] for x in a2a), max(x[1] for x in a2a)
        return RoundTraffic(duration, t.bytes_sent + a2a_sent, t.mean_intra + a2a_sent - a2a_inter,
                            t.mean_inter + a2a_inter, t.max_inter + a2a_inter, per_rank=per_rank)
    P = plan.world_size
    sent = tuple(t.sent[r // U] + a2a[r][0] for r in ranks)
    inter = tuple(t.inter[r // U] + a2a[r][1] for r in ranks)
    received = tuple(t.received[r // U] + a2a[r][2] for r in ranks)
    a2a_inter = sum(x[1] for x in a2a) / P
    return RoundTraffic(duration, max(sent), t.mean_intra + sum(x[0] for x in a2a) / P - a2a_inter,
                        t.mean_inter + a2a_inter, max(inter), sent, received, inter, per_rank)


def _a2a_rank(plan: Plan, r: int, shape: AttentionShape, topo: Topology, direction: str, duration: dict,
              per_rank: dict | None, cache: dict) -> tuple[int, int, int]:
    """CP rank r's all-to-all rounds of a hybrid: their durations go into ``duration`` (the slowest
    rank's) and ``per_rank``; returns r's all-to-all bytes sent, sent across nodes and received."""
    sent = inter = received = 0
    for op in plan.round_ops(r, direction):
        if type(op) is not Post or not any(x.key.span == 1 for x in op.sends + op.recvs):
            continue
        loads, out, across, got = _post_loads(plan, r, op, shape, topo, cache)
        sent, inter, received = sent + out, inter + across, received + got
        took = _round_time(loads, topo)
        duration[op.round] = max(duration.get(op.round, 0.0), took)
        if per_rank is not None:
            per_rank[(r, op.round)] = took
    return sent, inter, received


def _exact_traffic(plan: Plan, shape: AttentionShape, topo: Topology, direction: str) -> RoundTraffic:
    cache: dict = {}
    duration: dict[int, float] = {}
    per_rank: dict[tuple[int, int], float] = {}
    sent, received, inter, intra = [], [], [], []
    for r in range(plan.world_size):
        s = rcv = x = i = 0
        for post in _posts(plan.round_ops(r, direction)):
            loads, out, across, got = _post_loads(plan, r, post, shape, topo, cache)
            s, x, i, rcv = s + out, x + across, i + out - across, rcv + got
            per_rank[(r, post.round)] = _round_time(loads, topo)
            duration[post.round] = max(duration.get(post.round, 0.0), per_rank[(r, post.round)])
        sent.append(s)
        received.append(rcv)
        inter.append(x)
        intra.append(i)
    P = plan.world_size
    return RoundTraffic(duration, max(sent), sum(intra) / P, sum(inter) / P, max(inter), tuple(sent),
                        tuple(received), tuple(inter), per_rank)


class _RingTraffic:
    """Approximation 3: every rank's round t moves rank 0's bytes to its own ring neighbours.

    A transfer of rank 0 is labelled by the ring it travels on: (family, ring index, send/recv).
    On rank r the same label means: the successor (send) or predecessor (receive) of r on that
    ring if r is on it, else on the ring of the same family that holds r (Mesh: r's own Q or KV
    ring). Ranks with the same link class for every label are interchangeable, so each round is
    priced once per class pattern.
    """

    def __init__(self, plan: Plan):
        self.plan, P = plan, plan.world_size
        self.arc: dict[tuple[int, int], tuple[str, int] | None] = {}  # None: on two rings
        self.next: dict[tuple[str, int], dict[int, int]] = {}
        self.prev: dict[tuple[str, int], dict[int, int]] = {}
        self.holder: dict[str, list[int]] = {}  # family -> rank -> the one ring holding it (-1: none/several)
        for fam, rs in plan.rings.items():
            holder = self.holder[fam] = [-1] * P
            seen = [0] * P
            for k, ring in enumerate(rs):
                n = len(ring)
                nxt = self.next[(fam, k)] = {u: ring[(i + 1) % n] for i, u in enumerate(ring)}
                self.prev[(fam, k)] = {u: ring[(i - 1) % n] for i, u in enumerate(ring)}
                for u in ring:
                    seen[u] += 1
                    holder[u] = k if seen[u] == 1 else -1
                    if n > 1:
                        a = (u, nxt[u])
                        self.arc[a] = None if a in self.arc else (fam, k)

    def peers(self, fam: str, k: int, is_send: bool) -> list[int] | None:
        """Every rank's peer for label (fam, k, is_send), or None if some rank has no such ring."""
        table = self.next if is_send else self.prev
        own, holder = table[(fam, k)], self.holder[fam]
        out = []
        for r in range(self.plan.world_size):
            p = own.get(r)
            if p is None:
                h = holder[r]
                if h < 0:
                    return None
                p = table[(fam, h)][r]
            out.append(p)
        return out

    @classmethod
    def build(cls, plan: Plan, shape: AttentionShape, topo: Topology, direction: str) -> RoundTraffic | None:
        P = plan.world_size
        if P == 1:
            return RoundTraffic({}, 0, 0.0, 0.0, 0, (0,), (0,), (0,))
        self = cls(plan)
        cache: dict = {}
        labels: dict[tuple[str, int, bool], int] = {}
        rounds: list[tuple[int, list[tuple[int, int]]]] = []  # round -> [(label index, bytes)]
        for post in _posts(plan.round_ops(0, direction)):
            items = []
            for is_send, transfers in ((True, post.sends), (False, post.recvs)):
                for t in transfers:
                    ring = self.arc.get((0, t.peer) if is_send else (t.peer, 0))
                    if ring is None:
                        return None
                    li = labels.setdefault((*ring, is_send), len(labels))
                    items.append((li, _nbytes(plan, t.key, shape, cache)))
            rounds.append((post.round, items))
        label_list = list(labels)
        peers = [self.peers(*label) for label in label_list]  # label -> rank -> peer
        if any(p is None for p in peers):
            return None
        if not cls._matches(plan, direction, P - 1, rounds, label_list, [p[P - 1] for p in peers], shape, cache):
            return None
        node = [topo.node(r) for r in range(P)]
        links = [["intra" if node[r] == node[p] else "inter" for r, p in enumerate(row)] for row in peers]
        return cls._summarise(rounds, label_list, links, topo, P)

    @staticmethod
    def _matches(plan, direction, r, rounds, label_list, peers_r, shape, cache) -> bool:
        """Rank r's real rounds are the predicted ones (same peers, same bytes, same order)."""
        real = _posts(plan.round_ops(r, direction))
        if [p.round for p in real] != [t for t, _ in rounds]:
            return False
        for post, (_, items) in zip(real, rounds):
            got = sorted([(True, t.peer, _nbytes(plan, t.key, shape, cache)) for t in post.sends]
                         + [(False, t.peer, _nbytes(plan, t.key, shape, cache)) for t in post.recvs])
            if got != sorted((label_list[li][2], peers_r[li], n) for li, n in items):
                return False
        return True

    @staticmethod
    def _summarise(rounds, label_list, links, topo: Topology, P: int) -> RoundTraffic:
        patterns = Counter(zip(*links))  # rank -> its link class per label; equal rows price alike
        duration: dict[int, float] = {}
        priced: dict[tuple, float] = {}  # most rounds repeat the same transfers (a ring step)
        sent_by_label: Counter = Counter()
        for t, items in rounds:
            sig = tuple(items)
            worst = priced.get(sig)
            if worst is None:
                worst = 0.0
                for pattern in patterns:
                    loads: Counter = Counter()
                    for li, n in items:
                        loads[(pattern[li], label_list[li][2])] += n
                    worst = max(worst, _round_time(loads, topo))
                priced[sig] = worst
            duration[t] = worst
            for li, n in items:
                if label_list[li][2]:
                    sent_by_label[li] += n
        total = sum(sent_by_label.values())
        inter_of = {pattern: sum(n for li, n in sent_by_label.items() if pattern[li] == "inter") for pattern in patterns}
        mean_inter = sum(inter_of[p] * c for p, c in patterns.items()) / P
        return RoundTraffic(duration, total, total - mean_inter, mean_inter, max(inter_of.values(), default=0))

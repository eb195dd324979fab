"""Intra-tile schedules: the order in which a rank pulls chunks, computes blocks and returns
accumulators, written once in *offset space* and shared by every rank (SPMD).

A rank sits on two rings (Mesh-Attention): its Q ring (size a) and its KV ring (size b). Offset k
on a ring means "the chunk that started k hops behind me", offset 0 is the rank's own chunk.
Because every rank runs the same template, the send of round t on one rank always meets the
receive of round t on its ring neighbour: the plan is deadlock-free by construction (the
validator still checks it).

Template ops (tuples):

* ``("post", t, items)`` -- start round t. An item is ``("pull", ring, k)``: forward the chunk at
  offset k-1 to the next rank, receive the one at offset k from the previous; or
  ``("acc", ring, k)``: send my accumulator for offset k to the next rank and receive the
  accumulator for offset k+1 (mod the ring size: the last one is my own total) from the previous.
* ``("wait", t)`` -- complete round t (rounds are waited in the order they were posted).
* ``("block", u, v)`` -- compute the block of Q offset u and KV offset v.
* ``("merge", ring, k)`` -- fold the incoming accumulator for offset k into my own partial.

Accumulators travel the ring like the chunks do: the partial output (forward) or dQ (backward) of
the Q chunk at offset k is merged on every rank that computed part of it, hop by hop, and the
last hop delivers the total to the owner. This keeps all traffic between ring neighbours (the
paper's "wrap-around mesh"), and it is exactly ring attention's dK/dV handling when a = 1.

Pull orders
-----------
``lockstep``: round k pulls the next Q chunk and the next KV chunk together (k = 1..max(a,b)-1).

``greedy`` (the default): one pull per round; the next pull is the one that unlocks the most block
compute per byte moved -- a new Q chunk unlocks one block per KV chunk held and costs one Q
transfer, a new KV chunk unlocks one block per Q chunk held and costs one KV transfer. Ties go to
KV, so that the last pulls are Q chunks and remote rows then complete one at a time (their
partial outputs leave while the rest computes). Blocks are computed as soon as both chunks are
held, remote rows first in ring order, the local row last.

Worked example (4 ranks, tile 2x2, MHA: a KV chunk is twice the bytes of a Q chunk)::

    start       Q {0}    KV {0}    compute block (0,0) while round 1 runs
    round 1     pull Q offset 1     (Q: unlocks 1 block / 1 unit,  KV: 1 block / 2 units)
    round 2     pull KV offset 1    (the only pull left) ; meanwhile compute (1,0)
    then        compute (1,1) -> remote row 1 complete -> round 3 returns its partial output
                compute (0,1) -> local row complete; wait round 3, merge the incoming total.

The greedy pull sequence is a function of (a, b) and the Q/KV byte ratio only, so it is the same
on every rank.
"""

from __future__ import annotations

import typing
from typing import Iterable, Literal

__all__ = ["Schedule", "SCHEDULES", "pull_rounds", "build_template", "template_text"]

# the order a Mesh rank pulls its chunks in (see pull_rounds)
Schedule = Literal["greedy", "lockstep"]
SCHEDULES = typing.get_args(Schedule)


def pull_rounds(a: int, b: int, schedule: str, q_cost: float, kv_cost: float,
                q_have: int = 1, kv_have: int = 1) -> list[list[tuple[str, str, int]]]:
    """The pull items of each round, in order.

    ``q_have``/``kv_have`` say how many offsets of each ring are present before any pull (1: only
    the rank's own chunk; a or b: everything already held, nothing to pull).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    nq, nk = q_have, kv_have
    rounds: list[list[tuple[str, str, int]]] = []
    if schedule == "lockstep":
        while nq < a or nk < b:
            items = []
            if nq < a:
                items.append(("pull", "q", nq))
                nq += 1
            if nk < b:
                items.append(("pull", "kv", nk))
                nk += 1
            rounds.append(items)
        return rounds
    while nq < a or nk < b:
        # blocks unlocked per unit of transfer cost; a pull of Q offset nq pairs with nk KV chunks
        q_score = nk / q_cost if nq < a else -1.0
        kv_score = nq / kv_cost if nk < b else -1.0
        if nk < b and kv_score >= q_score:
            rounds.append([("pull", "kv", nk)])
            nk += 1
        else:
            rounds.append([("pull", "q", nq)])
            nq += 1
    return rounds


class _Template:
    """The template being built (see :func:`build_template`): the ops so far, the rounds posted
    and not yet waited, the blocks unlocked, and per ring which accumulators have left."""

    def __init__(self, a: int, b: int, acc_rings: tuple[str, ...], q_have: int, kv_have: int):
        self.acc_rings = acc_rings
        self.size = {"q": a, "kv": b}
        self.have = {"q": list(range(q_have)), "kv": list(range(kv_have))}
        # blocks unlocked but not computed yet; a new Q (KV) offset unlocks one block per KV (Q) offset held
        self.ready: list[tuple[int, int]] = [(u, v) for u in self.have["q"] for v in self.have["kv"]]
        self.left = {"q": [b] * a, "kv": [a] * b}  # blocks still to compute per Q offset (row) / KV offset (column)
        self.next_acc = {ring: 1 for ring in acc_rings}  # next offset whose accumulator leaves, per ring
        self.acc_round: dict[tuple[str, int], int] = {}  # (ring, k) -> round that sent offset k (and brought k+1)
        self.ops: list[tuple] = []
        self.posted: list[int] = []  # rounds posted and not yet waited, in posting order
        self.rounds = 0

    def post(self, items: list) -> int:
        self.rounds += 1
        self.ops.append(("post", self.rounds, tuple(items)))
        self.posted.append(self.rounds)
        return self.rounds

    def wait_through(self, t: int) -> None:
        # rounds complete in posting order on every transport (NCCL runs them on one stream)
        while self.posted and self.posted[0] <= t:
            self.ops.append(("wait", self.posted.pop(0)))

    def send_accumulators(self) -> None:
        """Post the accumulator of every offset whose blocks are all done, in offset order per ring."""
        for ring in self.acc_rings:
            k = self.next_acc[ring]
            while k < self.size[ring] and self.left[ring][k] == 0:
                if k >= 2:  # fold in what the previous rank sent for this offset
                    self.wait_through(self.acc_round[(ring, k - 1)])
                    self.ops.append(("merge", ring, k))
                self.acc_round[(ring, k)] = self.post([("acc", ring, k)])
                k += 1
            self.next_acc[ring] = k

    def compute_ready(self) -> None:
        """Compute the unlocked blocks, each accumulator leaving as soon as its blocks are done."""
        # remote rows first, in ring order (their accumulators leave first); local row last
        self.ready.sort(key=lambda uv: (uv[0] == 0, uv[0], uv[1] == 0, uv[1]))
        for u, v in self.ready:
            self.ops.append(("block", u, v))
            self.left["q"][u] -= 1
            self.left["kv"][v] -= 1
            self.send_accumulators()
        self.ready.clear()

    def arrived(self, items) -> None:
        """The pulled offsets of a waited round are here: each unlocks its blocks with the other ring's."""
        for _, ring, k in items:
            other = "kv" if ring == "q" else "q"
            self.ready.extend((k, o) if ring == "q" else (o, k) for o in self.have[other])
            self.have[ring].append(k)

    def finish(self) -> list[tuple]:
        """The last blocks and accumulators, the merges of this rank's own totals, every wait."""
        self.compute_ready()
        self.send_accumulators()
        for ring in self.acc_rings:
            if self.size[ring] > 1:  # the last accumulator round brought my own total
                self.wait_through(self.acc_round[(ring, self.size[ring] - 1)])
                self.ops.append(("merge", ring, 0))
        self.wait_through(self.rounds)
        return self.ops


def build_template(a: int, b: int, rounds: list[list[tuple[str, str, int]]], acc_rings: Iterable[str],
                   q_have: int = 1, kv_have: int = 1) -> list[tuple]:
    """Interleave the pull rounds with block computes and accumulator returns (see module doc).

    ``acc_rings``: the rings whose accumulators travel home -- ("q",) in the forward (partial
    outputs), ("q", "kv") in the backward (dQ and dK/dV).
    """
    template = _Template(a, b, tuple(acc_rings), q_have, kv_have)
    for items in rounds:
        t = template.post(items)
        template.compute_ready()
        template.wait_through(t)
        template.arrived(items)
    return template.finish()


def template_text(ops: list[tuple]) -> str:
    """A readable one-line form of a template, e.g. 'B00 P1[q1] B10 W1 ...' (for docs/tests)."""
    parts = []
    for op in ops:
        if op[0] == "post":
            parts.append(f"P{op[1]}[" + ",".join(f"{'' if it[0] == 'pull' else 'acc:'}{it[1]}{it[2]}" for it in op[2]) + "]")
        elif op[0] == "wait":
            parts.append(f"W{op[1]}")
        elif op[0] == "block":
            parts.append(f"B{op[1]}{op[2]}")
        else:
            parts.append(f"M{op[1]}{op[2]}")
    return " ".join(parts)

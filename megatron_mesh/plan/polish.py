"""Polishing a mask-aware plan by simulation: how much of its own block each rank runs first.

A rank of a mask-aware plan (:mod:`.sparse`) runs its own block -- its rows against its own keys,
which nobody waits for -- where it hides a transfer: all of it first where no partial moves
(hiding the pulls), all of it after the return rounds where the rank sends partials home or
receives them (what it sends travels while it computes, and its peers wait for it at their
step's end). That rule knows neither the pulls a rank still waits for nor the host, and both can
matter:

* **Pulls waited for.** A rank with return rounds may still wait for its pulls at the start (Mesh
  on its owners layout, the forward): some own calls first hide them.
* **The host.** Where a rank's other blocks are many small kernel calls, its host issues them more
  slowly than the device runs them; a long own call first lets the host run ahead while the
  device is busy.

So a plan of a few ranks (up to ``Tunables.polish_ranks``, with at least
``Tunables.polish_tokens`` tokens per rank: below that a step takes microseconds) is polished:
per direction, the rank that finishes last -- and the ranks it waited for longest -- try running
all of their own block's calls (one per document, in row order) before their other blocks, none,
then each count in between, in the plan rebuilt with that choice and simulated on the machine
the plan is priced on (``Placement.build``'s ``topology``); the first change that shortens the
direction is kept, and the search starts again from the new finisher, within
``Tunables.polish_sims`` simulations a direction. A trial shares the plan's blocks, slots and
rounds (:func:`~.sparse.reordered`), so the rounds' traffic, and what it made of the other ranks'
ops (:func:`~.ir.plan.carry`: their rank plans, host ops and compute seconds). The choices are the
plan's ``own_first`` fact (the header's ``own_first=3b0,4f3``: rank 3's backward none, rank 4's
forward 3); every rank building the same plan makes the same choices (the search is
deterministic), and ranks that chose differently would still match: only the order of a rank's
calls changes, not its rounds.

Worked example (8 GPUs, 64K tokens of ``lognormal:4096,1.0`` seed 6, Mesh on its owners layout,
the 8-GPU problem of docs/performance.md, "Polished by simulation"): blocks computed at their
keys' holder send partials home, and by the rule the ranks they go to and come from run their
own block last (the step 6.44 ms). In the forward rank 3 finishes last, waiting for the pulls
of rounds 3, 6 and 7; its 3 own calls first hide them, then rank 4's, the new last (the forward
2.09 -> 2.00 ms); the backward's finisher has no better choice. The step goes 6.44 -> 6.35 ms:
``own_first=3f3,4f3``. (Under stop 66's rule, the pulls' share of the bytes first, the same
search went 6.58 -> 6.29 ms -- the results' casts not priced then -- with five choices, three of
them "none first" in the backward: what the rule now does.)
"""

from __future__ import annotations

from typing import Callable

from .ir import Plan, Post
from .ir.plan import carry
from .shape import AttentionShape
from .simulate import PhaseResult, round_traffic, simulate_direction
from .topology import Topology
from .tunables import TUNABLES, Tunables

__all__ = ["polishes", "polish"]

DIRECTIONS = ("forward", "backward")


def polishes(world_size: int, tokens: int, tunables: Tunables = TUNABLES) -> bool:
    """Whether a mask-aware plan of ``world_size`` ranks and ``tokens`` per rank is polished."""
    return tunables.polish_sims > 1 and 1 < world_size <= tunables.polish_ranks and tokens >= tunables.polish_tokens


def polish(plan_of: Callable[[tuple], Plan], calls_of: Callable[[int, str], int], shape: AttentionShape,
           topology: Topology, tunables: Tunables = TUNABLES, *, rank_of: Callable[[int], int] = int,
           first: Plan | None = None) -> Plan:
    """The plan ``plan_of(own_first)`` with the ``own_first`` choices the search keeps (the module
    docstring): ``plan_of(())`` (``first``, where the caller has it) where no choice shortens it.
    ``calls_of(x, direction)``: the calls of rank x's own block there (the choices are 0 ... that
    many first: :func:`~.sparse.own_calls`); ``rank_of``: the rank of a choice that a rank of the
    plan runs by (a Ulysses hybrid's plan ranks g run inner rank g // U's choices)."""
    plan = plan_of(()) if first is None else first
    chosen: dict[tuple[int, str], bool] = {}
    for direction in DIRECTIONS:  # a choice changes one direction's ops: each is searched on its own
        # a choice reorders a rank's calls, not its rounds: every trial moves the plan's traffic
        traffic = round_traffic(plan, shape, topology, direction)
        phase = simulate_direction(plan, shape, topology, direction, timeline=True, traffic=traffic)
        sims = 1
        tried: set = set()
        improved = True
        while improved and sims < tunables.polish_sims:
            improved = False
            for x, k in _trials(plan, phase, direction, rank_of, calls_of, chosen, tried):
                if sims >= tunables.polish_sims:
                    break
                tried.add((x, k))
                trial = {**chosen, (x, direction): k}
                candidate = plan_of(tuple((r, d, f) for (r, d), f in trial.items()))
                ranks = [g for g in range(plan.world_size) if rank_of(g) == x]
                carry(candidate, plan, ranks)
                if all(candidate.rank(g).ops(direction) == plan.rank(g).ops(direction) for g in ranks):
                    continue  # the choice the rank made already: the same plan
                got = simulate_direction(candidate, shape, topology, direction, timeline=True, traffic=traffic)
                sims += 1
                if got.time < phase.time * (1 - 1e-9):
                    chosen, plan, phase, improved = trial, candidate, got, True
                    break
    return plan


def _trials(plan: Plan, phase: PhaseResult, direction: str, rank_of: Callable[[int], int],
            calls_of: Callable[[int, str], int], chosen: dict, tried: set) -> list[tuple[int, int]]:
    """(rank, own calls first) to try, in order: the rank finishing ``direction`` last, then the
    peers of the two rounds it waited for longest (each as ``rank_of`` it); each with all its own
    calls first, none, then 1 ... n - 1; less what is chosen or tried."""
    ends: dict[int, float] = {}
    waits: list[tuple[float, int]] = []
    for e in phase.timeline:
        if e.stream == "compute":
            ends[e.rank] = max(ends.get(e.rank, 0.0), e.end)
    last = max(sorted(ends), key=lambda r: ends[r])
    for e in phase.timeline:
        if e.rank == last and e.stream == "compute" and e.what.startswith("wait "):
            waits.append((e.end - e.start, int(e.what.split()[1])))
    ranks = [last]
    rounds = [t for _, t in sorted(waits, key=lambda w: (-w[0], w[1]))[:2]]
    for t in rounds:
        for op in plan.rank(last).ops(direction):
            if type(op) is Post and op.round == t:
                ranks += [p for p in dict.fromkeys(tr.peer for tr in op.sends + op.recvs) if p not in ranks]
    out = []
    for x in dict.fromkeys(rank_of(r) for r in ranks):
        n = calls_of(x, direction)
        out += [(x, k) for k in dict.fromkeys((n, 0, *range(1, n)))
                if (x, k) not in tried and chosen.get((x, direction)) != k]
    return out

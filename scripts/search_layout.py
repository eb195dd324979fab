#!/usr/bin/env python
"""Search one sample's documents for a layout, and where each of its blocks is computed, that
moves few bytes on the busiest rank at balanced work. Offline: it takes minutes per sample, so it
says how far the built layouts (``megatron_mesh.balanced_layout``) are from what is attainable;
it is not a data loader's layout.

The family searched (found on issue 19's CPU sample, 8 ranks, 64K tokens of lognormal:4096),
for causal attention over packed documents (no window):

* a *long* document -- work above the mean per-rank work, or more tokens than a rank holds -- is
  poured in contiguous portions into the tokens the others leave, along an order of the ranks
  (the longest first);
* every other document stays whole on one rank (no traffic);
* the block of rank i's queries against rank j's keys (where a long document's portions meet) is
  computed on one rank, i or j or another (``BalancedLayout.owners``).

Contiguous portions of a document meet in one block per pair of ranks, where zigzag portions meet in
two, and a block computed at either end lets work go where there is room. Worked example
(``BalancedLayout``'s): one document of 12 tokens on 3 ranks, [4r, 4r + 4) on rank r -- the
query owner gives the ranks 10, 26 and 42 pairs; computing block (2, 0) on rank 0 gives 26 each,
and each rank sends one portion per block it takes part in.

The search: simulated annealing from a seeded random start (moves: a short document to another
rank, two swapped, two ranks swapped in the pouring order, a block to another rank), scored by
the busiest rank's bytes sent (forward + backward, counted as the plan counts them, portions kept
for the backward where :class:`~megatron_mesh.plan.sparse_needs.Keeps` keeps them: the model of
``megatron_mesh/plan/owner_model.py``), with a penalty on work max/mean above ``--max-balance``. The best state is then built by the planner -- Mesh's plan
on the ``BalancedLayout`` with its owners -- and that plan's bytes and work are printed (they
equal the model's: a difference exits non-zero). ``--out`` writes the layout's text line, which
``compare_attention.py --layout-file`` runs on N processes against the fp64 reference:

    python scripts/search_layout.py --world 8 --seq-len 65536 --docs lognormal:4096,1.0 --heads 2 \\
        --kv-heads 2 --head-dim 32 --dtype fp32 --search-seeds 13 --iters 100000 --out /tmp/layout.txt
    python scripts/compare_attention.py --world 8 --seq-len 65536 --heads 2 --kv-heads 2 --head-dim 32 \\
        --dtype fp32 --docs lognormal:4096,1.0 --no-check --modes mesh --layout-file /tmp/layout.txt
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time

from megatron_mesh.plan import AttentionShape, Mask, plan_bytes, rank_work, resolve
from megatron_mesh.plan.layout import ZigzagLayout
from megatron_mesh.plan.owner_model import Problem, State, first_homes, layout_of
from megatron_mesh.tools.plan_args import document_bounds

ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}


class SearchState(State):
    """A :class:`~megatron_mesh.plan.owner_model.State` with the search's random moves."""

    def moved(self, problem: Problem, rng: random.Random) -> "SearchState":
        home, order, owners = dict(self.home), list(self.order), dict(self.owners)
        P, u = problem.P, rng.random()
        if u < 0.2 and problem.short:
            home[rng.choice(problem.short)] = rng.randrange(P)
        elif u < 0.35 and len(problem.short) > 1:
            a, b = rng.sample(problem.short, 2)
            home[a], home[b] = home[b], home[a]
        elif u < 0.5:
            a, b = rng.sample(range(P), 2)
            order[a], order[b] = order[b], order[a]
        else:
            i, j = rng.sample(range(P), 2)
            v = rng.random()
            owners[(i, j)] = i if v < 0.35 else j if v < 0.7 else rng.randrange(P)
        return SearchState(home, order, owners)


def objective(result, max_balance: float) -> float:
    """MB sent by the busiest rank, plus 1,000 per unit of work max/mean above the bound."""
    return math.inf if result is None else result[0] / 1e6 + 1000 * max(0.0, result[1] - max_balance)


def anneal(problem: Problem, seed: int, iters: int, max_balance: float, temp: float = 3.0):
    """The best (objective, state, result) of one annealing run from a seeded random start."""
    rng = random.Random(seed)
    P = problem.P
    order = rng.sample(range(P), P)
    # random homes can overfill a rank: a bounded number of draws, then the largest-first start
    for _ in range(100):
        state = SearchState({d: rng.randrange(P) for d in problem.short}, order, {})
        result = problem.score(state)
        if result is not None:
            break
    else:
        state = SearchState(first_homes(problem), order, {})
        result = problem.score(state)
    cost = objective(result, max_balance)
    best = (cost, state, result)
    decay = (0.002 / temp) ** (1 / max(iters, 1))  # to 2 kB at the end: only improvements then
    for _ in range(iters):
        nxt = state.moved(problem, rng)
        got = problem.score(nxt)
        c = objective(got, max_balance)
        if c < cost or (c < math.inf and rng.random() < math.exp((cost - c) / temp)):
            state, cost = nxt, c
            if c < best[0]:
                best = (c, nxt, got)
        temp *= decay
    return best


def zigzag_best(world: int, bounds: list[int], shape: AttentionShape) -> tuple[int, str]:
    """(bytes the busiest rank sends, mode) of the zigzag layout's best mode on these documents:
    ring, Mesh (its tile chosen as the runtime chooses it), TASP and, at an even CP size above 2,
    the Ulysses hybrids of degree 2 -- the issue's yardstick for a searched layout."""
    S = bounds[-1]
    mask = Mask.from_cu_seqlens(bounds, S, True, None).normalized(S)
    modes = [("ring", {}), ("mesh", {}), ("tasp", {})]
    if world % 2 == 0 and world > 2:
        modes += [(f"a2a+{inner}", {"ulysses_size": 2}) for inner in ("ring", "mesh", "tasp")]
    best = None
    for name, settings in modes:
        plan = resolve(name, world, shape, mask=Mask(True), **settings).build(shape, mask, ZigzagLayout(world, S))
        sent = max(b.sent for b in plan_bytes(plan, shape))
        label = name + (f":{settings['ulysses_size']}" if settings else "")
        if best is None or sent < best[0]:
            best = (sent, label)
    return best


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=8, help="CP size (default 8)")
    ap.add_argument("--seq-len", type=int, default=65536)
    ap.add_argument("--docs", default="lognormal:4096,1.0", help="documents, as megatron-mesh-plan --docs")
    ap.add_argument("--seed", type=int, default=0, help="random seed of --docs lognormal")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--dtype", choices=sorted(ITEMSIZE), default="fp32")
    ap.add_argument("--max-balance", type=float, default=1.05, help="work max/mean bound (default 1.05)")
    # one run of 100,000 moves takes 7-9 s on the 8-rank sample; the best of a few seeds is what is
    # worth reporting (seeds 0-7 of 300,000 moves there, stop 44: best 4.94 MB, median 6.0, worst 13.8)
    ap.add_argument("--search-seeds", type=int, nargs="+", default=[0, 1, 2, 3],
                    help="one annealing run per seed, the best kept (default 0 1 2 3)")
    ap.add_argument("--iters", type=int, default=100000, help="moves per run (default 100000)")
    ap.add_argument("--out", help="write the best layout's text line here")
    args = ap.parse_args(argv)
    # the plan built at the end is Mesh's, whose ranks hold two zigzag halves of the sequence
    if args.world < 2 or args.seq_len % (2 * args.world):
        ap.error(f"--world must be >= 2 and --seq-len divisible by 2 * --world, got {args.world} and {args.seq_len}")
    if args.iters < 0:
        ap.error(f"--iters must be >= 0, got {args.iters}")
    if not 1 <= args.max_balance < math.inf:  # NaN too: it would switch the balance penalty off
        ap.error(f"--max-balance must be a number >= 1, got {args.max_balance}")
    try:
        shape = AttentionShape(args.seq_len // args.world, 1, args.heads,
                               args.heads if args.kv_heads is None else args.kv_heads, args.head_dim,
                               ITEMSIZE[args.dtype])
        bounds = document_bounds(args.docs, args.seq_len, args.seed)
    except ValueError as e:
        ap.error(str(e))
    problem = Problem(args.world, [b - a for a, b in zip(bounds, bounds[1:])], shape)
    if not problem.long:
        ap.error(f"no document of --docs {args.docs} is long (more work than a rank's mean, or more tokens "
                 f"than its {problem.T}): the search pours long documents into the room the others leave, "
                 "so it has nothing to search here (megatron_mesh.balanced_layout lays out such documents)")
    try:
        first_homes(problem)
    except ValueError as e:
        ap.error(str(e))
    best = None
    for seed in args.search_seeds:
        t0 = time.perf_counter()
        got = anneal(problem, seed, args.iters, args.max_balance)
        print(f"search seed {seed}: busiest rank {got[2][0] / 1e6:.3f} MB sent, work max/mean {got[2][1]:.4f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        if best is None or got[0] < best[0]:
            best = got
    _, state, (sent, balance, model_sent, _, ranks) = best
    layout = layout_of(problem, bounds, state, ranks)
    # the planner's plan of it: Mesh computes each block where the layout names
    plan = resolve("mesh", args.world, shape).build(shape, Mask(True), layout)
    planned = [b.sent for b in plan_bytes(plan, shape)]
    work = rank_work(plan)
    plan_balance = max(work) / (sum(work) / len(work))
    print(f"{len(problem.lengths)} documents, {len(problem.long)} long ({', '.join(str(problem.lengths[d]) for d in problem.long)} "
          f"tokens); best: busiest rank {max(planned) / 1e6:.3f} MB sent (the plan's), work max/mean {plan_balance:.4f}")
    print("rank  portions (document tokens [start, end))" + " " * 30 + "sent MB  work/mean")
    for r, pcs in enumerate(ranks):
        text = ", ".join(f"{problem.lengths[d]}[{a}:{b})" if d in problem.long else str(problem.lengths[d])
                         for d, a, b in sorted(pcs, key=lambda p: bounds[p[0]] + p[1]))
        print(f"{r:>4}  {text:<66}{planned[r] / 1e6:>8.3f}{work[r] / (sum(work) / len(work)):>11.3f}")
    if planned != model_sent:
        raise SystemExit(f"the model's bytes {model_sent} differ from the plan's {planned}")
    zigzag, zigzag_mode = zigzag_best(args.world, bounds, shape)
    print(f"the zigzag layout's best mode on these documents: {zigzag_mode}, busiest rank {zigzag / 1e6:.3f} MB sent; "
          f"searched / zigzag = {max(planned) / zigzag:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            f.write(layout.text() + "\n")
        print(f"layout written to {args.out}")
    return dict(sent=max(planned), balance=plan_balance, layout=layout, planned=planned, zigzag=zigzag,
                zigzag_mode=zigzag_mode)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

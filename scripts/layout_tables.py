#!/usr/bin/env python3
"""Per-sample tables of the layouts of packed documents against the bounds (docs/performance.md,
"The balanced layout against its bound"): for each seed of ``--docs``, every mode of ``--modes``
on Megatron's zigzag, on the balanced layout and on the default (``--cp-layout auto``: per sample
and mode the one :func:`megatron_mesh.plan.choice.pick_layout` keeps, or Mesh's owners layout
where simulated faster) -- the busiest rank's
bytes over the query-owner bound (:mod:`megatron_mesh.plan.bound`), the simulated time over the
compute floor, the work max/mean -- and the issue's criteria over the seeds. Pure Python::

    python scripts/layout_tables.py --cp 256 --nodes 32 --seq-len 1048576 --docs lognormal:4096,1.0 \\
        --seeds 0 1 2 3 4 5 6 7 8 9 --jobs 2                # two processes, a seed each at a time
    python scripts/layout_tables.py --cp 8 --seq-len 65536 --heads 2 --kv-heads 2 --head-dim 32 --dtype fp32 \\
        --modes ring,mesh-auto,tasp --seeds 0 1 2 3 4 5 6 7 8 9

The rows are the planner's (:func:`megatron_mesh.tools.layout_rows.layout_rows`, as ``megatron-mesh-plan
--layout zigzag`` / ``balanced`` / ``auto`` print them): the default layout's row is the zigzag's, the
balanced one's or (Mesh on up to 8 ranks) the owners layout's, as ``--cp-layout auto`` picks -- what
Megatron runs by default.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_mesh.plan import AttentionShape, Topology  # noqa: E402
from megatron_mesh.plan.bound import query_owner_bound  # noqa: E402
from megatron_mesh.plan.sparse_needs import KEEP_LIMIT, check_keep_limit  # noqa: E402
from megatron_mesh.tools.plan_args import ITEMSIZE, document_bounds  # noqa: E402
from megatron_mesh.tools.layout_rows import layout_rows  # noqa: E402
from megatron_mesh.tools.planner import allowed_pairs, compute_floor, worker_pool  # noqa: E402
from megatron_mesh.tools.workers import sigterm_as_exit  # noqa: E402

PLAIN = ("ring", "mesh-auto", "tasp")  # the plain modes the issue asks to be never slower on the default layout


def sample(args, shape: AttentionShape, topo: Topology, seed: int, pool) -> dict:
    """One seed's rows: per (mode, U) the zigzag's, the balanced layout's and the default's (the row of
    the layout ``auto`` picks: one of those two, or Mesh's owners layout)."""
    cu = document_bounds(args.docs, args.seq_len, seed)
    rows, _ = layout_rows(args.cp, shape, topo, cu, modes=args.modes.split(","),
                          layouts=("zigzag", "balanced", "auto"), keep_limit=args.backward_keep_limit, executor=pool)
    bound = query_owner_bound(cu, args.cp, shape)
    out = dict(seed=seed, documents=len(cu) - 1, longest=max(b - a for a, b in zip(cu, cu[1:])),
               floor=compute_floor(allowed_pairs(cu), args.cp, shape, topo), bound=bound.bytes, simple=bound.simple,
               rows=[])
    by = {(r.layout, r.mode, r.ulysses): r for r in rows}
    for r in rows:
        z, b = by.get(("zigzag", r.mode, r.ulysses)), by.get(("balanced", r.mode, r.ulysses))
        if r.layout != "auto" or z is None or b is None:
            continue
        out["rows"].append(dict(mode=r.mode, U=r.ulysses, pick=r.extra["auto_pick"], zigzag=_cell(z), balanced=_cell(b),
                                default=_cell(r)))
    return out


def _cell(row) -> dict:
    return dict(bytes=row.bytes_per_rank, time=row.time_s, work=row.extra.get("forward_work_max_over_mean"))


def _sample_alone(job) -> dict:
    """:func:`sample` in a worker process (a seed's rows planned there, one after another)."""
    args, shape, topo, seed = job
    return sample(args, shape, topo, seed, None)


def pairs_of(args, seed: int) -> int:
    """A sample's causal pairs (the sum of its documents' squared lengths): what its planning
    time grows with -- a long document is a block for every pair of ranks it spans."""
    cu = document_bounds(args.docs, args.seq_len, seed)
    return sum((b - a) ** 2 for a, b in zip(cu, cu[1:]))


def _in_order(pool, args, shape: AttentionShape, topo: Topology):
    """The seeds' samples planned in the workers, the largest first (:func:`pairs_of`: at 256 GPUs
    seed 8 of ``lognormal:16384`` takes three times seed 0's 50 s; started last, as the ninth of ten,
    it ran alone on one core at the end), and given back in seed order."""
    seeds = sorted(args.seeds, key=lambda seed: -pairs_of(args, seed))
    futures = {seed: pool.submit(_sample_alone, (args, shape, topo, seed)) for seed in seeds}
    for seed in args.seeds:
        yield futures[seed].result()


def _name(row) -> str:
    return row["mode"] + (f" U{row['U']}" if row["U"] > 1 else "")


def print_sample(s: dict) -> None:
    fl, b = s["floor"], s["bound"]
    print(f"\nseed {s['seed']}: {s['documents']} documents (longest {s['longest']:,}), compute floor {fl * 1e3:.2f} ms, "
          f"query-owner bound {b / 2**20:.2f} MiB (b max(sqrt(L^2 - 2B), L - T): {s['simple'] / 2**20:.2f} MiB)")
    print(f"  {'mode':<14} {'zigzag MiB':>10} {'ms':>7} {'x floor':>7}  {'balanced MiB':>12} {'x bound':>7} {'ms':>7} "
          f"{'x floor':>7} {'work':>5}  default")
    for r in s["rows"]:
        z, a, d = r["zigzag"], r["balanced"], r["default"]
        print(f"  {_name(r):<14} {z['bytes'] / 2**20:>10.1f} {z['time'] * 1e3:>7.2f} {z['time'] / fl:>7.2f}  "
              f"{a['bytes'] / 2**20:>12.1f} {a['bytes'] / b if b else 0:>7.2f} {a['time'] * 1e3:>7.2f} "
              f"{a['time'] / fl:>7.2f} {a['work'] or 0:>5.2f}  {r['pick']}: {d['time'] * 1e3:.2f} ms "
              f"({d['time'] / fl:.2f}x), {d['bytes'] / b if b else 0:.2f}x bound"
              + (f", work {d['work']:.3f}" if r["pick"] not in ("balanced", "zigzag") and d["work"] else ""))


def summary(samples: list[dict]) -> None:
    """The criteria of the issue over the samples."""
    fastest, slower, ratios, plain_bal, work = [], [], [], [], []
    for s in samples:
        default = {_name(r): r["default"] for r in s["rows"]}
        fastest.append(min(d["time"] for d in default.values()) / s["floor"])
        for r in s["rows"]:
            # the builders' balance: the balanced layout's, and the owners layout's where the default is it
            work.append(max(r["balanced"]["work"] or 0, r["default"]["work"] or 0 if r["pick"] == "owners" else 0))
            if r["mode"] in PLAIN:
                d = default[_name(r)]
                slower += [f"seed {s['seed']} {_name(r)}"] if d["time"] > r["zigzag"]["time"] * (1 + 1e-9) else []
                if s["bound"]:
                    ratios.append(d["bytes"] / s["bound"])
                    plain_bal.append(r["balanced"]["bytes"] / s["bound"])
    print(f"\nover {len(samples)} samples: fastest mode on the default layout {statistics.mean(fastest):.3f}x the "
          f"floor on average, {max(fastest):.3f}x at most ({', '.join(f'{x:.2f}' for x in fastest)})")
    print(f"plain modes ({', '.join(PLAIN)}) slower on the default layout than on the zigzag: "
          f"{', '.join(slower) if slower else 'none'}")
    if ratios:
        print(f"plain modes' busiest-rank bytes over the query-owner bound: default layout median "
              f"{statistics.median(ratios):.2f}, balanced layout median {statistics.median(plain_bal):.2f} "
              f"({min(plain_bal):.2f}-{max(plain_bal):.2f})")
    print(f"work max/mean of the balanced layout (and of the owners layout where the default is it): at most "
          f"{max(work):.3f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cp", type=int, required=True)
    ap.add_argument("--nodes", type=int, default=None, help="nodes (default: CP / 8, at least 1)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(ITEMSIZE), default="bf16")
    ap.add_argument("--docs", default="lognormal:4096,1.0")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    ap.add_argument("--modes", default="ring,mesh-auto,tasp,a2a+tasp")
    ap.add_argument("--jobs", type=int, default=1, help="processes that plan and simulate (the planner's --jobs): "
                    "with several seeds each plans a seed at a time, with one the seed's rows")
    ap.add_argument("--json", help="also write every sample's rows to this file (JSON lines)")
    ap.add_argument("--backward-keep-limit", type=float, default=KEEP_LIMIT, metavar="X",
                    help="what a rank's backward keeps of what it pulled, x its own Q, K and V (the modes' "
                         f"backward_keep_limit; default {KEEP_LIMIT})")
    ap.add_argument("--host-lead-us", type=float, default=0.0, metavar="US",
                    help="how far the host is ahead of its GPU when a direction starts (the planner's --host-lead-us; "
                         "default 0: it starts with the GPU)")
    args = ap.parse_args(argv)
    if args.cp < 1 or args.seq_len % (2 * args.cp):
        ap.error(f"--cp {args.cp} must be >= 1 and split --seq-len {args.seq_len} into 2 x CP halves")
    try:
        shape = AttentionShape(args.seq_len // args.cp, 1, args.heads, args.kv_heads, args.head_dim,
                               ITEMSIZE[args.dtype])
        topo = Topology(nodes=args.nodes or max(1, -(-args.cp // args.gpus_per_node)),
                        gpus_per_node=args.gpus_per_node, host_lead=args.host_lead_us * 1e-6)
        topo.check(args.cp)
        document_bounds(args.docs, args.seq_len)
        check_keep_limit("--backward-keep-limit", args.backward_keep_limit)
    except ValueError as e:
        ap.error(str(e))
    start, samples = time.perf_counter(), []
    with sigterm_as_exit(), worker_pool(args.jobs) as pool:  # a killed run stops its workers too
        # several seeds: a seed per worker at a time (no worker waits for another seed's slowest row),
        # printed in order; one seed: its rows spread over the workers
        samples_of = _in_order(pool, args, shape, topo) if pool is not None and len(args.seeds) > 1 \
            else (sample(args, shape, topo, seed, pool) for seed in args.seeds)
        for s in samples_of:
            print_sample(s)
            samples.append(s)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(s) + "\n")
    summary(samples)
    print(f"\n({len(samples)} samples planned and simulated in {time.perf_counter() - start:.0f} s, --jobs {args.jobs})")


if __name__ == "__main__":
    main()

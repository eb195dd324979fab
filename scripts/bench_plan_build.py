#!/usr/bin/env python3
"""How long one batch's layout and plan take to build (the data loader builds them per sample).

For each CP size and document set: the balanced layout (:func:`megatron_mesh.balanced_layout`),
the default layout's choice for each mode (``--cp-layout auto``: the balanced layout and the zigzag
priced, :func:`megatron_mesh.plan.choice.pick_layout` as the data loader calls it; "auto ms"), then
each mode's mask-aware plan on the zigzag and on the balanced layout -- building every rank's op
lists, as the ranks of a real run do together (each rank builds only its own; the maximum over
ranks is printed as "per rank"). Pure Python, no torch::

    python scripts/bench_plan_build.py                                   # P = 64, 256, 1024; 1M tokens
    python scripts/bench_plan_build.py --cp 8 --seq-len 131072 --docs lognormal:12,1 --modes ring
    python scripts/bench_plan_build.py --cp 256 --seeds 0 1 2 --cpu --repeat 3 --modes ring tasp  # CPU time, per seed
    python scripts/bench_plan_build.py --cp 256 --modes mesh --mesh-tile square    # a fixed tile: 16x16

The plan's block table is built once per batch and shared by every layer (and mode) of that
batch; "plan" is the time to the first rank's op list, "all ranks" to every rank's; "sample" is
one rank's whole time for a sample (the layout, the choice, the plan of the layout kept).
Every mode is resolved as Megatron resolves it, with the machine's CP ranks per node -- Mesh's tile
``auto`` (``--mesh-tile-shape``'s default: on the zigzag under documents every tile map of the group
competes with the query owner, :mod:`megatron_mesh.plan.sparse_compete`) unless ``--mesh-tile``
fixes one ("square": the squarest tile of each CP size, which docs/performance.md's build times
before stop 75 measured).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_mesh.plan import AttentionShape, Mask, Topology, balanced_layout, get_mode, resolve, tile_shapes  # noqa: E402
from megatron_mesh.plan import sparse_blocks  # noqa: E402
from megatron_mesh.plan.choice import pick_layout  # noqa: E402
from megatron_mesh.plan.mesh import parse_tile  # noqa: E402
from megatron_mesh.tools.plan_args import document_bounds  # noqa: E402


def _clear() -> None:
    """Forget every cached block table: each sample is a new batch; and collect the garbage of the
    plans before (every rank's op lists), whose collection would otherwise be timed here."""
    sparse_blocks.block_table.cache_clear()
    sparse_blocks.blocks_of.cache_clear()
    gc.collect()


def measure(P: int, S: int, spec: str, modes: list[str], seed: int = 0, clock=time.perf_counter,
            mesh_tile: str = "auto") -> list[dict]:
    """One sample's rows (``clock``: the wall clock, or ``time.process_time`` on a shared machine;
    ``mesh_tile``: Mesh's tile, "auto", "AxB" or "square")."""
    cu = document_bounds(spec, S, seed)
    shape = AttentionShape(seq_local=S // P, batch=1, heads=32, kv_heads=8, head_dim=128)
    out = []
    gc.collect()
    t0 = clock()
    nodes = 8 if P > 8 and P % 8 == 0 else None  # the default machine's nodes of 8 GPUs
    layout = balanced_layout(cu, P, ranks_per_node=nodes)
    layout_s = clock() - t0
    topo = Topology(nodes=P // nodes if nodes else 1, gpus_per_node=nodes or P)
    for mode in modes:
        gc.collect()
        t0 = clock()
        pick = pick_layout(layout, shape, topo, mode)
        choice_s = clock() - t0
        for name, lay, mask in (("zigzag", None, Mask.from_cu_seqlens(cu, S)), ("balanced", layout, Mask())):
            _clear()
            # the placement Megatron resolves: its CP ranks per node (TASP's rings follow the nodes)
            placement = resolve(mode, P, shape, ranks_per_node=nodes, **_tile(mode, P, mesh_tile))
            t0 = clock()
            plan = placement.build(shape, mask, lay)
            plan.rank(0)
            first = clock() - t0
            per_rank = first
            for r in range(1, P):
                t1 = clock()
                plan.rank(r)
                per_rank = max(per_rank, clock() - t1)
            del plan  # its op lists are garbage before the next plan's clock starts
            out.append(dict(P=P, S=S, seed=seed, docs=len(cu) - 1, mode=mode, layout=name, kept=name == pick,
                            layout_s=layout_s if name == "balanced" else 0.0,
                            choice_s=choice_s if name == "balanced" else 0.0, plan_s=first,
                            all_ranks_s=clock() - t0, per_rank_s=per_rank))
    return out


def _takes_tile(mode: str) -> bool:
    return "tile" in get_mode(mode).Options.__dataclass_fields__


def _tile(mode: str, P: int, mesh_tile: str) -> dict:
    """The tile setting of ``mode`` (none for a mode without one)."""
    if not _takes_tile(mode):
        return {}
    if mesh_tile == "square":
        return {"tile": min(tile_shapes(P), key=lambda t: (abs(t[0] - t[1]), t))}
    return {"tile": mesh_tile}


TIMES = ("layout_s", "choice_s", "plan_s", "all_ranks_s", "per_rank_s")


def fastest(P: int, S: int, spec: str, modes: list[str], seed: int = 0, clock=time.perf_counter,
            repeat: int = 1, mesh_tile: str = "auto") -> list[dict]:
    """:func:`measure` ``repeat`` times, each time the fastest of the runs (a shared machine's
    other jobs only ever slow a run down)."""
    runs = [measure(P, S, spec, modes, seed, clock, mesh_tile) for _ in range(repeat)]
    return [dict(rows[0], **{k: min(r[k] for r in rows) for k in TIMES}) for rows in zip(*runs)]


def sample_s(rows: list[dict], row: dict) -> float | None:
    """A sample's time for ``row``'s mode where ``row`` is the layout ``auto`` keeps: the layout,
    the choice and the plan of the kept layout (what the data loader builds), else None."""
    if not row["kept"]:
        return None
    balanced = next(r for r in rows if r["mode"] == row["mode"] and r["layout"] == "balanced")
    return balanced["layout_s"] + balanced["choice_s"] + row["plan_s"]


DEFAULT_DOCS = "lognormal:4096,1.0"  # the documents (1M tokens)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cp", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--seq-len", type=int, default=1 << 20)
    ap.add_argument("--docs", default=None, help=f"documents, as megatron-mesh-plan --docs (default {DEFAULT_DOCS})")
    ap.add_argument("--modes", nargs="+", default=["ring", "mesh", "tasp"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="samples of --docs (default 0)")
    ap.add_argument("--cpu", action="store_true", help="CPU time of this process instead of the wall clock (a "
                    "shared machine)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each sample; every time the fastest (default 1)")
    ap.add_argument("--mesh-tile", default="auto", help="Mesh's tile: 'auto' (Megatron's default; under documents "
                    "every tile map competes), AxB, or 'square' (the squarest tile of each CP size)")
    args = ap.parse_args(argv)
    if args.seq_len < 1 or args.repeat < 1:
        ap.error(f"--seq-len and --repeat must be >= 1, got {args.seq_len} and {args.repeat}")
    if len(set(args.cp)) < len(args.cp) or len(set(args.modes)) < len(args.modes):
        ap.error(f"--cp {args.cp} / --modes {args.modes}: name each CP size and mode once")
    bad = [P for P in args.cp if P < 1 or args.seq_len % (2 * P)]
    if bad:
        ap.error(f"--cp {bad or args.cp}: every CP size must be >= 1 and split --seq-len {args.seq_len} into 2 x CP halves")
    given, args.docs = args.docs, args.docs or DEFAULT_DOCS
    try:  # the documents and the modes, before the first measurement
        document_bounds(args.docs, args.seq_len)
        for mode in args.modes:
            get_mode(mode)
    except ValueError as e:
        ap.error(str(e) + ("" if given else f" (--docs {DEFAULT_DOCS} is the default: give --docs for a --seq-len this "
                                              "short)"))
    try:  # Mesh's tile, for every CP size, where a mode takes one
        for P in args.cp if args.mesh_tile != "square" and any(map(_takes_tile, args.modes)) else ():
            parse_tile(args.mesh_tile, P)
    except ValueError as e:
        ap.error(f"--mesh-tile: {e} (or 'square': the squarest tile of each CP size)")
    print(f"{'P':>5} {'seed':>4} {'docs':>6} {'mode':<6} {'layout':<9} {'layout ms':>10} {'auto ms':>8} {'plan ms':>9} "
          f"{'all ranks s':>12} {'sample ms':>10}  (* the layout auto keeps; sample: layout + auto + its plan; Mesh's "
          f"tile {args.mesh_tile})")
    for P in args.cp:
        for seed in args.seeds:
            rows = fastest(P, args.seq_len, args.docs, args.modes, seed,
                           time.process_time if args.cpu else time.perf_counter, args.repeat, args.mesh_tile)
            for row in rows:
                total = sample_s(rows, row)
                print(f"{row['P']:>5} {row['seed']:>4} {row['docs']:>6} {row['mode']:<6} "
                      f"{row['layout'] + '*' * row['kept']:<9} {row['layout_s'] * 1e3:>10.1f} "
                      f"{row['choice_s'] * 1e3:>8.1f} {row['plan_s'] * 1e3:>9.1f} {row['all_ranks_s']:>12.2f} "
                      f"{'' if total is None else f'{total * 1e3:.1f}':>10}")


if __name__ == "__main__":
    main()

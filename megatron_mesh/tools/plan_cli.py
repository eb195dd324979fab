"""``megatron-mesh-plan`` (``python -m megatron_mesh.tools.plan_cli``): compare the CP modes of one problem.

Per mode (ring, mesh per tile, mesh-auto, tasp, the Ulysses hybrids a2a+ring / a2a+mesh /
a2a+tasp for every all-to-all degree, auto, and Ulysses / USP by formula): bytes each rank sends in the
forward + backward of one attention layer (the busiest rank's, and the mean over the ranks split
intra/inter-node), communication rounds, peak extra buffer memory, and the predicted forward +
backward time of the simulator (:mod:`megatron_mesh.plan.simulate`). ``mesh-auto``,
``a2a+mesh-auto`` and ``auto`` are the fastest of their candidates, ties within
:data:`~megatron_mesh.plan.autotile.TIME_TOLERANCE` going to fewer inter-node bytes
(:data:`~megatron_mesh.plan.autotile.TIE_RULE`). Example (the paper's scale)::

    megatron-mesh-plan --cp 256 --heads 32 --kv-heads 8 --head-dim 128 --seq-len 1048576 --gpus-per-node 8

Masks: ``--window L[,R]`` (a sliding window) and ``--docs SPEC`` (packed documents: ``fixed:N``
or ``lognormal:MEAN,SIGMA`` document lengths drawn with ``--seed``, after any ``one:N+`` single
documents, e.g. ``one:524288+lognormal:4096,1``) plan every mode mask-aware and add the per-rank
work max / mean. With documents the layouts are compared side by side (``--layout``), and the
table ends with the fastest row and the fewest bytes on the busiest rank over them;
``--samples N`` plans N samples of the documents and gives every row's mean over them (one
sample can mislead: which layout wins can change from sample to sample). ``--layout-file F``
adds the rows of one more layout of the same documents, read from F (its text line, e.g. the one
``scripts/search_layout.py --out`` writes), as layout ``file``: the GPU model's price of a layout
searched offline, next to the ones Megatron can run.

``--json`` prints ``{"modes": [{"mode", "tile", "bytes_per_rank", "inter_node_bytes_per_rank",
"rounds", "time_s", ...}], "skipped": [...], ...}`` (bytes are whole bytes sent in one layer's
forward + backward; ``bytes_per_rank`` is the busiest rank's, the ``*_node_bytes_per_rank`` split
values are means over the ranks, ``max_inter_node_bytes`` is the busiest rank's across nodes; a derived row -- ``auto``, ``mesh-auto`` -- names its ``pick``, and with
``--samples`` its ``picks``, one per sample); ``--plot FILE.png`` draws, against the
CP size (8..1024 by default), the busiest rank's bytes, the time and the time relative to ring. ``--jobs N`` plans and simulates the rows in N worker
processes (0: one per CPU core): the same output, sooner.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace

from ..plan.autotile import TIE_RULE
from ..plan.bound import BUDGET, placement_bound, query_owner_bound
from ..plan.layouts import LAYOUTS, REFERENCE_LAYOUT
from ..plan.mask import Mask
from ..plan.modes import REFERENCE_MODE, option_specs
from ..plan.shape import AttentionShape
from ..plan.simulate import BACKWARD_FLOPS
from ..plan.sparse_needs import check_keep_limit
from ..plan.topology import Topology
from ..plan.units import format_bytes
from .default_layout import registered_mode
from .layout_rows import layout_rows
from .mask_spec import cli_kind
from .plan_args import (budget_of, document_bounds, layout_file_of, layouts_of, mask_of, modes_of, parser, random_docs,
                        seeds_of, shape_of, topology_of)
from .plan_budget import BUDGET_REASON, LATE_REASON, Budget, planning_gc
from .plan_plot import draw_plot, plot_sizes
from .planner import (AUTO, FORMULAS, REGISTRY, ModeResult, allowed_pairs, compute_floor, derived_modes, evaluate,
                      host_bound, mean_rows, placement_keys, plan_settings, worker_pool)
from .workers import sigterm_as_exit


def _host_text(r: ModeResult) -> str:
    """A row's host ms (the slowest rank's, issuing its ops), "!" where it is behind the device."""
    if "host_s" not in r.extra:
        return "-"
    return f"{r.extra['host_s'] * 1e3:.2f}" + ("!" if host_bound(r) else "")


def _table(rows: list[ModeResult], skipped: list[dict], floor: float | None = None, bound: float | None = None) -> str:
    ring = next((r for r in rows if r.mode == REFERENCE_MODE), None)
    work = any("forward_work_max_over_mean" in r.extra for r in rows)
    sampled = any("time_s_max" in r.extra for r in rows)  # rows averaged over samples (mean_rows)
    layouts = len({r.layout for r in rows}) > 1
    head = (["layout"] if layouts else []) + \
        ["mode", "a2a", "tile", "order", "bytes max", "vs ring", "intra mean", "inter mean", "inter max", "rounds",
         "peak buf", "fwd ms", "bwd ms", "time ms"] + (["time max"] if sampled else []) + \
        ["exposed ms", "host ms", "speedup"] + (["work max/mean"] if work else []) + \
        (["x floor"] if floor else []) + (["x bound"] if bound else [])
    lines = [head]
    for r in rows:
        tile = f"{r.tile[0]}x{r.tile[1]}" if r.tile else "-"
        vs = f"{100 * (r.bytes_per_rank / ring.bytes_per_rank - 1):+.1f}%" if ring and ring.bytes_per_rank else "-"
        speed = f"{ring.time_s / r.time_s:.2f}x" if ring else "-"
        row = ([r.layout] if layouts else []) + [r.mode + ("*" if r.by_formula else ""),
                                                 str(r.ulysses) if r.ulysses > 1 else "-", tile,
               r.contiguous or "-", format_bytes(r.bytes_per_rank), vs, format_bytes(r.intra_node_bytes_per_rank),
               format_bytes(r.inter_node_bytes_per_rank), format_bytes(r.max_inter_node_bytes), str(r.rounds),
               format_bytes(r.peak_buffer_bytes), f"{r.forward_s * 1e3:.2f}", f"{r.backward_s * 1e3:.2f}",
               f"{r.time_s * 1e3:.2f}"] + ([f"{r.extra['time_s_max'] * 1e3:.2f}"] if sampled else []) + \
            [f"{r.exposed_comm_s * 1e3:.2f}", _host_text(r), speed]
        if work:
            w = r.extra.get("forward_work_max_over_mean")
            row.append("-" if w is None else f"{w:.2f}")
        if floor:
            row.append(f"{r.time_s / floor:.2f}")
        if bound:  # the busiest rank's bytes over the sample's query-owner bound (plan/bound.py)
            row.append(f"{r.bytes_per_rank / bound:.2f}")
        lines.append(row)
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    left = 4 + layouts
    out = ["  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
           for row in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    details: dict[str, list[str]] = {}  # one line per explanation, naming the rows it explains
    for r in rows:
        if r.detail:
            details.setdefault(r.detail, []).append(r.mode + (f" ({r.layout})" if layouts else ""))
    out += [f"{', '.join(dict.fromkeys(names))}: {detail}" for detail, names in details.items()]
    derived = [m for m in dict.fromkeys(r.mode for r in rows) if m in derived_modes()]
    if derived:  # what their "fastest" means: a row a little faster than the pick is within the tie rule
        out.append(f"{', '.join(derived)}: the fastest of {'its' if len(derived) == 1 else 'their'} candidates, "
                   f"{TIE_RULE}")
    if any(r.by_formula for r in rows):
        out.append("* by formula (no plan): Ulysses all-to-alls priced analytically; USP's ring part is simulated")
    if any(host_bound(r) for r in rows):
        out.append("! host-bound: the host needs longer to issue the step's torch ops than the device to run them "
                   "(--host-op-us per op; CUDA graphs would take most of it away: docs/performance.md)")
    reasons: dict[str, list[str]] = {}  # one line per reason, naming the rows it leaves out
    for s in skipped:
        reasons.setdefault(s["reason"], []).append(s["mode"])
    out += [f"not available: {', '.join(names)}: {reason}" for reason, names in reasons.items()]
    return "\n".join(out)


def _row_name(r: ModeResult) -> str:
    parts = [r.mode] + ([f"U {r.ulysses}"] if r.ulysses > 1 else []) + ([f"{r.tile[0]}x{r.tile[1]}"] if r.tile else [])
    return " ".join(parts) + f" on {r.layout}"


def megatron_flags(r: ModeResult, world_size: int) -> str | None:
    """The plugin's Megatron flags that run row ``r`` (None for Transformer Engine's own rows, the
    formulas and a layout read from a file): ``--cp-comm-type``, the all-to-all degree, Mesh's tile
    and the layout."""
    mode = registered_mode(r.mode)
    kind = LAYOUTS.get(r.layout)  # None: a layout from a file
    if mode not in REGISTRY or kind is None or kind.flag is None:  # TE's rows, the formulas; no Megatron flag
        return None
    flags = [f"--cp-comm-type {mode}"]
    if r.ulysses > 1:
        flags.append(f"--hierarchical-context-parallel-sizes {r.ulysses} {world_size // r.ulysses}")
    tile = next((o.flag for o in option_specs(REGISTRY[mode].Options) if o.name == "tile"), None)
    if r.tile and tile:  # the mode's own tile option (Mesh's, inner or not)
        flags.append(f"{tile} {r.tile[0]}x{r.tile[1]}")
    flags.append(kind.flag)
    return " ".join(flags)


def _advice(fast: ModeResult, rows: list[ModeResult], world_size: int) -> str | None:
    """The Megatron flags that run row ``fast``; on a layout that cannot lay out every sample (Mesh's
    owners layout), those of the derived layout (``auto``) whose row this sample is, where there is
    one: a run on the layout itself stops at the first sample it refuses."""
    flags = megatron_flags(fast, world_size)
    kind = LAYOUTS.get(fast.layout)
    if flags is None or kind is None or kind.every_sample:
        return flags
    key = (fast.mode, fast.ulysses, fast.tile, fast.time_s)
    same = next((r for r in rows if LAYOUTS.get(r.layout) is not None and LAYOUTS[r.layout].derived_from
                 and (r.mode, r.ulysses, r.tile, r.time_s) == key), None)
    if same is not None:
        return (f"{megatron_flags(same, world_size)} (it runs this sample on {fast.layout}; {kind.flag} stops at a "
                "sample it cannot lay out)")
    return f"{flags} (stops at a sample it cannot lay out, naming it)"


def _best(rows: list[ModeResult], floor: float | None = None, world_size: int | None = None) -> str:
    """Under several layouts: the fastest row and the row whose busiest rank sends the fewest
    bytes, over every layout (the auto rows repeat a row, so they are left out)."""
    samples = max((r.extra.get("samples", 1) for r in rows), default=1)
    # over several samples a derived row whose pick changes from sample to sample: no one set of flags runs it
    pool = [r for r in rows if r.mode != AUTO and len(set(r.extra.get("picks", ()))) < 2]
    if len({r.layout for r in rows}) < 2 or not pool:
        return ""
    fast = min(pool, key=lambda r: r.time_s)
    light = min(pool, key=lambda r: r.bytes_per_rank)
    vs = f" ({fast.time_s / floor:.2f}x the compute floor)" if floor else ""
    mean = f"mean over {samples} samples " if samples > 1 else ""
    flags = _advice(fast, rows, world_size) if world_size else None
    return (f"fastest over the layouts: {_row_name(fast)}, {mean}{fast.time_s * 1e3:.2f} ms{vs}\n" +
            (f"  in Megatron: {flags}\n" if flags else "") +
            f"fewest bytes sent by the busiest rank: {_row_name(light)}, {mean}{format_bytes(light.bytes_per_rank)}")


def _header(args, world_size: int, shape: AttentionShape, topo: Topology, mask: Mask | None = None,
            layouts: tuple[str, ...] = ("zigzag",)) -> str:
    what = mask.text() if mask is not None else ("causal" if args.causal else "full")
    if mask is not None and mask.documents is not None:
        lens = [b - a for a, b in mask.documents]
        what = what.split(",docs=")[0] + f", {len(lens)} documents of mean {sum(lens) / len(lens):,.0f} tokens"
        if len(layouts) == 1:  # the table has a layout column only when it compares several
            what += f"; every row on the {layouts[0]} layout"
    used, spread = topo.nodes_used(world_size), ""
    if used < topo.nodes:  # --nodes larger than the CP group fills: say how to spread it
        spread = f" (of the machine's {topo.nodes} nodes: the CP ranks fill nodes of --gpus-per-node {topo.gpus_per_node} in order"
        spread += (f"; --gpus-per-node {world_size // topo.nodes} spreads them over all {topo.nodes})"
                   if world_size % topo.nodes == 0 else ")")
    return (f"CP {world_size} on {used} node(s) x {topo.gpus_per_node} GPUs{spread}; sequence "
            f"{args.seq_len:,} tokens ({shape.seq_local:,} per rank), batch {shape.batch}, heads {shape.heads}/"
            f"{shape.kv_heads}, {shape.dims_text}, {args.dtype}, {what}\n"
            f"machine: {topo.describe()}\n"
            "bytes: sent per rank, forward + backward, one attention layer -- 'max': the busiest rank's, 'mean': the "
            "mean over the ranks (intra mean + inter mean = the mean rank's bytes, at most bytes max); time: "
            "simulated forward + backward\n"
            "columns: a2a: the all-to-all degree U of the a2a+ modes ('U 8' below); tile: Mesh's a x b; order: which "
            "Mesh ring is made of consecutive CP ranks (q or kv, --mesh-contiguous); rounds: communication rounds of a "
            "call; peak buf: the largest memory a rank's receive buffers hold at once; exposed ms: time not hidden "
            "behind compute (time ms - the busiest rank's compute); host ms: the slowest rank's host issuing its torch "
            "ops ('!': longer than its device's work)\n")


def _explain(rows, floor: float | None) -> str:
    """Where the fastest plan of each layout spends its time (rows with a breakdown)."""
    out = []
    for layout in dict.fromkeys(r.layout for r in rows):
        pool = [r for r in rows if r.layout == layout and "breakdown" in r.extra]
        if not pool:
            continue
        # the row auto recommends where there is one (it may take a row within 1 % of the fastest that
        # sends fewer bytes across nodes); else the fastest
        best = next((r for r in pool if r.mode == AUTO), None) or min(pool, key=lambda r: r.time_s)
        name = f"auto = {best.detail.split(':')[0]}" if best.mode == "auto" and best.detail else best.mode
        what = name + (f", all-to-all {best.ulysses}" if best.ulysses > 1 else "") + \
            (f", tile {best.tile[0]}x{best.tile[1]}" if best.tile and best.tile[0] > 1 else "")
        where = f" on the {layout} layout" if len({r.layout for r in rows}) > 1 or layout != REFERENCE_LAYOUT else ""
        out.append(f"\nwhere the time goes: {what}{where}, {best.time_s * 1e3:.2f} ms"
                   + (f" = {best.time_s / floor:.2f}x the compute floor" if floor else ""))
        for b in best.extra["breakdown"]:
            parts = ", ".join(f"{k[:-2]} {b[k] * 1e3:.3f}" for k in ("flops_s", "launches_s", "accumulate_s",
                                                                      "copies_s", "combine_s", "host_s", "exposed_s"))
            out.append(f"  {b['direction']:8s} {b['time_s'] * 1e3:8.3f} ms on rank {b['rank']}: {parts} ms")
            for w in b["waits"][:3]:
                out.append(f"           waits {w['seconds'] * 1e3:.3f} ms for round {w['round']} ({w['moves']})")
    return "\n".join(out)


def _plan_sample(args, modes, shape: AttentionShape, topo: Topology, mask: Mask | None, seed: int, layouts,
                 pool, file_layout=None, budget: Budget | None = None
                 ) -> tuple[list[ModeResult], list[dict], float | None, tuple | None]:
    """The rows, the rows left out, the compute floor and the bounds on the busiest rank's bytes
    (:func:`_bounds`) of one sample of --docs (seed ``seed``), and the rows of ``file_layout``
    (--layout-file) as layout "file"; ``budget``: this sample's share of --plan-budget (the layout
    file's rows get a part of it as one more layout)."""
    part = None if budget is None else budget.portion(2) if file_layout is not None else budget
    docs = None if args.docs is None else document_bounds(args.docs, args.seq_len, seed)
    # the mask's window, None for none: the layouts that place the documents take it apart from them
    window = None if mask is None or args.mask or mask.window == (None, 0 if args.causal else None) else mask.window
    head = (kind := cli_kind(args)) or Mask(args.causal, window)
    if layouts == (REFERENCE_LAYOUT,):
        rows, skipped = evaluate(args.cp, shape, topo, modes, mask=mask if mask is not None else Mask(args.causal),
                                 backward_chunks=args.backward_chunks, schedule=args.schedule,
                                 keep_limit=args.backward_keep_limit, explain=args.explain,
                                 executor=pool, budget=part)
    else:
        rows, skipped = layout_rows(args.cp, shape, topo, docs, causal=args.causal, window=window, kind=kind, modes=modes,
                                    layouts=layouts, backward_chunks=args.backward_chunks, schedule=args.schedule,
                                    keep_limit=args.backward_keep_limit,
                                    explain=args.explain, plan_all=args.layout not in (None, "all"), executor=pool,
                                    budget=part)
    if file_layout is not None:  # one more layout of the same documents, as given
        got, skip = evaluate(args.cp, shape, topo, modes=[m for m in modes if m not in FORMULAS],
                             backward_chunks=args.backward_chunks, schedule=args.schedule,
                             keep_limit=args.backward_keep_limit,
                             mask=head, layout=file_layout, explain=args.explain, executor=pool, budget=budget)
        rows = rows + [replace(r, layout="file") for r in got]
        skipped = skipped + [{**s, "mode": f"{s['mode']} (file)"} for s in skip]
    # the documents as given (one document over the whole sequence is plain causal)
    floor = None if docs is None else compute_floor(allowed_pairs(docs, mask=head), args.cp, shape, topo)
    return rows, skipped, floor, _bounds(args, docs, window if kind is None else kind, shape)


def _mean_samples(planned) -> tuple:
    """Several samples' (rows, skipped, floor, bounds) as one: each row's mean over the samples
    (:func:`mean_rows`), per row left out the first sample's reason (they differ in counts only)
    and what some sample could not plan, the mean floor and bounds."""
    planned, short = _complete_samples(planned)
    rows, missing = mean_rows([r for r, _, _, _ in planned])
    first: dict[str, dict] = {}
    for _, skipped, _, _ in planned:
        for x in skipped:
            first.setdefault(x["mode"], x)
    missing += short
    n = len(planned)
    bounds = None if planned[0][3] is None else tuple(sum(p[3][i] for p in planned) / n for i in range(3))
    return rows, list(first.values()) + missing, sum(p[2] for p in planned) / n, bounds


def _complete_samples(planned) -> tuple[list, list[dict]]:
    """The samples whose rows a mean can take, and an entry of the table's "not available" list
    for those left out: a sample planned after the others had spent the planning budget lacks
    rows they have, and a row missing from one sample is left out of the mean -- with --samples 3
    every row was ("planned in 2 of the 3 samples only", stop 81's review), an empty table. The
    sample the budget cut short that planned the fewest rows is left out while that leaves more
    rows planned in every sample still in (samples whose rows differ by their documents -- a
    layout that cannot lay one out -- are all kept, as before)."""
    keys = [set(placement_keys(rows)) for rows, _, _, _ in planned]
    cut = [any(_past_budget(x) for x in skipped) for _, skipped, _, _ in planned]
    kept = list(range(len(planned)))
    while len(kept) > 1 and any(cut[i] for i in kept):
        common = set.intersection(*(keys[i] for i in kept))
        fewest = min((i for i in kept if cut[i]), key=lambda i: len(keys[i]))
        rest = [i for i in kept if i != fewest]
        if len(set.intersection(*(keys[i] for i in rest))) <= len(common):
            break
        kept = rest
    left = [i for i in range(len(planned)) if i not in kept]
    if not left:
        return planned, []
    return [planned[i] for i in kept], [{
        "mode": f"sample {i + 1} of {len(planned)}",
        "reason": f"planned {len(keys[i])} of the {max(map(len, keys))} rows the others planned (past the planning "
                  f"budget); every number is the mean over the {len(kept)} other samples; --plan-budget 0 plans every "
                  "row"} for i in left]


def _past_budget(skipped: dict) -> bool:
    """Whether a "not available" entry is a row the planning budget left out (up front, or by its clock)."""
    return skipped.get("reason") in (BUDGET_REASON, LATE_REASON)


def _bounds_line(bounds, samples: int) -> str:
    """The sample's bounds on the busiest rank's bytes, as the planner prints them."""
    return (f"busiest rank's bytes, lower bounds (plan/bound.py, work at most {BUDGET}x the mean): "
            f"{format_bytes(bounds[0])} when every pair is computed by its query's owner ('x bound'; "
            f"b max(sqrt(L^2 - 2B), L - T): {format_bytes(bounds[1])}), {format_bytes(bounds[2])} wherever blocks "
            "are computed" + ("; the means over the samples" if samples > 1 else "") + "\n")


def _bounds(args, docs, window, shape: AttentionShape) -> tuple[float, float, float] | None:
    """(query-owner bound, its b x max(sqrt(L^2 - 2B), L - T) form, any-placement bound) on the
    busiest rank's bytes (:mod:`megatron_mesh.plan.bound`), for causal documents without a
    window and one sample per batch (None otherwise: the bounds are derived for that case)."""
    if docs is None or not args.causal or window is not None or shape.batch != 1:
        return None
    q = query_owner_bound(docs, args.cp, shape)
    return q.bytes, q.simple, placement_bound(docs, args.cp, shape).bytes


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    try:
        if args.config is not None:
            return _predict_config(args, argv)
        with sigterm_as_exit():  # a killed run stops its workers too
            return _main(args)
    except BrokenPipeError:  # `megatron-mesh-plan ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush would raise again
        return 0


def _predict_config(args, argv: list[str]) -> int:
    """``--config CONFIG.yaml``: the prediction for a Megatron config's attention
    (:func:`megatron_mesh.tools.predict.prediction_section`), every kind of its layers priced with
    its own mask, on the machine the machine's flags describe (``--gpus-per-node``: GPUs per node,
    each CP group holding gpus-per-node / TP of them); a problem flag, or ``--nodes``, beside it is
    an error (the problem and its node layout are the config's)."""
    from . import predict
    from .plan_args import CONFIG_FLAG, machine_links

    machine = next(g for g in parser()._action_groups if g.title.startswith("machine"))
    allowed = {CONFIG_FLAG} | {o for a in machine._group_actions for o in a.option_strings} - {"--nodes"}
    others = [a.split("=", 1)[0] for a in argv if a.startswith("--") and a.split("=", 1)[0] not in allowed]
    if others:
        print(f"megatron-mesh-plan: error: {CONFIG_FLAG} {args.config} plans the config's own problem: leave out "
              f"{', '.join(others)} (with it go only the machine's flags, --nodes not: the config's CP and TP sizes "
              "place its ranks)", file=sys.stderr)
        return 2
    try:
        if args.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be >= 1, got {args.gpus_per_node}")
        topo = predict.machine(predict.read_config(args.config), args.gpus_per_node, **machine_links(args))
        print(predict.prediction_section(args.config, topo))
    except (ValueError, OSError) as e:
        print(f"megatron-mesh-plan: error: {e}", file=sys.stderr)
        return 2
    return 0


@dataclass
class _Planned:
    """What one run of the planner found: the rows (a mean over the samples), the rows left out,
    the compute floor and bounds, and the problem they were planned for."""

    rows: list
    skipped: list
    floor: float | None
    bounds: tuple | None
    shape: AttentionShape
    topo: Topology
    mask: Mask | None
    seeds: list[int]
    layouts: tuple[str, ...]
    elapsed: float
    sizes: list[int] | None = None  # --plot's CP sizes
    plot_s: float | None = None


def _plan(args) -> _Planned:
    """Check every argument, then plan every sample (and the plot) in one worker pool."""
    modes = modes_of(args.modes)
    if args.jobs < 0:
        raise ValueError(f"--jobs {args.jobs}: must be >= 0 (N processes; 0: one per CPU core)")
    shape, topo, mask = shape_of(args, args.cp), topology_of(args, args.cp), mask_of(args)
    seeds, layouts, file_layout, budget = seeds_of(args), layouts_of(args), layout_file_of(args), budget_of(args)
    check_keep_limit("--backward-keep-limit", args.backward_keep_limit)
    plan_settings(args.backward_chunks, args.schedule, args.backward_keep_limit)  # and with --backward-chunks
    if args.plot_cp is not None and not args.plot:
        raise ValueError(f"--plot-cp {args.plot_cp} sets the CP sizes of --plot FILE.png, which is not given")
    sizes = plot_sizes(args, modes) if args.plot else None
    start = time.perf_counter()
    with planning_gc(), worker_pool(args.jobs) as pool:  # one pool for every sample, the table and the plot
        planned = [_plan_sample(args, modes, shape, topo, mask if seed == args.seed else mask_of(args, seed), seed,
                                layouts, pool, file_layout, budget.portion(len(seeds) - k))
                   for k, seed in enumerate(seeds)]
        rows, skipped, floor, bounds = planned[0] if len(planned) == 1 else _mean_samples(planned)
        out = _Planned(rows, skipped, floor, bounds, shape, topo, mask, seeds, layouts,
                       time.perf_counter() - start, sizes)
        if args.plot:  # the plot plans every CP size again and draws: often longer than the table
            draw_plot(args, modes, args.plot, sizes, pool)
            out.plot_s = time.perf_counter() - start - out.elapsed
    return out


def _main(args) -> int:
    try:
        got = _plan(args)
    except ValueError as e:
        print(f"megatron-mesh-plan: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the rows not started are dropped, the workers stop with this process
        print("megatron-mesh-plan: interrupted", file=sys.stderr)
        return 130
    except BrokenProcessPool:  # a worker killed (out of memory, a signal): its rows are lost
        print(f"megatron-mesh-plan: error: a worker process of --jobs {args.jobs} ended before its rows were planned "
              "(killed, or out of memory: each worker holds its own plans); run again with fewer --jobs",
              file=sys.stderr)
        return 1
    print(_json(args, got) if args.json else _report(args, got))
    return 0


def _json(args, got: _Planned) -> str:
    return json.dumps({"modes": [r.to_json() for r in got.rows], "skipped": got.skipped,
                       "problem": {"cp": args.cp, "seq_len": args.seq_len, **vars(got.shape), "causal": args.causal,
                                   "mask": got.mask.text() if got.mask is not None else None},
                       "topology": {k: v for k, v in vars(got.topo).items() if k != "node_of"},
                       "compute_floor_s": got.floor, "bounds": None if got.bounds is None else dict(
                           zip(("query_owner_bytes", "query_owner_simple_bytes", "any_placement_bytes"), got.bounds)),
                       "samples": len(got.seeds), "seeds": got.seeds if args.docs else None,
                       "planner_seconds": got.elapsed, "plot_seconds": got.plot_s}, indent=1)


def _budget_note(got: _Planned) -> str:
    """Where --plan-budget left rows (or samples) out: one line saying that what the table and its
    best rows say is of the rows planned only -- a layout or a mode left out may be faster."""
    left = [x for x in got.skipped if _past_budget(x)]
    if not left:
        return ""
    what = "no row was planned" if not got.rows else f"{len(left)} entr{'y' if len(left) == 1 else 'ies'} of the list " \
        "above not planned"
    return (f"note: {what} within the planning budget (--plan-budget, CPU seconds): the fastest row and the fewest bytes "
            "are among the rows planned only, and a layout or mode left out may be faster; --plan-budget 0 plans "
            "every row")


def _report(args, got: _Planned) -> str:
    """The table with its header, floor, bounds, best rows and (--explain) where the time goes."""
    seeds, floor, bounds = got.seeds, got.floor, got.bounds
    out = [_header(args, args.cp, got.shape, got.topo, got.mask, got.layouts)]
    if len(seeds) > 1:
        out.append(f"samples: {len(seeds)} of --docs {args.docs} (--seed {seeds[0]}..{seeds[-1]}); every number is "
                   "the mean over them (buffer memory: the largest; time max: the slowest sample); the documents "
                   "above are the first sample's\n")
    if floor:
        out.append(f"compute floor: {floor * 1e3:.2f} ms (every allowed pair spread evenly over the ranks, forward + "
                   f"{BACKWARD_FLOPS}x backward at {got.topo.attention_flops / 1e12:g} TFLOP/s; no communication, no "
                   "kernel launches" + ("; the mean over the samples" if len(seeds) > 1 else "") + ")\n")
    if bounds:
        out.append(_bounds_line(bounds, len(seeds)))
    out.append(_table(got.rows, got.skipped, floor, bounds[0] if bounds else None))
    best = _best(got.rows, floor, args.cp)
    if best:
        out.append("\n" + best)
        if len(seeds) == 1 and random_docs(args.docs):  # which layout wins can change from sample to sample
            out.append(f"(one sample of --docs, --seed {args.seed}: --samples N gives the mean over N samples)")
    short = _budget_note(got)
    if short:
        out.append(short)
    if args.explain:
        out.append(_explain(got.rows, floor))
    out.append(f"\n(planned and simulated in {got.elapsed:.2f} s" + (
        f"; the plot, {len(got.sizes)} CP sizes planned and drawn, in {got.plot_s:.2f} s, written to {args.plot}; "
        f"{got.elapsed + got.plot_s:.2f} s in all)" if args.plot else ")"))
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())

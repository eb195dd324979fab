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

import argparse
import json
import os
import signal
import sys
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace

import math
import random

from ..plan.autotile import TIE_RULE
from ..plan.bound import BUDGET, placement_bound, query_owner_bound
from ..plan.hostcost import HOST_OP_SOURCE, host_op_us
from ..plan.layout import layout_from_text
from ..plan.mask import Mask, documents_of
from ..plan.mesh import BACKWARD_CHUNKS
from ..plan.modes import REFERENCE_MODE, option_specs
from ..plan.shape import AttentionShape
from ..plan.simulate import BACKWARD_FLOPS
from ..plan.topology import Topology
from ..plan.units import format_bytes
from ..plan.layouts import LAYOUTS, REFERENCE_LAYOUT, layout_names
from .layout_rows import layout_rows
from .mask_spec import HELP as MASK_HELP, cli_kind
from .plan_budget import BUDGET_S, Budget, planning_gc
from .planner import (AUTO, FORMULAS, REGISTRY, ModeResult, all_modes, allowed_pairs, compute_floor, default_modes,
                      derived_modes, evaluate, host_bound, mean_rows, worker_pool)

ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
PLOT_CP = "8,16,32,64,128,256,512,1024"  # --plot's CP sizes unless --plot-cp says
MAX_SAMPLES = 10_000  # --samples: each sample plans every row again, and its rows are kept for the mean
# the lines of --plot (one per mode: rows with one placement per CP size)
PLOT_MODES = ("ring", "mesh-auto", "tasp", "a2a+mesh-auto", "usp", "ulysses")


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" only where X says something: not for on/off flags (the help says
    what the flag turns on or off) nor for None (the help says what happens without the option)."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    d = Topology()
    p = argparse.ArgumentParser(
        prog="megatron-mesh-plan", description=__doc__.split("\n\n")[0], formatter_class=_DefaultsHelp)
    g = p.add_argument_group("problem (one attention layer)")
    g.add_argument("--cp", type=int, default=8, help="context-parallel size P")
    g.add_argument("--heads", type=int, default=32, help="query heads H")
    g.add_argument("--kv-heads", type=int, default=None, help="key/value heads G (default: H, i.e. MHA)")
    g.add_argument("--head-dim", type=int, default=128, help="head dimension D (of queries and keys)")
    g.add_argument("--v-head-dim", type=int, default=None, help="value head dimension (default: D; MLA: e.g. 128)")
    g.add_argument("--seq-len", type=int, default=131072, help="global sequence length S (divisible by 2P)")
    g.add_argument("--batch", type=int, default=1, help="micro-batch size")
    g.add_argument("--dtype", choices=sorted(ITEMSIZE), default="bf16", help="activation dtype of q, k, v")
    g.add_argument("--no-causal", dest="causal", action="store_false", help="full (non-causal) attention (default: causal)")
    g.add_argument("--backward-chunks", choices=BACKWARD_CHUNKS, default="auto",
                   help="re-communicate Q/KV chunks in the backward ('refetch'), keep them from the forward ('keep'), "
                        "or keep them where a mask-aware plan's pulled tokens are at most a rank's own Q, K, V ('auto'; "
                        "dense plans refetch; TE's rows always refetch, as TE does)")
    g.add_argument("--schedule", choices=("greedy", "lockstep"), default="greedy", help="Mesh intra-tile schedule")
    g.add_argument("--modes", default=",".join(default_modes()), help="comma-separated subset of "
                   f"{','.join(all_modes())} "
                   f"(a2a+mesh lists every all-to-all degree x inner tile; {', '.join(derived_modes())}: the fastest "
                   f"of their candidates, {TIE_RULE})".replace("%", "%%"))  # argparse: help is a %-format
    g.add_argument("--window", default=None, metavar="L[,R]",
                   help="sliding window: a query attends keys at most L tokens before it and, with --no-causal, at "
                        "most R after it (R left out: no bound with --no-causal; 0, or left out, when causal) "
                        "(default: no window)")
    g.add_argument("--mask", default=None, metavar="KIND:N", help=MASK_HELP)
    g.add_argument("--docs", default=None, metavar="SPEC",
                   help="packed documents: fixed:N (every document N tokens) or lognormal:MEAN,SIGMA (lengths "
                        "drawn with mean MEAN tokens), after any one:N+ parts (one document of N tokens each, e.g. "
                        "one:524288+lognormal:4096,1); N and MEAN at most --seq-len, the last document is cut where "
                        "the sequence ends")
    g.add_argument("--seed", type=int, default=0, help="random seed of --docs lognormal")
    g.add_argument("--samples", type=int, default=1, metavar="N",
                   help="plan N samples of --docs lognormal (seeds --seed .. --seed+N-1) and give each row's mean "
                        "over them (buffer memory: the largest; 'time max': the slowest sample): what a run over "
                        f"many such samples can expect, where one sample can mislead; at most {MAX_SAMPLES:,}; not "
                        "with --explain")
    g.add_argument("--layout", default=None, choices=layout_names() + ("all",),
                   help="the sequence layout under --docs (Megatron runs each with the flag the 'in Megatron' line "
                        "names): " + "; ".join(f"{k.name}: {k.help}" for k in LAYOUTS.values()) + "; or all side by "
                        "side (a layout that would take too long to plan at this CP size, e.g. THD above 64 ranks, "
                        f"planned only when named alone) (default: all with --docs, {REFERENCE_LAYOUT} without: the "
                        "other layouts place documents)")
    g.add_argument("--layout-file", default=None, metavar="F",
                   help="also plan the layout in F for the same --docs and --seed (one sample; its text line, as "
                        "scripts/search_layout.py --out writes it), as the rows of layout 'file'; no Megatron flag "
                        "runs it")
    t = p.add_argument_group("machine (defaults: H100 SXM5, NVLink 4, one 400 Gb/s NIC per GPU)")
    t.add_argument("--nodes", type=int, default=None, help="nodes U (default: ceil(P / gpus-per-node))")
    t.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node, help="CP ranks per node M")
    t.add_argument("--intra-bandwidth", type=float, default=d.intra_bandwidth / 1e9, help="GB/s per GPU per direction")
    t.add_argument("--inter-bandwidth", type=float, default=d.inter_bandwidth / 1e9, help="GB/s per GPU per direction")
    t.add_argument("--intra-latency", type=float, default=d.intra_latency * 1e6, help="us per round")
    t.add_argument("--inter-latency", type=float, default=d.inter_latency * 1e6, help="us per round")
    t.add_argument("--tflops", type=float, default=d.attention_flops / 1e12, help="attention TFLOP/s per GPU")
    t.add_argument("--kernel-latency", type=float, default=d.kernel_latency * 1e6, help="us per attention kernel")
    t.add_argument("--hbm", type=float, default=d.memory_bandwidth / 1e12, help="HBM TB/s (merges)")
    t.add_argument("--host-op-us", default=None, metavar="US|FILE",
                   help="the host's us per torch op the executor issues (0: no host), or a JSON file that holds it: "
                        "scripts/gpu_check.sh's host_cost.json, or a bench_kernels.py / bench_masks.py --json result "
                        f"(default: {d.host_op_time * 1e6:g} us, {HOST_OP_SOURCE})")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print JSON instead of a table")
    o.add_argument("--explain", action="store_true",
                   help="also say where the fastest plan's time goes (per layout): on its slowest rank, FLOPs, "
                        "kernel launches, fp32 accumulation, copies, merges and exposed communication, with the "
                        "rounds it waits for (JSON: every row's 'breakdown'); one sample's plans, so not with --samples N > 1")
    o.add_argument("--plot", metavar="FILE.png", help="also draw bytes, time and time relative to ring versus CP "
                   "size (unmasked: not with --window or --docs)")
    o.add_argument("--plot-cp", default=None, help=f"CP sizes of the plot (with --plot; default {PLOT_CP})")
    o.add_argument("--plan-budget", type=float, default=BUDGET_S, metavar="S",
                   help="with --docs or --window, plan the rows whose estimated planning time fits in S seconds (one "
                        "core of a build machine), each mode's likeliest placements first (the squarest tile, the "
                        "smallest all-to-all degree), shared by the layouts and samples; the rest are left out, named "
                        "in one line (0: plan every row, however long it takes)")
    o.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="plan and simulate the rows in N processes (0: one per CPU core); the same table, sooner "
                        "(every row is one plan and one simulation: 1M tokens at 256 ranks with --layout all takes "
                        "minutes in one process)")
    return p


def _topology(args, world_size: int) -> Topology:
    gpn = args.gpus_per_node
    if gpn < 1:
        raise ValueError(f"--gpus-per-node must be >= 1, got {gpn}")
    if world_size > gpn and world_size % gpn:
        raise ValueError(f"--gpus-per-node {gpn} does not divide --cp {world_size}: a CP group that spans nodes holds "
                         f"the same number of consecutive ranks on every node (allowed: a divisor of {world_size}, "
                         f"or >= {world_size} for one node)")
    for flag, value, zero_ok in (("--intra-bandwidth", args.intra_bandwidth, False),
                                 ("--inter-bandwidth", args.inter_bandwidth, False),
                                 ("--intra-latency", args.intra_latency, True),
                                 ("--inter-latency", args.inter_latency, True), ("--tflops", args.tflops, False),
                                 ("--kernel-latency", args.kernel_latency, True), ("--hbm", args.hbm, False)):
        if not math.isfinite(value) or value < 0 or value == 0 and not zero_ok:
            raise ValueError(f"{flag} must be a finite number {'>= 0' if zero_ok else '> 0'}, got {value:g}")
    links = dict(intra_bandwidth=args.intra_bandwidth * 1e9, inter_bandwidth=args.inter_bandwidth * 1e9,
                 intra_latency=args.intra_latency * 1e-6, inter_latency=args.inter_latency * 1e-6,
                 attention_flops=args.tflops * 1e12, kernel_latency=args.kernel_latency * 1e-6,
                 memory_bandwidth=args.hbm * 1e12)
    if args.host_op_us is not None:
        try:
            links["host_op_time"] = host_op_us(args.host_op_us)[0] * 1e-6
        except ValueError as e:
            raise ValueError(f"--host-op-us: {e}") from None
    if args.nodes is None:
        return Topology.for_cp(world_size, gpn, **links)
    return Topology(nodes=args.nodes, gpus_per_node=gpn, **links)


def _shape(args, world_size: int) -> AttentionShape:
    kv, dv = (x if x is not None else y for x, y in ((args.kv_heads, args.heads), (args.v_head_dim, args.head_dim)))
    for flag, value in (("--cp", world_size), ("--seq-len", args.seq_len), ("--heads", args.heads), ("--kv-heads", kv),
                        ("--head-dim", args.head_dim), ("--v-head-dim", dv), ("--batch", args.batch)):
        if value < 1:  # named by its flag, not by the shape's field
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.seq_len % (2 * world_size):
        raise ValueError(f"--seq-len {args.seq_len} must be divisible by 2 * CP size = {2 * world_size} "
                         "(Megatron's zigzag layout cuts the sequence into 2P halves)")
    return AttentionShape(seq_local=args.seq_len // world_size, batch=args.batch, heads=args.heads, kv_heads=kv,
                          head_dim=args.head_dim, itemsize=ITEMSIZE[args.dtype], v_head_dim=dv)


def window_of(text: str, causal: bool, full_flag: str = "--no-causal") -> tuple[int, int | None]:
    """(left, right) of the tools' ``--window L`` or ``L,R``: tokens each query sees before and
    after itself; R defaults to 0 under a causal mask, else to no bound (None). ValueError in the
    flags' terms: R > 0 needs a full mask, which the tool's ``full_flag`` asks for."""
    try:
        parts = [int(x) for x in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or min(parts) < 0:
        raise ValueError(f"--window {text!r} must be L or L,R (integers >= 0)")
    if causal and len(parts) == 2 and parts[1]:  # said here in the flag's terms, not Mask's (None)
        raise ValueError(f"--window {text!r}: a causal query never sees a later key, so R must be 0 or left out "
                         f"(--window {parts[0]}); give {full_flag} for R > 0")
    return parts[0], parts[1] if len(parts) == 2 else (0 if causal else None)


def _mask(args, seed: int | None = None) -> Mask | None:
    """The mask of --window / --mask / --docs drawn with ``seed`` (default --seed; None: none)."""
    window, kind = None if args.window is None else window_of(args.window, args.causal), cli_kind(args)
    docs = None if args.docs is None else document_bounds(args.docs, args.seq_len, args.seed if seed is None else seed)
    if window is None and docs is None and kind is None:
        return None
    head = Mask(args.causal, window) if kind is None else kind
    return head.with_documents(None if docs is None else documents_of(docs, args.seq_len)).normalized(args.seq_len)


def document_bounds(spec: str, seq_len: int, seed: int = 0) -> list[int]:
    """cu_seqlens of documents packed into ``seq_len`` tokens: parts joined by ``+``, in sequence
    order: ``one:N`` (one document of N tokens) any number of times, then at most one part that
    fills the rest -- ``fixed:N`` (documents of N tokens) or ``lognormal:MEAN,SIGMA`` (lengths drawn
    from a log-normal with that mean, at least 1 and at most ``seq_len``). The last document is cut
    where the sequence ends, as a packing data loader cuts it; a length longer than the whole
    sequence is refused, since it would leave no document boundary at all; ``one`` parts alone must
    cover the sequence exactly.

    >>> document_bounds("fixed:3", 8)
    [0, 3, 6, 8]
    >>> document_bounds("one:4+fixed:3", 12)
    [0, 4, 7, 10, 12]
    """
    allowed = (f"must be parts joined by '+': one:N (one document of N tokens) any number of times, then at most "
               f"one of fixed:N (an integer 1 <= N <= --seq-len {seq_len}) or lognormal:MEAN,SIGMA (finite numbers, "
               f"1 <= MEAN <= --seq-len {seq_len}, SIGMA >= 0)")
    parts = spec.split("+")
    cu = [0]
    for i, part in enumerate(parts):
        kind, _, val = part.partition(":")
        try:
            if kind == "one":
                n = int(val)
                if not 1 <= n <= seq_len - cu[-1]:
                    raise ValueError
                cu.append(cu[-1] + n)
                continue
            if i != len(parts) - 1:  # a filling part leaves nothing for the parts after it
                raise ValueError
            draw = _length_draw(kind, val, seq_len, seed)
        except ValueError:
            raise ValueError(f"--docs {spec!r} {allowed}; {part!r} at {cu[-1]} of {seq_len} tokens") from None
        if cu[-1] == seq_len:
            raise ValueError(f"--docs {spec!r}: {part!r} fills nothing, the one:N documents before it already cover "
                             f"--seq-len {seq_len}; leave it out")
        while cu[-1] < seq_len:
            cu.append(min(seq_len, cu[-1] + draw()))
    if cu[-1] != seq_len:
        raise ValueError(f"--docs {spec!r}: its one:N documents cover {cu[-1]} of --seq-len {seq_len} tokens; end with "
                         f"fixed:N or lognormal:MEAN,SIGMA to fill the rest")
    return cu


def _length_draw(kind: str, val: str, seq_len: int, seed: int):
    """The document length generator of a filling --docs part (ValueError if it is not one)."""
    if kind == "fixed":
        n = int(val)
        if not 1 <= n <= seq_len:
            raise ValueError
        return lambda: n
    if kind == "lognormal":
        mean, sigma = (float(x) for x in val.split(","))
        if not (math.isfinite(mean) and math.isfinite(sigma) and 1 <= mean <= seq_len and sigma >= 0):
            raise ValueError
        mu = math.log(mean) - sigma * sigma / 2  # so that the mean length is `mean`
        if not math.isfinite(mu):  # SIGMA so large its square overflows
            raise ValueError
        rng = random.Random(seed)
        return lambda: min(seq_len, max(1, round(rng.lognormvariate(mu, sigma))))
    raise ValueError


def _layouts(args) -> tuple[str, ...]:
    """The layouts to compare: --layout, or all of them when --docs gives documents (Megatron's
    zigzag alone otherwise: the others place documents)."""
    if args.layout is None:
        return layout_names() if args.docs is not None else (REFERENCE_LAYOUT,)
    if args.layout != REFERENCE_LAYOUT and args.docs is None:
        raise ValueError(f"--layout {args.layout} places documents: give them with --docs (e.g. lognormal:4096,1)")
    return layout_names() if args.layout == "all" else (args.layout,)


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    allowed = all_modes()
    if not modes:
        raise ValueError(f"--modes {text!r} names no mode; allowed: {', '.join(allowed)}")
    bad = [m for m in modes if m not in allowed]
    if bad:
        raise ValueError(f"--modes {text!r}: unknown {bad}; allowed: {', '.join(allowed)}")
    twice = sorted({m for m in modes if modes.count(m) > 1})
    if twice:
        raise ValueError(f"--modes {text!r} names {', '.join(twice)} more than once")
    return modes


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
    mode = next((name for name, m in REGISTRY.items() if r.mode in (name, m.auto_row)), None)
    kind = LAYOUTS.get(r.layout)  # None: a layout from a file
    if mode is None or kind is None or kind.flag is None:  # TE's rows, the formulas; no Megatron flag
        return None
    flags = [f"--cp-comm-type {mode}"]
    if r.ulysses > 1:
        flags.append(f"--hierarchical-context-parallel-sizes {r.ulysses} {world_size // r.ulysses}")
    tile = next((o.flag for o in option_specs(REGISTRY[mode].Options) if o.name == "tile"), None)
    if r.tile and tile:  # the mode's own tile option (Mesh's, inner or not)
        flags.append(f"{tile} {r.tile[0]}x{r.tile[1]}")
    flags.append(kind.flag)
    return " ".join(flags)


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
    flags = megatron_flags(fast, world_size) if world_size else None
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
    return (f"CP {world_size} on {topo.nodes_used(world_size)} node(s) x {topo.gpus_per_node} GPUs; sequence "
            f"{args.seq_len:,} tokens ({shape.seq_local:,} per rank), batch {shape.batch}, heads {shape.heads}/"
            f"{shape.kv_heads}, {shape.dims_text}, {args.dtype}, {what}\n"
            f"machine: {topo.describe()}\n"
            "bytes: sent per rank, forward + backward, one attention layer -- 'max': the busiest rank's, 'mean': the "
            "mean over the ranks (intra mean + inter mean = the mean rank's bytes, at most bytes max); time: "
            "simulated forward + backward\n")


def _plot_sizes(args, modes: tuple[str, ...]) -> list[int]:
    """--plot's CP sizes, checked before any planning (ValueError naming the option): the plot
    draws unmasked attention for the modes of PLOT_MODES, into a PNG file that can be written."""
    if args.window is not None or args.docs is not None or args.mask is not None:
        raise ValueError("--plot draws unmasked attention against the CP size; it does not take --window or --docs "
                         "(plot without them, or leave --plot out)")
    if not any(m in PLOT_MODES for m in modes):
        raise ValueError(f"--plot draws {', '.join(PLOT_MODES)}; --modes {args.modes!r} names none of them")
    path = args.plot
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK) \
            or not path.lower().endswith(".png"):  # it writes PNG whatever the name says
        raise ValueError(f"--plot {path!r} must be a PNG file (FILE.png) in a writable folder")
    args.plot_cp = PLOT_CP if args.plot_cp is None else args.plot_cp
    try:
        sizes = [int(x) for x in args.plot_cp.split(",") if x.strip()]
    except ValueError:
        sizes = []
    bad = [P for P in sizes if P < 1 or args.seq_len % (2 * P)]
    if not sizes or bad:
        raise ValueError(f"--plot-cp {args.plot_cp!r} must be CP sizes joined by ',' that each split --seq-len "
                         f"{args.seq_len} into 2 x CP halves" + (f"; not {bad}" if bad else ""))
    return sizes


# each line of --plot its own colour, line style and marker: lines that coincide (tasp moves ring's
# bytes; at small P every mode takes the same time) still show both. Ring, the reference every
# other line is read against, is a wide pale band drawn under the rest; the markers are hollow.
PLOT_STYLES = {
    "ring": dict(color="black", ls="-", lw=5.0, alpha=0.25, zorder=1),
    "mesh-auto": dict(color="tab:orange", ls="-", marker="o"),
    "tasp": dict(color="tab:green", ls="--", marker="s"),
    "a2a+mesh-auto": dict(color="tab:red", ls="-", marker="D"),
    "usp": dict(color="tab:purple", ls=":", marker="^"),
    "ulysses": dict(color="tab:brown", ls="-.", marker="v"),
}
PLOT_DPI = 120


def _plot_series(args, modes: tuple[str, ...], sizes: list[int], pool) -> dict[str, list[tuple[int, ModeResult]]]:
    """Per mode of PLOT_MODES asked for: (CP size, row) at each of ``sizes`` where it runs."""
    series: dict[str, list[tuple[int, ModeResult]]] = {m: [] for m in PLOT_MODES if m in modes}
    for P in sizes:
        rows, _ = evaluate(P, _shape(args, P), _topology(argparse.Namespace(**{**vars(args), "nodes": None}), P),
                           modes=list(series), mask=Mask(args.causal), backward_chunks=args.backward_chunks,
                           schedule=args.schedule, executor=pool)
        for r in rows:
            series[r.mode].append((P, r))
    return {m: pts for m, pts in series.items() if pts}


def _g(value, _pos=None) -> str:
    """A tick label as the number it is (8, 1024, 0.5), not 2^3 or 5 x 10^-1."""
    return f"{value:g}"


def plot_fig(series: dict[str, list[tuple[int, ModeResult]]], title: str, gpus_per_node: int):
    """The --plot figure: per mode, against the CP size, the bytes the busiest rank sends (log),
    the predicted time (log) and the time relative to ring's at the same CP size (linear: the
    10-20 % between modes that a log axis flattens). One legend for the three panels, under them."""
    import matplotlib  # lazy: only --plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, (ax_b, ax_t, ax_r) = plt.subplots(1, 3, figsize=(15, 4.8), layout="constrained")
    ring = {P: r.time_s for P, r in series.get(REFERENCE_MODE, [])}
    handles = []
    for mode, pts in series.items():
        style = {"lw": 1.4, "ms": 6, "mfc": "none", "mew": 1.3, "zorder": 2, **PLOT_STYLES[mode]}
        xs = [P for P, _ in pts]
        (line,) = ax_b.plot(xs, [r.bytes_per_rank / 2**30 for _, r in pts], label=mode, **style)
        ax_t.plot(xs, [r.time_s * 1e3 for _, r in pts], **style)
        vs = [(P, r.time_s / ring[P]) for P, r in pts if P in ring]
        if vs:
            ax_r.plot([P for P, _ in vs], [v for _, v in vs], **style)
        handles.append(line)
    sizes = sorted({P for pts in series.values() for P, _ in pts})
    for ax, what in ((ax_b, "GiB"), (ax_t, "ms"),
                     (ax_r, "time / ring's time (below 1: faster)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [_g(P) for P in sizes])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(f"CP size ({gpus_per_node} GPUs per node)")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    for ax in (ax_b, ax_t):
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(_g))
        # the 2s and 5s of each decade labelled too (a decade with one label is hard to read)
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _pos: _g(v) if f"{v:.0e}"[0] in "25" else ""))
    ax_b.set_title("bytes sent by the busiest rank (fwd + bwd, log)", fontsize=10)
    ax_t.set_title("predicted attention time (fwd + bwd, log)", fontsize=10)
    ax_r.set_title(f"time relative to {REFERENCE_MODE} (linear)", fontsize=10)
    if not ring:
        ax_r.text(0.5, 0.5, f"no {REFERENCE_MODE} row to compare with\n(add it to --modes)", ha="center",
                  va="center", transform=ax_r.transAxes)
    fig.suptitle(title, fontsize=10)
    fig.legend(handles, [h.get_label() for h in handles], loc="outside lower center", ncols=len(handles),
               title="mode", fontsize=9)
    return fig


def _plot(args, modes: tuple[str, ...], path: str, sizes: list[int], pool) -> None:
    import matplotlib.pyplot as plt

    kv = args.kv_heads if args.kv_heads is not None else args.heads
    title = (f"S = {args.seq_len:,} tokens, heads {args.heads}/{kv}, {_shape(args, 1).dims_text}, {args.dtype}, "
             f"{'causal' if args.causal else 'full'}, one attention layer (megatron-mesh-plan)")
    fig = plot_fig(_plot_series(args, modes, sizes, pool), title, args.gpus_per_node)
    try:
        fig.savefig(path, dpi=PLOT_DPI, format="png")
    except OSError as e:
        raise ValueError(f"--plot {path!r}: {e.strerror or e}") from None
    finally:
        plt.close(fig)


def _explain(rows, floor: float | None) -> str:
    """Where the fastest plan of each layout spends its time (rows with a breakdown)."""
    out = []
    for layout in dict.fromkeys(r.layout for r in rows):
        pool = [r for r in rows if r.layout == layout and "breakdown" in r.extra]
        if not pool:
            continue
        best = min(pool, key=lambda r: r.time_s)
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


def _random_docs(spec: str | None) -> bool:
    """--docs draws its lengths at random (a lognormal part): its samples differ by --seed."""
    return spec is not None and any(p.partition(":")[0] == "lognormal" for p in spec.split("+"))


def _seeds(args) -> list[int]:
    """The --seed of each sample of --docs (--samples of them, from --seed on)."""
    n = args.samples
    if n < 1:
        raise ValueError(f"--samples {n}: must be >= 1")
    if n > MAX_SAMPLES:
        raise ValueError(f"--samples {n}: at most {MAX_SAMPLES:,} (each sample plans every row again, and its rows are "
                         "kept for the mean)")
    if n > 1:
        if not _random_docs(args.docs):
            raise ValueError(f"--samples {n} draws --docs with seeds {args.seed}..{args.seed + n - 1}: give --docs a "
                             f"lognormal part (one: and fixed: documents are the same in every sample), got "
                             f"{args.docs!r}")
        if args.explain:
            raise ValueError(f"--explain breaks down one sample's plans: leave out --samples {n} or --explain")
    return list(range(args.seed, args.seed + n))


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
                                 backward_chunks=args.backward_chunks, schedule=args.schedule, explain=args.explain,
                                 executor=pool, budget=part)
    else:
        rows, skipped = layout_rows(args.cp, shape, topo, docs, causal=args.causal, window=window, kind=kind, modes=modes,
                                    layouts=layouts, backward_chunks=args.backward_chunks, schedule=args.schedule,
                                    explain=args.explain, plan_all=args.layout not in (None, "all"), executor=pool,
                                    budget=part)
    if file_layout is not None:  # one more layout of the same documents, as given
        got, skip = evaluate(args.cp, shape, topo, modes=[m for m in modes if m not in FORMULAS],
                             backward_chunks=args.backward_chunks, schedule=args.schedule,
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
    rows, missing = mean_rows([r for r, _, _, _ in planned])
    first: dict[str, dict] = {}
    for _, skipped, _, _ in planned:
        for x in skipped:
            first.setdefault(x["mode"], x)
    n = len(planned)
    bounds = None if planned[0][3] is None else tuple(sum(p[3][i] for p in planned) / n for i in range(3))
    return rows, list(first.values()) + missing, sum(p[2] for p in planned) / n, bounds


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


def read_layout_file(path: str, world_size: int, documents, world_flag: str = "--cp"):
    """The layout in ``path`` (one text line, :meth:`Layout.text`, as ``scripts/search_layout.py
    --out`` writes it), checked against the problem: ``world_size`` ranks (given by ``world_flag``)
    and the ``documents`` ((start, end), ...). ValueError naming the file and what differs."""
    try:
        with open(path) as f:
            layout = layout_from_text(f.read().strip())
    except (OSError, ValueError) as e:
        raise ValueError(f"--layout-file {path}: {e}") from None
    if layout.world_size != world_size:
        raise ValueError(f"--layout-file {path}: a layout of {layout.world_size} ranks, {world_flag} {world_size}")
    if layout.documents() is None:  # the zigzag: the same tokens for any documents
        raise ValueError(f"--layout-file {path}: a {layout.text().split()[0]} layout places no documents; give a "
                         "layout of the documents (balanced, thd), e.g. the one scripts/search_layout.py --out writes")
    if documents is None or tuple(layout.documents()) != tuple(documents):
        raise ValueError(f"--layout-file {path}: its documents are not those of --docs (give the --docs, --seed and "
                         "--seq-len it was made for)")
    return layout


def _layout_file(args):
    """The layout of --layout-file (None without it): one sample's, of --docs."""
    if args.layout_file is None:
        return None
    if args.docs is None or args.samples > 1:
        raise ValueError(f"--layout-file {args.layout_file} holds one sample's layout of its documents: give the "
                         f"--docs (and --seed) it was made for, and no --samples (got --docs {args.docs}, --samples "
                         f"{args.samples})")
    bounds = document_bounds(args.docs, args.seq_len, args.seed)
    return read_layout_file(args.layout_file, args.cp, tuple(zip(bounds, bounds[1:])))


def _budget(args) -> Budget:
    """The --plan-budget (ValueError in the flag's terms); its clock is this process's CPU time, or
    wall time when worker processes plan (--jobs)."""
    try:
        return Budget(args.plan_budget, clock=time.process_time if args.jobs == 1 else time.monotonic)
    except ValueError:
        raise ValueError(f"--plan-budget {args.plan_budget:g} must be a finite number of seconds >= 0 (0: plan every "
                         "row)") from None


def _terminated(signum, frame):
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # SIGTERM (a job's time limit, kill) as an exception, so that the worker pool stops its workers
    # on the way out instead of leaving them to init; the caller's handler comes back at the end
    main_thread = threading.current_thread() is threading.main_thread()  # where signal handlers can be set
    handler = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        return _main(args)
    except BrokenPipeError:  # `megatron-mesh-plan ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush would raise again
        return 0
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if handler is None else handler)


def _main(args) -> int:
    try:
        modes = _modes(args.modes)
        if args.jobs < 0:
            raise ValueError(f"--jobs {args.jobs}: must be >= 0 (N processes; 0: one per CPU core)")
        shape = _shape(args, args.cp)
        topo = _topology(args, args.cp)
        mask = _mask(args)
        seeds = _seeds(args)
        layouts = _layouts(args)
        file_layout = _layout_file(args)
        budget = _budget(args)
        if args.plot_cp is not None and not args.plot:
            raise ValueError(f"--plot-cp {args.plot_cp} sets the CP sizes of --plot FILE.png, which is not given")
        plot_sizes = _plot_sizes(args, modes) if args.plot else None
        start = time.perf_counter()
        with planning_gc(), worker_pool(args.jobs) as pool:  # one pool for every sample, the table and the plot
            planned = [_plan_sample(args, modes, shape, topo, mask if seed == args.seed else _mask(args, seed), seed,
                                    layouts, pool, file_layout, budget.portion(len(seeds) - k))
                       for k, seed in enumerate(seeds)]
            rows, skipped, floor, bounds = planned[0] if len(planned) == 1 else _mean_samples(planned)
            elapsed = time.perf_counter() - start
            plot_s = None  # the plot plans every CP size again and draws: often longer than the table
            if args.plot:
                _plot(args, modes, args.plot, plot_sizes, pool)
                plot_s = time.perf_counter() - start - elapsed
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
    if args.json:
        print(json.dumps({"modes": [r.to_json() for r in rows], "skipped": skipped,
                          "problem": {"cp": args.cp, "seq_len": args.seq_len, **vars(shape), "causal": args.causal,
                                      "mask": mask.text() if mask is not None else None},
                          "topology": {k: v for k, v in vars(topo).items() if k != "node_of"},
                          "compute_floor_s": floor, "bounds": None if bounds is None else dict(
                              zip(("query_owner_bytes", "query_owner_simple_bytes", "any_placement_bytes"), bounds)),
                          "samples": len(seeds), "seeds": seeds if args.docs else None,
                          "planner_seconds": elapsed, "plot_seconds": plot_s}, indent=1))
    else:
        print(_header(args, args.cp, shape, topo, mask, layouts))
        if len(seeds) > 1:
            print(f"samples: {len(seeds)} of --docs {args.docs} (--seed {seeds[0]}..{seeds[-1]}); every number is the "
                  "mean over them (buffer memory: the largest; time max: the slowest sample); the documents above "
                  "are the first sample's\n")
        if floor:
            print(f"compute floor: {floor * 1e3:.2f} ms (every allowed pair spread evenly over the ranks, forward + "
                  f"{BACKWARD_FLOPS}x backward at {topo.attention_flops / 1e12:g} TFLOP/s; no communication, no "
                  "kernel launches" + ("; the mean over the samples" if len(seeds) > 1 else "") + ")\n")
        if bounds:
            print(_bounds_line(bounds, len(seeds)))
        print(_table(rows, skipped, floor, bounds[0] if bounds else None))
        best = _best(rows, floor, args.cp)
        if best:
            print("\n" + best)
            if len(seeds) == 1 and _random_docs(args.docs):  # which layout wins can change from sample to sample
                print(f"(one sample of --docs, --seed {args.seed}: --samples N gives the mean over N samples)")
        if args.explain:
            print(_explain(rows, floor))
        print(f"\n(planned and simulated in {elapsed:.2f} s" +
              (f"; the plot, {len(plot_sizes)} CP sizes planned and drawn, in {plot_s:.2f} s, written to {args.plot}; "
               f"{elapsed + plot_s:.2f} s in all)" if args.plot else ")"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

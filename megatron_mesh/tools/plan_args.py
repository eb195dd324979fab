"""The planner's command line (``megatron-mesh-plan``, :mod:`.plan_cli`): its arguments
(:func:`parser`) and what each says about the problem -- the machine (:func:`topology_of`), the
attention shape (:func:`shape_of`), the mask and its documents (:func:`mask_of`,
:func:`document_bounds`), the layouts, modes, samples and planning budget to compare. Each reader
raises ValueError naming the flag and what it allows.
"""

from __future__ import annotations

import argparse
import math
import random
import time

from ..plan.autotile import TIE_RULE
from ..plan.hostcost import HOST_OP_SOURCE, host_costs
from ..plan.layout import layout_from_text
from ..plan.layouts import LAYOUTS, REFERENCE_LAYOUT, layout_names
from ..plan.mask import Mask, documents_of
from ..plan.mesh import BACKWARD_CHUNKS
from ..plan.shape import AttentionShape
from ..plan.sparse_needs import KEEP_LIMIT
from ..plan.topology import Topology
from .mask_spec import HELP as MASK_HELP, cli_kind
from .plan_budget import BUDGET_S, Budget
from .planner import all_modes, default_modes, derived_modes

__all__ = ["ITEMSIZE", "MAX_SAMPLES", "PLOT_CP", "budget_of", "document_bounds", "layout_file_of", "layouts_of",
           "mask_of", "modes_of", "parser", "random_docs", "read_layout_file", "seeds_of", "shape_of", "topology_of",
           "window_of"]

# the first line of --help, as plan_cli's docstring opens
DESCRIPTION = ("``megatron-mesh-plan`` (``python -m megatron_mesh.tools.plan_cli``): compare the CP modes of one "
               "problem.")
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
PLOT_CP = "8,16,32,64,128,256,512,1024"  # --plot's CP sizes unless --plot-cp says
MAX_SAMPLES = 10_000  # --samples: each sample plans every row again, and its rows are kept for the mean


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" only where X says something: not for on/off flags (the help says
    what the flag turns on or off) nor for None (the help says what happens without the option)."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def parser() -> argparse.ArgumentParser:
    """The planner's arguments: the problem (one attention layer), the machine, the output."""
    p = argparse.ArgumentParser(prog="megatron-mesh-plan", description=DESCRIPTION, formatter_class=_DefaultsHelp)
    problem = p.add_argument_group("problem (one attention layer)")
    _problem_arguments(problem)
    _mask_arguments(problem)  # the same group: the masks, documents and layouts are part of the problem
    _machine_arguments(p.add_argument_group("machine (defaults: H100 SXM5, NVLink 4, one 400 Gb/s NIC per GPU)"))
    _output_arguments(p.add_argument_group("output"))
    return p


def _problem_arguments(g) -> None:
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
                        "or keep what of a mask-aware plan's pulled tokens fits in --backward-keep-limit x a rank's own "
                        "Q, K, V ('auto'; "
                        "dense plans refetch; TE's rows always refetch, as TE does)")
    g.add_argument("--backward-keep-limit", type=float, default=KEEP_LIMIT, metavar="X",
                   help="under --backward-chunks auto: a rank keeps what it pulled up to X times the bytes of its own "
                        f"Q, K and V chunk and pulls the rest again (default {KEEP_LIMIT}; Megatron: "
                        "--mesh-backward-keep-limit / --tasp-backward-keep-limit)")
    g.add_argument("--schedule", choices=("greedy", "lockstep"), default="greedy", help="Mesh intra-tile schedule")
    g.add_argument("--modes", default=",".join(default_modes()), help="comma-separated subset of "
                   f"{','.join(all_modes())} "
                   f"(a2a+mesh lists every all-to-all degree x inner tile; {', '.join(derived_modes())}: the fastest "
                   f"of their candidates, {TIE_RULE})".replace("%", "%%"))  # argparse: help is a %-format


def _mask_arguments(g) -> None:
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


def _machine_arguments(t) -> None:
    d = Topology()
    t.add_argument("--nodes", type=int, default=None, help="nodes U of the machine (default: ceil(P / gpus-per-node)); "
                   "the CP ranks fill nodes of --gpus-per-node ranks in order, so to spread P ranks over U nodes give "
                   "--gpus-per-node P/U")
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
    t.add_argument("--host-view-us", type=float, default=None, metavar="US",
                   help="the host's us per view the executor makes (a slice: no kernel launch; priced only where "
                        "--host-op-us is not 0; default: the --host-op-us file's host_view_us where it has one, "
                        f"else {d.host_view_time * 1e6:g} us)")
    t.add_argument("--host-lead-us", type=float, default=d.host_lead * 1e6, metavar="US",
                   help="how far the host is ahead of its GPU when the attention's forward or backward starts: the "
                        "layer's other work lets it queue ops early (0: it starts with the GPU, the worst case; a "
                        "Llama-3-8B-like layer at 4K tokens per rank gives about 2000; default %(default)g)")


CONFIG_FLAG = "--config"


def _output_arguments(o) -> None:
    o.add_argument(CONFIG_FLAG, metavar="CONFIG.yaml",
                   help="a Megatron config (MODEL_ARGS, as scripts/pretrain_gpt.sh takes it): print the prediction for "
                        "its attention on the default machine instead -- a table per kind of layer (windows, Llama 4's "
                        "chunks: --attention-chunk-size) and the stack under auto's picks; the problem is the "
                        "config's, so only the machine's flags go with it (--gpus-per-node: GPUs per node, of which "
                        "each CP group holds gpus-per-node / TP; not --nodes) (scripts/compare_cp_modes.sh --predict "
                        "puts the same, on the default machine, in its report)")
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


def topology_of(args, world_size: int) -> Topology:
    gpn = args.gpus_per_node
    if gpn < 1:
        raise ValueError(f"--gpus-per-node must be >= 1, got {gpn}")
    if world_size > gpn and world_size % gpn:
        raise ValueError(f"--gpus-per-node {gpn} does not divide --cp {world_size}: a CP group that spans nodes holds "
                         f"the same number of consecutive ranks on every node (allowed: a divisor of {world_size}, "
                         f"or >= {world_size} for one node)")
    links = machine_links(args)
    if args.nodes is None:
        return Topology.for_cp(world_size, gpn, **links)
    return Topology(nodes=args.nodes, gpus_per_node=gpn, **links)


def machine_links(args) -> dict:
    """The machine flags but the node layout (links, throughput, the host) as
    :class:`~megatron_mesh.plan.topology.Topology` fields, checked (ValueError naming the flag)."""
    for flag, value, zero_ok in (("--intra-bandwidth", args.intra_bandwidth, False),
                                 ("--inter-bandwidth", args.inter_bandwidth, False),
                                 ("--intra-latency", args.intra_latency, True),
                                 ("--inter-latency", args.inter_latency, True), ("--tflops", args.tflops, False),
                                 ("--kernel-latency", args.kernel_latency, True), ("--hbm", args.hbm, False),
                                 ("--host-view-us", 0.0 if args.host_view_us is None else args.host_view_us, True),
                                 ("--host-lead-us", args.host_lead_us, True)):
        if not math.isfinite(value) or value < 0 or value == 0 and not zero_ok:
            raise ValueError(f"{flag} must be a finite number {'>= 0' if zero_ok else '> 0'}, got {value:g}")
    links = dict(intra_bandwidth=args.intra_bandwidth * 1e9, inter_bandwidth=args.inter_bandwidth * 1e9,
                 intra_latency=args.intra_latency * 1e-6, inter_latency=args.inter_latency * 1e-6,
                 attention_flops=args.tflops * 1e12, kernel_latency=args.kernel_latency * 1e-6,
                 memory_bandwidth=args.hbm * 1e12, host_lead=args.host_lead_us * 1e-6)
    if args.host_op_us is not None:
        try:
            op, view, _ = host_costs(args.host_op_us)
        except ValueError as e:
            raise ValueError(f"--host-op-us: {e}") from None
        links["host_op_time"] = op * 1e-6
        if view is not None:  # a host_cost.json measured both: its views' price goes with its ops'
            links["host_view_time"] = view * 1e-6
    if args.host_view_us is not None:
        links["host_view_time"] = args.host_view_us * 1e-6
    return links


def shape_of(args, world_size: int) -> AttentionShape:
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


def mask_of(args, seed: int | None = None) -> Mask | None:
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
                if n >= 1 and n > seq_len - cu[-1]:  # the value is fine, the sequence too short for it
                    raise ValueError(f"--docs {spec!r}: {part!r} is longer than the {seq_len - cu[-1]} tokens of "
                                     f"--seq-len {seq_len} left after the documents before it; give a longer --seq-len "
                                     "or a shorter document")
                if n < 1:
                    raise ValueError
                cu.append(cu[-1] + n)
                continue
            if i != len(parts) - 1:  # a filling part leaves nothing for the parts after it
                raise ValueError
            draw = _length_draw(kind, val, seq_len, seed)
        except ValueError as e:
            if str(e).startswith("--docs "):  # already says what is wrong
                raise
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


def layouts_of(args) -> tuple[str, ...]:
    """The layouts to compare: --layout, or all of them when --docs gives documents (Megatron's
    zigzag alone otherwise: the others place documents)."""
    if args.layout is None:
        return layout_names() if args.docs is not None else (REFERENCE_LAYOUT,)
    if args.layout != REFERENCE_LAYOUT and args.docs is None:
        raise ValueError(f"--layout {args.layout} places documents: give them with --docs (e.g. lognormal:4096,1)")
    return layout_names() if args.layout == "all" else (args.layout,)


def modes_of(text: str) -> tuple[str, ...]:
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


def random_docs(spec: str | None) -> bool:
    """--docs draws its lengths at random (a lognormal part): its samples differ by --seed."""
    return spec is not None and any(p.partition(":")[0] == "lognormal" for p in spec.split("+"))


def seeds_of(args) -> list[int]:
    """The --seed of each sample of --docs (--samples of them, from --seed on)."""
    n = args.samples
    if n < 1:
        raise ValueError(f"--samples {n}: must be >= 1")
    if n > MAX_SAMPLES:
        raise ValueError(f"--samples {n}: at most {MAX_SAMPLES:,} (each sample plans every row again, and its rows are "
                         "kept for the mean)")
    if n > 1:
        if not random_docs(args.docs):
            raise ValueError(f"--samples {n} draws --docs with seeds {args.seed}..{args.seed + n - 1}: give --docs a "
                             f"lognormal part (one: and fixed: documents are the same in every sample), got "
                             f"{args.docs!r}")
        if args.explain:
            raise ValueError(f"--explain breaks down one sample's plans: leave out --samples {n} or --explain")
    return list(range(args.seed, args.seed + n))


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


def layout_file_of(args):
    """The layout of --layout-file (None without it): one sample's, of --docs."""
    if args.layout_file is None:
        return None
    if args.docs is None or args.samples > 1:
        raise ValueError(f"--layout-file {args.layout_file} holds one sample's layout of its documents: give the "
                         f"--docs (and --seed) it was made for, and no --samples (got --docs {args.docs}, --samples "
                         f"{args.samples})")
    bounds = document_bounds(args.docs, args.seq_len, args.seed)
    return read_layout_file(args.layout_file, args.cp, tuple(zip(bounds, bounds[1:])))


def budget_of(args) -> Budget:
    """The --plan-budget (ValueError in the flag's terms); its clock is this process's CPU time, or
    wall time when worker processes plan (--jobs)."""
    try:
        return Budget(args.plan_budget, clock=time.process_time if args.jobs == 1 else time.monotonic)
    except ValueError:
        raise ValueError(f"--plan-budget {args.plan_budget:g} must be a finite number of seconds >= 0 (0: plan every "
                         "row)") from None

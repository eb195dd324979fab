"""The planner's ``--plot FILE.png`` (:mod:`.plan_cli`): unmasked attention against the CP size
(``--plot-cp``), one line per mode of :data:`PLOT_MODES` -- the busiest rank's bytes, the
simulated time and the time relative to ring (:func:`plot_fig` draws the figure from the rows).
"""

from __future__ import annotations

import argparse
import os
import sys

from ..plan.mask import Mask
from ..plan.modes import REFERENCE_MODE
from .mode_result import ModeResult
from .plan_args import PLOT_CP, shape_of, topology_of
from .planner import evaluate

__all__ = ["PLOT_MODES", "draw_plot", "plot_fig", "plot_sizes"]

# the lines of --plot (one per mode: rows with one placement per CP size)
PLOT_MODES = ("ring", "mesh-auto", "tasp", "a2a+mesh-auto", "usp", "ulysses")


def plot_sizes(args, modes: tuple[str, ...]) -> list[int]:
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
SLOW_PLOT_CP = 256  # a plot with a CP size this large is announced before it is planned


def _plot_series(args, modes: tuple[str, ...], sizes: list[int], pool) -> dict[str, list[tuple[int, ModeResult]]]:
    """Per mode of PLOT_MODES asked for: (CP size, row) at each of ``sizes`` where it runs."""
    series: dict[str, list[tuple[int, ModeResult]]] = {m: [] for m in PLOT_MODES if m in modes}
    for P in sizes:
        rows, _ = evaluate(P, shape_of(args, P), topology_of(argparse.Namespace(**{**vars(args), "nodes": None}), P),
                           modes=list(series), mask=Mask(args.causal), backward_chunks=args.backward_chunks,
                           schedule=args.schedule, keep_limit=args.backward_keep_limit, executor=pool)
        for r in rows:
            series[r.mode].append((P, r))
    return {m: pts for m, pts in series.items() if pts}


def _g(value, _pos=None) -> str:
    """A tick label as the number it is (8, 1024, 0.5), not 2^3 or 5 x 10^-1."""
    return f"{value:g}"


RATIO_LOG_SPREAD = 3.0  # the relative-time panel goes log where its largest ratio is this many times its smallest


def plot_fig(series: dict[str, list[tuple[int, ModeResult]]], title: str, gpus_per_node: int):
    """The --plot figure: per mode, against the CP size, the bytes the busiest rank sends (log),
    the predicted time (log) and the time relative to ring's at the same CP size (linear: the
    10-20 % between modes that a log axis flattens -- log where the ratios spread over more than
    :data:`RATIO_LOG_SPREAD` x). One legend for the three panels, under them."""
    import matplotlib  # lazy: only --plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, (ax_b, ax_t, ax_r) = plt.subplots(1, 3, figsize=(15, 4.8), layout="constrained")
    ring = {P: r.time_s for P, r in series.get(REFERENCE_MODE, [])}
    handles = []
    top = max((P for pts in series.values() for P, _ in pts), default=0)
    for mode, pts in series.items():
        style = {"lw": 1.4, "ms": 6, "mfc": "none", "mew": 1.3, "zorder": 2, **PLOT_STYLES[mode]}
        xs = [P for P, _ in pts]
        # a mode that stops short (Ulysses: no more ranks than heads) says where: its few points can hide
        # under the others' in the time panels
        label = mode + (f" (to CP {max(xs)})" if max(xs) < top else "")
        (line,) = ax_b.plot(xs, [r.bytes_per_rank / 2**30 for _, r in pts], label=label, **style)
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
    # the ratios: linear where they lie close (the 10-20 % between modes that a log axis flattens),
    # log where one mode is several times ring's (TASP at 1024 ranks: 4.7x squashed every other curve
    # under 1 together, stop 81's review)
    ratios = [v for line in ax_r.get_lines() for v in line.get_ydata()]
    spread = max(ratios) / min(ratios) if ratios and min(ratios) > 0 else 1.0
    log_ratio = spread > RATIO_LOG_SPREAD
    for ax in (ax_b, ax_t) + ((ax_r,) if log_ratio else ()):
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(_g))
        # the 2s and 5s of each decade labelled too (a decade with one label is hard to read)
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _pos: _g(v) if f"{v:.0e}"[0] in "25" else ""))
    ax_b.set_title("bytes sent by the busiest rank (fwd + bwd, log)", fontsize=10)
    ax_t.set_title("predicted attention time (fwd + bwd, log)", fontsize=10)
    ax_r.set_title(f"time relative to {REFERENCE_MODE} ({'log' if log_ratio else 'linear'})", fontsize=10)
    if not ring:
        ax_r.text(0.5, 0.5, f"no {REFERENCE_MODE} row to compare with\n(add it to --modes)", ha="center",
                  va="center", transform=ax_r.transAxes)
    fig.suptitle(title, fontsize=10)
    fig.legend(handles, [h.get_label() for h in handles], loc="outside lower center", ncols=len(handles),
               title="mode", fontsize=9)
    return fig


def draw_plot(args, modes: tuple[str, ...], path: str, sizes: list[int], pool) -> None:
    import matplotlib.pyplot as plt

    kv = args.kv_heads if args.kv_heads is not None else args.heads
    title = (f"S = {args.seq_len:,} tokens, heads {args.heads}/{kv}, {shape_of(args, 1).dims_text}, {args.dtype}, "
             f"{'causal' if args.causal else 'full'}, one attention layer (megatron-mesh-plan)")
    if max(sizes) >= SLOW_PLOT_CP:  # say so before the wait (it plans every size again; a minute or more on 2 cores)
        print(f"megatron-mesh-plan: --plot plans {len(sizes)} CP sizes ({', '.join(map(str, sizes))}) for the figure: "
              "up to a few minutes (--plot-cp A,B,... plots fewer)", file=sys.stderr, flush=True)
    fig = plot_fig(_plot_series(args, modes, sizes, pool), title, args.gpus_per_node)
    try:
        fig.savefig(path, dpi=PLOT_DPI, format="png")
    except OSError as e:
        raise ValueError(f"--plot {path!r}: {e.strerror or e}") from None
    finally:
        plt.close(fig)

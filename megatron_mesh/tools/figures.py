"""The comparison report's figures: one function per figure, each taking the runs
(:class:`~megatron_mesh.tools.runs.RunResult`) and the report directory and returning the names of
the PNG files it wrote (none when the runs hold nothing to draw).

* :func:`loss_figure` (``loss.png``) -- per mask a panel with every mode's loss curve, and under it
  the loss deviation from that mask's baseline on a log axis (parity at a glance: every CP mode
  sits at rounding level, a broken one decades above);
* :func:`measure_figure` (``bytes.png``, ``time.png``, ``memory.png``) -- grouped bars: one group
  per mask, one bar per mode;
* :func:`ranks_figure` (``ranks.png``) -- per mask the attention work and the bytes sent of every
  CP rank, grouped by mode, with each group's max / mean (the imbalance);
* :func:`heatmap_figure` (``heatmap.png``) -- per mask and mode, the bytes each CP rank sent to
  each other one (sender x receiver, as ``comm_counter`` measured them): ring's band, Mesh's tile
  blocks, TASP's spread, a hybrid's all-to-all pairs beside its inner ring; one unit and one colour
  scale for every panel.

Each figure has a ``*_fig`` builder that returns the matplotlib Figure (the tests inspect its
artists). Layout: constrained layout, legends in the figure margin (outside the data), saved with
``bbox_inches="tight"`` so nothing is clipped. matplotlib is imported here only, and only when a
figure is drawn (:mod:`.report` writes its tables without it).
"""

from __future__ import annotations

import os

from .runs import RunResult, imbalance, mean_time, timed_iterations, timed_steps

__all__ = ["FIGURES", "DEVIATION_FLOOR", "loss_figure", "measure_figure", "ranks_figure", "heatmap_figure",
           "write_figures", "loss_fig", "measure_fig", "ranks_fig", "heatmap_fig", "MEASURES"]

DPI = 110
# a loss equal to the baseline's to the last bit has no place on a log axis: drawn at this floor
DEVIATION_FLOOR = 1e-12
# measure -> (file name, y label ({unit}: see _unit), value of a run, kind of unit, CP 1 runs drawn)
MEASURES = {
    # bytes and memory: the busiest rank's (RunResult's max over ranks)
    "bytes": ("bytes.png", "attention bytes sent per step\nby the busiest rank ({unit})", lambda r: r.bytes_per_step,
              "bytes", False),  # CP 1 sends nothing: no bar
    "time": ("time.png", "time per iteration ({unit})", mean_time, "ms", True),
    "memory": ("memory.png", "peak memory, the largest\nof the ranks ({unit})", lambda r: r.peak_memory, "bytes",
               True),
}


def _unit(largest: float, kind: str) -> tuple[str, float]:
    """(unit name, scale) that writes ``largest`` with a few digits: bytes in B/KiB/MiB/GiB, counts
    in thousands/millions/billions, milliseconds as they are."""
    if kind == "ms":
        return "ms", 1.0
    steps = {"bytes": (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1)),
             "count": (("billions", 1e9), ("millions", 1e6), ("thousands", 1e3), ("", 1))}[kind]
    for name, size in steps:
        if largest >= size:
            return name, 1 / size
    return steps[-1][0], 1.0


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _masks(runs: list[RunResult]) -> list[str]:
    return list(dict.fromkeys(r.mask for r in runs))


def _modes(runs: list[RunResult]) -> list[str]:
    return list(dict.fromkeys(r.mode for r in runs))


def _colors(modes: list[str], baseline: str | None) -> dict[str, tuple]:
    """One color per mode, the same in every figure (the baseline black)."""
    plt = _plt()
    cmap = plt.get_cmap("tab10")
    others = [m for m in modes if m != baseline]
    colors = {m: cmap(i % 10) for i, m in enumerate(others)}
    if baseline in modes:
        colors[baseline] = (0.0, 0.0, 0.0, 1.0)
    return colors


def _save(fig, out_dir: str, name: str) -> list[str]:
    plt = _plt()
    fig.savefig(os.path.join(out_dir, name), dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return [name]


# -- loss ---------------------------------------------------------------------------------------------
def loss_fig(runs: list[RunResult], baseline: str | None = "baseline"):
    """Per mask (columns): the loss curves of every mode (top) and their deviation from the mask's
    baseline on a log axis (bottom; without a baseline run, the top row only). None: no losses."""
    runs = [r for r in runs if r.losses]
    if not runs:
        return None
    plt = _plt()
    masks, modes = _masks(runs), _modes(runs)
    colors = _colors(modes, baseline)
    bases = {r.mask: r for r in runs if r.mode == baseline}
    nrows = 2 if bases else 1
    fig, axes = plt.subplots(nrows, len(masks), figsize=(3.6 * len(masks) + 1.8, 3.0 * nrows), squeeze=False,
                             sharex=True, layout="constrained")
    # modes that agree draw on top of each other: hollow markers of decreasing size (nested rings)
    # keep every one of them visible
    others = [m for m in modes if m != baseline]
    style = {m: dict(marker="os^Dv<>ph"[j % 9], ms=max(3.0, 10.0 - 1.3 * j), mfc="none", mew=1.2)
             for j, m in enumerate(others)}
    handles = {}
    floored = False
    for col, mask in enumerate(masks):
        ax = axes[0][col]
        mine = [r for r in runs if r.mask == mask]
        for r in mine:
            its = sorted(r.losses)
            is_base = r.mode == baseline
            (line,) = ax.plot(its, [r.losses[i] for i in its], color=colors[r.mode], label=r.mode,
                              lw=3.0 if is_base else 1.0, alpha=0.35 if is_base else 0.9,
                              zorder=1 if is_base else 2, **({} if is_base else style[r.mode]))
            handles.setdefault(r.mode, line)
        ax.set_title(f"mask: {mask}")
        ax.set_ylabel("lm loss" if col == 0 else "")
        if nrows == 1:
            ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        if nrows == 2:
            ax = axes[1][col]
            base = bases.get(mask)
            for r in mine:
                if base is None or r is base:
                    continue
                its = [i for i in sorted(r.losses) if i in base.losses]
                devs = [abs(r.losses[i] - base.losses[i]) for i in its]
                floored |= any(d < DEVIATION_FLOOR for d in devs)
                (line,) = ax.plot(its, [max(d, DEVIATION_FLOOR) for d in devs], color=colors[r.mode], label=r.mode,
                                  lw=1.0, **style[r.mode])
                handles.setdefault(r.mode, line)
            ax.set_yscale("log")
            ax.set_ylim(DEVIATION_FLOOR / 3, 1.0)
            ax.set_xlabel("iteration")
            ax.set_ylabel("|loss - baseline loss|" if col == 0 else "")
            ax.grid(alpha=0.3, which="major")
            if base is None:
                ax.set_title("(no baseline run)", fontsize=9)
    for ax in axes.flat:
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle("Loss per mask (top) and |loss - baseline| (bottom, log)" if nrows == 2 else "Loss per mask")
    note = f" (a deviation of 0 is drawn at {DEVIATION_FLOOR:g})" if floored else ""
    fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncols=min(len(handles), 6),
               title="mode" + note)
    return fig


def loss_figure(runs: list[RunResult], out_dir: str, baseline: str | None = "baseline") -> list[str]:
    fig = loss_fig(runs, baseline)
    return [] if fig is None else _save(fig, out_dir, "loss.png")


# -- bytes, time, memory: grouped bars ---------------------------------------------------------------
def measure_fig(runs: list[RunResult], measure: str, baseline: str | None = "baseline"):
    """Grouped bars of ``measure`` (a key of :data:`MEASURES`): one group per mask, one bar per mode
    (failed runs and runs without the measure have no bar). None: nothing measured."""
    if measure not in MEASURES:
        raise ValueError(f"unknown measure {measure!r}; allowed: {', '.join(MEASURES)}")
    _, ylabel, value, kind, single = MEASURES[measure]
    runs = [r for r in runs if single or r.cp > 1]
    vals = {(r.mask, r.mode): value(r) for r in runs if r.ok and value(r) is not None}
    if not vals:
        return None
    unit, scale = _unit(max(vals.values()), kind)
    vals = {k: v * scale for k, v in vals.items()}
    ylabel = ylabel.format(unit=unit)
    kinds = sorted({r.memory_kind for r in runs if r.memory_kind})
    if measure == "memory" and kinds:  # what was measured: max RSS on CPU, the CUDA allocator's peak on GPUs
        ylabel += f"\n({', '.join(kinds)})"
    plt = _plt()
    masks, modes = _masks(runs), _modes(runs)
    colors = _colors(modes, baseline)
    modes = [m for m in modes if any((mask, m) in vals for mask in masks)]  # a failed mode has no bar, no entry
    width = 0.8 / len(modes)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 + 0.35 * len(modes) * len(masks)) + 1.8, 3.6), layout="constrained")
    by_key = {(r.mask, r.mode): r for r in runs}
    for j, mode in enumerate(modes):
        xs = [i + (j - (len(modes) - 1) / 2) * width for i, mask in enumerate(masks) if (mask, mode) in vals]
        ys = [vals[mask, mode] for mask in masks if (mask, mode) in vals]
        ax.bar(xs, ys, width=width * 0.92, color=colors[mode], label=mode)
        if measure == "time":  # the spread of the timed iterations: a difference inside it is noise
            spans = [[min(ts) * scale, max(ts) * scale] for mask in masks if (mask, mode) in vals
                     for ts in [timed_iterations(by_key[mask, mode])]]
            ax.errorbar(xs, ys, yerr=[[y - lo for y, (lo, _) in zip(ys, spans)], [hi - y for y, (_, hi) in zip(ys, spans)]],
                        fmt="none", ecolor="black", elinewidth=0.8, capsize=2)
    if measure == "time":
        # three short lines: the title stays clear of the legend beside the plot
        ax.set_title(f"{_timed_text(runs)}, whiskers: min-max;\ndifferences inside the whiskers are noise; on CPU "
                     "the ranks share\nthe cores, so these times say nothing of GPU speed", fontsize=8)
    elif measure == "memory" and "max RSS" in kinds:
        ax.set_title("max RSS per process: mostly torch and Megatron themselves, not attention buffers", fontsize=8)
    ax.set_xticks(range(len(masks)), [f"mask: {m}" for m in masks])
    ax.set_xlim(-0.5, len(masks) - 0.5)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    fig.legend(loc="outside right upper", title="mode")
    return fig


def _timed_text(runs: list[RunResult]) -> str:
    """Which iterations the time bars are: "time of iteration 2 (the first left out)" (a job of
    two), "mean of iterations 2-10 (the first left out)", runs of different lengths joined by "/"."""
    spans = sorted({(s[0], s[-1], len(s), len(r.times_ms) > 1) for r in runs if r.ok and r.times_ms
                    for s in [timed_steps(r)]})
    if not spans:
        return "no iteration timed"
    text = "/".join(str(a) if n == 1 else f"{a}-{b}" for a, b, n, _ in spans)
    one = all(n == 1 for _, _, n, _ in spans)
    warm_up = {w for *_, w in spans}
    why = {frozenset({True}): "the first left out", frozenset({False}): "the only one"}.get(
        frozenset(warm_up), "the first left out where there are others")
    return f"{'time of iteration' if one else 'mean of iterations'} {text} ({why})"


def measure_figure(runs: list[RunResult], out_dir: str, measure: str, baseline: str | None = "baseline") -> list[str]:
    fig = measure_fig(runs, measure, baseline)
    return [] if fig is None else _save(fig, out_dir, MEASURES[measure][0])


# -- per rank: work and bytes ------------------------------------------------------------------------
def ranks_fig(runs: list[RunResult]):
    """Per mask (rows): attention work (left) and bytes sent (right) of every CP rank, one group of
    bars per mode (bar i = CP rank i), the group's max / mean written above it. Runs without
    per-rank metrics (CP 1) are left out. None: no run has them."""
    runs = [r for r in runs if r.ok and r.cp > 1 and r.rank_work and r.rank_bytes]
    if not runs:
        return None
    plt = _plt()
    masks = _masks(runs)
    cp = max(len(r.rank_work) for r in runs)
    cmap = plt.get_cmap("viridis")
    rank_colors = [cmap(0.1 + 0.8 * i / max(1, cp - 1)) for i in range(cp)]
    nmodes = max(len([r for r in runs if r.mask == m]) for m in masks)
    fig, axes = plt.subplots(len(masks), 2, figsize=(2 * max(4.0, 1.0 + 1.05 * nmodes) + 1.4, 2.9 * len(masks)),
                             squeeze=False, layout="constrained")
    for row, mask in enumerate(masks):
        mine = [r for r in runs if r.mask == mask]
        for col, (what, ylabel, kind) in enumerate((("rank_work", "attention work per step\n(scores computed, "
                                                    "forward{unit})", "count"),
                                                   ("rank_bytes", "attention bytes sent\nper step ({unit})", "bytes"))):
            ax = axes[row][col]
            unit, scale = _unit(max(max(getattr(r, what)) for r in mine), kind)
            ylabel = ylabel.format(unit=f", {unit}" if kind == "count" and unit else unit)
            width = 0.8 / cp
            top = max(max(getattr(r, what)) * scale for r in mine) or 1.0
            for g, r in enumerate(mine):
                vals = [v * scale for v in getattr(r, what)]
                xs = [g + (i - (len(vals) - 1) / 2) * width for i in range(len(vals))]
                ax.bar(xs, vals, width=width * 0.9, color=rank_colors[:len(vals)])
                ratio = imbalance(vals)
                ax.text(g, max(vals) + 0.03 * top, "-" if ratio is None else f"max/mean\n{ratio:.2f}",
                        ha="center", va="bottom", fontsize=7)
            ax.set_ylim(0, top * 1.3)
            ax.set_xticks(range(len(mine)), [r.mode for r in mine], rotation=20, ha="right",
                          rotation_mode="anchor", fontsize=8)
            ax.set_xlim(-0.5, len(mine) - 0.5)
            ax.set_ylabel(ylabel, fontsize=9)
            ax.set_title(f"mask: {mask} -- {'work' if col == 0 else 'bytes'} per CP rank", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
            ax.set_axisbelow(True)
    from matplotlib.patches import Patch

    fig.legend([Patch(color=c) for c in rank_colors], [f"rank {i}" for i in range(cp)], loc="outside right upper",
               title="CP rank")
    return fig


def ranks_figure(runs: list[RunResult], out_dir: str) -> list[str]:
    fig = ranks_fig(runs)
    return [] if fig is None else _save(fig, out_dir, "ranks.png")


# -- who sends to whom -------------------------------------------------------------------------------
def heatmap_fig(runs: list[RunResult]):
    """Per mask (rows) and mode (columns): the bytes per step each CP rank sent (row) to each
    other one (column), as measured. One unit for every panel (from the largest cell of all): the
    cells (annotated, CP <= 8), colour bars and panel totals all in it. One colour scale per mask,
    shared by its modes (the comparison the figure is for: the same problem, mode against mode);
    masks get their own, since a mask that sends a tenth of the bytes would otherwise show no
    pattern at all. None: no run has the per-peer counts."""
    runs = [r for r in runs if r.ok and r.cp > 1 and r.bytes_matrix]
    if not runs:
        return None
    plt = _plt()
    masks = _masks(runs)
    modes = _modes(runs)
    cp = max(len(r.bytes_matrix) for r in runs)
    size = max(2.3, 0.42 * cp)
    fig, axes = plt.subplots(len(masks), len(modes), figsize=(size * len(modes) + 1.5, (size + 0.7) * len(masks)),
                             squeeze=False, layout="constrained")
    fig.get_layout_engine().set(h_pad=0.08)  # the image panels keep their aspect: room between the rows
    unit, scale = _unit(max(v for r in runs for line in r.bytes_matrix for v in line), "bytes")
    for row, mask in enumerate(masks):
        by_mode = {r.mode: r for r in runs if r.mask == mask}
        vmax = max((v for r in by_mode.values() for line in r.bytes_matrix for v in line), default=0) * scale or 1.0
        image = None
        for col, mode in enumerate(modes):
            ax = axes[row][col]
            r = by_mode.get(mode)
            if r is None:
                ax.set_axis_off()
                continue
            data = [[v * scale for v in line] for line in r.bytes_matrix]
            image = ax.imshow(data, cmap="Blues", vmin=0, vmax=vmax)
            n = len(data)
            if n <= 8:
                for i in range(n):
                    for j in range(n):
                        if r.bytes_matrix[i][j]:
                            ax.text(j, i, _cell_label(data[i][j]), ha="center", va="center", fontsize=7,
                                    color="white" if data[i][j] > 0.6 * vmax else "black")
            total = sum(sum(line) for line in r.bytes_matrix)
            ax.set_title(f"{mode}: total {_cell_label(total * scale)} {unit}", fontsize=9)
            ax.set_xticks(range(n))
            ax.set_yticks(range(n))
            ax.tick_params(labelsize=7)
            ax.set_xlabel("receiver (CP rank)" if row == len(masks) - 1 else "", fontsize=8)
            ax.set_ylabel(f"mask: {mask}\nsender (CP rank)" if col == 0 else "", fontsize=8)
        if image is not None:
            bar = fig.colorbar(image, ax=list(axes[row]), shrink=0.85, pad=0.01)
            bar.set_label(f"{unit} sent per step", fontsize=8)
            bar.ax.tick_params(labelsize=7)
    fig.suptitle(f"Attention bytes sent per step, sender x receiver, in {unit}; one colour scale per mask (measured by "
                 "comm_counter)")
    return fig


def _cell_label(v: float) -> str:
    """A cell's value in the figure's unit, in at most ~4 characters ('2.25', '768', '0.75')."""
    if v >= 100:
        return f"{v:.0f}"
    return f"{v:.3g}" if v >= 1 else f"{v:.2g}"


def heatmap_figure(runs: list[RunResult], out_dir: str) -> list[str]:
    fig = heatmap_fig(runs)
    return [] if fig is None else _save(fig, out_dir, "heatmap.png")


FIGURES = ("loss.png", "bytes.png", "time.png", "ranks.png", "heatmap.png", "memory.png")


def write_figures(runs: list[RunResult], out_dir: str, baseline: str | None = "baseline") -> list[str]:
    """Every figure the runs have data for, in :data:`FIGURES` order; returns the file names."""
    os.makedirs(out_dir, exist_ok=True)
    names = loss_figure(runs, out_dir, baseline)
    names += measure_figure(runs, out_dir, "bytes", baseline)
    names += measure_figure(runs, out_dir, "time", baseline)
    names += ranks_figure(runs, out_dir)
    names += heatmap_figure(runs, out_dir)
    names += measure_figure(runs, out_dir, "memory", baseline)
    return names

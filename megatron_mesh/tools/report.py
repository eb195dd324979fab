"""The side-by-side report of CP modes: read each run's per-rank metrics (JSON lines written by
``--cp-metrics-dir``, see ``megatron_mesh.megatron.metrics``) and write Markdown tables, a CSV and
PNG figures (:mod:`.figures`; the tables are written first and never need matplotlib).

A run is one mode (e.g. ``mesh:2x2``) of the same pretraining job under one mask (``none``,
``docs``, ``window``). Its metrics give the loss and time of every iteration, the attention bytes
each rank sent, its peak memory and the mode and tile of every layer -- no scraping of Megatron's
human-readable log. Every run is compared with the baseline and the ring run of its own mask; with
several masks a second table puts each mode's bytes and time under every mask side by side, and a
mask ``<m>-zigzag`` (the same runs on Megatron's zigzag layout) is set beside ``<m>`` in a third.
Per CP rank the metrics also give the attention work and the bytes sent to each peer: the tables'
max/mean columns and the per-rank and sender x receiver figures.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field

from ..plan.modes import REFERENCE_MODE
from ..plan.units import format_bytes
from .runs import RunResult, imbalance, label, mean_time as _mean_time

__all__ = ["RunResult", "Metrics", "read_metrics", "write_report", "format_bytes", "label", "imbalance"]


@dataclass
class Metrics:
    """What a run's ``rank*.jsonl`` files say, reduced over ranks."""

    losses: dict[int, float] = field(default_factory=dict)  # iteration -> Megatron's reduced "lm loss"
    times_ms: dict[int, float] = field(default_factory=dict)  # iteration -> slowest rank's train_step
    bytes_per_step: float | None = None  # attention bytes sent: max over ranks of the mean over iterations
    # the bytes the plans each call ran send, reduced the same way (None for metrics without them)
    planned_bytes_per_step: float | None = None
    peak_memory: int | None = None  # max over ranks
    memory_kind: str = ""
    layers: dict[int, dict] = field(default_factory=dict)  # layer number -> {"mode", "cp", "tile", ...}
    # Per CP rank (list index = the rank in its CP group; the max over CP groups where DP, TP or PP
    # give several), means over iterations: attention bytes sent, attention work (scores computed
    # in the forward, see megatron_mesh.megatron.metrics) and the bytes each rank sent to each
    # peer, bytes_matrix[sender][receiver] (its rows sum to rank_bytes). Empty for metrics
    # written before these were recorded.
    rank_bytes: list[float] = field(default_factory=list)
    rank_work: list[float] = field(default_factory=list)
    bytes_matrix: list[list[float]] = field(default_factory=list)

    @property
    def tile(self) -> str:
        """The Mesh tile(s) of the run's layers ('2x2'; 'a, b' when layers differ; '' without Mesh)."""
        return ", ".join(sorted({r["tile"] for r in self.layers.values() if r.get("tile")}))


def read_metrics(metrics_dir: str, loss_key: str = "lm loss") -> Metrics:
    """Read and reduce the ``rank*.jsonl`` files of ``metrics_dir`` (empty Metrics if none)."""
    m = Metrics()
    if not os.path.isdir(metrics_dir):
        return m
    per_rank_bytes, per_rank_planned, peaks = [], [], []
    per_cp_rank: dict[int, list[list[dict]]] = {}  # CP rank -> each of its processes' iteration records
    for name in sorted(os.listdir(metrics_dir)):
        if not name.endswith(".jsonl"):
            continue
        with open(os.path.join(metrics_dir, name)) as f:
            recs = _latest_run([json.loads(line) for line in f if line.strip()])
        its = [r for r in recs if r.get("kind") == "iteration"]
        for r in recs:
            if r.get("kind") == "layer":
                m.layers.setdefault(r["layer"], r)
        for r in its:
            if loss_key in r["losses"]:
                m.losses.setdefault(r["iteration"], r["losses"][loss_key])
            if r.get("time_ms") is not None:
                m.times_ms[r["iteration"]] = max(m.times_ms.get(r["iteration"], 0.0), r["time_ms"])
        if its:
            per_rank_bytes.append(sum(r["bytes_sent"] for r in its) / len(its))
            if all("planned_bytes_sent" in r for r in its):
                per_rank_planned.append(sum(r["planned_bytes_sent"] for r in its) / len(its))
            peaks.append(max(r["peak_memory"] for r in its))
            m.memory_kind = its[-1]["memory_kind"]
            cp_rank = its[-1].get("cp_rank")
            if cp_rank is not None:
                per_cp_rank.setdefault(cp_rank, []).append(its)
    if per_rank_bytes:
        m.bytes_per_step, m.peak_memory = max(per_rank_bytes), max(peaks)
    if per_rank_planned and len(per_rank_planned) == len(per_rank_bytes):
        m.planned_bytes_per_step = max(per_rank_planned)
    if per_cp_rank:
        _per_cp_rank(m, per_cp_rank)
    return m


def _latest_run(recs: list[dict]) -> list[dict]:
    """The records the latest run of a file stands on (a directory used by several runs: each
    starts with a ``run`` record). A run keeps the earlier runs' iterations before its first one
    -- a run resumed from a checkpoint at iteration k continues them; a new run from iteration 1
    keeps none -- and its own layer records replace theirs. E.g. runs of iterations 1-10, then
    (resumed at 9) 9-12: iterations 1-8 of the first and 9-12 of the second."""
    kept: list[dict] = []
    runs: list[list[dict]] = [[]]
    for r in recs:
        if r.get("kind") == "run":
            runs.append([])
        else:
            runs[-1].append(r)
    for run in runs:
        its = [r["iteration"] for r in run if r.get("kind") == "iteration"]
        if its:
            kept = [r for r in kept if r.get("kind") != "iteration" or r["iteration"] < min(its)]
            if not any(r.get("kind") == "iteration" for r in kept):  # a new run: none of the earlier records
                kept = []  # stands, their layers neither (a run at CP 1 writes none: a CP 4 run's were read)
        if any(r.get("kind") == "layer" for r in run):
            kept = [r for r in kept if r.get("kind") != "layer"]
        kept += run
    return kept


def _per_cp_rank(m: Metrics, per_cp_rank: dict[int, list[list[dict]]]) -> None:
    """Fill the per-rank lists and the bytes matrix from each rank's iteration records."""
    size = max(max(per_cp_rank) + 1, max((int(p) + 1 for runs in per_cp_rank.values() for its in runs
                                          for r in its for p in r.get("bytes_sent_to", {})), default=0))
    m.rank_bytes, m.rank_work = [0.0] * size, [0.0] * size
    m.bytes_matrix = [[0.0] * size for _ in range(size)]
    for rank, groups in per_cp_rank.items():
        best = None  # the group whose rank sent most: its row of the matrix, so rows sum to rank_bytes
        for its in groups:
            sent = sum(r["bytes_sent"] for r in its) / len(its)
            row = [0.0] * size
            for r in its:
                for peer, n in r.get("bytes_sent_to", {}).items():
                    row[int(peer)] += n / len(its)
            work = sum(r.get("attention_work") or 0 for r in its) / len(its)
            if best is None or sent > best[0]:
                best = (sent, row)
            m.rank_work[rank] = max(m.rank_work[rank], work)
        m.rank_bytes[rank], m.bytes_matrix[rank] = best


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


PLOTTING_MISSING = ("Figures: not drawn -- matplotlib is not installed (`pip install matplotlib`, or install the "
                    "plugin with its `megatron` extra: `pip install -e .[megatron]`); the tables above are complete.")


def _rows(runs: list[RunResult], rings: dict, iters: list[int], deviation) -> list[dict]:
    """One CSV row per run: its measures, ratios to its mask's ring run, per-rank values, losses."""
    rows = []
    for r in runs:
        ring = rings.get(r.mask)
        # CP = 1 moves nothing: no ratio to show for it
        vs_ring = (r.bytes_per_step / ring.bytes_per_step) if (ring and ring.bytes_per_step and r.cp > 1
                                                               and r.bytes_per_step is not None) else None
        rows.append(dict(mode=r.mode, mask=r.mask, cp=r.cp, tile=r.tile, status="ok" if r.ok else f"FAILED: {r.error}",
                         max_loss_deviation=deviation(r), time_per_iteration_ms=_mean_time(r),
                         attention_bytes_per_rank_per_step=r.bytes_per_step,
                         bytes_vs_ring=vs_ring, peak_memory_bytes=r.peak_memory,
                         work_max_over_mean=imbalance(r.rank_work), bytes_max_over_mean=imbalance(r.rank_bytes),
                         attention_work_per_rank=" ".join(f"{v:.0f}" for v in r.rank_work),
                         attention_bytes_per_rank=" ".join(f"{v:.0f}" for v in r.rank_bytes),
                         **{f"loss_iter{i}": r.losses.get(i) for i in iters}))
    return rows


def _main_table(runs: list[RunResult], rows: list[dict], bases: dict) -> list[str]:
    """The Markdown table of every run (the CSV rows, formatted)."""
    lines = ["| mode | mask | CP | tile | max loss deviation from baseline | time / iteration (ms) | attention bytes sent "
             "per rank per step | vs ring | peak memory | work max/mean | bytes max/mean |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row, r in zip(rows, runs):
        dev, mt, vs = row["max_loss_deviation"], row["time_per_iteration_ms"], row["bytes_vs_ring"]
        dev_s = "baseline" if bases.get(r.mask) is r else ("-" if dev is None else f"{dev:.2e}")
        mt_s = "-" if mt is None else f"{mt:.1f}"
        lines.append(f"| {r.mode}{'' if r.ok else ' (failed)'} | {r.mask} | {r.cp} | {r.tile or '-'} | {dev_s} | {mt_s} | "
                     f"{format_bytes(r.bytes_per_step)} | {_ratio(vs)} | {format_bytes(r.peak_memory)} | "
                     f"{_ratio(row['work_max_over_mean'])} | {_ratio(row['bytes_max_over_mean'])} |")
    return lines


def write_report(runs: list[RunResult], out_dir: str, title: str, baseline: str | None = None,
                 notes: tuple[str, ...] = (), sections: tuple[str, ...] = ()) -> str:
    """Write report.md, report.csv and the PNG figures (:mod:`.figures`) into ``out_dir``; returns
    the Markdown text. ``baseline``: the mode whose runs (one per mask) the others' losses are
    compared with; ``sections``: further Markdown blocks (e.g. the planner's prediction), put after
    the tables. The tables are written first, so a figure that cannot be drawn never loses them;
    without matplotlib the report says so in one line."""
    os.makedirs(out_dir, exist_ok=True)
    bases = {r.mask: r for r in runs if r.mode == baseline}
    rings = {r.mask: r for r in runs if r.mode == REFERENCE_MODE}
    iters = sorted({i for r in runs for i in r.losses})
    masks = list(dict.fromkeys(r.mask for r in runs))

    def deviation(r: RunResult) -> float | None:
        base = bases.get(r.mask)
        if base is None or not r.losses:
            return None
        common = [i for i in r.losses if i in base.losses]
        return max((abs(r.losses[i] - base.losses[i]) for i in common), default=None)

    rows = _rows(runs, rings, iters, deviation)
    with open(os.path.join(out_dir, "report.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = [f"# {title}", "", *_main_table(runs, rows, bases)]
    if len(masks) > 1:
        lines += _mask_table(runs, masks)
    for mask in masks:
        if mask.endswith(ZIGZAG_SUFFIX) and mask[:-len(ZIGZAG_SUFFIX)] in masks:
            lines += _layout_table(runs, mask[:-len(ZIGZAG_SUFFIX)], mask, deviation)
    lines += _loss_table(runs, iters)
    lines += ["", _measures_text(runs), *notes, ""]
    failed = [r for r in runs if not r.ok]
    for r in failed:
        lines.append(f"**{label(r)} failed**: {r.error}")
    for section in sections:
        lines += ["", section.rstrip(), ""]

    def write(extra: list[str]) -> str:
        text = "\n".join(lines + extra) + "\n"
        with open(os.path.join(out_dir, "report.md"), "w") as f:
            f.write(text)
        return text

    write([])  # the tables are on disk before any figure is drawn
    try:
        import matplotlib  # noqa: F401 -- only to know whether the figures can be drawn
    except ImportError:
        return write(["", PLOTTING_MISSING])
    from .figures import write_figures

    drawn = write_figures(runs, out_dir, baseline)
    if not drawn:  # no run finished: nothing to draw, and no legend of figures that are not there
        return write(["", "Figures: none (no run finished)."])
    return write(["", *_FIGURE_TEXT, ""] + [f"![{name}]({name})" for name in drawn])


def _loss_table(runs: list[RunResult], iters: list[int]) -> list[str]:
    """The loss of every run at every iteration (none where no run logged a loss: every one failed)."""
    if not iters:
        return []
    lines = ["", "Loss per iteration:", "", "| run | " + " | ".join(str(i) for i in iters) + " |",
             "|---|" + "---|" * len(iters)]
    for r in runs:
        lines.append(f"| {label(r)} | " + " | ".join(f"{r.losses[i]:.6f}" if i in r.losses else "-" for i in iters)
                     + " |")
    return lines


def _measures_text(runs: list[RunResult]) -> str:
    """What the tables' measures are: which peak memory, which time, which bytes, against what."""
    kinds = {r.memory_kind for r in runs if r.memory_kind}
    return (f"Peak memory is the {', '.join(sorted(kinds)) or 'peak memory (max RSS on CPU, the CUDA allocator on GPUs)'} "
            "of the largest rank; time per iteration is the slowest rank's Megatron train_step, the first iteration "
            "left out where there are others; bytes are the plugin's attention traffic (all layers, forward "
            "and backward) measured by comm_counter; each run's loss deviation and ratio to ring are against the "
            "baseline and ring runs of its own mask. Work max/mean and bytes max/mean: the busiest CP rank's "
            "attention work (scores its kernel calls computed in the forward, from the plans the layers ran) and "
            "bytes sent over the mean of the ranks (1.00: balanced).")


ZIGZAG_SUFFIX = "-zigzag"
_FIGURE_TEXT = ("Figures: loss.png -- loss curves per mask and their deviation from the mask's baseline (log axis; "
                "parity is a flat line at rounding level); bytes.png, time.png, memory.png -- one group of bars per "
                "mask, one bar per mode; ranks.png -- attention work and bytes of every CP rank (imbalance); "
                "heatmap.png -- the bytes each CP rank sent to each other one (sender x receiver).",)


def _layout_table(runs: list[RunResult], mask: str, zigzag: str, deviation) -> list[str]:
    """Per mode: the runs under ``mask`` (its default layout; balanced for documents) and under
    ``<mask>-zigzag`` (Megatron's zigzag layout) side by side."""
    by = {(r.mode, r.mask): r for r in runs}
    name = "documents" if mask == "docs" else mask
    out = ["", f"{name}: balanced vs zigzag layout ('{mask}' runs vs '{zigzag}' runs; attention bytes sent per rank "
           "per step, work and bytes max/mean over CP ranks, time per iteration, max loss deviation from the CP 1 "
           "baseline):", "",
           "| mode | bytes balanced | bytes zigzag | work max/mean balanced | work max/mean zigzag | bytes max/mean "
           "balanced | bytes max/mean zigzag | ms balanced | ms zigzag | loss deviation balanced | loss deviation zigzag |",
           "|---|" + "---|" * 10]
    for mode in dict.fromkeys(r.mode for r in runs):
        pair = [by.get((mode, mask)), by.get((mode, zigzag))]
        if all(r is None or r.cp == 1 for r in pair):
            continue  # CP 1 has no layout to compare
        cells = [format_bytes(r.bytes_per_step) if r else "-" for r in pair]
        cells += [_ratio(imbalance(r.rank_work)) if r else "-" for r in pair]
        cells += [_ratio(imbalance(r.rank_bytes)) if r else "-" for r in pair]
        for r in pair:
            t = _mean_time(r) if r else None
            cells.append("-" if t is None else f"{t:.1f}")
        for r in pair:
            d = deviation(r) if r else None
            cells.append("-" if d is None else f"{d:.2e}")
        out.append(f"| {mode} | " + " | ".join(cells) + " |")
    return out


def _mask_table(runs: list[RunResult], masks: list[str]) -> list[str]:
    """Per mode: attention bytes per rank per step and time per iteration under every mask."""
    by = {(r.mode, r.mask): r for r in runs}
    modes = list(dict.fromkeys(r.mode for r in runs))
    head = " | ".join(f"bytes [{m}]" for m in masks) + " | " + " | ".join(f"ms [{m}]" for m in masks)
    out = ["", "With and without the masks (attention bytes sent per rank per step; time per iteration in ms):", "",
           f"| mode | {head} |", "|---|" + "---|" * (2 * len(masks))]
    for mode in modes:
        cells = [format_bytes(by[mode, m].bytes_per_step) if (mode, m) in by else "-" for m in masks]
        for m in masks:
            t = _mean_time(by[mode, m]) if (mode, m) in by else None
            cells.append("-" if t is None else f"{t:.1f}")
        out.append(f"| {mode} | " + " | ".join(cells) + " |")
    return out

"""The side-by-side report of CP modes: parse each run's Megatron log and per-rank metrics, and
write a Markdown table, a CSV and PNG plots.

A run is one mode (e.g. ``mesh:2x2``) of the same pretraining job. Megatron's log line for an
iteration gives the loss and the time per iteration; ``megatron_mesh.megatron.metrics`` gives
the attention bytes each rank sent and its peak memory (see there).
"""

from __future__ import annotations

import csv
import json
import os
import re
from dataclasses import dataclass, field

__all__ = ["RunResult", "parse_megatron_log", "read_metrics", "write_report"]

_ITER = re.compile(r"iteration\s+(\d+)/\s*(\d+)\s*\|")
_TIME = re.compile(r"elapsed time per iteration \(ms\):\s*([0-9.]+)")
_LOSS = re.compile(r"lm loss:\s*([0-9.Ee+-]+)")


@dataclass
class RunResult:
    """One mode's run: per-iteration losses and times, bytes per rank per step, peak memory."""

    mode: str
    cp: int
    tile: str = ""
    losses: dict[int, float] = field(default_factory=dict)
    times_ms: dict[int, float] = field(default_factory=dict)
    bytes_per_step: float | None = None  # max over ranks, mean over iterations
    peak_memory: int | None = None  # max over ranks
    memory_kind: str = ""
    ok: bool = True
    error: str = ""


def parse_megatron_log(text: str) -> tuple[dict[int, float], dict[int, float]]:
    """(losses, times in ms) by iteration from Megatron's iteration log lines."""
    losses, times = {}, {}
    for line in text.splitlines():
        m = _ITER.search(line)
        if not m:
            continue
        it = int(m.group(1))
        if (t := _TIME.search(line)):
            times[it] = float(t.group(1))
        if (lo := _LOSS.search(line)):
            losses[it] = float(lo.group(1))
    return losses, times


def read_metrics(metrics_dir: str) -> tuple[float | None, int | None, str]:
    """(attention bytes sent per rank per iteration -- max over ranks of the mean over iterations,
    peak memory -- max over ranks, what memory was measured) from ``rank*.jsonl`` files."""
    if not os.path.isdir(metrics_dir):
        return None, None, ""
    per_rank, peaks, kind = [], [], ""
    for name in sorted(os.listdir(metrics_dir)):
        if not name.endswith(".jsonl"):
            continue
        with open(os.path.join(metrics_dir, name)) as f:
            recs = [json.loads(line) for line in f if line.strip()]
        if len(recs) < 2:
            continue
        # records at the start of each iteration and one at exit: differences are per-iteration bytes
        steps = [b["bytes_sent"] - a["bytes_sent"] for a, b in zip(recs, recs[1:])]
        per_rank.append(sum(steps) / len(steps))
        peaks.append(max(r["peak_memory"] for r in recs))
        kind = recs[-1]["memory_kind"]
    if not per_rank:
        return None, None, ""
    return max(per_rank), max(peaks), kind


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def write_report(runs: list[RunResult], out_dir: str, title: str, baseline: str | None = None,
                 notes: tuple[str, ...] = ()) -> str:
    """Write report.md, report.csv and PNG plots into ``out_dir``; returns the Markdown text."""
    os.makedirs(out_dir, exist_ok=True)
    base = next((r for r in runs if r.mode == baseline), None)
    ring = next((r for r in runs if r.mode == "ring"), None)
    iters = sorted({i for r in runs for i in r.losses})

    def deviation(r: RunResult) -> float | None:
        if base is None or not r.losses:
            return None
        common = [i for i in r.losses if i in base.losses]
        return max((abs(r.losses[i] - base.losses[i]) for i in common), default=None)

    def mean_time(r: RunResult) -> float | None:
        ts = [t for i, t in sorted(r.times_ms.items()) if i > min(r.times_ms)] or list(r.times_ms.values())
        return sum(ts) / len(ts) if ts else None

    rows = []
    for r in runs:
        dev, mt = deviation(r), mean_time(r)
        # CP = 1 moves nothing: no ratio to show for it
        vs_ring = (r.bytes_per_step / ring.bytes_per_step) if (ring and ring.bytes_per_step and r.cp > 1
                                                               and r.bytes_per_step is not None) else None
        rows.append(dict(mode=r.mode, cp=r.cp, tile=r.tile, status="ok" if r.ok else f"FAILED: {r.error}",
                         max_loss_deviation=dev, time_per_iteration_ms=mt, attention_bytes_per_rank_per_step=r.bytes_per_step,
                         bytes_vs_ring=vs_ring, peak_memory_bytes=r.peak_memory,
                         **{f"loss_iter{i}": r.losses.get(i) for i in iters}))
    with open(os.path.join(out_dir, "report.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)

    lines = [f"# {title}", ""]
    lines.append("| mode | CP | tile | max loss deviation from baseline | time / iteration (ms) | attention bytes sent per rank per step | vs ring | peak memory |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for row, r in zip(rows, runs):
        dev, mt, vs = row["max_loss_deviation"], row["time_per_iteration_ms"], row["bytes_vs_ring"]
        dev_s = "baseline" if r is base else ("-" if dev is None else f"{dev:.2e}")
        mt_s = "-" if mt is None else f"{mt:.1f}"
        vs_s = "-" if vs is None else f"{vs:.2f}"
        lines.append(f"| {r.mode}{'' if r.ok else ' (failed)'} | {r.cp} | {r.tile or '-'} | {dev_s} | {mt_s} | "
                     f"{_fmt_bytes(r.bytes_per_step)} | {vs_s} | {_fmt_bytes(r.peak_memory)} |")
    lines += ["", "Loss per iteration:", "", "| mode | " + " | ".join(str(i) for i in iters) + " |",
              "|---|" + "---|" * len(iters)]
    for r in runs:
        lines.append(f"| {r.mode} | " + " | ".join(f"{r.losses[i]:.6f}" if i in r.losses else "-" for i in iters) + " |")
    kinds = {r.memory_kind for r in runs if r.memory_kind}
    lines += ["", f"Peak memory is the {', '.join(sorted(kinds)) or 'peak memory'} of the largest rank; time per "
              "iteration excludes the first iteration; bytes are the plugin's attention traffic (all layers, forward "
              "and backward) measured by comm_counter.", *notes, ""]
    failed = [r for r in runs if not r.ok]
    for r in failed:
        lines.append(f"**{r.mode} failed**: {r.error}")
    plots = _plots(runs, out_dir)
    lines += [f"![{name}]({name})" for name in plots]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(text)
    return text


def _plots(runs: list[RunResult], out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        if r.losses:
            its = sorted(r.losses)
            ax.plot(its, [r.losses[i] for i in its], marker="o", label=r.mode, alpha=0.8)
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title("Loss (curves overlap when the modes agree)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "loss.png"), dpi=110)
    plt.close(fig)
    names.append("loss.png")
    for key, label, fname, scale in (
            ("time", "time per iteration (ms)", "time.png", 1.0),
            ("bytes", "attention bytes sent per rank per step (MiB)", "bytes.png", 1 / 2**20),
            ("memory", "peak memory per rank (MiB)", "memory.png", 1 / 2**20)):
        vals = []
        for r in runs:
            if key == "time":
                ts = [t for i, t in r.times_ms.items() if i > min(r.times_ms)] if r.times_ms else []
                v = sum(ts) / len(ts) if ts else None
            elif key == "bytes":
                v = r.bytes_per_step
            else:
                v = r.peak_memory
            vals.append(None if v is None else v * scale)
        if all(v is None for v in vals):
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar([r.mode for r in runs], [v or 0 for v in vals], color="tab:blue")
        ax.set_ylabel(label)
        ax.tick_params(axis="x", rotation=30)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, fname), dpi=110)
        plt.close(fig)
        names.append(fname)
    return names

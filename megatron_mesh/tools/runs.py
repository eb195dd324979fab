"""One run of the comparison (a mode under a mask) and the measures the report and its figures
share: mean time per iteration, the run's name, the max / mean balance of per-rank values."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RunResult", "mean_time", "label", "imbalance"]


@dataclass
class RunResult:
    """One mode's run: per-iteration losses and times, bytes per rank per step, peak memory."""

    mode: str
    cp: int
    mask: str = "none"  # "none", "docs", "window": the mask the run trained under
    tile: str = ""
    losses: dict[int, float] = field(default_factory=dict)
    times_ms: dict[int, float] = field(default_factory=dict)
    bytes_per_step: float | None = None  # max over ranks, mean over iterations
    planned_bytes_per_step: float | None = None  # what the plans each call ran send, reduced the same way
    peak_memory: int | None = None  # max over ranks
    memory_kind: str = ""
    ok: bool = True
    error: str = ""
    # per CP rank (index = rank in the CP group), means over iterations; see report.Metrics
    rank_bytes: list[float] = field(default_factory=list)
    rank_work: list[float] = field(default_factory=list)
    bytes_matrix: list[list[float]] = field(default_factory=list)  # [sender][receiver]


def timed_steps(r: RunResult) -> list[int]:
    """The iterations a run's time is made of, in order: the first (warm-up) iteration left out
    when there are others."""
    steps = sorted(r.times_ms)
    return steps[1:] or steps


def timed_iterations(r: RunResult) -> list[float]:
    """The iteration times (ms) a run's time is made of (:func:`timed_steps`)."""
    return [r.times_ms[i] for i in timed_steps(r)]


def mean_time(r: RunResult) -> float | None:
    """Mean time per iteration over :func:`timed_iterations`."""
    ts = timed_iterations(r)
    return sum(ts) / len(ts) if ts else None


def label(r: RunResult) -> str:
    """The run's name in tables and plots: the mode, and the mask when there is one."""
    return r.mode if r.mask == "none" else f"{r.mode} [{r.mask}]"


def imbalance(values: list[float]) -> float | None:
    """max / mean of per-rank values (1.00: balanced); None with fewer than two ranks (CP 1 has no
    balance to show) or a zero mean."""
    mean = sum(values) / len(values) if len(values) > 1 else 0
    return max(values) / mean if mean > 0 else None

"""One planner row: a CP mode's bytes, rounds, memory and times per rank (:class:`ModeResult`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["ModeResult"]


@dataclass(frozen=True)
class ModeResult:
    """One CP mode: bytes are sent per rank, forward + backward; times in seconds."""

    mode: str
    tile: tuple[int, int] | None
    bytes_per_rank: int
    intra_node_bytes_per_rank: float  # mean over ranks
    inter_node_bytes_per_rank: float  # mean over ranks (ring: only the ranks at node boundaries send)
    max_inter_node_bytes: float  # the rank with the most inter-node bytes
    rounds: int  # communication rounds (all-to-alls for Ulysses) per rank, forward + backward
    peak_buffer_bytes: int
    time_s: float
    forward_s: float
    backward_s: float
    compute_s: float
    contiguous: str | None = None
    detail: str = ""
    by_formula: bool = False
    ulysses: int = 1
    extra: dict = field(default_factory=dict, compare=False)
    layout: str = "zigzag"

    @property
    def exposed_comm_s(self) -> float:
        return max(0.0, self.time_s - self.compute_s)

    def to_json(self) -> dict:
        d = asdict(self)
        d["tile"] = list(self.tile) if self.tile is not None else None
        d["exposed_comm_s"] = self.exposed_comm_s
        for k in ("intra_node_bytes_per_rank", "inter_node_bytes_per_rank", "max_inter_node_bytes"):
            d[k] = round(d[k])  # whole bytes (the per-rank means can be fractional)
        d.update(d.pop("extra"))
        return d

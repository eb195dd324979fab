"""TASP as a CP mode: options (the transport), rings (Hamiltonian, chained over nodes), the dense
plan, everything-in-one-round under a mask, the node sub-groups its transport routes through."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..mask import Mask
from ..mesh import BACKWARD_CHUNKS
from ..shape import AttentionShape
from ..sparse import Assignment
from ..tasp import build_tasp_plan, tasp_rings
from ..topology import Topology
from .base import Mode, Placement, setting
from .mesh import backward_words, keep_limit_setting

__all__ = ["TaspMode", "TaspOptions", "TRANSPORTS"]

# how a plan's rounds travel: one batch of sends/receives per round, or one all_to_all_single
TRANSPORTS = ("p2p", "alltoall")


@dataclass(frozen=True)
class TaspOptions:
    transport: Literal[TRANSPORTS] = setting("p2p", flag="--tasp-transport",
                                             help="TASP transfers as point-to-point sends ('p2p') or all-to-all "
                                                  "collectives ('alltoall')")
    backward_chunks: Literal[BACKWARD_CHUNKS] = setting(
        "auto", flag="--tasp-backward-chunks",
        help="under documents, windows or a document layout: 'refetch' pulls the K/V tokens again in the backward, "
             "'keep' keeps the forward's (fewer bytes, more activation memory), 'auto' keeps on each rank as "
             "many of them as fit in twice its own Q, K and V (--tasp-backward-keep-limit) and pulls the rest again; the "
             "dense TASP plan refetches under every setting (its rotation would have to keep all P-1 chunks)")
    backward_keep_limit: float = keep_limit_setting("--tasp-backward-keep-limit")


class TaspMode(Mode):
    name = "tasp"
    burst_rounds = True
    Options = TaspOptions
    shorthand = ("ranks_per_node",)
    doc = "TASP: ring attention whose KV rotation is split over arc-disjoint Hamiltonian rings"

    def resolve(self, world_size: int, shape: AttentionShape, topology: Topology | None, ranks_per_node, options,
                mask: Mask) -> Placement:
        tasp_rings(world_size, ranks_per_node)  # raises where no chained rings exist (3 or 5 ranks per node)
        return Placement(self.name, world_size, options, ranks_per_node)

    def build_dense(self, p: Placement, shape: AttentionShape, mask: Mask):
        # backward_chunks is a mask-aware plan's setting here: the dense rotation refetches whatever it says
        return build_tasp_plan(p.world_size, shape, causal=mask.causal, ranks_per_node=p.ranks_per_node)

    def assignment(self, p: Placement, mask: Mask, layout) -> Assignment:
        return Assignment(rounds="burst")

    def rings(self, p: Placement) -> dict:
        return {"kv": tuple(tuple(r) for r in tasp_rings(p.world_size, p.ranks_per_node)[0])}

    def extra_groups(self, p: Placement) -> tuple[tuple[int, ...], ...]:
        n = p.ranks_per_node
        return tuple(tuple(range(a, a + n)) for a in range(0, p.world_size, n)) if n else ()  # same-node peers

    def describe(self, p: Placement) -> str:
        # said where it shows (start-up log, telemetry): 'keep' changes only the mask-aware plans
        chunks = p.options.backward_chunks
        backward = "" if chunks == "refetch" else \
            f", backward {backward_words(p.options)} under masks (the dense plan refetches)"
        return (f"tasp (CP {p.world_size}, transport {p.options.transport}, CP ranks per node "
                f"{p.ranks_per_node or p.world_size}{backward})")

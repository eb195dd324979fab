"""The Ulysses hybrids as CP modes: ``a2a+<inner>`` for every mode that can be an inner mode (an
all-to-all over U consecutive ranks, then the inner mode across the P / U groups of one head
slice; the plan is :mod:`..hybrid`'s). A mode registered later gets its hybrid too."""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, replace

from ..hybrid import build_hybrid_plan, hybrid_rings, inner_shape
from ..ir import Plan
from ..mask import Mask
from ..polish import polish, polishes
from ..problem import normalize
from ..sparse import MaskAwareFacts, own_calls, reordered
from ..shape import AttentionShape
from ..topology import Topology
from ..tunables import TUNABLES, Tunables
from .base import HYBRID_PREFIX, Mode, Placement, check_ranks_per_node, option_specs, register, setting, topology_for

__all__ = ["HybridMode", "UlyssesOptions", "register_hybrid"]


@dataclass(frozen=True)
class UlyssesOptions:
    """A hybrid placement's own choice (the inner mode's are on its inner placement)."""

    ulysses_size: int


def _options_type(inner: Mode) -> type:
    """ulysses_size + every option of the inner mode."""
    hints = typing.get_type_hints(inner.Options)
    fields = [("ulysses_size", typing.Optional[int],
               setting(None, help="the all-to-all degree U (a divisor of the CP size; Megatron: "
                                  "--hierarchical-context-parallel-sizes U M)"))]
    for s in option_specs(inner.Options):
        fields.append((s.name, hints[s.name], setting(s.default, help=s.help, flag=s.flag, parse=s.parse, check=s.check,
                                                           only_with=s.only_with)))
    return dataclasses.make_dataclass(f"{type(inner).__name__}HybridOptions", fields, frozen=True)


class HybridMode(Mode):
    can_be_inner = False

    def __init__(self, inner: Mode):
        self.inner = inner
        self.name = HYBRID_PREFIX + inner.name
        self.burst_rounds = inner.burst_rounds
        self.Options = _options_type(inner)
        self.doc = f"Ulysses all-to-all over U consecutive ranks x {inner.name} across the P/U groups"
        self.auto_row = HYBRID_PREFIX + inner.auto_row if inner.auto_row else None
        self.planner_rows = "auto" if self.auto_row else "all"  # every U x every tile is too many rows
        self.shorthand = ("ulysses_size",) + tuple(s for s in inner.shorthand if s != "ranks_per_node")

    def resolve(self, world_size: int, shape: AttentionShape, topology: Topology | None, ranks_per_node, options,
                mask: Mask) -> Placement:
        U = options.ulysses_size
        if U is None:
            raise ValueError(f"CP mode {self.name!r} needs ulysses_size (the all-to-all degree U, a divisor of the CP "
                             f"size {world_size})")
        if not isinstance(U, int) or isinstance(U, bool) or U < 1 or world_size % U:
            raise ValueError(f"ulysses_size {U!r} must be a positive divisor of the CP size {world_size}")
        if ranks_per_node is not None and ranks_per_node % U:
            raise ValueError(f"ulysses_size {U} must divide the CP ranks per node {ranks_per_node}: an all-to-all group "
                             "stays inside a node")
        sub = inner_shape(shape, U)
        M = world_size // U
        inner_topo = None
        if topology is not None:  # the inner group of one head slice: every U-th rank
            inner_topo = replace(topology, node_of=tuple(topology.node(m * U) for m in range(M)))
        inner_options = {f.name: getattr(options, f.name) for f in dataclasses.fields(self.inner.Options)}
        if inner_options.get("transport", "p2p") != "p2p":
            raise ValueError(f"transport {inner_options['transport']!r}: CP mode {self.name!r} runs its all-to-all and "
                             f"the inner {self.inner.name} rounds point-to-point (allowed: 'p2p')")
        inner_rpn = check_ranks_per_node(M, ranks_per_node // U) if ranks_per_node else None
        try:
            inner = self.inner.resolve(M, sub, inner_topo, inner_rpn, self.inner.options(**inner_options), mask)
        except ValueError as e:  # its sizes are the inner group's: say which group that is
            raise ValueError(f"CP mode {self.name!r} at CP size {world_size} = all-to-all {U} x inner "
                             f"{self.inner.name} over {M} ranks: {e}") from None
        return Placement(self.name, world_size, UlyssesOptions(U), ranks_per_node, inner)

    def build(self, p: Placement, shape: AttentionShape, mask, layout, tunables: Tunables = TUNABLES,
              own_first: tuple | None = None, topology: Topology | None = None):
        """The hybrid plan; a mask-aware inner plan polished as part of it (:mod:`..polish`: the
        inner ranks' choices tried on the hybrid plan, inner rank m standing for ranks m U ... m U +
        U - 1), or with the inner ranks' ``own_first`` choices."""
        mask, layout = normalize(p.world_size, shape, mask, layout)
        self.check_layout(layout)
        plan = build_hybrid_plan(self.name, p.world_size, p.ulysses, functools.partial(
            p.inner.build, tunables=tunables, own_first=own_first or ()), shape, mask, layout)
        inner = plan.facts.inner
        if own_first is None and polishes(p.world_size, shape.seq_local, tunables) and \
                isinstance(inner.facts, MaskAwareFacts) and inner.world_size > 1:  # one inner rank: no other block
            U = p.ulysses

            def plan_of(choices: tuple) -> Plan:
                return build_hybrid_plan(self.name, p.world_size, U, lambda *_: reordered(inner, choices),
                                         shape, mask, layout)
            return polish(plan_of, lambda m, d: own_calls(inner, m, d), shape,
                          topology_for(p.world_size, p.ranks_per_node, topology), tunables, rank_of=lambda g: g // U,
                          first=plan)
        return plan

    def rings(self, p: Placement) -> dict:
        return hybrid_rings(p.world_size, p.ulysses, p.inner.rings())

    def extra_groups(self, p: Placement) -> tuple[tuple[int, ...], ...]:
        groups = self.inner.extra_groups(p.inner)
        return hybrid_rings(p.world_size, p.ulysses, {"g": groups})["g"] if groups else ()

    def candidates(self, world_size: int, shape: AttentionShape, topo: Topology) -> list[Placement]:
        rpn = topo.ranks_per_node(world_size)
        spans = rpn is not None
        out = []
        for U in range(2, min(world_size, topo.gpus_per_node) + 1):
            if world_size % U or (topo.gpus_per_node % U and spans):
                continue
            try:
                sub = inner_shape(shape, U)
            except ValueError:
                continue
            M = world_size // U
            inner_topo = replace(topo, node_of=tuple(topo.node(m * U) for m in range(M)))
            for inner in self.inner.candidates(M, sub, inner_topo):
                out.append(Placement(self.name, world_size, UlyssesOptions(U), rpn, inner))
        return out

    def describe(self, p: Placement) -> str:
        return f"{self.name} (CP {p.world_size} = all-to-all {p.ulysses} x {p.inner.describe()})"


def register_hybrid(mode: Mode) -> None:
    """Register ``a2a+<mode>`` when ``mode`` can be an inner mode."""
    if mode.can_be_inner:
        register(HybridMode(mode))

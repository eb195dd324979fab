"""CP modes in one registry, and :class:`Placement`: a mode's choices resolved once per CP group.

Every consumer -- the Python API, the Megatron adapter (flags, process groups, core attention),
the planner and the scripts -- reads the modes from :data:`MODES`; a new mode is its own plan
builder plus one :func:`register` call.

A :class:`Placement` is everything a mode decides about *where* things go for one CP group,
resolved once (like torchtitan's ``ParallelDims``): the tile and which Mesh ring holds
consecutive ranks, the CP ranks per node (TASP's chained rings, the topology the ``auto``
choices are simulated on), the Ulysses degree and the inner placement of a hybrid. From it come
the plan (:meth:`Placement.build`), the rings the plan moves data on and the process sub-groups
a torch.distributed transport needs (:meth:`Placement.groups`) -- nobody re-derives them.

Example::

    placement = resolve("mesh", 8, shape, tile="auto", ranks_per_node=4)   # 2 nodes x 4
    placement.tile, placement.contiguous      # e.g. ((2, 4), 'q'): Q rings inside a node
    plan = placement.build(shape)             # the plan every rank executes
    placement.groups()                        # ((0, 1), (0, 2, 4, 6), ...): the sub-groups to create
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from .accounting import AttentionShape
from .ir import Plan
from .mask import Mask
from .topology import Topology

__all__ = ["Mode", "Placement", "MODES", "register", "get_mode", "resolve", "HYBRID_PREFIX", "TRANSPORTS"]

HYBRID_PREFIX = "a2a+"
# how a plan's rounds travel (TASP): one batch of sends/receives per round, or one all_to_all_single
TRANSPORTS = ("p2p", "alltoall")


@dataclass(frozen=True)
class Placement:
    """A CP mode's choices for one CP group of ``world_size`` ranks (see the module docstring).

    ``ranks_per_node``: consecutive CP ranks that share a node (None: the whole group is one
    node). ``inner``: a hybrid's inner placement over world_size / ulysses ranks.
    """

    mode: str
    world_size: int
    tile: tuple[int, int] | None = None
    contiguous: str = "q"
    schedule: str = "greedy"
    backward_chunks: str = "refetch"
    ranks_per_node: int | None = None
    transport: str = "p2p"
    ulysses: int = 1
    inner: "Placement | None" = None

    def build(self, shape: AttentionShape, mask: Mask | None = None, layout=None) -> Plan:
        """The plan of this placement for ``shape`` (per rank), ``mask`` (default causal) and
        ``layout`` (default Megatron's zigzag)."""
        return get_mode(self.mode).build(self, shape, mask if mask is not None else Mask(), layout)

    def rings(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        """The rings (CP-rank tuples in ring order) the dense plan of this placement moves data on."""
        return get_mode(self.mode).rings(self)

    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The process sub-groups (sorted CP-rank tuples, 2 <= size < P) a transport routes
        through: every ring's members, a hybrid's all-to-all groups, TASP's nodes."""
        out = set()
        for rings in self.rings().values():
            for ring in rings:
                if 2 <= len(ring) < self.world_size:
                    out.add(tuple(sorted(ring)))
        return tuple(sorted(out))

    def describe(self) -> str:
        """One phrase naming the mode and its choices (logs, reports)."""
        return get_mode(self.mode).describe(self)


@dataclass(frozen=True)
class Mode:
    """One CP mode: how to resolve its settings into a Placement, build its plan, name its rings,
    and which placements the planner compares."""

    name: str
    settings: tuple[str, ...]  # keyword settings resolve() accepts
    resolve: Callable[..., Placement]  # (world_size, shape, topology, **settings) -> Placement
    build: Callable[[Placement, AttentionShape, Mask, object], Plan]
    rings: Callable[[Placement], dict]
    candidates: Callable[[int, AttentionShape, Topology], list[Placement]]  # planner rows
    describe: Callable[[Placement], str]
    doc: str = ""


MODES: dict[str, Mode] = {}


def register(mode: Mode) -> Mode:
    MODES[mode.name] = mode
    return mode


def get_mode(name: str) -> Mode:
    mode = MODES.get(name)
    if mode is None:
        raise ValueError(f"unknown CP mode {name!r}; allowed: {', '.join(MODES)}")
    return mode


def topology_for(world_size: int, ranks_per_node: int | None, topology: Topology | None = None) -> Topology:
    """The machine the ``auto`` choices are simulated on: ``topology`` if given, else nodes of
    ``ranks_per_node`` consecutive CP ranks (None: one node) with the default link speeds."""
    if topology is not None:
        return topology
    per = ranks_per_node or world_size
    return Topology(nodes=-(-world_size // per), gpus_per_node=per)


def resolve(name: str, world_size: int, shape: AttentionShape, topology: Topology | None = None,
            **settings) -> Placement:
    """The Placement of mode ``name`` for a CP group of ``world_size`` ranks and per-rank
    ``shape``; ``settings`` are the mode's own (ValueError naming any it does not take)."""
    mode = get_mode(name)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"CP size must be a positive integer, got {world_size!r}")
    extra = sorted(set(settings) - set(mode.settings))
    if extra:
        raise ValueError(f"CP mode {name!r} takes no setting {', '.join(extra)}; its settings: "
                         f"{', '.join(mode.settings) or 'none'}")
    return mode.resolve(world_size, shape, topology, **settings)


# -- shared checks -------------------------------------------------------------------------------------
def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}, got {value!r}")


def _check_ranks_per_node(world_size: int, rpn) -> int | None:
    if rpn is None:
        return None
    if not isinstance(rpn, int) or isinstance(rpn, bool) or rpn < 1 or world_size % rpn:
        raise ValueError(f"CP ranks per node (gpus_per_node) must be a positive divisor of the CP size {world_size}, "
                         f"got {rpn!r}")
    return None if rpn >= world_size else rpn


# -- ring and mesh -------------------------------------------------------------------------------------------
def _mesh_resolve(world_size, shape, topology, tile="auto", contiguous="auto", schedule="greedy",
                  backward_chunks="refetch", ranks_per_node=None, causal=True) -> Placement:
    from .autotile import choose_tile
    from .mesh import BACKWARD_CHUNKS, CONTIGUOUS, parse_tile
    from .schedule import SCHEDULES

    _check_choice("schedule", schedule, SCHEDULES)
    _check_choice("backward_chunks", backward_chunks, BACKWARD_CHUNKS)
    _check_choice("contiguous", contiguous, CONTIGUOUS + ("auto",))
    rpn = _check_ranks_per_node(world_size, ranks_per_node)
    parsed = parse_tile(tile, world_size)
    if parsed == "auto" or contiguous == "auto":
        topo = topology_for(world_size, rpn, topology)
        parsed, contiguous = choose_tile(world_size, shape, topo, tile=parsed, contiguous=contiguous, causal=causal,
                                         backward_chunks=backward_chunks, schedule=schedule)
    return Placement("mesh", world_size, tile=parsed, contiguous=contiguous, schedule=schedule,
                     backward_chunks=backward_chunks, ranks_per_node=rpn)


def _mesh_build(p: Placement, shape, mask, layout) -> Plan:
    from .mesh import build_mesh_plan

    return build_mesh_plan(p.world_size, p.tile, shape, schedule=p.schedule, backward_chunks=p.backward_chunks,
                           contiguous=p.contiguous, mask=mask, layout=layout)


def _mesh_rings(p: Placement) -> dict:
    from .mesh import TileMap

    a, b = p.tile
    tiles = TileMap(a, b, p.contiguous)
    return {"q": tuple(tiles.q_group(tiles.rank_at(r, 0)) for r in range(b)),
            "kv": tuple(tiles.kv_group(tiles.rank_at(0, c)) for c in range(a))}


def _mesh_candidates(world_size, shape, topo) -> list[Placement]:
    from .mesh import tile_shapes

    spans = topo.nodes_used(world_size) > 1
    out = []
    for a, b in tile_shapes(world_size):
        if (a, b) == (1, world_size):
            continue  # ring's own row
        for c in (("q", "kv") if spans and a > 1 and b > 1 else ("q",)):
            out.append(Placement("mesh", world_size, tile=(a, b), contiguous=c))
    return out


def _mesh_describe(p: Placement) -> str:
    return (f"mesh (CP {p.world_size}, tile {p.tile[0]}x{p.tile[1]}, schedule {p.schedule}, backward "
            f"{p.backward_chunks}, contiguous {p.contiguous})")


def _ring_resolve(world_size, shape, topology, ranks_per_node=None, backward_chunks="refetch") -> Placement:
    from .mesh import BACKWARD_CHUNKS

    _check_choice("backward_chunks", backward_chunks, BACKWARD_CHUNKS)
    return Placement("ring", world_size, tile=(1, world_size), ranks_per_node=_check_ranks_per_node(world_size,
                                                                                                   ranks_per_node),
                     backward_chunks=backward_chunks)


def _ring_build(p: Placement, shape, mask, layout) -> Plan:
    from .mesh import build_mesh_plan

    plan = build_mesh_plan(p.world_size, (1, p.world_size), shape, backward_chunks=p.backward_chunks, mask=mask,
                           layout=layout)
    return replace(plan, mode="ring", _cache={}) if plan.mode != "ring" else plan


register(Mode("ring", ("ranks_per_node", "backward_chunks"), _ring_resolve, _ring_build, _mesh_rings,
              lambda world, shape, topo: [Placement("ring", world, tile=(1, world))],
              lambda p: f"ring (CP {p.world_size}, zigzag ring)",
              "zigzag ring attention (Transformer Engine's p2p algorithm): Mesh with tile 1 x CP"))
register(Mode("mesh", ("tile", "contiguous", "schedule", "backward_chunks", "ranks_per_node", "causal"),
              _mesh_resolve, _mesh_build, _mesh_rings, _mesh_candidates, _mesh_describe,
              "Mesh-Attention: each rank computes an a x b tile of the block matrix (a * b = CP size)"))


# -- TASP -------------------------------------------------------------------------------------------------------
def _tasp_resolve(world_size, shape, topology, gpus_per_node=None, ranks_per_node=None, transport="p2p") -> Placement:
    from .tasp import tasp_rings

    if gpus_per_node is not None and ranks_per_node is not None and gpus_per_node != ranks_per_node:
        raise ValueError(f"gpus_per_node {gpus_per_node} and ranks_per_node {ranks_per_node} disagree")
    rpn = _check_ranks_per_node(world_size, gpus_per_node if gpus_per_node is not None else ranks_per_node)
    _check_choice("transport", transport, TRANSPORTS)
    tasp_rings(world_size, rpn)  # raises where no chained rings exist (3 or 5 ranks per node)
    return Placement("tasp", world_size, ranks_per_node=rpn, transport=transport)


def _tasp_build(p: Placement, shape, mask, layout) -> Plan:
    from .tasp import build_tasp_plan

    return build_tasp_plan(p.world_size, shape, gpus_per_node=p.ranks_per_node, mask=mask, layout=layout)


def _tasp_rings(p: Placement) -> dict:
    from .tasp import tasp_rings

    rings = {"kv": tuple(tuple(r) for r in tasp_rings(p.world_size, p.ranks_per_node)[0])}
    if p.ranks_per_node:  # same-node peers route through their node's group
        rings["node"] = tuple(tuple(range(n, n + p.ranks_per_node)) for n in range(0, p.world_size, p.ranks_per_node))
    return rings


def _tasp_candidates(world, shape, topo) -> list[Placement]:
    rpn = topo.gpus_per_node if topo.nodes_used(world) > 1 else None
    return [Placement("tasp", world, ranks_per_node=rpn)]


register(Mode("tasp", ("gpus_per_node", "ranks_per_node", "transport"), _tasp_resolve, _tasp_build, _tasp_rings,
              _tasp_candidates,
              lambda p: f"tasp (CP {p.world_size}, transport {p.transport}, CP ranks per node "
                        f"{p.ranks_per_node or p.world_size})",
              "TASP: ring attention whose KV rotation is split over arc-disjoint Hamiltonian rings"))


# -- hybrids: Ulysses all-to-all x an inner mode ---------------------------------------------------------------------
def _hybrid(inner_name: str) -> Mode:
    name = HYBRID_PREFIX + inner_name
    inner_mode = MODES[inner_name]

    def resolve(world_size, shape, topology, ulysses_size=None, **inner_settings) -> Placement:
        from .hybrid import inner_shape

        if ulysses_size is None:
            raise ValueError(f"CP mode {name!r} needs ulysses_size (the all-to-all degree U, a divisor of the CP size "
                             f"{world_size})")
        U = ulysses_size
        if not isinstance(U, int) or isinstance(U, bool) or U < 1 or world_size % U:
            raise ValueError(f"ulysses_size {U!r} must be a positive divisor of the CP size {world_size}")
        rpn = inner_settings.pop("ranks_per_node", None)
        rpn = inner_settings.pop("gpus_per_node", None) if rpn is None else rpn
        rpn = _check_ranks_per_node(world_size, rpn)
        if rpn is not None and rpn % U:
            raise ValueError(f"ulysses_size {U} must divide the CP ranks per node {rpn}: an all-to-all group stays "
                             "inside a node")
        sub = inner_shape(shape, U)
        M = world_size // U
        inner_rpn = (rpn // U) if rpn else None
        inner_topo = None
        if topology is not None:  # the inner group of one head slice: every U-th rank
            inner_topo = replace(topology, node_of=tuple(topology.node(m * U) for m in range(M)))
        if inner_name == "tasp":
            inner_settings.setdefault("gpus_per_node", inner_rpn if inner_rpn and inner_rpn < M else None)
        elif inner_rpn:
            inner_settings.setdefault("ranks_per_node", inner_rpn)
        inner = inner_mode.resolve(M, sub, inner_topo, **inner_settings)
        return Placement(name, world_size, tile=inner.tile, contiguous=inner.contiguous, schedule=inner.schedule,
                         backward_chunks=inner.backward_chunks, ranks_per_node=rpn, transport=inner.transport,
                         ulysses=U, inner=inner)

    def build(p: Placement, shape, mask, layout) -> Plan:
        from .hybrid import build_hybrid_plan
        from .mesh import _mask_and_layout

        mask, layout = _mask_and_layout(p.world_size, shape, mask.causal, mask, layout)
        return build_hybrid_plan(p.world_size, p.ulysses, lambda M, sub, m, lay: p.inner.build(sub, m, lay), shape,
                                 mask, layout, inner_name)

    def rings(p: Placement) -> dict:
        U = p.ulysses
        out = {"a2a": tuple(tuple(range(m * U, (m + 1) * U)) for m in range(p.world_size // U))}
        for fam, rs in p.inner.rings().items():
            out[fam] = tuple(tuple(r * U + u for r in ring) for u in range(U) for ring in rs)
        return out

    def candidates(world, shape, topo) -> list[Placement]:
        from .hybrid import inner_shape

        out = []
        for U in range(2, min(world, topo.gpus_per_node) + 1):
            if world % U or (topo.gpus_per_node % U and topo.nodes_used(world) > 1):
                continue
            try:
                sub = inner_shape(shape, U)
            except ValueError:
                continue
            M = world // U
            inner_topo = replace(topo, node_of=tuple(topo.node(m * U) for m in range(M)))
            for inner in inner_mode.candidates(M, sub, inner_topo):
                out.append(Placement(name, world, tile=inner.tile, contiguous=inner.contiguous,
                                     ranks_per_node=topo.gpus_per_node if topo.nodes_used(world) > 1 else None,
                                     ulysses=U, inner=inner))
        return out

    def describe(p: Placement) -> str:
        return f"{name} (CP {p.world_size} = all-to-all {p.ulysses} x {p.inner.describe()})"

    settings = ("ulysses_size",) + tuple(s for s in inner_mode.settings) + \
        (("ranks_per_node",) if "ranks_per_node" not in inner_mode.settings else ())
    if inner_name == "tasp":
        settings = tuple(s for s in settings)
    return Mode(name, settings, resolve, build, rings, candidates, describe,
                f"Ulysses all-to-all over U consecutive ranks x {inner_name} across the P/U groups")


for _inner in ("mesh", "tasp", "ring"):
    register(_hybrid(_inner))

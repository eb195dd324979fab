"""The CP mode registry's core: :class:`Mode` (what one mode knows), :class:`Placement` (a mode's
choices resolved once per CP group), :func:`setting` (a typed option with its Megatron flag),
and the registry itself.

Each mode lives in one file of this package (:mod:`.mesh` -- Mesh and ring --, :mod:`.tasp`,
:mod:`.hybrid`) and owns everything about itself: its options (a frozen dataclass of
:func:`setting` fields: type, choices, default, help and the Megatron flag), how it resolves
them into a :class:`Placement` (``auto`` choices included), its dense plan, its block assignment
for mask-aware plans, its rings, the planner's candidates and its description. Every consumer --
the Python API, the Megatron flags, checks and groups, the planner and the reports -- reads the
registry; none compares mode names.

Example::

    placement = resolve("mesh", 8, shape, ranks_per_node=4, tile="auto")   # 2 nodes x 4
    placement.tile, placement.options.contiguous   # e.g. ((2, 4), 'q'): Q rings inside a node
    plan = placement.build(shape)                 # the plan every rank executes
    placement.groups()                            # ((0, 1), (0, 2, 4, 6), ...): the sub-groups to create
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar

from ..ir import Plan
from ..layout import Layout
from ..mask import Mask
from ..polish import polish, polishes
from ..problem import is_dense, normalize
from ..shape import AttentionShape
from ..sparse import Assignment, build_sparse_plan, own_calls, reordered
from ..sparse_needs import KEEP_LIMIT
from ..topology import Topology
from ..tunables import TUNABLES, Tunables

__all__ = ["Mode", "Placement", "MODES", "register", "get_mode", "resolve", "parse_mode_spec", "setting", "option_specs",
           "OptionSpec", "HYBRID_PREFIX", "topology_for", "check_ranks_per_node", "check_no_choices"]

HYBRID_PREFIX = "a2a+"


# -- options ----------------------------------------------------------------------------------------------
def setting(default: Any, *, help: str, flag: str | None = None, parse: Callable[[str], Any] | None = None,
            check: Callable[[str, Any], None] | None = None, only_with: tuple[str, Any] | None = None):
    """A mode option: a dataclass field with its help text and, when users set it on Megatron's
    command line, its ``flag`` (e.g. ``--mesh-tile-shape``); ``parse`` turns the flag's text into
    the value (default: as given). Allowed values come from the field's ``Literal`` type, or
    ``check(name, value)`` (ValueError naming the value); ``only_with=(option, value)``: a value
    other than the default means something only where that other option has that value, so
    elsewhere it is an error, not a setting silently ignored."""
    return field(default=default, metadata={"help": help, "flag": flag, "parse": parse, "check": check,
                                            "only_with": only_with})


@dataclass(frozen=True)
class OptionSpec:
    """One option of one mode, as the registry describes it to its consumers."""

    name: str
    default: Any
    choices: tuple | None  # the Literal values, None: checked by the mode's resolve
    help: str
    flag: str | None
    parse: Callable[[str], Any] | None
    check: Callable[[str, Any], None] | None = None
    only_with: tuple[str, Any] | None = None


@functools.cache
def option_specs(options_type: type) -> tuple[OptionSpec, ...]:
    """The options of an options dataclass, in field order (cached: the batch split asks for
    them per sample, and resolving the type hints is most of a sample's layout lookup)."""
    hints = _hints(options_type)
    out = []
    for f in dataclasses.fields(options_type):
        choices = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is typing.Literal else None
        out.append(OptionSpec(f.name, f.default, choices, f.metadata.get("help", ""), f.metadata.get("flag"),
                              f.metadata.get("parse"), f.metadata.get("check"), f.metadata.get("only_with")))
    return tuple(out)


@functools.cache
def _hints(options_type: type) -> dict:
    return typing.get_type_hints(options_type)


def check_options(mode: str, options_type: type, values: dict) -> Any:
    """``options_type(**values)`` after checking names and ``Literal`` choices (ValueError naming
    the value and what is allowed)."""
    specs = {s.name: s for s in option_specs(options_type)}
    extra = sorted(set(values) - set(specs))
    if extra:
        raise ValueError(f"CP mode {mode!r} takes no setting {', '.join(extra)}; its settings: "
                         f"{', '.join(specs) or 'none'}")
    hints = _hints(options_type)
    for name, value in values.items():
        choices = specs[name].choices
        if choices is not None and value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
        if hints[name] is bool and not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
        if specs[name].check is not None:
            specs[name].check(name, value)
        _check_only_with(specs, name, value, values)
    return options_type(**values)


def _check_only_with(specs: dict, name: str, value, values: dict) -> None:
    """ValueError where ``name`` is set away from its default while the option it goes with
    (:func:`setting`'s ``only_with``) has another value than the one it needs."""
    need = specs[name].only_with
    if need is None or value == specs[name].default:
        return
    other, wanted = need
    got = values.get(other, specs[other].default)
    if got != wanted:
        raise ValueError(f"{name} {value!r} applies only with {other}={wanted!r}, got {other}={got!r}: set "
                         f"{other} to {wanted!r} or leave {name} at its default {specs[name].default!r}")


@dataclass(frozen=True)
class NoOptions:
    """A mode without options."""


# -- placements ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    """A CP mode's choices for one CP group of ``world_size`` ranks: its ``options`` resolved
    (``auto`` chosen), the consecutive CP ranks per node (None: one node), and a hybrid's
    ``inner`` placement over world_size / U ranks."""

    mode: str
    world_size: int
    options: Any = NoOptions()
    ranks_per_node: int | None = None
    inner: "Placement | None" = None

    @property
    def spec(self) -> "Mode":
        return get_mode(self.mode)

    def build(self, shape: AttentionShape, mask: Mask | None = None, layout: Layout | None = None,
              tunables: Tunables = TUNABLES, own_first: tuple | None = None, topology: Topology | None = None) -> Plan:
        """The plan of this placement for ``shape`` (per rank), ``mask`` (default causal) and
        ``layout`` (default Megatron's zigzag), with the builders' ``tunables``; a mask-aware
        plan with the ranks' ``own_first`` choices (:func:`~..sparse.build_sparse_plan`; a Ulysses
        hybrid's: its inner plan's ranks'; None: those :mod:`..polish` finds, where it polishes, on
        ``topology``: the machine the plan will be simulated on, default :func:`topology_for`'s)."""
        return self.spec.build(self, shape, mask, layout, tunables, own_first, topology)

    def rings(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        """The rings (CP-rank tuples in ring order) the dense plan of this placement moves data on:
        the one source of ``Plan.rings``."""
        return self.spec.rings(self)

    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The process sub-groups (sorted CP-rank tuples, 2 <= size < P) a transport routes
        through: every ring's members, a hybrid's all-to-all groups, TASP's nodes."""
        out = set()
        for rings in (*self.rings().values(), self.spec.extra_groups(self)):
            for ring in rings:
                if 2 <= len(ring) < self.world_size:
                    out.add(tuple(sorted(ring)))
        return tuple(sorted(out))

    def describe(self) -> str:
        """One phrase naming the mode and its choices (logs, reports)."""
        return self.spec.describe(self)

    def with_options(self, **values) -> "Placement":
        """A copy with the given options replaced where this placement's mode (or its inner
        mode's) has them, e.g. ``backward_chunks="keep"`` for every Mesh-like placement."""
        names = [f.name for f in dataclasses.fields(self.options)]
        merged = {**{k: getattr(self.options, k) for k in names}, **{k: v for k, v in values.items() if k in names}}
        options = check_options(self.mode, type(self.options), merged)  # checked as the mode's options() checks
        inner = self.inner.with_options(**values) if self.inner is not None else None
        return dataclasses.replace(self, options=options, inner=inner)

    # facts other layers read, whatever the mode
    @property
    def tile(self) -> tuple[int, int] | None:
        """The Mesh tile (a hybrid's inner one); None for modes without a tile."""
        tile = getattr(self.options, "tile", None)
        return tile if tile is not None or self.inner is None else self.inner.tile

    @property
    def transport(self) -> str:
        """How the rounds travel: "p2p" (batched point-to-point) or "alltoall" (one collective)."""
        return getattr(self.options, "transport", "p2p")

    @property
    def ulysses(self) -> int:
        """The Ulysses all-to-all degree (1: none)."""
        return getattr(self.options, "ulysses_size", 1)


# -- modes ---------------------------------------------------------------------------------------------------
class Mode:
    """One CP mode. Subclasses set ``name``, ``Options``, ``doc`` and implement the hooks;
    :meth:`build` (dense or mask-aware, decided here once) is common."""

    name: ClassVar[str]
    Options: ClassVar[type] = NoOptions
    doc: ClassVar[str] = ""
    can_be_inner: ClassVar[bool] = True  # a Ulysses hybrid a2a+<name> exists
    auto_row: ClassVar[str | None] = None  # the planner's row of this mode's fastest candidate
    auto_pool: ClassVar[tuple[str, ...]] = ()  # other modes whose rows compete for that row
    planner_rows: ClassVar[str] = "all"  # what the planner shows by default: "all" candidates, or its "auto" row
    shorthand: ClassVar[tuple[str, ...]] = ()  # settings given positionally in "mode:a:b" (see parse_mode_spec)
    uses_nodes: ClassVar[bool] = True  # its placement depends on the CP ranks per node
    burst_rounds: ClassVar[bool] = False  # pulls over every link at once each round (TASP), not one ring shift
    takes_block_owners: ClassVar[bool] = False  # computes blocks where a layout's ``owners`` name (Mesh)

    def options(self, **values) -> Any:
        """The mode's options from keyword settings, checked."""
        return check_options(self.name, self.Options, values)

    def resolve(self, world_size: int, shape: AttentionShape, topology: Topology | None, ranks_per_node: int | None,
                options: Any, mask: Mask) -> Placement:
        """The placement for this group (``auto`` options chosen for ``shape``, ``topology`` and ``mask``)."""
        return Placement(self.name, world_size, options, ranks_per_node)

    def build(self, p: Placement, shape: AttentionShape, mask: Mask | None, layout: Layout | None,
              tunables: Tunables = TUNABLES, own_first: tuple | None = None, topology: Topology | None = None) -> Plan:
        mask, layout = normalize(p.world_size, shape, mask, layout)
        self.check_layout(layout)
        if is_dense(mask, layout):  # the builders name their own algorithm; the plan is this mode's
            check_no_choices(own_first)
            plan = self.build_dense(p, shape, mask)
            return plan if plan.mode == self.name else replace(plan, mode=self.name, _cache={})
        plan = build_sparse_plan(self.name, p.world_size, shape, mask, layout, self.assignment(p, mask, layout),
                                 backward_chunks=getattr(p.options, "backward_chunks", "auto"),
                                 keep_limit=getattr(p.options, "backward_keep_limit", KEEP_LIMIT),
                                 ranks_per_node=p.ranks_per_node, tunables=tunables, own_first=own_first or ())
        if own_first is None and polishes(p.world_size, shape.seq_local, tunables):
            return polish(lambda choices: reordered(plan, choices), lambda x, d: own_calls(plan, x, d), shape,
                          topology_for(p.world_size, p.ranks_per_node, topology), tunables, first=plan)
        return plan

    def check_layout(self, layout: Layout) -> None:
        """ValueError for a layout that names its blocks' owners (its work balance rests on them)
        where this mode computes blocks elsewhere -- not a silently unbalanced run."""
        if layout.owners and not self.takes_block_owners:
            raise ValueError(f"this layout names the rank that computes each of its blocks (owners); CP mode {self.name!r} "
                             "computes them elsewhere and would run it unbalanced: use mesh, or a layout without owners "
                             "(megatron_mesh.balanced_layout)")

    def build_dense(self, p: Placement, shape: AttentionShape, mask: Mask) -> Plan:
        """The plan under a causal or full mask on Megatron's zigzag (any builder's: :meth:`build`
        names it after this mode)."""
        raise NotImplementedError(f"CP mode {self.name!r} has no dense plan")

    def assignment(self, p: Placement, mask: Mask, layout: Layout) -> Assignment:
        """Block placement of mask-aware plans (default: the query owner computes)."""
        return Assignment()

    def rings(self, p: Placement) -> dict:
        return {}

    def extra_groups(self, p: Placement) -> tuple[tuple[int, ...], ...]:
        """Process sub-groups a transport needs beyond the rings (e.g. TASP's nodes)."""
        return ()

    def candidates(self, world_size: int, shape: AttentionShape, topo: Topology) -> list[Placement]:
        """The placements the planner compares for this mode."""
        return [self.resolve(world_size, shape, topo, _planner_rpn(world_size, topo), self.options(), Mask())]

    def describe(self, p: Placement) -> str:
        return f"{self.name} (CP {p.world_size})"


def _planner_rpn(world_size: int, topo: Topology) -> int | None:
    return topo.ranks_per_node(world_size)


MODES: dict[str, Mode] = {}


def register(mode: Mode) -> Mode:
    """Add ``mode`` to the registry (and, when it can be an inner mode, its Ulysses hybrid: see
    :mod:`.hybrid`, which registers a factory here)."""
    MODES[mode.name] = mode
    for hook in _ON_REGISTER:
        hook(mode)
    return mode


_ON_REGISTER: list[Callable[[Mode], None]] = []


def get_mode(name: str) -> Mode:
    mode = MODES.get(name)
    if mode is None:
        raise ValueError(f"unknown CP mode {name!r}; allowed: {', '.join(MODES)}")
    return mode


def check_no_choices(own_first: tuple | None) -> None:
    """ValueError for ``own_first`` choices given where the plan is dense (no own block to move)."""
    if own_first:
        raise ValueError(f"own_first choices {tuple(own_first)!r} apply to mask-aware plans (documents, a window, "
                         "another layout than the zigzag); this plan is dense")


def topology_for(world_size: int, ranks_per_node: int | None, topology: Topology | None = None) -> Topology:
    """The machine the ``auto`` choices are simulated on: ``topology`` if given, else nodes of
    ``ranks_per_node`` consecutive CP ranks (None: one node) with the default link speeds."""
    if topology is not None:
        return topology
    per = ranks_per_node or world_size
    return Topology(nodes=-(-world_size // per), gpus_per_node=per)


def check_ranks_per_node(world_size: int, rpn) -> int | None:
    """None, or a divisor of the CP size (the whole group on one node is None)."""
    if rpn is None:
        return None
    if not isinstance(rpn, int) or isinstance(rpn, bool) or rpn < 1 or world_size % rpn:
        raise ValueError(f"CP ranks per node (gpus_per_node) must be a positive divisor of the CP size {world_size}, "
                         f"got {rpn!r}")
    return None if rpn >= world_size else rpn


def parse_mode_spec(text: str) -> tuple[str, dict]:
    """(mode, settings) of a command-line mode: the name, then the mode's :attr:`Mode.shorthand`
    settings separated by colons -- ``mesh:2x2`` (tile), ``tasp:4`` (CP ranks per node),
    ``a2a+mesh:2:1x2`` (all-to-all degree 2, inner tile 1x2); values stay text where the option
    takes text and become integers where they are digits (resolve checks them)."""
    name, *args = str(text).split(":")
    mode = get_mode(name)
    if len(args) > len(mode.shorthand):
        form = ":".join([name, *(s.upper() for s in mode.shorthand)])
        raise ValueError(f"mode {text!r} has {len(args)} settings after the name; {name} takes at most "
                         f"{len(mode.shorthand)}: {form}")
    return name, {key: int(v) if v.isdigit() else v for key, v in zip(mode.shorthand, args) if v}


def resolve(name: str, world_size: int, shape: AttentionShape, topology: Topology | None = None, *,
            ranks_per_node: int | None = None, mask: Mask | None = None, **settings) -> Placement:
    """The Placement of mode ``name`` for a CP group of ``world_size`` ranks and per-rank
    ``shape``; ``settings`` are the mode's options (ValueError naming any it does not take),
    ``mask`` the one its ``auto`` choices are made for (default causal)."""
    mode = get_mode(name)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"CP size must be a positive integer, got {world_size!r}")
    options = mode.options(**settings)
    rpn = check_ranks_per_node(world_size, ranks_per_node)
    return mode.resolve(world_size, shape, topology, rpn, options, mask if mask is not None else Mask())

"""The CP layout registry's core: :class:`LayoutKind` (a layout users choose by name -- Megatron's
``--cp-layout`` value, the planner's ``--layout`` row), :class:`Sample` (what a layout is built
for) and the registry itself.

Each kind lives in one file of this package (:mod:`.zigzag`, :mod:`.thd`, :mod:`.balanced`,
:mod:`.balanced_hide`, :mod:`.auto`) and owns everything about itself: its name and help, how it
is built for one sample of packed documents, the Megatron flag that runs it, and what it asks
of the consumers (declared members with defaults). Megatron's flags, checks and per-sample
decision, and the planner's rows, read the registry; none compares layout names. (The layouts
themselves -- which positions a rank holds -- are :class:`~..layout.Layout` objects; a kind is
how a user asks for one.)

Example::

    kind = get_layout_kind("balanced")
    layout = kind.build(Sample((0, 8, 12, 16), 2))   # rank 0: [0, 2) + [6, 12), rank 1: [2, 6) + [12, 16)
    kind.flag                                         # '--cp-layout balanced'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..layout import Layout
from ..maskkinds import MaskKind, MaskStack, work_mask
from ..shape import AttentionShape
from ..sparse_needs import KEEP_LIMIT, check_keep_limit
from ..topology import Topology

__all__ = ["LayoutKind", "Sample", "SampleLayoutError", "LAYOUTS", "register", "get_layout_kind", "layout_names", "cp_layout_names",
           "DEFAULT_LAYOUT", "REFERENCE_LAYOUT"]

# Megatron's --cp-layout when it is left out (why: docs/megatron.md, "Packed documents: the CP layout")
DEFAULT_LAYOUT = "auto"
# Megatron's own layout: the one the others are compared against, and the only one the planner
# plans without documents (the others place documents)
REFERENCE_LAYOUT = "zigzag"


class SampleLayoutError(ValueError):
    """A layout kind cannot lay out one sample's documents (its settings are fine: another sample
    may pass) -- a run stops on it, naming the sample and the kinds that lay out every one."""


@dataclass(frozen=True)
class Sample:
    """One sample of packed documents (boundaries ``cu_seqlens``, 0 = c0 < ... < cn = S) over a CP
    group of ``world_size`` ranks, and what its layout is built for: the mask (``causal``,
    ``window``, a ``mask`` kind such as chunked, or the layers' :class:`~..maskkinds.MaskStack`),
    the Ulysses degree ``group`` of the mode that runs it (1: none), the CP ranks per node (None:
    one node), and -- for a kind that prices its choice (``auto``) -- the
    ``mode`` that runs it, the per-rank ``shape``, the machine (``topology``; None: nodes of
    ``ranks_per_node`` with the default links) and what its backward keeps (``keep_limit``)."""

    cu_seqlens: tuple[int, ...]
    world_size: int
    causal: bool = True
    window: tuple | None = None
    group: int = 1
    ranks_per_node: int | None = None
    mode: str = "ring"
    shape: AttentionShape | None = None
    topology: Topology | None = None
    # a mask kind without documents (chunked, prefix), or the layers' masks (a MaskStack: layers with
    # different masks share the layout), instead of causal / window
    mask: MaskKind | MaskStack | None = None
    # what the mode's backward keeps of what a rank pulled, x its own Q, K and V (a priced choice
    # reads it: :func:`~..sparse_needs.keep_limit_of` of the mode's backward_chunks and keep limit)
    keep_limit: float = KEEP_LIMIT
    # every mode that runs on the layout where it is more than ``mode`` (Megatron's per-layer list,
    # TE's modes included): a priced choice offers only a layout each of them runs (:meth:`LayoutKind.runs`)
    layer_modes: tuple[str, ...] = ()
    # the mode's options as the layers set them, (name, value) pairs (a priced choice that plans the
    # mode plans it with them: Mesh's schedule, tile, ...; the mode's defaults for the others)
    options: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        check_keep_limit("keep_limit", self.keep_limit)
        if isinstance(self.layer_modes, str) or not all(isinstance(m, str) for m in self.layer_modes):
            raise ValueError(f"layer_modes must be a sequence of mode names, got {self.layer_modes!r}")
        object.__setattr__(self, "layer_modes", tuple(self.layer_modes))
        object.__setattr__(self, "options", tuple(sorted((str(k), v) for k, v in dict(self.options).items())))
        object.__setattr__(self, "cu_seqlens", tuple(int(c) for c in self.cu_seqlens))
        if self.window is not None:
            object.__setattr__(self, "window", tuple(self.window))

    @property
    def head(self) -> MaskKind:
        """The mask without documents the layout is built for (whose work it balances)."""
        return work_mask(self.mask, self.causal, self.window)

    @property
    def machine(self) -> Topology:
        """The machine a priced choice is made on: ``topology``, else nodes of ``ranks_per_node``."""
        if self.topology is not None:
            return self.topology
        n = self.ranks_per_node
        return Topology(nodes=self.world_size // n if n else 1, gpus_per_node=n or self.world_size)


class LayoutKind:
    """One CP layout users choose by name. Subclasses set ``name`` and ``help`` and implement
    :meth:`build`; the other members declare what the kind asks of its consumers."""

    name: ClassVar[str]
    help: ClassVar[str] = ""  # what it is, one phrase (Megatron's --cp-layout help, the planner's --layout help)
    cp_layout: ClassVar[bool] = True  # a value of Megatron's --cp-layout (False: another flag runs it, megatron_flag)
    megatron_flag: ClassVar[str | None] = None  # the Megatron flag that runs it where it is not --cp-layout NAME
    # Megatron's batch split, RoPE and layers follow a layout of each sample (False: Megatron's own
    # global zigzag split, :meth:`build` None for every sample)
    per_sample: ClassVar[bool] = True
    # the kind it differs from only for Ulysses groups (U > 1): Megatron needs such groups, the
    # planner plans only the hybrids on it (the plain modes run on that kind); None: a layout of its own
    varies: ClassVar[str | None] = None
    # its planner rows are another kind's, picked per mode and sample (:meth:`pick`) from these kinds' rows
    derived_from: ClassVar[tuple[str, ...]] = ()
    # Transformer Engine's own modes run on it: the planner adds their rows (te-p2p, te-a2a+p2p)
    transformer_engine_rows: ClassVar[bool] = False
    # it lays out every sample it is built for (False: some it refuses, naming why -- a run on it stops
    # there; the planner's advice names the derived kind that runs it where it can)
    every_sample: ClassVar[bool] = True

    def build(self, sample: Sample) -> Layout | None:
        """The layout of ``sample``; None: Megatron's zigzag over the whole sequence (the documents
        then come with the mask)."""
        raise NotImplementedError(f"CP layout {self.name!r} builds no layout")

    def pick(self, sample: Sample) -> str:
        """A derived kind (:attr:`derived_from`): the kind whose layout ``sample`` runs on."""
        raise NotImplementedError(f"CP layout {self.name!r} is not picked from other layouts")

    def runs(self, mode: str) -> str | None:
        """Why CP mode ``mode`` cannot run on this kind's layouts (the planner lists its rows as
        skipped with it, ``auto`` offers the layout only where every layer's mode runs on it);
        None: it can."""
        return None

    def refuses(self, sample: Sample, *, build: bool = True) -> str | None:
        """Why this kind gives ``sample`` no layout (the planner lists its rows as skipped with it,
        ``auto`` leaves it out, Megatron's start-up check names it); None: :meth:`build` lays it
        out. ``build=False``: only what does not depend on the sample's documents (the start-up
        check, before any sample)."""
        return None

    def too_large(self, sample: Sample) -> str | None:
        """Why a comparison of every layout leaves the plugin's modes out on this one for ``sample``
        (planning them would take too long); None: plan them."""
        return None

    @property
    def flag(self) -> str | None:
        """The Megatron flag that puts a sample's tokens in this layout (None: no Megatron flag)."""
        return f"--cp-layout {self.name}" if self.cp_layout else self.megatron_flag


LAYOUTS: dict[str, LayoutKind] = {}


def register(kind: LayoutKind) -> LayoutKind:
    """Add ``kind`` to the registry: its name becomes a --cp-layout choice (where it is one), a
    per-sample decision and a planner row."""
    LAYOUTS[kind.name] = kind
    return kind


def get_layout_kind(name: str) -> LayoutKind:
    kind = LAYOUTS.get(name)
    if kind is None:
        raise ValueError(f"unknown CP layout {name!r}; allowed: {', '.join(LAYOUTS)}")
    return kind


def layout_names() -> tuple[str, ...]:
    """Every registered layout, in registration order (the planner's rows), read at call time."""
    return tuple(LAYOUTS)


def cp_layout_names() -> tuple[str, ...]:
    """The values of Megatron's --cp-layout, the default first, read at call time."""
    names = [name for name, kind in LAYOUTS.items() if kind.cp_layout]
    return tuple(sorted(names, key=lambda name: name != DEFAULT_LAYOUT))

"""A plan's facts, typed per mode family: what the builder that made a plan decided -- which tile
map placed its blocks, how its rounds are ordered, a Ulysses hybrid's degree and inner plan -- as
one frozen dataclass per family, held in ``Plan.facts``.

Each family lives with its builder and owns its part of the header of the plan text
(:mod:`.plan_text`): :class:`~..mesh.MeshFacts` (Mesh and ring), :class:`~..tasp.TaspFacts`,
:class:`~..sparse.MaskAwareFacts` (every mode's plan under a mask or another layout) and
:class:`~..hybrid.UlyssesFacts`. :class:`Facts` itself is a plan no builder made (written by hand),
and says what every consumer may ask of any plan: a family overrides the answers it knows.

The header prints the same keys for every plan (:data:`HEADER`), each family the keys it owns and
the others their default, so a plan text reads the same whatever the family (a family with a
fact no key names adds its own key, printed after them). Reading it back, the
``schedule`` value names the family (each registers the values it prints: :func:`register_facts`)
and a plan with an inner plan is a Ulysses hybrid. A new mode family is one such class, registered
in its builder's file. Example: the header of a dense 2x2 Mesh plan::

    tile=2x2 schedule=greedy backward_chunks=refetch contiguous=q assignment=tile direct=no
    last_round=- ranks_per_node=- ulysses=1 heads=- kernel_calls=varlen
"""

from __future__ import annotations

import typing
from typing import ClassVar, Literal

__all__ = ["Facts", "BackwardChunks", "Contiguous", "HEADER", "register_facts", "facts_of_header",
           "FAMILIES", "INNER", "tile_text", "parse_tile_text", "optional_int", "optional_text",
           "choice"]

# what the backward reads: "refetch" pulls the chunks again, "keep" keeps the forward's, "auto" (a
# mask-aware plan) keeps on each rank what fits in the keep limit x its own Q, K and V and pulls the rest again
BackwardChunks = Literal["refetch", "keep", "auto"]
# which ring of a Mesh tile holds consecutive ranks
Contiguous = Literal["q", "kv"]

# the header's keys in print order, each with the text of a plan that does not set it
HEADER = {"tile": "-", "schedule": "-", "backward_chunks": "refetch", "contiguous": "-", "assignment": "-",
          "direct": "no", "last_round": "-", "ranks_per_node": "-", "ulysses": "1", "heads": "-",
          "kernel_calls": "varlen"}


def choice(name: str, value, literal) -> str:
    """``value`` if it is one of the ``Literal`` type's values, else a ValueError naming both."""
    allowed = typing.get_args(literal)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def tile_text(tile: tuple[int, int] | None) -> str:
    return "-" if tile is None else f"{tile[0]}x{tile[1]}"


def parse_tile_text(text: str) -> tuple[int, int] | None:
    return None if text == "-" else tuple(int(x) for x in text.split("x"))  # type: ignore[return-value]


def optional_int(text: str) -> int | None:
    return None if text == "-" else int(text)


def optional_text(value: int | None) -> str:
    return "-" if value is None else str(value)


class Facts:
    """The facts of a plan no builder made, and what a consumer may ask of any plan's facts."""

    schedules: ClassVar[tuple[str, ...]] = ("-",)  # the header's schedule values this family prints
    holds_inner: ClassVar[bool] = False  # its plans hold an inner plan (the text's "begin inner" section)
    tile: tuple[int, int] | None = None  # the Mesh tile the blocks were assigned by (ring: (1, P))
    contiguous: Contiguous | None = None  # which ring of that tile holds consecutive ranks
    assignment: str = ""  # who computes a block (the family's word for it)
    direct: bool = False  # ranks move different tokens to different peers: analyses read every rank
    last_round: int | None = None  # the highest round any rank posts, where the builder states it
    ranks_per_node: int | None = None  # the consecutive CP ranks per node the rings were built for
    ulysses: int = 1  # the number of head slices keys may name
    heads: tuple[int, int] | None = None  # the (query, key/value) head counts the slices were cut from
    own_first: tuple = ()  # (rank, direction, first): where a rank runs its own block (mask-aware, ..polish)
    # a hybrid's inner plan (the traffic the simulator prices; a :class:`~.plan.Plan`, named not
    # imported: the plan module imports this one)
    inner: "Plan | None" = None

    @property
    def tile_placed(self) -> tuple[int, int] | None:
        """The tile whose map computed the blocks (None: another assignment did)."""
        return None

    def header(self) -> dict[str, str]:
        """The header keys this family sets (the others print their :data:`HEADER` default; keys
        not in it are the family's own, printed after them)."""
        return {}

    @classmethod
    def from_header(cls, head: dict[str, str], inner: "Plan | None") -> "Facts":
        """The facts of a header (``head``: key -> text, defaults filled in) read back."""
        return cls()

    def __eq__(self, other) -> bool:
        return type(other) is Facts if type(self) is Facts else NotImplemented

    def __hash__(self) -> int:
        return hash(Facts)

    def __repr__(self) -> str:
        return "Facts()"


INNER = "begin inner"
# a header's schedule value (INNER: a plan with an inner plan) -> the family that prints it
FAMILIES: dict[str, type[Facts]] = {"-": Facts}


def register_facts(family: type[Facts]) -> type[Facts]:
    """Register a family (a class decorator) under the schedule values it prints (a family whose
    plans hold an inner plan: under :data:`INNER`)."""
    for schedule in (INNER,) if family.holds_inner else family.schedules:
        known = FAMILIES.get(schedule)
        if known is not None and known is not family:
            raise ValueError(f"schedule {schedule!r} is printed by {known.__name__} already")
        FAMILIES[schedule] = family
    return family


def facts_of_header(given: dict[str, str], inner: "Plan | None") -> Facts:
    """The typed facts of a plan text's header (``given``: the keys the text states): the family
    its ``schedule`` names, the one holding an inner plan where the text has one, or -- a
    hand-written header without a schedule -- the first family that prints the keys it states
    (none stated: :class:`Facts`). A header the family would print otherwise is a ValueError
    naming the keys that differ."""
    if inner is not None or "schedule" in given:
        key = INNER if inner is not None else given["schedule"]
        if key not in FAMILIES:
            known = ", ".join(k for k in FAMILIES if k != INNER)
            raise ValueError(f"no plan facts family for {key!r} (the header's schedule; known: {known})")
        candidates = [FAMILIES[key]]
    else:
        candidates = list(dict.fromkeys(f for k, f in FAMILIES.items() if k != INNER))
    errors = {}  # family name -> why it does not read this header
    for family in candidates:
        try:
            facts = family.from_header({**HEADER, **given}, inner)
        except ValueError as e:
            errors[family.__name__] = str(e)
            continue
        printed = {**HEADER, **facts.header()}
        wrong = [k for k in given if k not in ("backward_chunks", "kernel_calls") and printed.get(k) != given[k]]
        if not wrong:
            return facts
        says = ", ".join(f"{k}={printed[k]}" if k in printed else f"no {k}" for k in wrong)
        errors[family.__name__] = (f"plan header {', '.join(f'{k}={given[k]}' for k in wrong)}: a {family.__name__} "
                                   f"plan says {says} (its keys: {', '.join(printed)})")
    if len(errors) == 1:
        raise ValueError(*errors.values())
    raise ValueError("no family of plan facts prints this header (it names no schedule): " +
                     "; ".join(f"{name}: {why}" for name, why in errors.items()))

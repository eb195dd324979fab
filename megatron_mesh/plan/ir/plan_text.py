"""The text form of a plan (:meth:`~.plan.Plan.to_text`, :meth:`~.plan.Plan.from_text`): printed
line by line, read back by :class:`_Parser` (a hybrid's inner plan recursively).

Lines, in order: the header (``plan MODE P=.. seq_local=..`` and every fact of :data:`~.facts.HEADER`:
the typed facts' family prints its own, :mod:`.facts`), ``mask``, ``layout``, one ``ring`` line per
ring family, ``note`` lines, the ``slot`` segments the ops name, each rank's section
(:meth:`~.rank.RankPlan.to_text`) and a hybrid's inner plan between ``begin inner`` and ``end inner``.
A hand-written plan may leave out the header's facts, the mask, layout, rings and notes (defaults).
"""

from __future__ import annotations

import re
from typing import Callable, Iterable

from ..layout import layout_from_text
from ..mask import KernelCalls, Mask
from ..sel import Segment, parse_sel, sel_text
from .facts import HEADER, BackwardChunks, choice, facts_of_header
from .ops import Free, Key, _parse_keys, op_keys, parse_op
from .rank import RankPlan

__all__ = ["plan_header", "plan_text", "describe_plan", "parse_plan"]


def plan_header(plan) -> str:
    """The first line: mode, sizes and every fact of the header (:data:`~.facts.HEADER`'s keys, then
    any the family adds)."""
    facts = {**HEADER, **plan.facts.header(), "backward_chunks": plan.backward_chunks,
             "kernel_calls": plan.kernel_calls}
    return f"plan {plan.mode} P={plan.world_size} seq_local={plan.seq_local} " + \
        " ".join(f"{k}={v}" for k, v in facts.items())


def describe_plan(plan, ranks: Iterable[int] | None = None) -> str:
    """A compact text form of the ops of ``ranks`` (default all; Free ops left out)."""
    lines = [plan_header(plan)]
    lines += [f"  note: {n}" for n in plan.notes]
    for r in range(plan.world_size) if ranks is None else ranks:
        rp = plan.rank(r)
        for direction in ("forward", "backward"):
            lines.append(f"rank {rp.rank} {direction}:")
            lines += ["  " + str(op) for op in rp.ops(direction) if type(op) is not Free]
    return "\n".join(lines)


def plan_text(plan) -> str:
    """The whole plan as text (the module docstring)."""
    lines = [plan_header(plan), f"mask {plan.mask.text()}", f"layout {plan.layout.text()}"]
    for family, rings in plan.rings.items():
        lines.append(f"ring {family} " + " ".join("(" + " ".join(map(str, r)) + ")" for r in rings))
    lines += [f"note {n}" for n in plan.notes]
    for (span, chunk, slot), segs in sorted(_used_slots(plan).items()):
        lines.append(f"slot {Key('q', chunk, slot, span=span)}{sel_text(segs)}".replace("slot q", "slot ", 1))
    lines += [rp.to_text() for rp in plan.ranks]
    if plan.facts.inner is not None:
        lines += ["begin inner", plan_text(plan.facts.inner).rstrip("\n"), "end inner"]
    return "\n".join(lines) + "\n"


def _used_slots(plan) -> dict:
    slots = {}
    for rp in plan.ranks:
        keys = [k for op in (*rp.forward, *rp.backward) for k in op_keys(op)]
        keys += [*rp.forward_inputs, *rp.backward_inputs]
        for k in keys:
            if k.slot >= 0:
                slots[(k.span, k.chunk, k.slot)] = plan.segments(k)
    return slots


def parse_plan(text: str, make: Callable[..., object]):
    """Parse :func:`plan_text` output -- or a hand-written plan in that form -- into the plan
    ``make(**fields)`` builds (the Plan class)."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return _Parser(lines, make).plan()


class _Parser:
    """Reads the lines of :func:`plan_text` (a hybrid's inner plan recursively)."""

    def __init__(self, lines: list[str], make: Callable[..., object]):
        self.lines, self.i, self.make = lines, 0, make

    def header(self) -> tuple[str, int, int, dict[str, str]]:
        if self.i >= len(self.lines) or not self.lines[self.i].startswith("plan "):
            raise ValueError("a plan text starts with 'plan MODE P=.. seq_local=.. ...'")
        words = self.lines[self.i].split()
        self.i += 1
        head = dict(item.split("=", 1) for item in words[2:])  # facts no family prints: facts_of_header says so
        if len(words) < 2 or "P" not in head or "seq_local" not in head:
            raise ValueError(f"a plan header names its mode, P and seq_local, e.g. 'plan ring P=2 seq_local=4', got "
                             f"{' '.join(words)!r}")
        return words[1], int(head.pop("P")), int(head.pop("seq_local")), head

    def plan(self):
        mode, P, T, given = self.header()
        head = {**HEADER, **given}
        mask, layout, rings, notes, slots = Mask(), None, {}, [], {}
        ranks: dict[int, dict] = {}
        section: dict = {"rank": None, "direction": None}  # the rank section and direction being read
        inner = None
        while self.i < len(self.lines):
            ln = self.lines[self.i]
            s = ln.strip()
            if s == "end inner":
                break
            self.i += 1
            if s.startswith("plan "):
                raise ValueError(f"a second plan header {s!r} (an inner plan goes between 'begin inner' / 'end inner')")
            if s == "begin inner":
                inner = self.plan()
                if self.i >= len(self.lines) or self.lines[self.i].strip() != "end inner":
                    raise ValueError("'begin inner' without 'end inner'")
                self.i += 1
            elif s.startswith("mask "):
                mask = Mask.from_text(s[5:])
            elif s.startswith("layout "):
                layout = layout_from_text(s[7:])
            elif s.startswith("ring "):  # a family without rings (a single rank) prints no ring after its name
                family, _, rest = s[5:].partition(" ")
                rings[family] = tuple(tuple(int(x) for x in r.split()) for r in re.findall(r"\(([^)]*)\)", rest))
            elif s.startswith("note "):
                notes.append(s[5:])
            elif s.startswith("slot "):
                m = re.match(r"^slot (\d+)(?:\*(\d+))?\.(\d+)(\[.*\])$", s)
                if m is None:
                    raise ValueError(f"bad slot line {ln!r} (e.g. 'slot 3.1[0:2,6:8]')")
                slots[(int(m.group(2) or 1), int(m.group(1)), int(m.group(3)))] = parse_sel(m.group(4))
            else:
                _rank_line(s, ln, ranks, section, T)
        if sorted(ranks) != list(range(P)):
            raise ValueError(f"plan text for P={P} ranks has rank sections {sorted(ranks)}")
        built = {r: RankPlan(r, T, tuple(d["forward"]), tuple(d["backward"]), d["forward_inputs"],
                             d["backward_inputs"], d["output"], d["grad_q"], d["grad_kv"], tuple(d["saved"]))
                 for r, d in ranks.items()}
        return self.make(mode=mode, world_size=P, seq_local=T, build_rank=built.__getitem__, mask=mask, layout=layout,
                         slots=slots, rings=rings, notes=tuple(notes), facts=facts_of_header(given, inner),
                         backward_chunks=choice("backward_chunks", head["backward_chunks"], BackwardChunks),
                         kernel_calls=choice("kernel_calls", head["kernel_calls"], KernelCalls))


def _rank_line(s: str, ln: str, ranks: dict[int, dict], section: dict, T: int) -> None:
    """One line of a rank's section of the plan text: its header, a direction, an input, a saved
    buffer or an op (``section``: the rank and direction being read, updated here)."""
    cur = section["rank"]
    if s.startswith("rank "):
        m = re.match(r"^rank (\d+): output (\S+) grad_q (\S+) grad_kv (\S+)$", s)
        if m is None:
            raise ValueError(f"bad rank line {ln!r}")
        section["rank"] = ranks[int(m.group(1))] = dict(
            output=Key.parse(m.group(2)), grad_q=Key.parse(m.group(3)), grad_kv=Key.parse(m.group(4)), forward=[],
            backward=[], forward_inputs={}, backward_inputs={}, saved=[])
        section["direction"] = None
    elif cur is None:
        raise ValueError(f"line {ln!r} comes before any 'rank N:' line")
    elif s in ("forward:", "backward:"):
        section["direction"] = s[:-1]
    elif s.startswith(("forward_input ", "backward_input ")):
        word, rest = s.split(" ", 1)
        (k,), (sel,) = _parse_keys(rest)
        cur[word + "s"][k] = sel if sel is not None else (Segment(0, T * k.span),)
    elif s.startswith("saved "):
        cur["saved"].append(Key.parse(s.split(" ", 1)[1]))
    elif section["direction"] is None:
        raise ValueError(f"op {ln!r} outside a 'forward:' / 'backward:' section")
    else:
        cur[section["direction"]].append(parse_op(s))

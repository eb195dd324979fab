"""One rank's part of a plan: its two op lists, the buffers it starts from and ends with, and its
text (a section of the plan text, :mod:`.plan_text`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from ..sel import Sel, sel_text
from .ops import Attend, AttendBackward, Key, Op, Post

__all__ = ["RankPlan"]


@dataclass(frozen=True)
class RankPlan:
    """Everything one rank does in one attention call.

    ``forward_inputs`` / ``backward_inputs`` say how the executor builds the initial buffers from
    the local tensors: each key maps to the token segments of the local chunk it is made of
    (concatenated; a key with a head slice takes that slice of the heads). Forward inputs are
    cut from (q,) or (k, v); backward inputs also from (dout, lse, delta) for kind ``do``.
    ``saved`` are forward buffers that the backward reads (kept instead of re-communicated).
    ``output`` is the final (out, lse) buffer; ``grad_q`` and ``grad_kv`` the final gradient
    buffers (all of the rank's own chunk and every head).
    """

    rank: int
    seq_local: int
    forward: tuple[Op, ...]
    backward: tuple[Op, ...]
    forward_inputs: dict[Key, Sel]
    backward_inputs: dict[Key, Sel]
    output: Key
    grad_q: Key
    grad_kv: Key
    saved: tuple[Key, ...] = ()

    def ops(self, direction: str) -> tuple[Op, ...]:
        if direction not in ("forward", "backward"):
            raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
        return self.forward if direction == "forward" else self.backward

    def rounds(self, direction: str) -> Iterator[Post]:
        return (op for op in self.ops(direction) if type(op) is Post)

    def blocks(self, direction: str = "forward") -> Iterator[Attend | AttendBackward]:
        return (op for op in self.ops(direction) if type(op) in (Attend, AttendBackward))

    def to_text(self) -> str:
        lines = [f"rank {self.rank}: output {self.output} grad_q {self.grad_q} grad_kv {self.grad_kv}"]
        for name, table in (("forward_input", self.forward_inputs), ("backward_input", self.backward_inputs)):
            lines += [f"  {name} {k}{sel_text(v)}" for k, v in table.items()]
        lines += [f"  saved {k}" for k in self.saved]
        for direction in ("forward", "backward"):
            lines.append(f"  {direction}:")
            lines += [f"    {op}" for op in self.ops(direction)]
        return "\n".join(lines)

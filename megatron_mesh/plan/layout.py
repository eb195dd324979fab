"""Megatron's context-parallel sequence layout ("zigzag"), and the causal rule it implies.

Megatron-Core (``get_batch_on_this_cp_rank``) cuts every sequence of S tokens into 2P equal
*halves* and gives CP rank r the halves r and 2P-1-r, concatenated: rank r's *chunk*. RoPE
positions are sliced the same way. The attention plugins must therefore accept this layout as is.

Worked example (P = 4, S = 16, halves of 2 tokens)::

    halves:    h0   h1   h2   h3   h4   h5   h6   h7
    tokens:   0,1  2,3  4,5  6,7  8,9 10,11 12,13 14,15
    rank 0 holds h0 + h7 = tokens [0, 1, 14, 15]
    rank 1 holds h1 + h6 = tokens [2, 3, 12, 13]
    rank 2 holds h2 + h5 = tokens [4, 5, 10, 11]
    rank 3 holds h3 + h4 = tokens [6, 7,  8,  9]

Why it balances causal work: for query chunk i and key/value chunk j,

* i == j: an ordinary causal block (the two halves are in increasing position order);
* j <  i: every query token sees the *front* half of chunk j (h_j < h_i) and none of its back
  half (h_{2P-1-j} > h_{2P-1-i}) -> "all queries x front KV half", exactly half a block;
* j >  i: only the *back* query half sees anything, and it sees all of chunk j -> "back query
  half x all KV", again exactly half a block.

So every block costs half a full block and every rank does the same work whatever blocks it is
given. :func:`block_mask` is that rule; every plan builder uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .ir import Segment

__all__ = ["ZigzagLayout", "BlockMask", "block_mask", "split_evenly", "slot_segments"]


class BlockMask(NamedTuple):
    """Which query rows and key/value columns of a (chunk i, chunk j) block are computed.

    ``q_half``/``kv_half`` are "all", "front" or "back"; ``causal`` means the diagonal block.
    """

    q_half: str
    kv_half: str
    causal: bool


FULL = BlockMask("all", "all", False)
DIAGONAL = BlockMask("all", "all", True)
BELOW = BlockMask("all", "front", False)  # j < i: all queries x front half of KV chunk j
ABOVE = BlockMask("back", "all", False)  # j > i: back half of the queries x all of KV chunk j


def block_mask(q_chunk: int, kv_chunk: int, causal: bool) -> BlockMask:
    """The part of block (q_chunk, kv_chunk) that has unmasked entries, in the zigzag layout."""
    if not causal:
        return FULL
    if q_chunk == kv_chunk:
        return DIAGONAL
    return BELOW if kv_chunk < q_chunk else ABOVE


@dataclass(frozen=True)
class ZigzagLayout:
    """Megatron's zigzag CP layout of a sequence of ``seq_len`` tokens over ``world_size`` ranks.

    The one owner of this permutation: :meth:`positions` gives rank r's tokens, and the torch
    helpers ``megatron_mesh.zigzag_shard`` / ``zigzag_unshard`` apply it to tensors.
    """

    world_size: int
    seq_len: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.seq_len % (2 * self.world_size):
            raise ValueError(
                f"sequence length {self.seq_len} must be divisible by 2 * CP size = "
                f"{2 * self.world_size} (Megatron's zigzag layout cuts it into 2P equal halves)"
            )

    @property
    def half_len(self) -> int:
        return self.seq_len // (2 * self.world_size)

    @property
    def seq_local(self) -> int:
        return 2 * self.half_len

    def halves(self, rank: int) -> tuple[int, int]:
        """Indices of the two halves rank ``rank`` holds: (rank, 2P - 1 - rank)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for CP size {self.world_size}")
        return rank, 2 * self.world_size - 1 - rank

    def positions(self, rank: int) -> list[int]:
        """Global token positions held by ``rank``, in local order."""
        h = self.half_len
        return [p for half in self.halves(rank) for p in range(half * h, (half + 1) * h)]

    def inverse(self) -> list[tuple[int, int]]:
        """For each global position, (rank, local index): the unshard permutation."""
        out: list[tuple[int, int]] = [(-1, -1)] * self.seq_len
        for r in range(self.world_size):
            for i, p in enumerate(self.positions(r)):
                out[p] = (r, i)
        return out


def split_evenly(n: int, parts: int) -> list[int]:
    """Boundaries that cut ``n`` items into ``parts`` contiguous pieces whose sizes differ by at
    most one (the larger ones last), e.g. split_evenly(10, 4) == [0, 2, 4, 7, 10]."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    return [i * n // parts for i in range(parts + 1)]


def slot_segments(seq_local: int, num_slots: int) -> list[tuple[Segment, Segment]]:
    """TASP slots of a zigzag chunk: slot s is sub-chunk s of the front half followed by
    sub-chunk s of the back half, so each slot keeps the two-halves shape the causal rule needs.

    Example: seq_local = 12 (halves of 6), 3 slots -> [(0,2)+(6,8)], [(2,4)+(8,10)], [(4,6)+(10,12)].
    """
    if seq_local % 2:
        raise ValueError(f"local sequence length {seq_local} must be even (two zigzag halves)")
    half = seq_local // 2
    if half < num_slots:
        raise ValueError(
            f"local sequence length {seq_local} is too short for {num_slots} slots: each half "
            f"({half} tokens) must hold at least one token per slot, i.e. seq_local >= {2 * num_slots}"
        )
    b = split_evenly(half, num_slots)
    return [(Segment(b[s], b[s + 1]), Segment(half + b[s], half + b[s + 1])) for s in range(num_slots)]

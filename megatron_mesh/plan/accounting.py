"""Problem shape, buffer byte sizes, measured-from-plan byte accounting and closed-form formulas.

Units: bytes per rank per attention call (one layer), batch and heads included. The executor
sends exactly the tensors listed in :mod:`.ir` for each buffer kind, so the plan's bytes are the
bytes ``comm_counter()`` measures.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .ir import KINDS, Key, Plan, Post
from .mask import BlockKind, classify_block
from .sel import sel_len
from .shape import AttentionShape

__all__ = [
    "AttentionShape",
    "buffer_bytes",
    "key_bytes",
    "RankBytes",
    "plan_bytes",
    "link_bytes",
    "round_link_bytes",
    "mesh_bytes_formula",
    "tasp_bytes_formula",
    "block_pairs",
    "block_area",
    "owner_work",
    "rank_work",
]

FP32 = 4


def buffer_bytes(kind: str, tokens: int, shape: AttentionShape, heads: int | None = None,
                 kv_heads: int | None = None) -> int:
    """Bytes of one buffer of ``kind`` holding ``tokens`` tokens (the kind table :data:`.ir.KINDS`);
    ``heads`` / ``kv_heads`` override the shape's (a head slice of a Ulysses all-to-all)."""
    spec = KINDS.get(kind)
    if spec is None:
        raise ValueError(f"unknown buffer kind {kind!r}; known: {', '.join(KINDS)}")
    h = shape.heads if heads is None else heads
    g = shape.kv_heads if kv_heads is None else kv_heads
    acc = max(FP32, shape.itemsize)  # accumulators are fp32 (fp64 for fp64 inputs)
    total = 0
    for side, dim, dtype in spec.tensors:  # each tensor at its own last dim (K and V may differ: MLA)
        n = shape.batch * (h if side == "q" else g) * tokens * shape.dim(dim)
        total += n * (shape.itemsize if dtype == "input" else acc)
    return total


def key_bytes(plan: Plan, key: Key, shape: AttentionShape) -> int:
    """Bytes of buffer ``key`` of ``plan`` (its tokens, its head slice)."""
    h, g = plan.head_counts(key, shape.heads, shape.kv_heads)
    return buffer_bytes(key.kind, plan.tokens(key), shape, h, g)


@dataclass(frozen=True)
class RankBytes:
    """Bytes one rank sends and receives, per direction (forward / backward)."""

    forward_sent: int
    forward_received: int
    backward_sent: int
    backward_received: int

    @property
    def sent(self) -> int:
        return self.forward_sent + self.backward_sent

    @property
    def received(self) -> int:
        return self.forward_received + self.backward_received


def _posts(plan: Plan, rank: int, direction: str):
    return (op for op in plan.round_ops(rank, direction) if isinstance(op, Post))


class _SizeCache:
    """Bytes of a buffer by (kind, slot, span, heads, chunk when slots differ per chunk)."""

    def __init__(self, plan: Plan, shape: AttentionShape):
        self.plan, self.shape, self.sizes = plan, shape, {}
        self.per_chunk = plan.slots_vary

    def __call__(self, key: Key) -> int:
        ck = (key.kind, key.slot, key.span, key.heads, key.chunk if self.per_chunk and key.slot >= 0 else 0)
        n = self.sizes.get(ck)
        if n is None:
            n = self.sizes[ck] = key_bytes(self.plan, key, self.shape)
        return n


def plan_bytes(plan: Plan, shape: AttentionShape) -> list[RankBytes]:
    """Bytes each rank sends/receives when executing ``plan`` (forward and backward)."""
    size = _SizeCache(plan, shape)
    out = []
    for r in range(plan.world_size):
        vals = []
        for direction in ("forward", "backward"):
            sent = recv = 0
            for post in _posts(plan, r, direction):
                sent += sum(size(t.key) for t in post.sends)
                recv += sum(size(t.key) for t in post.recvs)
            vals += [sent, recv]
        out.append(RankBytes(*vals))
    return out


def link_bytes(plan: Plan, shape: AttentionShape, direction: str = "forward") -> dict[tuple[int, int], int]:
    """Bytes carried by each directed link (src, dst) over the whole call in ``direction``."""
    size = _SizeCache(plan, shape)
    links: dict[tuple[int, int], int] = defaultdict(int)
    for r in range(plan.world_size):
        for post in _posts(plan, r, direction):
            for t in post.sends:
                links[(r, t.peer)] += size(t.key)
    return dict(links)


def round_link_bytes(plan: Plan, shape: AttentionShape, direction: str = "forward") -> dict[int, dict[tuple[int, int], int]]:
    """Per round: bytes on each directed link. The per-step link load that TASP spreads out."""
    size = _SizeCache(plan, shape)
    per_round: dict[int, dict[tuple[int, int], int]] = defaultdict(lambda: defaultdict(int))
    for r in range(plan.world_size):
        for post in _posts(plan, r, direction):
            for t in post.sends:
                per_round[post.round][(r, t.peer)] += size(t.key)
    return {r: dict(v) for r, v in per_round.items()}


def mesh_bytes_formula(world_size: int, tile: tuple[int, int], shape: AttentionShape,
                       backward_chunks: str = "refetch") -> RankBytes:
    """Closed-form bytes per rank of Mesh-Attention with tile (a, b); ring attention is (1, P).

    Forward:  (a-1)(Q + O) + (b-1) KV            (pull Q and KV chunks, return partial outputs)
    Backward, refetch: (a-1)(Q + dO + dQ) + (b-1)(KV + dKV)
    Backward, keep:    (a-1)(dO + dQ) + (b-1) dKV   (Q and KV chunks kept from the forward)

    with Q, KV, O, dO, dQ, dKV the byte sizes of one whole-chunk buffer of that kind. Every rank
    sends exactly what it receives, so sent == received.
    """
    a, b = tile
    if a * b != world_size:
        raise ValueError(f"tile {a}x{b} does not multiply to CP size {world_size}")
    size = {k: buffer_bytes(k, shape.seq_local, shape) for k in ("q", "kv", "o", "do", "dq", "dkv")}
    fwd = (a - 1) * (size["q"] + size["o"]) + (b - 1) * size["kv"]
    if backward_chunks == "refetch":
        bwd = (a - 1) * (size["q"] + size["do"] + size["dq"]) + (b - 1) * (size["kv"] + size["dkv"])
    elif backward_chunks == "keep":
        bwd = (a - 1) * (size["do"] + size["dq"]) + (b - 1) * size["dkv"]
    else:
        raise ValueError(f"backward_chunks must be 'refetch' or 'keep', got {backward_chunks!r}")
    return RankBytes(fwd, fwd, bwd, bwd)


def tasp_bytes_formula(world_size: int, shape: AttentionShape) -> RankBytes:
    """Closed-form bytes per rank of TASP: the same as ring attention, (P-1) KV chunks forward and
    (P-1)(KV + dKV) backward -- TASP spreads them over more links, it does not reduce them."""
    size_kv = buffer_bytes("kv", shape.seq_local, shape)
    size_dkv = buffer_bytes("dkv", shape.seq_local, shape)
    fwd = (world_size - 1) * size_kv
    bwd = (world_size - 1) * (size_kv + size_dkv)
    return RankBytes(fwd, fwd, bwd, bwd)


def block_pairs(plan: Plan, op) -> int:
    """Allowed (query, key) token pairs a block computes: the work measure of one Attend /
    AttendBackward (a causal block of n tokens has n(n+1)/2, a masked block what its mask allows)."""
    if op.mask == BlockKind.FULL:
        return block_area(plan, op)
    if op.mask == BlockKind.CAUSAL:
        n = sel_len(op.rows, plan.tokens(op.q))
        return n * (n + 1) // 2
    c = classify_block(plan.mask, plan.positions(op.q, op.rows),
                       tuple(plan.positions(k, op.col(i)) for i, k in enumerate(op.kv)))
    return 0 if c is None else c.pairs


def block_area(plan: Plan, op) -> int:
    """(query, key) pairs the kernel call computes: rows x columns, or n(n+1)/2 for a causal
    block (a masked block is computed densely and masked: rows x columns)."""
    rows = sel_len(op.rows, plan.tokens(op.q))
    if op.mask == BlockKind.CAUSAL:
        return rows * (rows + 1) // 2
    return rows * sum(sel_len(op.col(i), plan.tokens(k)) for i, k in enumerate(op.kv))


def owner_work(mask, layout, span: int = 1) -> list[int]:
    """Allowed (query, key) pairs of each chunk's rows (span-``span`` chunks: a Ulysses group's)
    against the whole sequence, from the mask and the layout alone: :func:`rank_work` of a plan
    in which each row's pairs are computed where the row lives (ring attention, Transformer
    Engine's p2p on THD; a hybrid's ranks count their group's pairs once per head slice, as
    ``rank_work`` does), without building any rank's blocks. E.g. two documents [0, 4) and [4, 8)
    on a zigzag over 2 ranks (rank 0: tokens 0, 1, 6, 7): causal 1 + 2 + 3 + 4 = 10 pairs."""
    S = layout.seq_len
    chunks = layout.world_size // span
    out = []
    classify = classify_block.__wrapped__  # one call per chunk: nothing to reuse, keep its cache for the plans
    for c in range(chunks):
        got = classify(mask, tuple((s, n) for _, s, n in layout.runs(c, span)), (((0, S),),))
        out.append(0 if got is None else got.pairs)
    return [w for w in out for _ in range(span)]


def rank_work(plan: Plan, direction: str = "forward") -> list[int]:
    """Allowed token pairs each rank computes in ``direction`` (summed over head slices, so a
    Ulysses plan counts each slice once). With Megatron's zigzag layout and no mask beyond
    causal, every rank gets the same work for every Mesh tile."""
    return [sum(block_pairs(plan, op) for op in plan.rank(r).blocks(direction)) for r in range(plan.world_size)]

"""Mesh-Attention plans: the a x b tile map and its per-rank op lists. Ring attention is tile (1, P).

Tile map
--------
With P = a * b ranks, rank g sits at (r, c) = (g // a, g % a) of a b x a grid. It computes the
a x b blocks (Q chunk i, KV chunk j) with

* i in its **Q group**  {r*a + c' : c' < a}  -- the a ranks of its grid row (a ring of size a);
* j in its **KV group** {r'*a + c : r' < b}  -- the b ranks of its grid column (a ring of size b).

Every block is computed exactly once (i = r*a + c' and j = r'*a + c identify (r, c)), and the only
block whose chunks are both local is the rank's own diagonal block (g, g). A rank pulls the other
a-1 Q chunks around its Q ring and the other b-1 KV chunks around its KV ring; partial outputs of
the remote Q chunks travel back around the Q ring, and in the backward dQ (Q ring) and dK/dV (KV
ring) do the same. Per-rank traffic is ~ (a-1) Q + (b-1) KV chunks instead of ring attention's
(P-1) KV chunks, i.e. ~S/sqrt(P) instead of ~S at the best tile.

Worked example (P = 4, tile 2x2; entry = the rank computing block (Q chunk, KV chunk))::

              KV0 KV1 KV2 KV3          Q groups (rings):  {0, 1}  {2, 3}
        Q0     0   1   0   1           KV groups (rings): {0, 2}  {1, 3}
        Q1     0   1   0   1
        Q2     2   3   2   3           rank 1 computes Q{0,1} x KV{1,3}: it pulls Q0 from rank 0
        Q3     2   3   2   3           and KV3 from rank 3, and returns its partial output of Q0.

Ring attention (tile 1xP) gives every rank its whole row; tile Px1 gives every rank a column.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, replace
from functools import lru_cache

from .accounting import buffer_bytes, mesh_bytes_formula
from .blocks import block_ops
from .ir import AddGrad, Key, MergeOut, Op, Plan, Post, RankPlan, Transfer, Wait
from .ir.facts import BackwardChunks, Contiguous, Facts, choice, parse_tile_text, register_facts, tile_text
from .layout import Layout, ZigzagLayout
from .mask import BlockKind, Mask, classify_block
from .passes import insert_frees
from .schedule import SCHEDULES, Schedule, build_template, pull_rounds
from .sel import Segment
from .shape import AttentionShape

__all__ = ["TileMap", "tile_shapes", "parse_tile", "best_tile", "build_mesh_plan", "build_ring_plan",
           "build_rotation_plan", "BACKWARD_CHUNKS", "CONTIGUOUS", "dense_backward_chunks", "MeshFacts"]

# "refetch": the backward pulls Q and KV chunks again (memory of ring attention; more bytes).
# "keep":    the forward keeps the pulled chunks for the backward (fewer bytes; a-1 Q and b-1 KV
#            chunks more memory per layer until its backward runs).
# "auto":    a mask-aware plan keeps what a rank pulled as far as it fits in its own Q, K and V
#            x the modes' ``backward_keep_limit`` (default 2; :func:`.sparse_needs.kept_chunks`); a dense plan refetches (its chunks rotate
#            behind every step's compute, and keeping them all would hold a-1 Q and b-1 KV chunks).
BACKWARD_CHUNKS = typing.get_args(BackwardChunks)


def dense_backward_chunks(backward_chunks: str) -> str:
    """What a dense plan does for ``backward_chunks``: "auto" refetches (see :data:`BACKWARD_CHUNKS`)."""
    if backward_chunks not in BACKWARD_CHUNKS:
        raise ValueError(f"backward_chunks must be one of {', '.join(BACKWARD_CHUNKS)}, got {backward_chunks!r}")
    return "refetch" if backward_chunks == "auto" else backward_chunks
# Which Mesh group holds consecutive CP ranks (see TileMap).
CONTIGUOUS = typing.get_args(Contiguous)


@register_facts
@dataclass(frozen=True)
class MeshFacts(Facts):
    """A dense Mesh plan's facts (ring attention's too: tile (1, P)): its ``tile`` (a, b) computes
    every block where the tile map says, ``contiguous`` names the ring of consecutive ranks, and
    ``schedule`` the order a rank pulls its chunks in (:mod:`.schedule`)."""

    schedules = SCHEDULES
    assignment = "tile"
    tile: tuple[int, int] = field()  # field(): required (without it Facts's None would be its default)
    contiguous: Contiguous = field()
    schedule: Schedule = "greedy"

    @property
    def tile_placed(self) -> tuple[int, int]:
        return self.tile

    def header(self) -> dict[str, str]:
        return {"tile": tile_text(self.tile), "schedule": self.schedule, "contiguous": self.contiguous,
                "assignment": self.assignment}

    @classmethod
    def from_header(cls, head: dict[str, str], inner) -> "MeshFacts":
        if head["tile"] == "-":
            raise ValueError(f"a Mesh plan (schedule {head['schedule']}) names its tile, e.g. tile=2x2")
        contiguous, schedule = head["contiguous"], head["schedule"]  # "-": a hand-written header left them out
        return cls(parse_tile_text(head["tile"]),
                   choice("contiguous", "q" if contiguous == "-" else contiguous, Contiguous),
                   choice("schedule", "greedy" if schedule == "-" else schedule, Schedule))


@dataclass(frozen=True)
class TileMap:
    """Which blocks each rank computes for tile (a, b) (see the module docstring).

    ``contiguous`` says which group is made of consecutive CP ranks -- and therefore shares a node
    when the CP group spans nodes: "q" (default; rank g = r*a + c as in the module docstring) or
    "kv" (rank g = c*b + r: the KV rings are the consecutive ranks). The planner puts the ring
    with more bytes per hop on the faster links.
    """

    a: int
    b: int
    contiguous: str = "q"

    def __post_init__(self) -> None:
        if self.a < 1 or self.b < 1:
            raise ValueError(f"tile sides must be >= 1, got {self.a}x{self.b}")
        if self.contiguous not in CONTIGUOUS:
            raise ValueError(f"contiguous must be one of {CONTIGUOUS}, got {self.contiguous!r}")

    @property
    def world_size(self) -> int:
        return self.a * self.b

    def coords(self, rank: int) -> tuple[int, int]:
        """(r, c): the rank's KV-ring position r < b and Q-ring position c < a."""
        if self.contiguous == "q":
            return rank // self.a, rank % self.a
        return rank % self.b, rank // self.b

    def rank_at(self, r: int, c: int) -> int:
        return r * self.a + c if self.contiguous == "q" else c * self.b + r

    def q_group(self, rank: int) -> tuple[int, ...]:
        """The Q ring of ``rank``: the ranks sharing its Q chunks, in ring order."""
        r, _ = self.coords(rank)
        return tuple(self.rank_at(r, c) for c in range(self.a))

    def kv_group(self, rank: int) -> tuple[int, ...]:
        """The KV ring of ``rank``: the ranks sharing its KV chunks, in ring order."""
        _, c = self.coords(rank)
        return tuple(self.rank_at(r, c) for r in range(self.b))

    def blocks(self, rank: int) -> list[tuple[int, int]]:
        """(Q chunk, KV chunk) of every block ``rank`` computes."""
        return [(i, j) for i in self.q_group(rank) for j in self.kv_group(rank)]

    def owner(self, q_chunk: int, kv_chunk: int) -> int:
        """The rank that computes block (q_chunk, kv_chunk): Q ring of q_chunk x KV ring of kv_chunk
        (``rank_at(coords(q_chunk)[0], coords(kv_chunk)[1])``, inlined: an owner map's needs ask
        it for each of thousands of blocks)."""
        if self.contiguous == "q":
            return q_chunk // self.a * self.a + kv_chunk % self.a
        return kv_chunk // self.b * self.b + q_chunk % self.b

    # a tile map is its owner map (a mask-aware plan's Assignment.owners take it as one, and knowing it
    # is a tile map, :mod:`.sparse_compete` walks a rank's blocks without asking every block)
    __call__ = owner

    def owner_parts(self, P: int) -> tuple[list[int], list[int]]:
        """(qs, ks): :meth:`owner` of block (i, j) is qs[i] + ks[j] for chunks < P -- a block's owner
        by two list lookups, where thousands of blocks are asked at once (:mod:`.sparse_compete`)."""
        if self.contiguous == "q":
            return [i // self.a * self.a for i in range(P)], [j % self.a for j in range(P)]
        return [i % self.b for i in range(P)], [j // self.b * self.b for j in range(P)]

    def rings(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        """The b Q rings and the a KV rings (CP ranks in ring order): what the plan moves data on
        and the process sub-groups a transport routes through."""
        return {"q": tuple(self.q_group(self.rank_at(r, 0)) for r in range(self.b)),
                "kv": tuple(self.kv_group(self.rank_at(0, c)) for c in range(self.a))}


def tile_shapes(world_size: int) -> list[tuple[int, int]]:
    """Every tile (a, b) with a * b == world_size, by increasing a (a=1 is ring attention)."""
    return [(a, world_size // a) for a in range(1, world_size + 1) if world_size % a == 0]


def parse_tile(tile, world_size: int) -> tuple[int, int] | str:
    """Normalise a tile given as (a, b), [a, b], "AxB" or "auto"; checks a * b == world_size."""
    if isinstance(tile, str):
        if tile == "auto":
            return "auto"
        parts = tile.lower().split("x")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"tile shape {tile!r} must be 'AxB' (e.g. '4x2') or 'auto'")
        tile = (int(parts[0]), int(parts[1]))
    try:
        a, b = tile
    except (TypeError, ValueError):
        raise ValueError(f"tile must be (a, b), 'AxB' or 'auto', got {tile!r}") from None
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (a, b)):
        raise ValueError(f"tile sides must be integers, got {tile!r}")
    if a < 1 or b < 1 or a * b != world_size:
        raise ValueError(
            f"tile {a}x{b} does not fit CP size {world_size}: a * b must equal the CP size; "
            f"allowed tiles: {', '.join(f'{x}x{y}' for x, y in tile_shapes(world_size))}"
        )
    return a, b


def best_tile(world_size: int, shape: AttentionShape, backward_chunks: str = "refetch") -> tuple[int, int]:
    """The tile with the fewest bytes per rank (forward + backward, closed form); ties -> the
    flatter tile (smaller a, closer to ring attention, fewer accumulator returns)."""
    backward_chunks = dense_backward_chunks(backward_chunks)
    return min(tile_shapes(world_size),
               key=lambda t: (mesh_bytes_formula(world_size, t, shape, backward_chunks).sent, t[0]))


def build_ring_plan(world_size: int, shape: AttentionShape, causal: bool = True,
                    backward_chunks: str = "refetch") -> Plan:
    """Ring attention (zigzag, Megatron's layout): the Mesh plan of tile (1, P)."""
    plan = build_mesh_plan(world_size, (1, world_size), shape, causal=causal, backward_chunks=backward_chunks)
    return replace(plan, mode="ring", _cache={})


def build_mesh_plan(world_size: int, tile, shape: AttentionShape, causal: bool = True,
                    schedule: str = "greedy", backward_chunks: str = "refetch", contiguous: str = "q") -> Plan:
    """The dense Mesh-Attention plan of every rank (causal or full attention on Megatron's zigzag;
    see the module docstring and .schedule). Masks and other layouts: ``resolve("mesh", ...).build``.

    ``tile``: (a, b) with a * b == world_size, or "AxB" (``"auto"`` is the planner's choice:
    ``megatron_mesh.plan.resolve("mesh", ..., tile="auto")``).
    ``contiguous``: which group is made of consecutive ranks ("q" or "kv", see :class:`TileMap`).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    backward_chunks = dense_backward_chunks(backward_chunks)
    tile = parse_tile(tile, world_size)
    if tile == "auto":
        raise ValueError("build_mesh_plan takes a concrete tile; tile 'auto' is chosen by "
                         "megatron_mesh.plan.resolve('mesh', ..., tile='auto') (fastest predicted)")
    if contiguous not in CONTIGUOUS:
        raise ValueError(f"contiguous must be one of {CONTIGUOUS}, got {contiguous!r}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    if shape.seq_local % 2:
        raise ValueError(f"local sequence length {shape.seq_local} must be even (two zigzag halves)")
    return _build_mesh_plan(world_size, tile, shape, Mask(causal), schedule, backward_chunks, contiguous)


# a plan keeps its rank plans once built (a P = 256 plan with every rank built holds ~100 MB): the
# planner evaluates dozens, so only the recent ones stay cached
@lru_cache(maxsize=32)
def _build_mesh_plan(world_size: int, tile: tuple[int, int], shape: AttentionShape, mask: Mask,
                     schedule: str, backward_chunks: str, contiguous: str, layout: Layout | None = None) -> Plan:
    a, b = tile
    tiles = TileMap(a, b, contiguous)
    T = shape.seq_local
    layout = ZigzagLayout(world_size, world_size * T) if layout is None else layout

    def cost(*kinds: str) -> int:
        return sum(buffer_bytes(k, T, shape) for k in kinds)

    keep = backward_chunks == "keep"
    fwd, bwd = _templates(a, b, schedule, keep, cost("q"), cost("kv"), cost("q", "do"), cost("do"))
    lowering = _MeshLowering(world_size, tiles, T, mask, layout, fwd, bwd, keep)
    return Plan(mode="mesh", world_size=world_size, seq_local=T, mask=mask, layout=layout,
                build_rank=lowering.rank_plan, build_rounds=lowering.round_ops,
                facts=MeshFacts(tile, contiguous, schedule), backward_chunks=backward_chunks, rings=tiles.rings())


def build_rotation_plan(world_size: int, shape: AttentionShape, mask: Mask, layout: Layout,
                        mode: str = "rotation") -> Plan:
    """Ring attention's schedule on any mask and layout: every chunk visits every rank around the
    ring, and each block computes what the mask allows of it -- Transformer Engine's ``p2p`` on its
    THD layout (whole KV chunks every step, per-document blocks, each block one variable-length
    kernel call over its documents: ``kernel_calls="block"``). The planner prices TE with it;
    the plugin's modes send only what a mask-aware plan needs instead (:mod:`.sparse`).
    ``mask`` / ``layout``: normalised (:func:`~.problem.normalize`)."""
    return replace(_build_mesh_plan(world_size, (1, world_size), shape, mask, "greedy", "refetch", "q", layout),
                   mode=mode, kernel_calls="block", _cache={})


@lru_cache(maxsize=256)
def _templates(a: int, b: int, schedule: str, keep: bool, q_cost: int, kv_cost: int, q_do_cost: int,
               do_cost: int) -> tuple[list, list]:
    """Forward and backward offset-space templates (shared by both placements of a tile)."""
    fwd = build_template(a, b, pull_rounds(a, b, schedule, q_cost, kv_cost), ("q",))
    if keep:  # Q and KV chunks are all held already; only dout/lse/delta of remote rows move
        bwd = build_template(a, b, pull_rounds(a, b, schedule, do_cost, 1, q_have=1, kv_have=b),
                             ("q", "kv"), q_have=1, kv_have=b)
    else:
        bwd = build_template(a, b, pull_rounds(a, b, schedule, q_do_cost, kv_cost), ("q", "kv"))
    return fwd, bwd


class _MeshLowering:
    """Turns the shared offset-space templates into each rank's ops (chunk ids, peers, masks)."""

    def __init__(self, world_size: int, tiles: TileMap, T: int, mask: Mask, layout, fwd: list, bwd: list,
                 keep: bool):
        self.tiles, self.T, self.mask, self.layout, self.keep = tiles, T, mask, layout, keep
        self.templates = {"forward": fwd, "backward": bwd}
        # what the matching and deadlock checks read: O(a + b) entries instead of O(a * b)
        self.round_templates = {d: [op for op in t if op[0] in ("post", "wait")] for d, t in self.templates.items()}
        self.pull_kinds = {"forward": {"q": ("q",), "kv": ("kv",)},
                           "backward": {"q": ("do",), "kv": ()} if keep else {"q": ("q", "do"), "kv": ("kv",)}}
        self.acc_kind = {"forward": {"q": "o"}, "backward": {"q": "dq", "kv": "dkv"}}
        # interned keys: a P=256 plan has 65,536 blocks per direction
        self.key = {kind: [Key(kind, c) for c in range(world_size)] for kind in ("q", "kv", "o", "do", "dq", "dkv")}
        self.incoming = {kind: [Key(kind, c, incoming=True) for c in range(world_size)] for kind in ("o", "dq", "dkv")}
        self.blocks: dict = {}

    def block(self, i: int, j: int):
        """(kernel mask, rows, cols) of block (Q chunk i, KV chunk j) under the mask; None when
        it allows nothing. None rows / cols: the whole chunk."""
        c = self.blocks.get((i, j), 0)
        if c == 0:
            runs = lambda g: tuple((start, n) for _, start, n in self.layout.runs(g))  # noqa: E731
            c = classify_block(self.mask, runs(i), (runs(j),))
            if c is not None:
                whole = (Segment(0, self.T),)
                c = (c.kind, None if c.rows == whole else c.rows, None if c.cols[0] == whole else c.cols[0])
            elif not self.mask.is_dense:
                # a rotation over a mask (TE's p2p on THD): the block's accumulators still travel the
                # ring, so the call runs and computes nothing (every row masked: out 0, lse -inf)
                c = (BlockKind.MASKED, None, None)
            self.blocks[(i, j)] = c
        return c

    def rank_plan(self, g: int) -> RankPlan:
        key = self.key
        whole = (Segment(0, self.T),)
        output, grad_q, grad_kv = key["o"][g], key["dq"][g], key["dkv"][g]
        saved: tuple[Key, ...] = ()
        if self.keep:
            saved = tuple(key["q"][c] for c in self.tiles.q_group(g) if c != g) + \
                    tuple(key["kv"][c] for c in self.tiles.kv_group(g) if c != g)
        forward = insert_frees(self.lower(g, "forward"), keep={output, key["q"][g], key["kv"][g], *saved})
        backward = insert_frees(self.lower(g, "backward"), keep={grad_q, grad_kv})
        return RankPlan(
            rank=g, seq_local=self.T, forward=forward, backward=backward,
            forward_inputs={key["q"][g]: whole, key["kv"][g]: whole},
            backward_inputs={key["q"][g]: whole, key["kv"][g]: whole, key["do"][g]: whole},
            output=output, grad_q=grad_q, grad_kv=grad_kv, saved=saved,
        )

    def round_ops(self, g: int, direction: str) -> tuple[Op, ...]:
        return tuple(self.lower(g, direction, blocks=False))

    def lower(self, g: int, direction: str, blocks: bool = True) -> list[Op]:
        rings = _Rings(g, self.tiles)
        backward = direction == "backward"
        pull_kinds, acc_kind, key = self.pull_kinds[direction], self.acc_kind[direction], self.key
        ops: list[Op] = []
        pending: list[tuple[int, int]] = []

        def flush() -> None:
            # consecutive blocks of the same Q chunk share one call where their masks allow
            run: list = []
            for u, v in pending:
                i, j = rings.chunk("q", u), rings.chunk("kv", v)
                c = self.block(i, j)
                if c is None:
                    continue
                if run and run[0][0] != i:
                    ops.extend(block_ops(key["q"][run[0][0]], [(key["kv"][jj], *cc) for _, jj, cc in run], backward))
                    run = []
                run.append((i, j, c))
            if run:
                ops.extend(block_ops(key["q"][run[0][0]], [(key["kv"][jj], *cc) for _, jj, cc in run], backward))
            pending.clear()

        for top in (self.templates if blocks else self.round_templates)[direction]:
            if top[0] == "block":
                if blocks:
                    pending.append((top[1], top[2]))
                continue
            flush()
            if top[0] == "post":
                sends, recvs = [], []
                for what, ring, k in top[2]:
                    chunks, nxt, prv = rings.by_offset[ring], rings.next[ring], rings.prev[ring]
                    if what == "pull":  # forward the chunk at offset k-1, receive the one at offset k
                        for kind in pull_kinds[ring]:
                            sends.append(Transfer(nxt, key[kind][chunks[k - 1]]))
                            recvs.append(Transfer(prv, key[kind][chunks[k]]))
                    else:  # my accumulator of offset k leaves; the one for offset k+1 arrives
                        kind = acc_kind[ring]
                        sends.append(Transfer(nxt, key[kind][chunks[k]]))
                        recvs.append(Transfer(prv, self.incoming[kind][chunks[(k + 1) % len(chunks)]]))
                ops.append(Post(top[1], tuple(sends), tuple(recvs)))
            elif top[0] == "wait":
                ops.append(Wait(top[1]))
            elif top[0] == "merge" and blocks:
                _, ring, k = top
                kind = acc_kind[ring]
                chunk = rings.chunk(ring, k)
                src, dst = self.incoming[kind][chunk], key[kind][chunk]
                ops.append(AddGrad(src, dst) if backward else MergeOut(src, dst))
        flush()
        return ops


class _Rings:
    """One rank's view of its two rings: offset -> chunk, and its ring neighbours (precomputed:
    lowering a P=256 plan looks these up ~10^5 times)."""

    def __init__(self, rank: int, tiles: TileMap):
        self.members = {"q": tiles.q_group(rank), "kv": tiles.kv_group(rank)}
        self.size, self.by_offset, self.next, self.prev = {}, {}, {}, {}
        for ring, m in self.members.items():
            n, pos = len(m), m.index(rank)
            self.size[ring] = n
            self.by_offset[ring] = [m[(pos - o) % n] for o in range(n)]
            self.next[ring] = m[(pos + 1) % n]
            self.prev[ring] = m[(pos - 1) % n]

    def chunk(self, ring: str, offset: int) -> int:
        return self.by_offset[ring][offset % self.size[ring]]

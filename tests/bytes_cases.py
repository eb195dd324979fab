"""The cases of test_plan_bytes_vs_measured.py: every plan-based CP mode of the registry, with
its settings, dense and masked -- and the part of the one gloo spawn that measures them.

A case is run through the public API (``megatron_mesh.attention(mode=..., **settings)``) and its
plan is rebuilt on the pytest side from the same placement (``resolve(mode, P, shape,
**settings).build(shape, mask, layout)``), so the bytes the simulator reads from the plan are
compared with the bytes the runtime moved. Documents run on Megatron's zigzag and on the balanced
layout (``layout="balanced"``: :func:`megatron_mesh.plan.balanced_layout` of the same documents,
per Ulysses group for the hybrids), where ranks' rounds differ most.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from megatron_mesh.plan import AttentionShape, Mask, Plan, balanced_layout, normalize, resolve, tile_shapes

SEQ_LOCAL, BATCH, HEADS, KV_HEADS, HEAD_DIM = 16, 1, 4, 2, 8
SHAPE = AttentionShape(SEQ_LOCAL, BATCH, HEADS, KV_HEADS, HEAD_DIM, itemsize=2)  # bf16


@dataclass(frozen=True)
class Case:
    """One plan-based mode with its settings and mask arguments."""

    name: str
    mode: str
    settings: dict = field(default_factory=dict, hash=False)
    causal: bool = True
    window: tuple | None = None
    cu_seqlens: tuple | None = None
    layout: str = "zigzag"  # or "balanced": the documents' balanced layout (per Ulysses group for a hybrid)

    def mask(self, world: int) -> Mask:
        S = world * SEQ_LOCAL
        if self.cu_seqlens is not None and self.layout == "zigzag":
            return Mask.from_cu_seqlens(self.cu_seqlens, S, self.causal, self.window)
        return Mask(self.causal, self.window)

    def api_layout(self, world: int):
        """The ``layout=`` of the call (None: Megatron's zigzag, ``cu_seqlens`` gives the documents)."""
        if self.layout == "zigzag":
            return None
        group = self.settings.get("ulysses_size", 1)
        return balanced_layout(self.cu_seqlens, world, causal=self.causal, window=self.window, group=group)

    def api_cu_seqlens(self):
        return self.cu_seqlens if self.layout == "zigzag" else None

    @property
    def masked(self) -> bool:
        return self.window is not None or self.cu_seqlens is not None

    def plan(self, world: int) -> Plan:
        mask, layout = normalize(world, SHAPE, self.mask(world), self.api_layout(world))
        return resolve(self.mode, world, SHAPE, **self.settings).build(SHAPE, mask, layout)


def cases(world: int) -> list[Case]:
    """Every plan-based mode at this CP size: ring, every Mesh tile with both rank orders and both
    backward modes, TASP on one node and over emulated nodes, the Ulysses hybrids; documents on
    every mode (a Mesh tile of two rows), on Megatron's zigzag and on the balanced layout; a window
    on ring, a Mesh tile and TASP."""
    # the mask changes which rows a block computes, never what travels: one non-causal dense case suffices
    out = [Case("ring refetch causal=False", "ring", {}, causal=False)]
    for a, b in tile_shapes(world):
        orders = ("q", "kv") if a > 1 and b > 1 else ("q",)
        for contiguous, bc in itertools.product(orders, ("refetch", "keep")):
            name = ("ring" if a == 1 else f"mesh {a}x{b} {contiguous}") + f" {bc} causal=True"
            out.append(Case(name, "mesh", dict(tile=(a, b), contiguous=contiguous, backward_chunks=bc)))
    for causal, gpn in ((True, None), (False, None), (True, 2), (True, 4)):
        case = Case(f"tasp ranks_per_node={gpn} causal={causal}", "tasp", dict(ranks_per_node=gpn), causal=causal)
        try:
            case.plan(world)
        except ValueError:  # TASP cannot run this size / node split
            continue
        out.append(case)
    for U in (2, 4):  # U = 4 > KV_HEADS: each KV head is replicated to two ranks
        if world % U:
            continue
        M = world // U
        out.append(Case(f"a2a+ring U={U}", "a2a+ring", dict(ulysses_size=U)))  # M = 1: plain Ulysses
        if M > 1:
            square = min(tile_shapes(M), key=lambda t: (abs(t[0] - t[1]), t))
            out.append(Case(f"a2a+mesh U={U} inner {square[0]}x{square[1]}", "a2a+mesh",
                            dict(ulysses_size=U, tile=square, contiguous="q")))
            out.append(Case(f"a2a+tasp U={U}", "a2a+tasp", dict(ulysses_size=U)))
    S = world * SEQ_LOCAL
    docs = tuple(sorted({0, 5, S // 2 + 3, S}))
    two_rows = next((t for t in tile_shapes(world) if t[0] == 2), None)
    masked = [("ring", {}), ("tasp", {})] + ([("mesh", dict(tile=two_rows, contiguous="q"))] if two_rows else [])
    for mode, settings in masked:
        label = mode + (f" {two_rows[0]}x{two_rows[1]}" if mode == "mesh" else "")
        for layout in ("zigzag", "balanced"):
            out.append(Case(f"{label} documents {docs} {layout}", mode, settings, cu_seqlens=docs, layout=layout))
        out.append(Case(f"{label} window (3, 0)", mode, settings, window=(3, 0)))
    # the hybrids' ranks differ in all-to-all and inner bytes once documents make rounds uneven
    for case in [c for c in out if c.mode.startswith("a2a+") and c.settings["ulysses_size"] == 2]:
        for layout in ("zigzag", "balanced"):
            out.append(Case(f"{case.name} documents {docs} {layout}", case.mode, case.settings, cu_seqlens=docs,
                            layout=layout))
    return out


def measure_group(rank: int, world: int, group=None) -> list[tuple[int, int, dict]]:
    """(In a spawned rank.) Bytes sent / received by this rank around forward + backward of each
    case, and the sent bytes per peer (group rank)."""
    import megatron_mesh as mm

    g = torch.Generator().manual_seed(rank)
    out = []
    for case in cases(world):
        q = torch.randn(SEQ_LOCAL, BATCH, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16).requires_grad_()
        k, v = (torch.randn(SEQ_LOCAL, BATCH, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16).requires_grad_()
                for _ in range(2))
        with mm.comm_counter() as c:
            o = mm.attention(q, k, v, mode=case.mode, group=group, causal=case.causal, window=case.window,
                             cu_seqlens=case.api_cu_seqlens(), layout=case.api_layout(world), **case.settings)
            o.float().sum().backward()
        out.append((c.bytes_sent, c.bytes_received, dict(c.sent_to)))
    return out

"""A mask kind of one's own, defined in this file alone (no package file knows it): prefix-LM as a
new contributor would write it -- bidirectional inside each document's first ``p`` tokens, causal
after. Registered, it goes through every mode's plan with exact cover at every P <= 8, through
the plan text, and through the public API on the in-process executor against the dense fp64
reference, forward and backward, with the bytes the plan says."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

import megatron_mesh as mm
from megatron_mesh.comm.inprocess import run_inprocess
from megatron_mesh.plan import MODES, Plan, plan_bytes, resolve
from megatron_mesh.plan.maskkinds import INF, MaskKind, register_mask_kind
from megatron_mesh.plan.validate import validate_plan

import cases


@register_mask_kind("toy-prefix-lm")
@dataclass(frozen=True)
class ToyPrefixLM(MaskKind):
    """Each document: pieces [0, p) (part 0) and [p, n) (part 1), one group; part 0 x part 0 both
    ways, part 1 x anything causal, part 0 x part 1 nothing."""

    p: int
    documents: tuple | None = None

    def parts(self, doc_len, lo, hi):
        cut = min(self.p, doc_len)
        return [piece for piece in ((lo, min(hi, cut), 0, 0), (max(lo, cut), hi, 0, 1)) if piece[0] < piece[1]]

    def pair_band(self, qpart, kpart):
        return {(0, 0): (-INF, INF), (0, 1): (1, 0)}.get((qpart, kpart), (0, INF))

    def head_text(self):
        return f"toy-prefix-lm={self.p}"

    @classmethod
    def from_head(cls, head, documents):
        return cls(int(head.split("=")[1]), documents)


def _settings(mode: str, P: int) -> dict:
    U = 2 if P % 2 == 0 and P > 2 else 1
    return {"mesh": dict(tile=(2, P // 2)) if P % 2 == 0 else {}, "a2a+mesh": dict(ulysses_size=U, tile=(P // U, 1)),
            "a2a+ring": dict(ulysses_size=U), "a2a+tasp": dict(ulysses_size=U)}.get(mode, {})


@pytest.mark.parametrize("P", range(1, 9))
def test_a_toy_kind_plans_exact_cover_in_every_mode(P):
    T = 12
    S = P * T
    cu = [0, 5, S // 2 + 3, S] if S > 12 else [0, 5, S]
    shape = cases.Problem(P, 4, 2, True, torch.float32, seq_local=T).shape
    for mode, p in itertools.product(MODES, (3, T + 1)):
        layouts = {"zigzag": None, "balanced": mm.balanced_layout(cu, P, mask=ToyPrefixLM(p))}
        for name, layout in layouts.items():
            mask = ToyPrefixLM(p) if layout is not None else ToyPrefixLM(p) & mm.masks.documents(cu)
            plan = resolve(mode, P, shape, **_settings(mode, P)).build(shape, mask, layout)
            validate_plan(plan)  # every allowed pair exactly once, forward and backward; no other
            assert Plan.from_text(plan.to_text()).mask == plan.mask  # the plan text reads the kind back


@pytest.mark.parametrize("P", [3, 4, 6])
def test_a_toy_kind_matches_the_dense_reference_in_every_mode(P):
    """Every mode through mm.attention(mask=...) on the in-process executor: outputs and dQ, dK, dV
    against the dense fp64 reference of the same mask, the bytes equal to the plan's."""
    T = 12
    S = P * T
    cu = (0, 5, S // 2 + 3, S)
    for i, (mode, balanced) in enumerate(itertools.product(MODES, (False, True))):
        heads = ("MHA", "GQA", "MQA")[i % 3]
        p = cases.Problem(P, *cases.HEADS[heads], True, torch.float32, seq_local=T, cu_seqlens=cu, seed=i,
                          kind=ToyPrefixLM(4), balanced=balanced)
        _check_problem(p, mode, _settings(mode, P))


def _check_problem(p: cases.Problem, mode: str, settings: dict) -> None:
    ref = cases.dense_reference(p)
    plan = resolve(mode, p.world, p.shape, **settings).build(p.shape, p.mask if p.layout is None else p.kind, p.layout)
    planned = [(b.sent, b.received) for b in plan_bytes(plan, p.shape)]

    def rank_fn(rank, comm):
        return cases.measure(rank, p, f"{mode} {p.mask.summary()}", lambda q, k, v: mm.attention(
            q, k, v, mode=mode, comm=comm, **p.mask_args(), **settings), ref)

    out = run_inprocess(rank_fn, p.world, timeout=120)
    cases.assert_accurate([[res] for res in out])
    assert [(res.sent, res.received) for res in out] == planned, (mode, p.mask.summary())

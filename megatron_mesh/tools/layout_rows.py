"""The planner's rows of packed documents on each CP layout of the registry
(:data:`megatron_mesh.plan.layouts.LAYOUTS`): Megatron's zigzag, Transformer Engine's THD (and TE's
own p2p and a2a+p2p on it), the balanced layout, balanced-hide and ``auto`` -- each kind built
for the sample as Megatron builds it (:meth:`~megatron_mesh.plan.layouts.LayoutKind.build`), the
rows of a derived kind (``auto``) picked from the rows of the kinds it chooses between.

Example: ``layout_rows(8, shape, topo, [0, 3000, 8192, ...], modes=("ring",))`` -> the ring row
on each layout, with its ``layout`` name.
"""

from __future__ import annotations

from concurrent.futures import Executor
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import lru_cache, partial

from ..plan.accounting import owner_work
from ..plan.autotile import evaluate_plan
from ..plan.hybrid import build_hybrid_plan
from ..plan.layout import Layout, ThdLayout
from ..plan.layouts import Sample, get_layout_kind, layout_names
from ..plan.mask import Mask, documents_of
from ..plan.mesh import build_rotation_plan
from ..plan.modes import MODES as REGISTRY, Placement
from ..plan.modes.hybrid import HybridMode
from ..plan.problem import normalize
from ..plan.shape import AttentionShape
from ..plan.sparse_needs import KEEP_LIMIT, keep_limit_of
from ..plan.topology import Topology
from .default_layout import derived_rows, registered_mode
from .formulas import usp_degree
from .plan_budget import BUDGET_REASON, LATE_REASON, Budget, balanced_size, budget_rows, problem_size
from .planner import (AUTO, FORMULAS, ModeResult, _auto_row, _mode_tasks, _wanted, all_modes, evaluate, plan_modes,
                      plan_settings)
from .workers import check_jobs, worker_pool

__all__ = ["TE_ROWS", "layout_rows"]

# Transformer Engine's own runs on its THD layout: p2p (every KV chunk around the ring), a2a+p2p (USP)
TE_ROWS = ("te-p2p", "te-a2a+p2p")


def _hybrid_names() -> list[str]:
    """The registered Ulysses hybrid modes (a2a+...), read at call time."""
    return [name for name, m in REGISTRY.items() if isinstance(m, HybridMode)]


def _hybrid_modes(modes) -> list[str]:
    """Of ``modes``, those a Ulysses hybrid runs: hybrid modes and their fastest-candidate rows
    (every hybrid mode when ``auto`` is asked)."""
    hybrid = _hybrid_names()
    rows = {m.auto_row for name, m in REGISTRY.items() if name in hybrid and m.auto_row}
    asked = [m for m in modes if m in hybrid or m in rows]
    return asked + [m for m in hybrid if m not in asked] if AUTO in modes else asked


def _te_rows(world_size: int, shape: AttentionShape, topo: Topology, mask: Mask, layout: Layout,
             skipped: list[dict], keep: list[bool] | None = None, budget: Budget | None = None) -> list[ModeResult]:
    """Transformer Engine as it runs on ``layout`` (THD): p2p (the ring schedule, whole KV chunks
    every step, the documents' blocks) and a2a+p2p (USP: the all-to-all over the largest node-local
    degree, then p2p); ``keep``: which of them the planning budget admitted (:func:`_admit`),
    ``budget``: whose clock may leave them out (:meth:`~.plan_budget.Budget.late`)."""
    mask, layout = normalize(world_size, shape, mask, layout)
    plans = {"te-p2p": lambda: build_rotation_plan(world_size, shape, mask, layout, "te-p2p")}
    u = usp_degree(world_size, shape, topo)
    if u is not None:
        plans["te-a2a+p2p"] = lambda: build_hybrid_plan(
            "te-a2a+p2p", world_size, u, lambda sub, m, lay: build_rotation_plan(world_size // u, sub, m, lay),
            shape, mask, layout)
    else:
        skipped.append({"mode": "te-a2a+p2p", "reason": "no all-to-all degree fits the node and the heads"})
    rows = []
    for k, (name, build) in enumerate(plans.items()):
        if keep is not None and not keep[k] or budget is not None and budget.late():
            skipped.append({"mode": name, "reason": BUDGET_REASON if keep is not None and not keep[k] else LATE_REASON})
            continue
        plan = build()
        c = evaluate_plan(plan, shape, topo)
        # each row's pairs are computed where it lives (its group's, for the hybrid): the layout
        # says how many, without building all P ranks' blocks (minutes at 256 ranks)
        w = owner_work(mask, layout, 1 if name == "te-p2p" else u)
        rows.append(ModeResult(name, None, c.bytes_per_rank, c.intra_node_bytes_per_rank, c.inter_node_bytes_per_rank,
                               c.max_inter_node_bytes, c.rounds, c.peak_buffer_bytes, c.time_s, c.forward_s,
                               c.backward_s, c.compute_s, detail=f"Transformer Engine on its {layout.text().split()[0].upper()} "
                               "layout: " + ("every KV chunk around the ring" if name == "te-p2p" else
                                             f"all-to-all degree {u} x every KV chunk around the ring"),
                               by_formula=False, ulysses=u if name != "te-p2p" else 1,
                               extra={"forward_work_max_over_mean": max(w) * len(w) / max(1, sum(w))}))
    return rows


def _node_ranks(world_size: int, topo: Topology) -> int | None:
    """The layouts' node level: CP ranks per node when the group spans nodes of consecutive ranks
    (None: one node, or an explicit rank-to-node map)."""
    m = topo.gpus_per_node
    return m if topo.node_of is None and world_size > m and world_size % m == 0 else None


def layout_rows(world_size: int, shape: AttentionShape, topo: Topology, cu_seqlens, *, causal: bool = True,
                window=None, modes=None, layouts=None, backward_chunks: str = "auto",
                schedule: str = "greedy", keep_limit: float = KEEP_LIMIT, explain: bool = False,
                plan_all: bool = False, jobs: int = 1, executor: Executor | None = None, kind=None,
                budget: Budget | None = None) -> tuple[list[ModeResult], list[dict]]:
    """Every mode of ``modes`` on each of ``layouts`` (default: every registered layout, in the
    registry's order) for these packed documents, each built as Megatron builds it for the
    placement's Ulysses group and nodes. Rows carry their ``layout``; a layout that pads the
    sequence (THD) gives rows of its padded shape. ``plan_all``: True plans the plugin's modes also
    on a layout whose kind says that takes too long at this size (THD above 64 ranks); else they
    are listed there as skipped, with the reason (TE's own rows are priced). ``jobs``: processes that plan and simulate the
    placements of every layout in parallel, or ``executor`` (:func:`evaluate`). ``kind``: a mask kind
    without documents (chunked, prefix: ``megatron_mesh.masks``) instead of ``causal`` / ``window``, applied
    inside each document; the layouts are built for its work, Transformer Engine's rows left out. ``budget``: a
    :class:`~.plan_budget.Budget` the rows of every layout share, each layout's likeliest placements
    first (:func:`_admit`); the rest are named in the skipped list. ``backward_chunks``, ``schedule``,
    ``keep_limit``: :func:`~.planner.evaluate`'s (the ``auto`` layout prices the backward they keep)."""
    jobs = check_jobs(jobs)
    settings = plan_settings(backward_chunks, schedule, keep_limit)
    with nullcontext(executor) if executor is not None else worker_pool(jobs) as pool:
        return _layout_rows(world_size, shape, topo, cu_seqlens, causal, window, kind, modes,
                            layout_names() if layouts is None else tuple(layouts), settings, explain, plan_all,
                            pool, budget)


def _kind_layout(name: str, sample: Sample, p: Placement):
    """Layout ``name`` of ``sample`` for a placement (its Ulysses group and mode): a module-level
    function, so that a worker process can be sent it."""
    return _built(name, replace(sample, group=p.ulysses, mode=p.mode))


@lru_cache(maxsize=8)
def _built(name: str, sample: Sample):
    """One layout, built once for every placement that runs on it (a mode's tiles share one; a
    balanced layout of a million documents takes seconds): its plans' caches are keyed by it."""
    return get_layout_kind(name).build(sample)


def _layout_rows(world_size, shape, topo, cu_seqlens, causal, window, kind, modes, layouts, settings: dict,
                 explain, plan_all, executor, budget=None) -> tuple[list[ModeResult], list[dict]]:
    kinds = [get_layout_kind(name) for name in layouts]  # ValueError naming an unknown one
    cu = [int(c) for c in cu_seqlens]
    S = world_size * shape.seq_local
    if cu[-1] != S:
        raise ValueError(f"the documents cover {cu[-1]} tokens, the sequence {S}")
    given = all_modes() if modes is None else modes
    shown = [m for m in given if m not in FORMULAS]
    # a derived layout's fastest row is over every mode, each on the layout picked for it: every mode's
    # rows are planned anyway for the fastest ones (auto's candidates); kept here for the derivation
    fastest = AUTO in shown and any(lk.derived_from for lk in kinds)
    modes = list(dict.fromkeys([*shown, *plan_modes()])) if fastest else shown
    rows, skipped = [], [{"mode": m, "reason": "priced by formula for dense attention only, not under documents"}
                         for m in given if m in FORMULAS]
    sample = Sample(tuple(cu), world_size, causal, window, ranks_per_node=_node_ranks(world_size, topo), shape=shape,
                    topology=topo, mask=kind,
                    keep_limit=keep_limit_of(settings["backward_chunks"], settings["backward_keep_limit"]),
                    options=tuple(settings.items()))
    plan = dict(backward_chunks=settings["backward_chunks"], schedule=settings["schedule"],
                keep_limit=settings["backward_keep_limit"], explain=explain, executor=executor)
    setups = [_kind_setup(lk, sample, shape, modes, plan_all) for lk in kinds if not lk.derived_from]
    keep, cost = _admit(setups, sample, topo, settings, budget) if budget is not None else ({}, {})
    # the cheapest layouts first (estimated): where the budget's clock runs out, the dearest layout's rows
    # go -- THD planned first at CP 16 took a minute, and every balanced row was left out (stop 81's review);
    # the rows are listed in the layouts' order all the same
    planned = {}
    for i in sorted(range(len(setups)), key=lambda i: cost.get(setups[i].kind.name, 0.0)):
        planned[i] = _kind_rows(setups[i], sample, topo, shown, plan, keep.get(setups[i].kind.name), budget)
    for i, setup in enumerate(setups):
        got, skip = planned[i]
        rows += [replace(r, layout=setup.kind.name) for r in got]
        skipped += [{**s, "mode": f"{s['mode']} ({setup.kind.name})"} for s in skip]
    for lk in kinds:
        if not lk.derived_from:
            continue
        missing = tuple(name for name in lk.derived_from if name not in layouts)
        both = rows + (_layout_rows(world_size, shape, topo, cu, causal, window, kind, modes, missing, settings,
                                    explain, plan_all, executor, budget)[0] if missing else [])
        got = derived_rows(lk, both, sample)
        rows += got
        # a mode whose rows on the kinds it picks between were not all planned (past the budget, say)
        have = {r.mode for r in got}
        skipped += [{"mode": f"{m} ({lk.name})", "reason": f"its {' or '.join(lk.derived_from)} row was not "
                     "planned (that row, or its mode's, says why)"} for m in shown if m not in have]
    extra = set(modes) - set(shown)  # planned only for the derived layout's fastest row
    return [r for r in rows if r.mode not in extra], skipped


@dataclass(frozen=True)
class _Setup:
    """One (not derived) layout kind as its rows are planned: the modes asked on it, its rows'
    shape and mask, the layout (a function of the placement; None: the zigzag), the plain modes'
    layout (``first``), and why its modes are not planned at this size (None: they are)."""

    kind: object
    asked: list
    shape: AttentionShape
    mask: Mask
    layout: object
    first: Layout | None
    too_large: str | None
    skipped: tuple = ()  # the modes asked that the kind does not run here, with the reason
    leave_out: frozenset = frozenset()  # the registered modes it does not run (not planned as candidates either)


def _kind_setup(kind, sample: Sample, shape: AttentionShape, modes, plan_all) -> _Setup:
    P = sample.world_size
    asked = _hybrid_modes(modes) if kind.varies else modes  # it changes only the Ulysses groups' layouts
    leave_out = frozenset(m for m in plan_modes() if kind.runs(m) is not None)
    # the fastest of every mode: of those it runs
    runs = {m: None if m == AUTO and len(leave_out) < len(plan_modes()) else kind.runs(registered_mode(m))
            for m in asked}
    skipped = tuple({"mode": m, "reason": why} for m, why in runs.items() if why is not None)
    asked = [m for m in asked if runs[m] is None]
    refused = kind.refuses(sample) if asked else None
    if refused is not None or skipped and not asked:  # no layout of this kind for the sample, or none asked
        return _Setup(kind, [], shape, None, None, None, None, skipped + tuple(
            {"mode": m, "reason": f"no {kind.name} layout of this sample: {refused}"} for m in asked), leave_out)
    first = _built(kind.name, sample)  # the plain modes' layout: its tokens per rank, and whether it brings the documents
    if first is not None:
        shape = replace(shape, seq_local=first.seq_local)
    # the layout's own documents, or (the zigzag, a layout of positions only) the mask's
    S = P * shape.seq_local
    mask = sample.head if first is not None and first.documents() is not None else \
        sample.head.with_documents(documents_of(sample.cu_seqlens, S)).normalized(S)
    layout = None if first is None else partial(_kind_layout, kind.name, sample)
    return _Setup(kind, asked, shape, mask, layout, first, None if plan_all else kind.too_large(sample), skipped,
                  leave_out)


def _admit(setups: list[_Setup], sample: Sample, topo: Topology, settings: dict,
           budget: Budget) -> tuple[dict[str, list[bool]], dict[str, float]]:
    """Which rows of every layout the planning budget admits (:meth:`~.plan_budget.Budget.admit`:
    every layout's likeliest placements first), per layout in the order of its modes' candidates,
    then Transformer Engine's own rows; and each layout's estimated seconds of the rows admitted."""
    if not budget.limited:
        return {}, {}
    P, priced = sample.world_size, []
    for st in setups:
        if st.mask is None:  # the kind lays this sample out not at all (:meth:`LayoutKind.refuses`)
            continue
        asked = [] if st.too_large else st.asked
        tasks = _mode_tasks(_wanted(asked) - st.leave_out, P, st.shape, topo, settings, [])
        kind, size = None, None
        if isinstance(st.first, ThdLayout):
            kind = "thd"
        elif st.first is not None and st.first.documents() is not None and not isinstance(st.first, ThdLayout):
            # a balanced layout per Ulysses degree: its size estimated from the documents, not built
            cu = sample.cu_seqlens
            kind, size = "balanced", balanced_size(P, tuple(zip(cu, cu[1:])), sample.causal, st.mask.window[0])
        rows = budget_rows(st.kind.name, tasks, P, st.shape, st.mask, st.first if size is None else None,
                            kind, size)
        if st.kind.transformer_engine_rows:  # and TE's own rows (the hybrid: USP's degree)
            u = usp_degree(P, st.shape, topo)
            te = (("te-p2p", None, 1),) + ((("te-a2a+p2p", None, u),) if u is not None else ())
            rows = replace(rows, tasks=rows.tasks + te, size=problem_size(P, 0, st.mask, st.first))
        priced.append(rows)
    keep = budget.admit(priced)
    return keep, {rows.layout: budget.admitted.get(rows.layout, 0.0) for rows in priced}


def _kind_rows(st: _Setup, sample: Sample, topo: Topology, modes, plan: dict, kept: list[bool] | None,
               budget: Budget | None) -> tuple[list[ModeResult], list[dict]]:
    """The rows of one (not derived) layout kind, and the modes left out with the reason; ``kept``:
    which of its rows the planning budget admitted (:func:`_admit`), ``budget``: its clock."""
    P, kind, asked = sample.world_size, st.kind, st.asked
    n = 0
    if not asked:
        got, skip = [], []
    elif st.too_large:
        got, skip = [], [{"mode": m, "reason": f"{st.too_large} (plan them with --layout {kind.name})"} for m in asked
                         if m in modes]
    else:
        settings = plan_settings(plan["backward_chunks"], plan["schedule"], plan["keep_limit"])
        n = len(_mode_tasks(_wanted(asked) - st.leave_out, P, st.shape, topo, settings, [])) \
            if kept else 0
        got, skip = evaluate(P, st.shape, topo, modes=asked, mask=st.mask, layout=st.layout,
                             keep=kept[:n] if kept else None, budget=budget, leave_out=st.leave_out, **plan)
    if kind.varies:  # the fastest of the hybrids on it, then the rows asked for
        pool = [r for r in got if r.mode in REGISTRY]
        got = [r for r in got if r.mode in modes]
        if AUTO in modes and pool:
            got.append(_auto_row(pool))
        elif AUTO in modes and not st.too_large:
            skip.append({"mode": AUTO, "reason": "no Ulysses hybrid runs here (their rows say why)"})
        hybrids = ", ".join(_hybrid_names())
        skip += [{"mode": m, "reason": f"{kind.name} changes only the Ulysses groups' layouts ({hybrids}); the plain "
                  f"modes run on the {kind.varies} one (--layout {kind.varies})"} for m in modes if m not in asked and m != AUTO]
    skip += [s for s in st.skipped if s["mode"] in modes]  # of the modes shown (not those planned for auto)
    if kind.transformer_engine_rows and sample.head.is_band:
        got += _te_rows(P, st.shape, topo, sample.head, st.first, skip, kept[n:] if kept else None, budget)
    elif kind.transformer_engine_rows:  # TE has no such mask
        skip += [{"mode": m, "reason": f"Transformer Engine has no {sample.head.kind} mask"} for m in TE_ROWS]
    return got, skip

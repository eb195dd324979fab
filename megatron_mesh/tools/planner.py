"""The planner: every CP mode of one problem on one machine, side by side (pure Python).

For the plan-based modes -- every mode of the registry (:data:`megatron_mesh.plan.modes.MODES`):
``ring``, ``mesh`` with each tile, ``tasp``, and the hybrids ``a2a+ring`` / ``a2a+mesh`` /
``a2a+tasp`` for every all-to-all degree U that divides the heads and the node size -- the
numbers come from the plans the runtime executes: bytes from their rounds, time from
:func:`~megatron_mesh.plan.simulate.simulate`, buffer memory from
:func:`~megatron_mesh.plan.memory.buffer_memory`. ``mesh-auto`` is the fastest Mesh tile,
``a2a+mesh-auto`` the fastest hybrid with an inner Mesh, ``auto`` the fastest plan of all -- each
"fastest" by :func:`~megatron_mesh.plan.autotile.pick_best`: predicted times within
:data:`TIME_TOLERANCE` of the fastest count as a tie, which goes to fewer inter-node bytes
(:data:`TIE_RULE` says it in words).
``ulysses`` and ``usp`` (Transformer Engine's ``a2a+p2p``) are also priced by formula, as their
papers and Transformer Engine describe them, next to our plan of the same algorithm
(``a2a+ring``; :mod:`.formulas` says how).

With a mask (``mask=``, e.g. documents or a window) the plan-based modes are built mask-aware
(:mod:`megatron_mesh.plan.sparse`), and each row also gives the per-rank work max / mean.
Numbers are per rank and per attention call (one layer), forward + backward.
"""

from __future__ import annotations

from concurrent.futures import Executor
from contextlib import nullcontext
from dataclasses import replace

from ..plan.accounting import rank_work
from ..plan.autotile import TIE_RULE, TIME_TOLERANCE, Candidate, evaluate_plan, pick_best
from ..plan.costs import pair_flops
from ..plan.mask import Mask
from ..plan.maskkinds import work_mask
from ..plan.modes import MODES as REGISTRY, REFERENCE_MODE, Placement
from ..plan.problem import normalize
from ..plan.shape import AttentionShape
from ..plan.simulate import simulate, time_breakdown
from ..plan.sparse_needs import KEEP_LIMIT, check_keep_limit
from ..plan.topology import Topology
from .formulas import FORMULA, ulysses_result, usp_result
from .mode_result import ModeResult
from .plan_budget import LATE_REASON, Budget, budget_rows, preference
from .workers import check_jobs, worker_pool

__all__ = ["all_modes", "default_modes", "derived_modes", "ModeResult", "evaluate", "plan_modes", "ulysses_result",
           "usp_result", "TIME_TOLERANCE", "TIE_RULE", "FORMULAS", "compute_floor", "allowed_pairs", "check_jobs",
           "worker_pool", "mean_rows"]

# rows beyond the registry: the fastest plan of all, and the formulas
AUTO = "auto"
FORMULAS = ("ulysses", "usp")


def plan_modes() -> tuple[str, ...]:
    """Every registered (plan-based) mode, read at call time."""
    return tuple(REGISTRY)


def derived_modes() -> tuple[str, ...]:
    """The modes' "fastest candidate" rows (e.g. mesh-auto) and ``auto``, the fastest plan of all
    (fastest as :func:`pick_best` picks: ties within :data:`TIME_TOLERANCE` go to fewer inter-node
    bytes)."""
    return tuple(m.auto_row for m in REGISTRY.values() if m.auto_row) + (AUTO,)


def all_modes() -> tuple[str, ...]:
    return plan_modes() + derived_modes() + FORMULAS


def default_modes() -> tuple[str, ...]:
    """What the planner shows unless told otherwise: each mode as it asks (every candidate and/or
    its fastest), the formulas and ``auto``."""
    out = []
    for m in REGISTRY.values():
        if m.planner_rows == "all":
            out.append(m.name)
        if m.auto_row:
            out.append(m.auto_row)
    return tuple(out) + FORMULAS + (AUTO,)


def _row(mode: str, c: Candidate, placement: Placement, detail: str = "", extra: dict | None = None) -> ModeResult:
    return ModeResult(mode, c.tile, c.bytes_per_rank, c.intra_node_bytes_per_rank, c.inter_node_bytes_per_rank,
                      c.max_inter_node_bytes, c.rounds, c.peak_buffer_bytes, c.time_s, c.forward_s, c.backward_s,
                      c.compute_s, c.contiguous, detail, ulysses=placement.ulysses,
                      extra={"saved_bytes": c.saved_bytes, "held_buffer_bytes": c.held_buffer_bytes, "host_s": c.host_s,
                             **(extra or {})})


def host_bound(r: ModeResult) -> bool:
    """The row's host needs longer to issue its ops than its device to run them (the simulator's
    host, :mod:`megatron_mesh.plan.hostops`; rows by formula have none)."""
    return r.extra.get("host_s", 0.0) > r.compute_s


def _breakdown_json(plan, shape: AttentionShape, topo: Topology, sim) -> list[dict]:
    return [{"direction": b.direction, "rank": b.rank, "time_s": b.time, **{f"{k}_s": v for k, v in b.parts.items()},
             "waits": [{"round": t, "seconds": w, "moves": what} for t, w, what in b.waits]}
            for b in time_breakdown(plan, shape, topo, sim)]


def _evaluate_placement(name: str, p: Placement, shape: AttentionShape, topo: Topology, mask: Mask | None,
                        layout, work: bool = False, explain: bool = False) -> ModeResult:
    plan = p.build(shape, mask, layout(p) if callable(layout) else layout, topology=topo)
    sim = simulate(plan, shape, topo, timeline=explain)  # one simulation: the row and its breakdown
    c = evaluate_plan(plan, shape, topo, contiguous=plan.facts.contiguous if plan.facts.tile and plan.facts.tile[0] > 1 else None,
                      sim=sim)
    extra = {}
    if explain:  # where the time goes on the slowest rank (--explain)
        extra["breakdown"] = _breakdown_json(plan, shape, topo, sim)
    if work or mask is not None and not mask.is_dense or layout is not None:
        for direction in ("forward", "backward"):
            if layout is None and plan.mask.is_dense:
                # the zigzag gives every rank the same dense work in every mode (a test checks each
                # one): no need to build all P plans of ranks (P^2 blocks, minutes at 4096 ranks)
                extra[f"{direction}_work_max_over_mean"] = 1.0
                continue
            w = rank_work(plan, direction)
            extra[f"{direction}_work_max_over_mean"] = max(w) * len(w) / max(1, sum(w))
    detail = "; ".join(plan.notes)
    if p.inner is not None:
        detail = f"{p.describe()}" + (f"; {detail}" if detail else "")
    return _row(name, c, p, detail, extra)


# -- everything -----------------------------------------------------------------------------------------
def plan_settings(backward_chunks: str = "auto", schedule: str = "greedy", keep_limit: float = KEEP_LIMIT) -> dict:
    """The options the planner sets on every candidate placement that has them (a keep limit away
    from its default with backward chunks other than "auto": ValueError, as the modes raise)."""
    check_keep_limit("keep_limit", keep_limit)
    if keep_limit != KEEP_LIMIT and backward_chunks != "auto":
        raise ValueError(f"a keep limit ({keep_limit}) applies only with backward chunks 'auto', got "
                         f"{backward_chunks!r}")
    return dict(backward_chunks=backward_chunks, schedule=schedule, backward_keep_limit=keep_limit)


def _mode_tasks(wanted: set, world_size: int, shape: AttentionShape, topo: Topology, settings: dict,
                skipped: list[dict]) -> list[tuple[str, Placement]]:
    """Every candidate placement of each registered mode in ``wanted``, in the registry's order, with
    the ``settings`` (options by name: backward chunks, keep limit, schedule) where it has them; a
    mode that cannot run is appended to ``skipped`` with the reason."""
    tasks: list[tuple[str, Placement]] = []
    for name in plan_modes():
        if name not in wanted:
            continue
        try:
            candidates = REGISTRY[name].candidates(world_size, shape, topo)
            if not candidates:
                raise ValueError(f"no {name} placement fits CP {world_size} on nodes of {topo.gpus_per_node} with "
                                 f"heads {shape.heads}/{shape.kv_heads}")
        except ValueError as e:
            skipped.append({"mode": name, "reason": str(e)})
            continue
        tasks += [(name, p.with_options(**settings)) for p in candidates]
    return tasks


def _evaluate_modes(tasks: list[tuple[str, Placement]], shape: AttentionShape, topo: Topology, mask: Mask, layout,
                    skipped: list[dict], work: bool = False, explain: bool = False,
                    executor: Executor | None = None, budget: Budget | None = None) -> dict[str, list[ModeResult]]:
    """The rows of ``tasks`` (:func:`_mode_tasks`), simulated under ``mask``; a placement that
    cannot run is appended to ``skipped`` with the reason, and so are those not planned when the
    ``budget``'s clock runs out (:meth:`~.plan_budget.Budget.late`). ``executor``: the placements
    are planned and simulated there, in parallel (the rows and their order are the same as in this
    process)."""
    evaluated: dict[str, list[ModeResult]] = {name: [] for name, _ in tasks}
    args = (shape, topo, mask, layout, work, explain)
    late = (lambda: False) if budget is None else budget.late
    order = planning_order(tasks)  # past the deadline what is left out is every mode's least likely rows
    results: list = [None] * len(tasks)
    if executor is None:
        for i in order:
            name, p = tasks[i]
            results[i] = None if late() else _attempt(name, p, *args)
    else:
        futures = {i: executor.submit(_attempt, *tasks[i], *args) for i in order}
        for i in order:  # past the deadline, the rows not started are dropped (the running ones end)
            f = futures[i]
            results[i] = None if late() and f.cancel() else f.result()
    for (name, p), got in zip(tasks, results):
        if isinstance(got, ModeResult):
            evaluated[name].append(got)
        elif got is not None:
            skipped.append({"mode": p.describe(), "reason": got})  # "ring (CP 2, ...)": it names the mode
    skipped += Budget.skipped(tasks, [got is not None for got in results], LATE_REASON)
    return evaluated


def planning_order(tasks) -> list[int]:
    """The order ``tasks`` ((mode name, placement), ...) are planned in: every mode's likeliest
    placement (:func:`~.plan_budget.preference`), then every mode's second, and so on -- the order
    the planning budget admits them in, so that where its clock runs out the rows left out are the
    least likely of every mode, not whole modes (``--modes a2a+tasp,a2a+ring,auto`` at 256 GPUs lost
    a2a+tasp and a2a+ring to auto's 30 candidates planned before them: stop 81's review). The rows
    are still listed in ``tasks``' order."""
    by_mode: dict[str, list[int]] = {}
    for i, (name, p) in enumerate(tasks):
        by_mode.setdefault(name, []).append(i)
    queues = [sorted(ix, key=lambda i: preference(tasks[i][1])) for ix in by_mode.values()]
    return [q[k] for k in range(max(map(len, queues), default=0)) for q in queues if k < len(q)]


# why a candidate is not planned when its plan would be ring's (:func:`_drop_ring_copies`)
RING_COPY = ("computes every block at its query owner, one round per shift, on this layout: its plan is ring's, "
             "which wins the tie (mesh-auto is ring's row)")


def _drop_ring_copies(tasks, modes, world_size: int, shape: AttentionShape, mask: Mask, layout, skipped: list[dict]):
    """``tasks`` without the placements asked only as candidates of a derived row (``mesh-auto``,
    ``auto``) whose mask-aware plan is ring's: the same block placement (the query owner, no map
    of its own) and rounds (one per shift) as a ring placement of the same backward chunks, on a
    layout that places documents (on the balanced layout Mesh's tiles leave a document on the ranks
    that share it). Such a row has ring's numbers and a tile, so ring's row wins every tie
    (:func:`~megatron_mesh.plan.autotile.pick_best`, the flatter tile): at 256 GPUs, 15 Mesh plans
    of 2 s each per sample. (Ring is the registry's reference mode, REFERENCE_MODE.)"""
    ring = {p.options.backward_chunks: p for name, p in tasks if name == REFERENCE_MODE}
    out = []
    for name, p in tasks:
        twin = ring.get(getattr(p.options, "backward_chunks", None))
        if name in (REFERENCE_MODE, *modes) or twin is None or not _same_plan(p, twin, world_size, shape, mask, layout):
            out.append((name, p))
        else:
            skipped.append({"mode": p.describe(), "reason": RING_COPY})
    return out


def _same_plan(p: Placement, ring: Placement, world_size: int, shape: AttentionShape, mask: Mask, layout) -> bool:
    """Whether placement ``p`` builds ring's mask-aware plan (:func:`_drop_ring_copies`)."""
    lay = layout(p) if callable(layout) else layout
    if lay is None or lay.documents() is None or (layout(ring) if callable(layout) else layout) != lay:
        return False
    try:
        m, lay = normalize(world_size, shape, mask, lay)
    except ValueError:
        return False  # its own row says why
    mine, theirs = p.spec.assignment(p, m, lay), ring.spec.assignment(ring, m, lay)
    return mine.rings and theirs.rings


def _attempt(name: str, p: Placement, *args) -> ModeResult | str:
    """One placement's row, or why it cannot run (a worker's task: the reason travels back as text)."""
    try:
        return _evaluate_placement(name, p, *args)
    except ValueError as e:
        return str(e)


# the numbers of a row that are memory: over several samples the largest counts (a buffer has to
# fit the worst sample); every other number is the mean
_PEAK_FIELDS = ("peak_buffer_bytes", "held_buffer_bytes")


def mean_rows(samples: list[list[ModeResult]]) -> tuple[list[ModeResult], list[dict]]:
    """Rows of several samples of documents (one list of rows per sample, e.g. :func:`layout_rows`
    of each, for the same modes and machine) as one row per placement: every number the mean
    over the samples, buffer memory the largest, ``extra["time_s_max"]`` the slowest sample's time,
    ``extra["samples"]`` their number -- what a run over many such samples can expect, where one
    sample can mislead (the winner between two layouts can change from sample to sample). A
    derived row (``auto``, ``mesh-auto``...) may pick differently per sample: its mean is that of
    its picks, ``extra["picks"]`` names them and, where they differ, its detail counts them. A row
    missing from some sample is left out, with the reason (second value)."""
    if not samples or any(not isinstance(rows, list) for rows in samples):
        raise ValueError("mean_rows takes a non-empty list of samples, each a list of rows")
    derived = set(derived_modes())
    by: dict = {}
    for rows in samples:
        for key, r in zip(placement_keys(rows), rows):
            by.setdefault(key, []).append(r)
    n = len(samples)
    out, skipped = [], []
    for rs in by.values():
        first = rs[0]
        if len(rs) != n:
            skipped.append({"mode": f"{_pick_name(first)} ({first.layout})",
                            "reason": f"planned in {len(rs)} of the {n} samples only"})
            continue
        values = {}
        for f in ("bytes_per_rank", "intra_node_bytes_per_rank", "inter_node_bytes_per_rank", "max_inter_node_bytes",
                  "rounds", "peak_buffer_bytes", "time_s", "forward_s", "backward_s", "compute_s"):
            xs = [getattr(r, f) for r in rs]
            v = max(xs) if f in _PEAK_FIELDS else sum(xs) / n
            values[f] = round(v) if isinstance(getattr(first, f), int) else v
        extra = {}
        for name, v in first.extra.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and all(name in r.extra for r in rs):
                xs = [r.extra[name] for r in rs]
                extra[name] = max(xs) if name in _PEAK_FIELDS else sum(xs) / n
                extra[name] = round(extra[name]) if isinstance(v, int) else extra[name]
        extra.update(time_s_max=max(r.time_s for r in rs), samples=n)
        if len({r.detail for r in rs}) > 1:  # e.g. the mask's documents: say whose it is
            values["detail"] = f"first sample: {first.detail}"
        picks = [r.extra.get("pick", _pick_name(r)) for r in rs]
        if first.mode in derived:
            extra["picks"] = picks
            if len(set(picks)) > 1:  # no one placement: the counts say which
                counts = ", ".join(f"{p} in {picks.count(p)}" for p in dict.fromkeys(picks))
                values.update(detail=f"the fastest per sample: {counts} of the {n} samples", tile=None,
                              contiguous=None, ulysses=first.ulysses if len({r.ulysses for r in rs}) == 1 else 1)
        out.append(replace(first, **values, extra=extra))
    return out, skipped


def placement_keys(rows: list[ModeResult]) -> list[tuple[str, str, int]]:
    """Per row, the key :func:`mean_rows` matches it by across samples: (layout, mode, k), the
    placement's k-th row of its (layout, mode) -- the same placement in every sample (the
    candidates' order does not depend on the documents); its plan's tile may differ (a sample of
    one document plans ring as the dense zigzag, with a tile)."""
    seen: dict = {}
    out = []
    for r in rows:
        k = seen[r.layout, r.mode] = seen.get((r.layout, r.mode), -1) + 1
        out.append((r.layout, r.mode, k))
    return out


def _pick_name(r: ModeResult) -> str:
    """A row's placement in words: its mode, all-to-all degree, tile and rank order (what a
    derived row picked: ``extra["pick"]``)."""
    tile = [f"{r.tile[0]}x{r.tile[1]}"] + ([r.contiguous] if r.contiguous else []) if r.tile and r.tile[0] > 1 else []
    return " ".join([r.mode] + ([f"U {r.ulysses}"] if r.ulysses > 1 else []) + tile)


def _auto_row(pool: list[ModeResult]) -> ModeResult:
    """The ``auto`` row: the fastest of ``pool`` (:func:`pick_best`, ties within
    :data:`TIME_TOLERANCE` going to fewer inter-node bytes), naming the mode it is."""
    best = pick_best(pool)
    return replace(best, mode=AUTO, detail=f"{best.mode}" + (f": {best.detail}" if best.detail else ""),
                   extra={**best.extra, "pick": _pick_name(best)})


def _wanted(modes) -> set:
    """The registered modes ``modes`` need planned: the modes, the candidates of their derived rows
    (``mesh-auto``: Mesh's and ring's), every mode for ``auto``."""
    wanted = set(modes)
    for m in REGISTRY.values():
        if m.auto_row and m.auto_row in wanted:
            wanted |= {m.name, *m.auto_pool}
    if AUTO in wanted:
        wanted |= set(plan_modes())
    return wanted


# a derived row (mesh-auto, auto...) none of whose candidates has a row
NO_CANDIDATE = "none of its candidates was planned (their own rows say why)"


def _derived_row(mode: str, evaluated: dict, pools: dict) -> ModeResult | None:
    """Derived row ``mode`` (``auto``, or a mode's fastest-candidate row of ``pools``) from the
    ``evaluated`` rows of its candidates; None when none of them has a row."""
    if mode == AUTO:
        pool = [r for name in plan_modes() for r in evaluated.get(name, [])]
        return _auto_row(pool) if pool else None
    pool = [r for name in pools[mode] for r in evaluated.get(name, [])]
    if not pool:
        return None
    best = pick_best(pool)
    return replace(best, mode=mode, extra={**best.extra, "pick": _pick_name(best)})


def evaluate(world_size: int, shape: AttentionShape, topo: Topology, modes=None, *, mask: Mask | None = None,
             layout=None, backward_chunks: str = "auto", schedule: str = "greedy", keep_limit: float = KEEP_LIMIT,
             work: bool = False, explain: bool = False, jobs: int = 1, executor: Executor | None = None,
             budget: Budget | None = None, keep: list[bool] | None = None,
             leave_out: frozenset = frozenset()) -> tuple[list[ModeResult], list[dict]]:
    """Rows for ``modes`` (see :data:`MODES`) and the modes that cannot run, with the reason.

    ``mask`` (default: causal; ``Mask(False)`` full attention) and ``layout`` (a layout, or a function of the
    placement giving one -- a layout balanced per Ulysses group) build the plan-based modes
    mask-aware; the formula rows (ulysses, usp) assume dense attention and are left out then.
    ``work``: give every plan-based row its per-rank work max / mean (masked rows always have it);
    ``explain``: and where its time goes (``extra["breakdown"]``, :func:`~..plan.simulate.time_breakdown`);
    ``backward_chunks``, ``schedule``, ``keep_limit`` (``backward_keep_limit``): on every placement (:func:`plan_settings`).
    ``jobs``: processes that plan and simulate the placements in parallel (1: this one; 0: one per
    CPU core; :func:`check_jobs`) -- the same rows, in the same order; ``layout`` must then pickle
    (a layout, or a module-level function or ``functools.partial`` of one), and a mode registered
    at run time rather than on import is unknown to the spawned workers (they import the calling
    script, as multiprocessing's spawn does: a script needs the ``if __name__ == "__main__":``
    guard). ``executor``: an executor to use instead (jobs is then ignored). ``budget``: a
    :class:`~.plan_budget.Budget` of estimated planning seconds; the mask-aware rows past it are
    left out up front and named in the skipped list (None: every row), and those its clock finds
    late for (:meth:`~.plan_budget.Budget.late`). ``keep``: instead of its estimates, which
    placements to plan, in the order of the modes' candidates (what :func:`layout_rows` admitted
    over several layouts). ``leave_out``: modes the layout cannot run, not planned as candidates."""
    jobs = check_jobs(jobs)
    allowed = all_modes()
    modes = allowed if modes is None else modes
    unknown = [m for m in modes if m not in allowed]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; allowed: {', '.join(allowed)}")
    topo.check(world_size)
    mask = Mask() if mask is None else mask
    masked = not mask.normalized(world_size * shape.seq_local).is_dense or layout is not None
    skipped: list[dict] = []
    wanted = _wanted(modes) - set(leave_out)
    auto_rows = {m.auto_row: (m.name, *m.auto_pool) for m in REGISTRY.values() if m.auto_row}
    tasks = _mode_tasks(wanted, world_size, shape, topo, plan_settings(backward_chunks, schedule, keep_limit), skipped)
    if keep is None and budget is not None and budget.limited:
        keep = budget.admit([budget_rows("layout", tasks, world_size, shape, mask, layout)])["layout"]
    if keep is not None:
        skipped += Budget.skipped(tasks, keep)
        tasks = [t for t, kept in zip(tasks, keep) if kept]
    tasks = _drop_ring_copies(tasks, modes, world_size, shape, mask, layout, skipped)
    with nullcontext(executor) if executor is not None else worker_pool(jobs) as pool:
        evaluated = _evaluate_modes(tasks, shape, topo, mask, layout, skipped, work, explain, pool, budget)
    return _rows_of(modes, evaluated, auto_rows, None if masked else mask, world_size, shape, topo, skipped), skipped


def _rows_of(modes, evaluated: dict, auto_rows: dict, dense: Mask | None, world_size: int, shape: AttentionShape,
             topo: Topology, skipped: list[dict]) -> list[ModeResult]:
    """:func:`evaluate`'s rows of ``modes`` from the placements ``evaluated``: the modes', the derived
    rows of ``auto_rows``, the formulas' (only where the mask is ``dense``, None otherwise)."""
    rows: list[ModeResult] = []
    for mode in modes:
        if mode in REGISTRY:
            rows.extend(evaluated.get(mode, []))
        elif mode in auto_rows or mode == AUTO:
            row = _derived_row(mode, evaluated, auto_rows)
            rows += [row] if row else []
            skipped += [] if row else [{"mode": mode, "reason": NO_CANDIDATE}]
        elif dense is None:
            skipped.append({"mode": mode, "reason": "priced by formula for dense attention only"})
        else:
            try:
                rows.append(FORMULA[mode](world_size, shape, topo, dense.causal))
            except ValueError as e:
                skipped.append({"mode": mode, "reason": str(e)})
    return rows


# -- the documents' work -------------------------------------------------------------------------------
def allowed_pairs(cu_seqlens, causal: bool = True, window=None, mask=None) -> int:
    """(query, key) pairs the mask (``mask``, or causal / window) of these documents allows."""
    head = work_mask(mask, causal, None if window is None else (window[0], 0 if causal else window[1]))
    return sum(head.span_work(0, b - a, b - a) for a, b in zip(cu_seqlens, cu_seqlens[1:]))


def compute_floor(pairs: int, world_size: int, shape: AttentionShape, topo: Topology) -> float:
    """Seconds of forward + backward attention per rank with every pair spread evenly and nothing
    else: the bound no layout or mode beats on this machine."""
    flops = (pair_flops(shape, shape.heads) + pair_flops(shape, shape.heads, backward=True)) * pairs / world_size
    return flops / topo.attention_flops

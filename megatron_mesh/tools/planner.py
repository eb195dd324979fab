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
(``a2a+ring``):

* Ulysses of degree u moves (u-1)/u of the local q, k, v and out in the forward, of dout and
  dq, dk, dv in the backward, in the activation dtype, as four all-to-alls that do not overlap
  the attention (head-sharded attention over the whole sequence runs between them). It needs
  ``heads % u == 0``; KV heads are replicated up to u when ``u % kv_heads == 0``.
* USP (u x r = P): the Ulysses all-to-all over u consecutive ranks, then zigzag ring attention
  over r ranks on u-times longer chunks of heads/u heads -- simulated with the ring plan.

With a mask (``mask=``, e.g. documents or a window) the plan-based modes are built mask-aware
(:mod:`megatron_mesh.plan.sparse`), and each row also gives the per-rank work max / mean.
Numbers are per rank and per attention call (one layer), forward + backward.
"""

from __future__ import annotations

from concurrent.futures import Executor
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace

from ..plan.accounting import rank_work
from ..plan.autotile import TIE_RULE, TIME_TOLERANCE, Candidate, evaluate_plan, pick_best
from ..plan.costs import pair_flops
from ..plan.mask import Mask
from ..plan.maskkinds import work_mask
from ..plan.mesh import build_mesh_plan
from ..plan.modes import MODES as REGISTRY, Placement
from ..plan.shape import AttentionShape
from ..plan.simulate import simulate, time_breakdown
from ..plan.topology import Topology
from .plan_budget import LATE_REASON, Budget, budget_rows
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


@dataclass(frozen=True)
class ModeResult:
    """One CP mode: bytes are sent per rank, forward + backward; times in seconds."""

    mode: str
    tile: tuple[int, int] | None
    bytes_per_rank: int
    intra_node_bytes_per_rank: float  # mean over ranks
    inter_node_bytes_per_rank: float  # mean over ranks (ring: only the ranks at node boundaries send)
    max_inter_node_bytes: float  # the rank with the most inter-node bytes
    rounds: int  # communication rounds (all-to-alls for Ulysses) per rank, forward + backward
    peak_buffer_bytes: int
    time_s: float
    forward_s: float
    backward_s: float
    compute_s: float
    contiguous: str | None = None
    detail: str = ""
    by_formula: bool = False
    ulysses: int = 1
    extra: dict = field(default_factory=dict, compare=False)
    layout: str = "zigzag"

    @property
    def exposed_comm_s(self) -> float:
        return max(0.0, self.time_s - self.compute_s)

    def to_json(self) -> dict:
        d = asdict(self)
        d["tile"] = list(self.tile) if self.tile is not None else None
        d["exposed_comm_s"] = self.exposed_comm_s
        for k in ("intra_node_bytes_per_rank", "inter_node_bytes_per_rank", "max_inter_node_bytes"):
            d[k] = round(d[k])  # whole bytes (the per-rank means can be fractional)
        d.update(d.pop("extra"))
        return d


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
    plan = p.build(shape, mask, layout(p) if callable(layout) else layout)
    sim = simulate(plan, shape, topo, timeline=explain)  # one simulation: the row and its breakdown
    c = evaluate_plan(plan, shape, topo, contiguous=plan.contiguous if plan.tile and plan.tile[0] > 1 else None,
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


# -- Ulysses / USP by formula ----------------------------------------------------------------------
def _ulysses_kv_heads(u: int, shape: AttentionShape) -> int | None:
    """KV heads after replication for Ulysses degree u (None: not possible)."""
    if shape.heads % u:
        return None
    if shape.kv_heads % u == 0:
        return shape.kv_heads
    if u % shape.kv_heads == 0:
        return u  # each rank gets one (replicated) KV head
    return None


def _a2a(world_size: int, u: int, nbytes: float, topo: Topology) -> tuple[float, float, float, float]:
    """All-to-alls inside each group of u consecutive ranks, ``nbytes`` of local data per rank
    (1/u of it stays home): (mean intra bytes, mean inter bytes, max inter bytes, time on the
    slowest rank) per rank."""
    per_peer = nbytes / u
    intra = inter = worst_inter = worst = 0.0
    for g0 in range(0, world_size, u):
        per_node: dict[int, int] = {}
        for r in range(g0, g0 + u):
            per_node[topo.node(r)] = per_node.get(topo.node(r), 0) + 1
        for r in range(g0, g0 + u):
            c = per_node[topo.node(r)]
            loads = {"intra": (c - 1) * per_peer, "inter": (u - c) * per_peer}
            intra, inter = intra + loads["intra"], inter + loads["inter"]
            worst_inter = max(worst_inter, loads["inter"])
            worst = max([worst] + [topo.latency(k) + v / topo.bandwidth(k) for k, v in loads.items() if v])
    return intra / world_size, inter / world_size, worst_inter, worst


@dataclass
class _AllToAlls:
    """The four all-to-alls of Ulysses of degree u (forward: q,k,v in, out back; backward: dout
    in, dq,dk,dv back), each group of u consecutive ranks among ``world_size``."""

    bytes_sent: float = 0.0
    intra: float = 0.0
    inter: float = 0.0
    max_inter: float = 0.0
    time: dict = field(default_factory=dict)  # direction -> seconds
    local: int = 0  # q + k + v (replicated KV heads) bytes on one rank

    @classmethod
    def price(cls, world_size: int, u: int, shape: AttentionShape, kv_heads: int, topo: Topology) -> "_AllToAlls":
        e, B, n, D, Dv = shape.itemsize, shape.batch, shape.seq_local, shape.head_dim, shape.v_head_dim
        q, kv, out = B * n * shape.heads * D * e, B * n * kv_heads * (D + Dv) * e, B * n * shape.heads * Dv * e
        acc = cls(local=q + kv)
        for direction, sizes in (("forward", (q + kv, out)), ("backward", (out, q + kv))):
            acc.time[direction] = 0.0
            for nbytes in sizes:
                i, x, mx, dt = _a2a(world_size, u, nbytes, topo)
                acc.intra, acc.inter, acc.max_inter = acc.intra + i, acc.inter + x, acc.max_inter + mx
                acc.time[direction] += dt
                acc.bytes_sent += nbytes * (u - 1) / u
        return acc


def _attention_time(seq_len: int, heads: int, shape: AttentionShape, topo: Topology, causal: bool) -> float:
    pairs = seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len
    return pair_flops(shape, heads) * pairs / topo.attention_flops + topo.kernel_latency


def ulysses_result(world_size: int, shape: AttentionShape, topo: Topology, causal: bool = True) -> ModeResult:
    """Ulysses (DeepSpeed-Ulysses, Transformer Engine's ``a2a``) of degree P, by formula."""
    u = world_size
    kv_heads = _ulysses_kv_heads(u, shape)
    if kv_heads is None:
        raise ValueError(f"Ulysses of degree {u} needs heads ({shape.heads}) divisible by {u} and kv heads "
                         f"({shape.kv_heads}) divisible by, or a divisor of, {u}")
    a2a = _AllToAlls.price(world_size, u, shape, kv_heads, topo)
    fwd_compute = _attention_time(shape.seq_local * u, shape.heads // u, shape, topo, causal)
    bwd_compute = fwd_compute * pair_flops(shape, 1, backward=True) / pair_flops(shape, 1)  # BACKWARD_FLOPS, any dims
    fwd, bwd = a2a.time["forward"] + fwd_compute, a2a.time["backward"] + bwd_compute
    # head-sharded q, k, v, out kept for the backward, then dout and the gradients
    peak = 2 * a2a.local + shape.batch * shape.seq_local * shape.heads * shape.v_head_dim * shape.itemsize
    return ModeResult("ulysses", None, round(a2a.bytes_sent), a2a.intra, a2a.inter, a2a.max_inter, 4, peak,
                      fwd + bwd, fwd, bwd, fwd_compute + bwd_compute, detail=f"all-to-all degree {u}",
                      by_formula=True, ulysses=u, extra={"ulysses_degree": u})


def _usp_degree(world_size: int, shape: AttentionShape, topo: Topology) -> int | None:
    """The largest all-to-all degree that stays inside a node and fits the heads."""
    best = None
    for u in range(2, min(world_size - 1, topo.gpus_per_node) + 1):
        if world_size % u == 0 and _ulysses_kv_heads(u, shape) is not None:
            best = u
    return best


def usp_result(world_size: int, shape: AttentionShape, topo: Topology, causal: bool = True) -> ModeResult:
    """USP / Transformer Engine ``a2a+p2p``: Ulysses over u consecutive ranks (inside a node) x
    zigzag ring over the r = P/u ranks holding the same heads (simulated with the ring plan)."""
    u = _usp_degree(world_size, shape, topo)
    if u is None:
        raise ValueError(f"USP needs an all-to-all degree 1 < u < {world_size}, u <= {topo.gpus_per_node} GPUs per "
                         f"node, dividing the CP size and the heads ({shape.heads}/{shape.kv_heads})")
    r = world_size // u
    kv_heads = _ulysses_kv_heads(u, shape)
    sub = replace(shape, seq_local=shape.seq_local * u, heads=shape.heads // u, kv_heads=max(1, kv_heads // u))
    ring_topo = replace(topo, node_of=tuple(topo.node(j * u) for j in range(r)))
    ring = evaluate_plan(build_mesh_plan(r, (1, r), sub, causal=causal), sub, ring_topo)
    a2a = _AllToAlls.price(world_size, u, shape, kv_heads, topo)
    fwd, bwd = a2a.time["forward"] + ring.forward_s, a2a.time["backward"] + ring.backward_s
    return ModeResult("usp", None, round(a2a.bytes_sent) + ring.bytes_per_rank,
                      a2a.intra + ring.intra_node_bytes_per_rank, a2a.inter + ring.inter_node_bytes_per_rank,
                      a2a.max_inter + ring.max_inter_node_bytes, 4 + ring.rounds,
                      2 * a2a.local + ring.peak_buffer_bytes, fwd + bwd, fwd, bwd, ring.compute_s,
                      detail=f"all-to-all degree {u} x ring {r}", by_formula=True, ulysses=u,
                      extra={"ulysses_degree": u, "ring_degree": r, "host_s": ring.host_s})


_FORMULA = {"ulysses": ulysses_result, "usp": usp_result}


# -- everything -----------------------------------------------------------------------------------------
def _mode_tasks(wanted: set, world_size: int, shape: AttentionShape, topo: Topology, backward_chunks: str,
                schedule: str, skipped: list[dict]) -> list[tuple[str, Placement]]:
    """Every candidate placement of each registered mode in ``wanted``, in the registry's order; a
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
        tasks += [(name, p.with_options(backward_chunks=backward_chunks, schedule=schedule)) for p in candidates]
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
    if executor is None:
        results = [None if late() else _attempt(name, p, *args) for name, p in tasks]
    else:
        futures = [executor.submit(_attempt, name, p, *args) for name, p in tasks]
        results = []
        for f in futures:  # past the deadline, the rows not started are dropped (the running ones end)
            results.append(None if late() and f.cancel() else f.result())
    for (name, p), got in zip(tasks, results):
        if isinstance(got, ModeResult):
            evaluated[name].append(got)
        elif got is not None:
            skipped.append({"mode": p.describe(), "reason": got})  # "ring (CP 2, ...)": it names the mode
    skipped += Budget.skipped(tasks, [got is not None for got in results], LATE_REASON)
    return evaluated


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
        # a placement's k-th row of its (layout, mode) is the same placement in every sample (the
        # candidates' order does not depend on the documents); its plan's tile may (a sample of
        # one document plans ring as the dense zigzag, with a tile)
        seen: dict = {}
        for r in rows:
            k = seen[r.layout, r.mode] = seen.get((r.layout, r.mode), -1) + 1
            by.setdefault((r.layout, r.mode, k), []).append(r)
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
             layout=None, backward_chunks: str = "auto", schedule: str = "greedy", work: bool = False,
             explain: bool = False, jobs: int = 1, executor: Executor | None = None, budget: Budget | None = None,
             keep: list[bool] | None = None) -> tuple[list[ModeResult], list[dict]]:
    """Rows for ``modes`` (see :data:`MODES`) and the modes that cannot run, with the reason.

    ``mask`` (default: causal; ``Mask(False)`` full attention) and ``layout`` (a layout, or a function of the
    placement giving one -- a layout balanced per Ulysses group) build the plan-based modes
    mask-aware; the formula rows (ulysses, usp) assume dense attention and are left out then.
    ``work``: give every plan-based row its per-rank work max / mean (masked rows always have it);
    ``explain``: and where its time goes (``extra["breakdown"]``, :func:`~..plan.simulate.time_breakdown`).
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
    over several layouts)."""
    jobs = check_jobs(jobs)
    allowed = all_modes()
    modes = allowed if modes is None else modes
    unknown = [m for m in modes if m not in allowed]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; allowed: {', '.join(allowed)}")
    topo.check(world_size)
    mask = Mask() if mask is None else mask
    masked = not mask.normalized(world_size * shape.seq_local).is_dense or layout is not None
    rows: list[ModeResult] = []
    skipped: list[dict] = []
    wanted = _wanted(modes)
    auto_rows = {m.auto_row: (m.name, *m.auto_pool) for m in REGISTRY.values() if m.auto_row}
    tasks = _mode_tasks(wanted, world_size, shape, topo, backward_chunks, schedule, skipped)
    if keep is None and budget is not None and budget.limited:
        keep = budget.admit([budget_rows("layout", tasks, world_size, shape, mask, layout)])["layout"]
    if keep is not None:
        skipped += Budget.skipped(tasks, keep)
        tasks = [t for t, kept in zip(tasks, keep) if kept]
    with nullcontext(executor) if executor is not None else worker_pool(jobs) as pool:
        evaluated = _evaluate_modes(tasks, shape, topo, mask, layout, skipped, work, explain, pool, budget)
    for mode in modes:
        if mode in REGISTRY:
            rows.extend(evaluated.get(mode, []))
        elif mode in auto_rows or mode == AUTO:
            row = _derived_row(mode, evaluated, auto_rows)
            rows += [row] if row else []
            skipped += [] if row else [{"mode": mode, "reason": NO_CANDIDATE}]
        elif masked:
            skipped.append({"mode": mode, "reason": "priced by formula for dense attention only"})
        else:
            try:
                rows.append(_FORMULA[mode](world_size, shape, topo, mask.causal))
            except ValueError as e:
                skipped.append({"mode": mode, "reason": str(e)})
    return rows, skipped


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

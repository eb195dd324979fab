"""The plugin's context-parallel attention in Megatron's own log, whatever the entry script.

* **Summary**: at the first forward, one line per pipeline stage (CP, TP and DP rank 0 of the
  stage) names the mode and settings of its plugin layers, e.g.
  ``megatron_mesh: pipeline stage 1/1: layers 1-2: mesh (CP 4, tile 2x2, schedule greedy, ...)``.
  The tile there is the one for dense attention; where a batch's documents or window make a Mesh
  plan place its blocks otherwise (another tile map, or every block at its query's owner), one
  more line says so, once for each such placement (:func:`on_plan`).
* **Timers** (Megatron's timers, log level 2: ``--timing-log-level 2``): ``cp-attention-compute``
  and ``cp-attention-comm`` -- the time the plugin's attention layers spend, forward and backward,
  outside and inside their transfers (starting a round, waiting for it). Logged with Megatron's
  other timers at every ``--log-interval`` (TensorBoard with ``--log-timers-to-tensorboard``).
  Megatron's timers synchronise the device at each start and stop, so at level 2 transfers no
  longer overlap compute: a diagnostic, like Megatron's own level-2 timers.
* **Bytes** (``--log-cp-attention-bytes``): at every ``--log-interval`` the attention bytes each
  rank sent and received per iteration, min and max over ranks, as a log line and as TensorBoard
  scalars ``cp-attention-bytes-sent`` / ``-received`` (max over ranks).
* **Metrics** (``--cp-metrics-dir DIR``): per-rank JSON lines, see :mod:`.metrics`: per iteration
  also the bytes this rank sent to each CP peer and the attention work of its kernel calls
  (:func:`on_attention`, called by every plugin attention call with the plan it runs).

The spec functions call :func:`install` with Megatron's parsed arguments; it wraps
``megatron.training.training.training_log`` (called once per iteration on every rank, after
Megatron's own log line) and ``train_step`` (timed for the metrics) -- only when timers, bytes or
metrics are asked for. Outside Megatron's training loop (Megatron-Core used from Python) only the
summary line is produced.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from ..comm.base import Communicator, total_bytes, total_sent_to
from ..plan.units import format_bytes

__all__ = ["install", "register_layer", "on_forward", "on_plan", "on_attention", "timed_communicator", "compute_phase", "mark_backward",
           "TIMER_COMPUTE", "TIMER_COMM", "TIMER_LOG_LEVEL"]

logger = logging.getLogger(__name__)

TIMER_COMPUTE = "cp-attention-compute"
TIMER_COMM = "cp-attention-comm"
TIMER_LOG_LEVEL = 2


class _State:
    args = None  # Megatron's parsed arguments, once installed
    timing = False  # the level-2 timers are on
    metrics = None  # MetricsWriter
    layers: dict = {}  # layer number -> (description, record) of this process's plugin layers
    summarized = False
    placements_said: set = set()  # (layer description, tile, assignment) already logged by on_plan
    depth = {TIMER_COMPUTE: 0, TIMER_COMM: 0}
    step_ms: Optional[float] = None
    bytes_at_record = (0, 0)
    sent_to_at_record: dict = {}  # peer -> bytes sent so far, at the last iteration record
    work = 0  # attention work of this rank's kernel calls since the last iteration record
    cp_rank: Optional[int] = None  # this rank's rank in its CP group (the peers' numbering)
    planned_sent = 0  # bytes this rank's plans send, since the last iteration record
    plan_costs: dict = {}  # id(plan) -> (plan, (rank, shape), work, forward bytes, backward bytes): once per plan
    bytes_at_log = (0, 0)
    iterations_since_log = 0


def install(args) -> None:
    """Turn on what ``args`` asks for (idempotent; the spec functions call it on every rank)."""
    if _State.args is args:
        return
    _State.args = args
    _State.timing = getattr(args, "timing_log_level", 0) >= TIMER_LOG_LEVEL
    metrics_dir = getattr(args, "cp_metrics_dir", None)
    if metrics_dir and _State.metrics is None:
        from .metrics import MetricsWriter

        _State.metrics = MetricsWriter(metrics_dir, dist.get_rank() if dist.is_initialized() else 0)
    if _State.timing or metrics_dir or getattr(args, "log_cp_attention_bytes", False):
        _wrap_training_loop()


# -- the summary line and the per-layer records ----------------------------------------------------------
def register_layer(layer_number: int, description: str, record: dict, logs: bool) -> None:
    """A plugin layer was built; ``logs``: this rank speaks for its pipeline stage."""
    if _State.summarized:  # a new model (tests build several in one process): summarise it anew
        _State.layers, _State.summarized = {}, False
    _State.layers[layer_number] = (description, dict(record, layer=layer_number, description=description), logs)


def on_forward() -> None:
    """Called by every plugin layer's forward; the first call summarises the layers built so far."""
    if _State.summarized:
        return
    _State.summarized = True
    layers = sorted(_State.layers.items())
    if layers and any(logs for _, (_, _, logs) in layers):
        logger.info("megatron_mesh: %s%s", _stage(), "; ".join(_groups(layers)))
    if _State.metrics is not None:
        for _, (_, record, _) in layers:
            _State.metrics.write({"kind": "layer", **record})


def _stage() -> str:
    try:
        from megatron.core import parallel_state as ps

        return f"pipeline stage {ps.get_pipeline_model_parallel_rank() + 1}/{ps.get_pipeline_model_parallel_world_size()}: "
    except Exception:  # noqa: BLE001 -- parallel_state not initialised (groups passed in)
        return ""


def _groups(layers) -> list[str]:
    """'layers 1-2: mesh (...)' for each run of consecutive layers with the same description."""
    runs: list[list] = []  # [first, last, description]
    for n, (desc, _, _) in layers:
        if runs and runs[-1][2] == desc and runs[-1][1] == n - 1:
            runs[-1][1] = n
        else:
            runs.append([n, n, desc])
    return [f"{f'layer {a}' if a == b else f'layers {a}-{b}'}: {desc}" for a, b, desc in runs]


def on_plan(layer_number: int, planned_tile, plan) -> None:
    """A plugin layer runs ``plan``; its summary line named ``planned_tile`` (the placement's tile,
    chosen for dense attention; None for modes without one). Under a batch's documents or window
    a Mesh plan may place its blocks otherwise -- another tile map, or every block at its query
    chunk's owner, whichever moves the fewest bytes on the busiest rank -- and then this logs one
    line saying so, once for each layer description and placement (plans are per batch; the
    check is one set lookup), e.g. ``megatron_mesh: layers with mesh (CP 8, tile 2x4, ...): under
    this batch's mask the plan runs tile 4x2 (...)``."""
    if planned_tile is None:
        return
    assignment = plan.assignment or "tile"
    if plan.tile == tuple(planned_tile) and (assignment == "tile" or planned_tile[0] == 1):
        return  # as summarised (a 1 x P tile is the query owner's placement)
    entry = _State.layers.get(layer_number)
    if entry is None or not entry[2]:
        return
    key = (entry[0], plan.tile, assignment)
    if key in _State.placements_said:
        return
    _State.placements_said.add(key)
    if assignment == "tile":
        what = (f"tile {plan.tile[0]}x{plan.tile[1]} (of the tile maps and the query owner, the fewest bytes on the "
                "busiest rank under this mask)")
    else:
        what = (f"every block at its query chunk's owner ({assignment}: under this mask no tile map moves fewer bytes "
                "on the busiest rank)")
    logger.info("megatron_mesh: layers with %s: under this batch's mask the plan runs %s", entry[0], what)


# -- attention work ------------------------------------------------------------------------------------
def records_attention() -> bool:
    """Whether :func:`on_attention` records anything (``--cp-metrics-dir``): the layer skips
    working out its arguments otherwise."""
    return _State.metrics is not None


def on_attention(plan, rank: int, shape, backward: bool) -> None:
    """A plugin attention call on this rank (its CP group rank ``rank``) runs ``plan`` for the
    problem ``shape`` (an AttentionShape: batch, heads, kv heads, head dim, element size); its
    backward will run when ``backward``. Credits, for the metrics:

    * the forward work of its kernel calls -- the (query, key) pairs the mask allows, times the
      query heads of each block and the batch, i.e. the attention scores actually computed (a
      Ulysses rank's blocks hold its head slice);
    * the bytes its plan says this rank sends: the forward's, and the backward's when it will run
      (an activation-recompute forward runs without it, then again with it) -- so the planned
      bytes of an iteration equal the measured ones when the run moves what it plans, documents
      included (each batch's own plan).

    Only with ``--cp-metrics-dir``; both are computed once per plan (the runtime caches plans, so
    the same object comes back every step)."""
    if _State.metrics is None:
        return
    _State.cp_rank = rank
    key = (rank, shape)
    entry = _State.plan_costs.get(id(plan))
    if entry is None or entry[0] is not plan or entry[1] != key:
        from ..plan.accounting import block_pairs, plan_bytes

        work = sum(block_pairs(plan, op) * plan.head_counts(op.q, shape.heads, shape.kv_heads)[0]
                   for op in plan.rank(rank).blocks("forward")) * shape.batch
        sent = plan_bytes(plan, shape)[rank]
        if len(_State.plan_costs) > 256:  # documents give a plan per batch: keep the table small
            _State.plan_costs.clear()
        entry = _State.plan_costs[id(plan)] = (plan, key, work, sent.forward_sent, sent.backward_sent)  # holding plan keeps id(plan) its own
    _State.work += entry[2]
    _State.planned_sent += entry[3] + (entry[4] if backward else 0)


# -- timers ----------------------------------------------------------------------------------------------
def _timers():
    global_vars = sys.modules.get("megatron.training.global_vars")
    return getattr(global_vars, "_GLOBAL_TIMERS", None) if global_vars is not None else None


def _enter(name: str) -> None:
    _State.depth[name] += 1
    if _State.depth[name] == 1:
        _timers()(name, log_level=TIMER_LOG_LEVEL).start()


def _leave(name: str) -> None:
    _State.depth[name] -= 1
    if _State.depth[name] == 0:
        _timers()(name, log_level=TIMER_LOG_LEVEL).stop()


def _on() -> bool:
    return _State.timing and _timers() is not None


@contextlib.contextmanager
def compute_phase() -> Iterator[None]:
    """Around a plugin layer's forward (the compute timer runs; transfers pause it)."""
    if not _on():
        yield
        return
    _enter(TIMER_COMPUTE)
    try:
        yield
    finally:
        _leave(TIMER_COMPUTE)


@contextlib.contextmanager
def _comm_phase() -> Iterator[None]:
    if not _on():
        yield
        return
    paused = _State.depth[TIMER_COMPUTE] > 0
    if paused:
        _timers()(TIMER_COMPUTE, log_level=TIMER_LOG_LEVEL).stop()
    _enter(TIMER_COMM)
    try:
        yield
    finally:
        _leave(TIMER_COMM)
        if paused:
            _timers()(TIMER_COMPUTE, log_level=TIMER_LOG_LEVEL).start()


class _Mark(torch.autograd.Function):
    """Identity whose backward calls ``event``: brackets a layer's backward for the timers."""

    @staticmethod
    def forward(ctx, event, *tensors):
        ctx.event = event
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.event()
        return (None, *grads)


def mark_backward(inputs: tuple):
    """(inputs, wrap): ``inputs`` marked so that the compute timer stops when the layer's backward
    has produced their gradients; ``wrap(output)`` marks the output so that it starts when the
    backward reaches the layer. Identity (and free) when the timers are off or nothing needs grad."""
    if not _on() or not torch.is_grad_enabled() or not any(t.requires_grad for t in inputs):
        return inputs, lambda out: out
    marked = _Mark.apply(lambda: _leave(TIMER_COMPUTE), *inputs)
    return marked, lambda out: _Mark.apply(lambda: _enter(TIMER_COMPUTE), out)[0]


class _TimedWork:
    def __init__(self, work):
        self.work = work

    def wait(self) -> None:
        with _comm_phase():
            self.work.wait()


class TimedCommunicator(Communicator):
    """``inner`` with its rounds (start and wait) on the communication timer."""

    def __init__(self, inner: Communicator):
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size

    def start(self, sends, recvs):
        with _comm_phase():
            work = self.inner.start(sends, recvs)  # inner counts the bytes
        return _TimedWork(work)

    def _start(self, sends, recvs):
        return self.inner._start(sends, recvs)

    def __getattr__(self, name):  # routes, group, ... of the wrapped communicator
        return getattr(self.inner, name)


def timed_communicator(comm: Optional[Communicator]) -> Optional[Communicator]:
    """``comm`` on the communication timer when the timers are on, else ``comm`` itself."""
    return TimedCommunicator(comm) if comm is not None and _State.timing else comm


# -- the training loop: timers, bytes and metrics per iteration -------------------------------------------
def _wrap_training_loop() -> None:
    from megatron.training import training

    if getattr(training.training_log, "megatron_mesh_hook", False):
        return
    training_log, train_step = training.training_log, training.train_step

    def train_step_timed(*args, **kwargs):
        start = time.perf_counter()
        out = train_step(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        _State.step_ms = (time.perf_counter() - start) * 1e3
        return out

    def training_log_then_plugin(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs):
        out = training_log(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs)
        _after_iteration(loss_dict, iteration, bool(kwargs.get("is_first_iteration", False)))
        return out

    training_log_then_plugin.megatron_mesh_hook = True
    training.training_log, training.train_step = training_log_then_plugin, train_step_timed


def _after_iteration(loss_dict: dict, iteration: int, is_first: bool) -> None:
    args = _State.args
    _State.iterations_since_log += 1
    if _State.metrics is not None:
        sent, received = total_bytes()
        sent_to = total_sent_to()
        before = _State.sent_to_at_record
        peak, kind = _peak_memory()
        _State.metrics.write({
            "kind": "iteration", "iteration": iteration,
            "losses": {k: float(v.float().mean()) if torch.is_tensor(v) else float(v) for k, v in loss_dict.items()},
            "time_ms": _State.step_ms, "bytes_sent": sent - _State.bytes_at_record[0],
            "bytes_received": received - _State.bytes_at_record[1], "peak_memory": peak, "memory_kind": kind,
            "cp_rank": _State.cp_rank,
            "bytes_sent_to": {str(p): n - before.get(p, 0) for p, n in sorted(sent_to.items()) if n != before.get(p, 0)},
            "attention_work": _State.work, "planned_bytes_sent": _State.planned_sent})
        _State.bytes_at_record, _State.sent_to_at_record, _State.work = (sent, received), sent_to, 0
        _State.planned_sent = 0
    if not (iteration % args.log_interval == 0 or is_first):
        return
    if _State.timing:  # like training_log: the first iteration is logged without resetting
        timers, names = _timers(), [TIMER_COMPUTE, TIMER_COMM]
        if getattr(args, "log_timers_to_tensorboard", False):
            timers.write(names, _writer(), iteration, normalizer=args.log_interval, reset=False)
        timers.log(names, normalizer=args.log_interval, reset=not is_first)
    if getattr(args, "log_cp_attention_bytes", False):
        _log_bytes(iteration, reset=not is_first)


def _peak_memory():
    from .metrics import peak_memory

    return peak_memory()


def _writer():
    from megatron.training import get_tensorboard_writer

    return get_tensorboard_writer()


def _log_bytes(iteration: int, reset: bool) -> None:
    """Bytes per iteration since the last log, min and max over all ranks (collective: every
    rank runs training_log)."""
    sent, received = total_bytes()
    n = max(1, _State.iterations_since_log)
    mine = [(sent - _State.bytes_at_log[0]) / n, (received - _State.bytes_at_log[1]) / n]
    if reset:
        _State.bytes_at_log, _State.iterations_since_log = (sent, received), 0
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    t = torch.tensor(mine + [-x for x in mine], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    hi_sent, hi_recv, lo_sent, lo_recv = t[0].item(), t[1].item(), -t[2].item(), -t[3].item()
    if not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1:  # where Megatron logs
        logger.info("cp attention bytes per iteration (min, max) across ranks: sent (%s, %s) | received (%s, %s)",
                    format_bytes(lo_sent), format_bytes(hi_sent), format_bytes(lo_recv), format_bytes(hi_recv))
        writer = _writer()
        if writer is not None:
            writer.add_scalar("cp-attention-bytes-sent", hi_sent, iteration)
            writer.add_scalar("cp-attention-bytes-received", hi_recv, iteration)



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
* **Layouts** (``--cp-layout auto``, the default under documents): at every ``--log-interval``
  which layouts this rank's samples ran on since the last log, e.g. ``megatron_mesh: --cp-layout
  auto ran this rank's 8 samples since the last log on: balanced 5, owners 2, zigzag 1``.
* **Metrics** (``--cp-metrics-dir DIR``): per-rank JSON lines, see :mod:`.metrics`: per iteration
  also the bytes this rank sent to each CP peer, the attention work of its kernel calls
  (:func:`on_attention`, called by every plugin attention call with the plan it runs) and the
  layouts its samples ran on (``layouts``).

All of it is one :class:`Telemetry` object -- the layers' summary (:class:`LayerSummary`), the
timers (:class:`Timing`) and the per-iteration records (:class:`Records`) -- that the layer spec
hands to every plugin layer it builds (:mod:`.spec`). The spec functions get the run's object from
:func:`install` with Megatron's parsed arguments; it wraps ``megatron.training.training.training_log``
(called once per iteration on every rank, after Megatron's own log line) and ``train_step``
(timed for the metrics), and the wrapper holds the run's telemetry, so every spec call of the run
(one per model chunk) gets the same one. Outside Megatron's training loop (Megatron-Core used
from Python) each spec makes its own, and only the summary line is produced. Tests make their
own objects (with their own timers and TensorBoard writer).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import sys
import time
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from ..comm.base import Communicator, total_bytes, total_sent_to
from ..plan.units import format_bytes
from . import ensure_typing_override
from .process import PROCESS, ProcessState
from .settings import plugin_settings

__all__ = ["Telemetry", "LayerSummary", "Timing", "Records", "install", "TimedCommunicator", "TIMER_COMPUTE",
           "TIMER_COMM", "TIMER_LOG_LEVEL"]

logger = logging.getLogger(__name__)

TIMER_COMPUTE = "cp-attention-compute"
TIMER_COMM = "cp-attention-comm"
TIMER_LOG_LEVEL = 2


class _Shared:
    """A process-wide sink: a copy of a layer spec (Megatron deep-copies some) shares it."""

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


# -- the summary line and the per-layer records ----------------------------------------------------------
class LayerSummary(_Shared):
    """The plugin layers built for one model (by layer number) and the lines said about them."""

    def __init__(self):
        self.layers: dict = {}  # layer number -> (description, record, logs) of this process's plugin layers
        self.summarized = False
        self.placements_said: set = set()  # (layer description, tile, assignment) already logged by on_plan

    def register_layer(self, layer_number: int, description: str, record: dict, logs: bool) -> None:
        """A plugin layer was built; ``logs``: this rank speaks for its pipeline stage."""
        if self.summarized:  # a new model (tests build several in one process): summarise it anew
            self.layers, self.summarized = {}, False
        self.layers[layer_number] = (description, dict(record, layer=layer_number, description=description), logs)

    def on_forward(self, metrics=None) -> None:
        """Called by every plugin layer's forward; the first call summarises the layers built so
        far (and writes their records to ``metrics``)."""
        if self.summarized:
            return
        self.summarized = True
        layers = sorted(self.layers.items())
        if layers and any(logs for _, (_, _, logs) in layers):
            logger.info("megatron_mesh: %s%s", _stage(), "; ".join(layer_runs(layers)))
        if metrics is not None:
            for _, (_, record, _) in layers:
                metrics.write({"kind": "layer", **record})

    def on_plan(self, layer_number: int, planned_tile, plan) -> None:
        """A plugin layer runs ``plan``; its summary line named ``planned_tile`` (the placement's
        tile, chosen for dense attention; None for modes without one). Under a batch's documents
        or window a Mesh plan may place its blocks otherwise -- another tile map, or every block
        at its query chunk's owner, whichever moves the fewest bytes on the busiest rank -- and
        then this logs one line saying so, once for each layer description and placement (plans
        are per batch; the check is one set lookup), e.g. ``megatron_mesh: layers with mesh (CP 8,
        tile 2x4, ...): under this batch's mask the plan runs tile 4x2 (...)``."""
        if planned_tile is None:
            return
        facts = plan.facts
        placed = facts.tile_placed  # the tile whose map computed the blocks (None: another assignment did)
        if facts.tile == tuple(planned_tile) and (placed is not None or planned_tile[0] == 1):
            return  # as summarised (a 1 x P tile is the query owner's placement)
        entry = self.layers.get(layer_number)
        if entry is None or not entry[2]:
            return
        key = (entry[0], facts.tile, facts.assignment)
        if key in self.placements_said:
            return
        self.placements_said.add(key)
        if placed is not None:
            what = (f"tile {placed[0]}x{placed[1]} (of the tile maps and the query owner, the fewest bytes on "
                    "the busiest rank under this mask)")
        else:
            what = (f"every block at its query chunk's owner ({facts.assignment}: under this mask no tile map moves "
                    "fewer bytes on the busiest rank)")
        logger.info("megatron_mesh: layers with %s: under this batch's mask the plan runs %s", entry[0], what)


def _stage() -> str:
    try:
        from megatron.core import parallel_state as ps

        return f"pipeline stage {ps.get_pipeline_model_parallel_rank() + 1}/{ps.get_pipeline_model_parallel_world_size()}: "
    except Exception:  # noqa: BLE001 -- parallel_state not initialised (groups passed in)
        return ""


def layer_runs(layers) -> list[str]:
    """'layers 1-2: mesh (...)' for each run of consecutive layers with the same description."""
    runs: list[list] = []  # [first, last, description]
    for n, (desc, _, _) in layers:
        if runs and runs[-1][2] == desc and runs[-1][1] == n - 1:
            runs[-1][1] = n
        else:
            runs.append([n, n, desc])
    return [f"{f'layer {a}' if a == b else f'layers {a}-{b}'}: {desc}" for a, b, desc in runs]


# -- attention work and bytes per iteration ----------------------------------------------------------------
class Records(_Shared):
    """The per-iteration records of ``--cp-metrics-dir`` (``metrics``: a MetricsWriter, or None)."""

    def __init__(self, metrics=None):
        self.metrics = metrics
        self.step_ms: Optional[float] = None
        self.bytes_at_record = total_bytes()
        self.sent_to_at_record: dict = total_sent_to()  # peer -> bytes sent so far, at the last record
        self.work = 0  # attention work of this rank's kernel calls since the last iteration record
        self.cp_rank: Optional[int] = None  # this rank's rank in its CP group (the peers' numbering)
        self.planned_sent = 0  # bytes this rank's plans send, since the last iteration record
        self.plan_costs: dict = {}  # id(plan) -> (plan, (rank, shape), work, forward bytes, backward bytes)

    def on_attention(self, plan, rank: int, shape, backward: bool) -> None:
        """A plugin attention call on this rank (its CP group rank ``rank``) runs ``plan`` for the
        problem ``shape`` (an AttentionShape: batch, heads, kv heads, head dim, element size);
        its backward will run when ``backward``. Credits, for the metrics:

        * the forward work of its kernel calls -- the (query, key) pairs the mask allows, times
          the query heads of each block and the batch, i.e. the attention scores actually
          computed (a Ulysses rank's blocks hold its head slice);
        * the bytes its plan says this rank sends: the forward's, and the backward's when it will
          run (an activation-recompute forward runs without it, then again with it) -- so the
          planned bytes of an iteration equal the measured ones when the run moves what it plans,
          documents included (each batch's own plan).

        Only with ``--cp-metrics-dir``; both are computed once per plan (the runtime caches
        plans, so the same object comes back every step)."""
        if self.metrics is None:
            return
        self.cp_rank = rank
        key = (rank, shape)
        entry = self.plan_costs.get(id(plan))
        if entry is None or entry[0] is not plan or entry[1] != key:
            from ..plan.accounting import block_pairs, plan_bytes

            work = sum(block_pairs(plan, op) * plan.head_counts(op.q, shape.heads, shape.kv_heads)[0]
                       for op in plan.rank(rank).blocks("forward")) * shape.batch
            sent = plan_bytes(plan, shape)[rank]
            if len(self.plan_costs) > 256:  # documents give a plan per batch: keep the table small
                self.plan_costs.clear()
            # holding the plan keeps id(plan) its own
            entry = self.plan_costs[id(plan)] = (plan, key, work, sent.forward_sent, sent.backward_sent)
        self.work += entry[2]
        self.planned_sent += entry[3] + (entry[4] if backward else 0)

    def write_iteration(self, loss_dict: dict, iteration: int, layouts: Optional[dict] = None) -> None:
        """The iteration's record: its losses, time, bytes (per peer too), memory and work, and the
        layout kinds its samples ran on (``layouts``, {name: samples}; where documents were split)."""
        sent, received = total_bytes()
        sent_to = total_sent_to()
        before = self.sent_to_at_record
        peak, kind = _peak_memory()
        self.metrics.write({
            "kind": "iteration", "iteration": iteration,
            "losses": {k: float(v.float().mean()) if torch.is_tensor(v) else float(v) for k, v in loss_dict.items()},
            "time_ms": self.step_ms, "bytes_sent": sent - self.bytes_at_record[0],
            "bytes_received": received - self.bytes_at_record[1], "peak_memory": peak, "memory_kind": kind,
            "cp_rank": self.cp_rank,
            "bytes_sent_to": {str(p): n - before.get(p, 0) for p, n in sorted(sent_to.items()) if n != before.get(p, 0)},
            "attention_work": self.work, "planned_bytes_sent": self.planned_sent, "layouts": dict(layouts or {})})
        self.bytes_at_record, self.sent_to_at_record, self.work = (sent, received), sent_to, 0
        self.planned_sent = 0


def _peak_memory():
    from .metrics import peak_memory

    return peak_memory()


# -- timers ----------------------------------------------------------------------------------------------
def megatron_timers():
    """Megatron's timers, once its training script has made them (else None)."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    return getattr(global_vars, "_GLOBAL_TIMERS", None) if global_vars is not None else None


class Timing(_Shared):
    """The compute and communication timers of the plugin layers (``on``: the level-2 timers are
    asked for; ``timers``: returns Megatron's timers, or None before they exist)."""

    def __init__(self, on: bool = False, timers: Callable = megatron_timers):
        self.on, self.timers = on, timers
        self.depth = {TIMER_COMPUTE: 0, TIMER_COMM: 0}

    def _running(self) -> bool:
        return self.on and self.timers() is not None

    def _enter(self, name: str) -> None:
        self.depth[name] += 1
        if self.depth[name] == 1:
            self.timers()(name, log_level=TIMER_LOG_LEVEL).start()

    def _leave(self, name: str) -> None:
        self.depth[name] -= 1
        if self.depth[name] == 0:
            self.timers()(name, log_level=TIMER_LOG_LEVEL).stop()

    @contextlib.contextmanager
    def compute_phase(self) -> Iterator[None]:
        """Around a plugin layer's forward (the compute timer runs; transfers pause it)."""
        if not self._running():
            yield
            return
        self._enter(TIMER_COMPUTE)
        try:
            yield
        finally:
            self._leave(TIMER_COMPUTE)

    @contextlib.contextmanager
    def comm_phase(self) -> Iterator[None]:
        """Around a transfer's start or wait (the compute timer pauses)."""
        if not self._running():
            yield
            return
        paused = self.depth[TIMER_COMPUTE] > 0
        if paused:
            self.timers()(TIMER_COMPUTE, log_level=TIMER_LOG_LEVEL).stop()
        self._enter(TIMER_COMM)
        try:
            yield
        finally:
            self._leave(TIMER_COMM)
            if paused:
                self.timers()(TIMER_COMPUTE, log_level=TIMER_LOG_LEVEL).start()

    def mark_backward(self, inputs: tuple):
        """(inputs, wrap): ``inputs`` marked so that the compute timer stops when the layer's
        backward has produced their gradients; ``wrap(output)`` marks the output so that it starts
        when the backward reaches the layer. Identity (and free) when the timers are off or
        nothing needs grad."""
        if not self._running() or not torch.is_grad_enabled() or not any(t.requires_grad for t in inputs):
            return inputs, lambda out: out
        marked = _Mark.apply(lambda: self._leave(TIMER_COMPUTE), *inputs)
        return marked, lambda out: _Mark.apply(lambda: self._enter(TIMER_COMPUTE), out)[0]

    def communicator(self, comm: Optional[Communicator]) -> Optional[Communicator]:
        """``comm`` on the communication timer when the timers are on, else ``comm`` itself."""
        return TimedCommunicator(comm, self) if comm is not None and self.on else comm


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


class _TimedWork:
    def __init__(self, work, timing: Timing):
        self.work, self.timing = work, timing

    def wait(self) -> None:
        with self.timing.comm_phase():
            self.work.wait()


class TimedCommunicator(Communicator):
    """``inner`` with its rounds (start and wait) on ``timing``'s communication timer."""

    def __init__(self, inner: Communicator, timing: Timing):
        self.inner, self.rank, self.world_size, self.timing = inner, inner.rank, inner.world_size, timing

    def start(self, sends, recvs):
        with self.timing.comm_phase():
            work = self.inner.start(sends, recvs)  # inner counts the bytes
        return _TimedWork(work, self.timing)

    def exchange(self, group, sends, recvs):
        with self.timing.comm_phase():
            work = self.inner.exchange(group, sends, recvs)  # the inner transport's collective, if it has one
        return _TimedWork(work, self.timing)

    def _start(self, sends, recvs):
        return self.inner._start(sends, recvs)

    def __getattr__(self, name):  # routes, group, ... of the wrapped communicator
        return getattr(self.inner, name)


# -- one run's telemetry, and Megatron's training loop -------------------------------------------------------
class Telemetry(_Shared):
    """What the plugin layers of one run report (see the module docstring): ``args`` are
    Megatron's parsed arguments (None outside a training script: the summary line only);
    ``timers`` and ``writer`` return Megatron's timers and TensorBoard writer (tests pass fakes)."""

    def __init__(self, args=None, metrics=None, timers: Callable = megatron_timers,
                 writer: Optional[Callable] = None, process: Optional[ProcessState] = None):
        self.args = args
        self.process = PROCESS if process is None else process  # whose batch split counts the layouts
        self.layouts_since_log: collections.Counter = collections.Counter()
        self.summary = LayerSummary()
        self.timing = Timing(getattr(args, "timing_log_level", 0) >= TIMER_LOG_LEVEL, timers)
        self.records = Records(metrics)
        self.writer = writer if writer is not None else _tensorboard_writer
        self.bytes_at_log = total_bytes()
        self.iterations_since_log = 0

    @property
    def log_bytes(self) -> bool:
        return plugin_settings(self.args).log_cp_attention_bytes

    def on_forward(self) -> None:
        """Called by every plugin layer's forward (the first one summarises the layers)."""
        self.summary.on_forward(self.records.metrics)

    def after_iteration(self, loss_dict: dict, iteration: int, is_first: bool) -> None:
        """After Megatron's ``training_log`` of ``iteration``: the metrics record, and at each
        ``--log-interval`` (and the first iteration) the timers and the bytes."""
        args = self.args
        self.iterations_since_log += 1
        layouts = dict(self.process.layout_kinds)  # the layouts of the samples this iteration split
        self.process.layout_kinds.clear()
        self.layouts_since_log.update(layouts)
        if self.records.metrics is not None:
            self.records.write_iteration(loss_dict, iteration, layouts)
        if not (iteration % args.log_interval == 0 or is_first):
            return
        self._log_layouts()
        if self.timing.on:  # like training_log: the first iteration is logged without resetting
            timers, names = self.timing.timers(), [TIMER_COMPUTE, TIMER_COMM]
            if getattr(args, "log_timers_to_tensorboard", False):
                timers.write(names, self.writer(), iteration, normalizer=args.log_interval, reset=False)
            timers.log(names, normalizer=args.log_interval, reset=not is_first)
        if self.log_bytes:
            self._log_bytes(iteration, reset=not is_first)

    def _log_layouts(self) -> None:
        """Under a layout picked per sample (``--cp-layout auto``), on the rank where Megatron logs:
        which layouts this rank's samples ran on since the last log -- the ranks of a CP group split
        the same samples; a data-parallel replica its own."""
        counts, self.layouts_since_log = self.layouts_since_log, collections.Counter()
        settings = plugin_settings(self.args) if counts else None
        if settings is None or not settings.layout.derived_from or self.args.context_parallel_size == 1:
            return  # at CP 1 every sample runs on the one rank: no layout to pick
        if not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1:
            ran = ", ".join(f"{name} {n}" for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
            logger.info("megatron_mesh: --cp-layout %s ran this rank's %d samples since the last log on: %s",
                        settings.cp_layout, sum(counts.values()), ran)

    def _log_bytes(self, iteration: int, reset: bool) -> None:
        """Bytes per iteration since the last log, min and max over all ranks (collective: every
        rank runs training_log)."""
        sent, received = total_bytes()
        n = max(1, self.iterations_since_log)
        mine = [(sent - self.bytes_at_log[0]) / n, (received - self.bytes_at_log[1]) / n]
        if reset:
            self.bytes_at_log, self.iterations_since_log = (sent, received), 0
        from .groups import local_device

        t = torch.tensor(mine + [-x for x in mine], dtype=torch.float64, device=local_device())
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        hi_sent, hi_recv, lo_sent, lo_recv = t[0].item(), t[1].item(), -t[2].item(), -t[3].item()
        if not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1:  # where Megatron logs
            logger.info("cp attention bytes per iteration (min, max) across ranks: sent (%s, %s) | received (%s, %s)",
                        format_bytes(lo_sent), format_bytes(hi_sent), format_bytes(lo_recv), format_bytes(hi_recv))
            writer = self.writer()
            if writer is not None:
                writer.add_scalar("cp-attention-bytes-sent", hi_sent, iteration)
                writer.add_scalar("cp-attention-bytes-received", hi_recv, iteration)


def _tensorboard_writer():
    from megatron.training import get_tensorboard_writer

    return get_tensorboard_writer()


def install(args) -> Telemetry:
    """The telemetry of the run of ``args`` (Megatron's parsed arguments; the spec functions call
    this on every rank, once per model chunk): the one Megatron's wrapped ``training_log`` holds
    when it was made for these arguments, else a new one that the wrapper holds from now on (the
    metrics file stays open: a run writes one)."""
    ensure_typing_override()
    from megatron.training import training

    held = getattr(training.training_log, "megatron_mesh_telemetry", None)
    if held is not None and held.args is args:
        return held
    metrics = held.records.metrics if held is not None else None
    metrics_dir = plugin_settings(args).cp_metrics_dir
    if metrics_dir and metrics is None:
        from .metrics import MetricsWriter

        ranks = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        metrics = MetricsWriter(metrics_dir, *ranks)
    telemetry = Telemetry(args, metrics if metrics_dir else None)
    if held is None:
        _wrap_training_loop(training)
    training.training_log.megatron_mesh_telemetry = telemetry
    return telemetry


def _wrap_training_loop(training) -> None:
    """Wrap Megatron's ``training_log`` and ``train_step``; the wrapper's
    ``megatron_mesh_telemetry`` is the run's :class:`Telemetry`."""
    training_log, train_step = training.training_log, training.train_step

    def train_step_timed(*args, **kwargs):
        telemetry = training_log_then_plugin.megatron_mesh_telemetry
        if not (telemetry.timing.on or telemetry.records.metrics is not None or telemetry.log_bytes):
            return train_step(*args, **kwargs)
        start = time.perf_counter()
        out = train_step(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        telemetry.records.step_ms = (time.perf_counter() - start) * 1e3
        return out

    def training_log_then_plugin(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs):
        out = training_log(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs)
        training_log_then_plugin.megatron_mesh_telemetry.after_iteration(
            loss_dict, iteration, bool(kwargs.get("is_first_iteration", False)))
        return out

    training.training_log, training.train_step = training_log_then_plugin, train_step_timed

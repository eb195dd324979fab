"""Packed documents with pipeline parallelism: every stage learns each micro-batch's documents.

Megatron hands batches to the first and last pipeline stages only (``get_batch`` returns None on
the others, whose ranks build no dataset; the last stage's TP ranks but the first get no tokens
or position ids either), but every stage's plugin layers need each micro-batch's document
boundaries and CP layout -- and the layout must be the same on every stage: the hidden states a
stage receives are in its token order (a CP rank holds the same tokens, in the same order, on
every stage, and the last stage's labels are split by it too). So per step, before the schedule
starts (no stage is waiting on another's activations then), :func:`install` makes
``forward_backward_func``:

1. take the step's micro-batches from the data iterator on the first stage's TP rank 0 (the
   schedule then gets those same micro-batches from a list), and broadcast their documents'
   source -- tokens (``--reset-attention-mask``, ``--cp-thd-packing``) or position ids
   (``--reset-position-ids`` through ``run_script``), [micro-batches, b, S] -- over its pipeline
   group, then on every stage over the TP group;
2. before each micro-batch's forward step -- and before its backward step, where a recomputed layer
   runs its forward again after later micro-batches' forward steps -- make its boundaries current
   on every rank (:attr:`.process.ProcessState.pipeline_rows`, and :func:`.batch_layout.set_current`
   of their :class:`~.batch_layout.BatchLayout`): the batch split on the first and last stages
   splits by them, the layers and RoPE of the stages in between read them. Which micro-batch a
   step runs comes from Megatron's schedule itself: its ``forward_step`` is told
   (``current_microbatch``), and its ``backward_step`` gets the output that forward step returned
   (:class:`_Step` remembers whose it was). So the order of the steps does not matter: 1F1B, a
   virtual pipeline's model chunks (stage 0 of PP 2 with two chunks of one layer runs the forward
   steps chunk 0 mb 0, chunk 0 mb 1, chunk 1 mb 0, ... and the backward steps in yet another
   order), activation recompute (full or selective) all see each micro-batch's own documents.

The batch split and the layers decide each sample's layout from its boundaries alone
(:func:`.layout_decision.sample_layout`), so the same boundaries give the same layout on every
stage. Example: PP 3 x CP 2, two micro-batches per step whose samples have documents [0, 40, 64]
and [0, 64): stage 0 reads both, broadcasts a [2, 1, 64] tensor of their tokens; the middle
stage's layers then run micro-batch 0 with boundaries (0, 40, 64) on its balanced layout, and
micro-batch 1 as one document -- without ever seeing a batch.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ..plan.megatron_problem import THD_DOCUMENTS
from .process import PROCESS, ProcessState
from .settings import BATCH_DOCUMENTS, PluginSettings

__all__ = ["install", "shares_documents"]

SOURCE_KEY = {"eod": "tokens", THD_DOCUMENTS: "tokens", "positions": "position_ids"}


def shares_documents(args, settings: PluginSettings) -> bool:
    """Whether the stages must share each micro-batch's documents: pipeline parallelism with
    documents from the batch (EOD tokens, position ids, or THD packing)."""
    return args.pipeline_model_parallel_size > 1 and settings.documents in SOURCE_KEY


def install(process: ProcessState = PROCESS) -> None:
    """Make Megatron's training and evaluation loops run each step's schedule through
    :func:`_share_documents` where :func:`shares_documents` (``pretrain`` looks
    ``get_forward_backward_func`` up in its module at call time; both entry scripts call this
    before it), and the schedules' forward and backward steps make their micro-batch's documents
    current while a step shares them (the schedules look ``forward_step`` / ``backward_step`` up
    in their module at call time). ``process``: whose flags say where the documents come from."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.training import training

    from . import bootstrap

    bootstrap.substitute(training, "get_forward_backward_func",
                         lambda get: functools.partial(_schedule, get, process))
    bootstrap.substitute(schedules, "forward_step", lambda step: functools.partial(_forward_step, step, process))
    # the multi-module schedule's backward (MIMO models) takes its arguments in the same order
    for name in ("backward_step", "backward_step_multimodule"):
        bootstrap.substitute(schedules, name, lambda step: functools.partial(_backward_step, step, process))


def _schedule(get, process: ProcessState, *a, **kw):
    """Megatron's ``get_forward_backward_func`` (``get``), its schedule wrapped by
    :func:`_share_documents` where the stages share documents."""
    from . import bootstrap

    schedule = get(*a, **kw)
    args = bootstrap.megatron_args()
    if args is None:
        return schedule
    settings = PluginSettings.from_args(args, entry_packs_documents=process.entry_packs_documents,
                                        batch_documents=process.batch_documents)
    if not shares_documents(args, settings):
        return schedule
    if (settings.documents in BATCH_DOCUMENTS and settings.layout.per_sample and args.context_parallel_size > 1
            and not process.stages_nodes_checked):
        _check_stages_nodes(settings)  # once: the placement cannot change during the run
        process.stages_nodes_checked = True
    return functools.wraps(schedule)(functools.partial(_share_documents, schedule, args, settings, process))


def _check_stages_nodes(settings: PluginSettings) -> None:
    """The one input of a sample's layout (:func:`.layout_decision.sample_layout`) that depends on
    the stage: the CP ranks per node, from the CP group's global ranks. Stages that see different
    ones would split the same micro-batch differently and hand each other hidden states in
    another token order: stop every rank, one line (each calls this the first time the loop gets its schedule).
    E.g. PP 3 x CP 2 on nodes of 3 GPUs: stage 2's CP group (ranks 2, 3) spans two nodes, the others
    one."""
    from megatron.core import parallel_state as mpu

    from .placement import ranks_per_node

    mine = ranks_per_node(tuple(mpu.get_context_parallel_global_ranks()), settings.gpus_per_node)
    every = [None] * mpu.get_pipeline_model_parallel_world_size()
    torch.distributed.all_gather_object(every, mine, group=mpu.get_pipeline_model_parallel_group())
    if len(set(every)) > 1:
        seen = ", ".join(f"stage {i + 1}: {n or 'one node'}" for i, n in enumerate(every))
        from . import bootstrap

        bootstrap.fail(f"the pipeline stages' CP groups span nodes differently (CP ranks per node: {seen}), so a "
                       "sample's layout would differ between stages; place every stage's CP group alike (nodes of a "
                       "multiple of a stage's ranks), or pass --cp-layout zigzag", at_once=True, tell=False)


def _share_documents(schedule, args, settings: PluginSettings, process: ProcessState, *a, **kw):
    """One call of Megatron's ``schedule`` (``forward_backward_func``, keyword arguments as
    Megatron passes them) with the step's documents shared first (see the module docstring)."""
    from .batch_layout import eod_token

    n = kw["num_microbatches"]
    # the step's batch shape as Megatron passes it: evaluation's --eval-micro-batch-size may differ
    shape = (n, kw.get("micro_batch_size", args.micro_batch_size), kw.get("seq_length", args.seq_length))
    data = kw.get("data_iterator")
    # a virtual pipeline passes one iterator per model chunk: the first chunk's reads the batches
    first = data[0] if isinstance(data, list) else data
    items, source = _step_sources(first, shape, SOURCE_KEY[settings.documents])
    if items is not None:
        kw["data_iterator"] = [iter(items), *data[1:]] if isinstance(data, list) else iter(items)
    process.pipeline_step = _Step(source.cpu(), args, settings, eod_token(settings.documents), process)
    try:
        return schedule(*a, **kw)
    finally:
        process.pipeline_step = None
        process.pipeline_rows = None  # the step's: a batch split outside it reads its own batch


def _step_sources(data_iterator, shape: tuple[int, int, int], key: str) -> tuple[Optional[list], torch.Tensor]:
    """(the step's n micro-batches where this rank reads them -- the first stage's TP rank 0 --
    else None; their ``key`` entries, ``shape`` [n, b, S], broadcast to every stage and TP rank)."""
    from megatron.core import parallel_state as mpu

    from .groups import local_device

    device = local_device()
    reads = mpu.is_pipeline_first_stage(ignore_virtual=True) and mpu.get_tensor_model_parallel_rank() == 0
    items = None
    if reads:
        if data_iterator is None:
            raise RuntimeError("megatron_mesh: the first pipeline stage has no data iterator, but the stages must "
                               "share each micro-batch's documents")
        items = [next(data_iterator) for _ in range(shape[0])]
        source = torch.stack([item[key] for item in items]).to(device=device, dtype=torch.int64)
        if tuple(source.shape) != shape:  # the other ranks receive this shape: a mismatch would hang NCCL
            raise RuntimeError(f"megatron_mesh: the step's micro-batches' {key} are {tuple(source.shape)}, not the "
                               f"[micro-batches, micro-batch size, sequence length] {list(shape)} Megatron's schedule "
                               "was given")
    else:
        source = torch.empty(shape, dtype=torch.int64, device=device)
    if mpu.get_tensor_model_parallel_rank() == 0:
        torch.distributed.broadcast(source, mpu.get_pipeline_model_parallel_first_rank(),
                                    group=mpu.get_pipeline_model_parallel_group())
    if mpu.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.broadcast(source, mpu.get_tensor_model_parallel_src_rank(),
                                    group=mpu.get_tensor_model_parallel_group())
    return items, source


class _Step:
    """The documents of one step's micro-batches (``source`` [n, b, S], see :data:`SOURCE_KEY`),
    made current by index; and which forward step's output was whose, for the backward steps."""

    def __init__(self, source: torch.Tensor, args, settings: PluginSettings, eod: Optional[int],
                 process: ProcessState):
        self.source, self.args, self.settings, self.eod, self.process = source, args, settings, eod, process
        self.made: dict[int, tuple] = {}  # micro-batch -> (its rows, its BatchLayout or None), made once
        self.outputs: dict[int, int] = {}  # id() of a forward step's output -> its micro-batch

    def activate(self, i: int) -> None:
        """Make micro-batch ``i``'s documents current (its boundaries, and their layouts where the
        batches carry the documents)."""
        from megatron.core import parallel_state as mpu

        from .batch_layout import document_rows, set_current, step_layout

        if not 0 <= i < self.source.shape[0]:
            raise RuntimeError(f"megatron_mesh: Megatron's schedule ran micro-batch {i} of a step of "
                               f"{self.source.shape[0]}")
        got = self.made.get(i)
        if got is None:
            name = "positions" if self.settings.documents == "positions" else "eod"
            rows = document_rows({SOURCE_KEY[self.settings.documents]: self.source[i]}, name, self.eod)
            layout = (step_layout(rows, self.args, mpu.get_context_parallel_rank(), self.settings, self.process)
                      if self.settings.documents in BATCH_DOCUMENTS else None)
            got = self.made[i] = (rows, layout)
        self.process.pipeline_rows = got[0]
        if got[1] is not None:
            set_current(got[1], self.process)


def _forward_step(original, process: ProcessState, *a, **kw):
    """Megatron's ``schedules.forward_step`` (``original``) with its micro-batch's documents made
    current first, while a step shares them; the output it returns is remembered as that
    micro-batch's, for its backward step."""
    step = process.pipeline_step
    if step is None:
        return original(*a, **kw)
    i = kw.get("current_microbatch")
    if i is None:
        raise RuntimeError("megatron_mesh: Megatron's schedule ran a forward step without naming its micro-batch "
                           "(current_microbatch), so the pipeline stages cannot tell whose documents it runs")
    step.activate(i)
    out = original(*a, **kw)
    step.outputs[id(out[0])] = i
    return out


def _backward_step(original, process: ProcessState, *a, **kw):
    """Megatron's ``schedules.backward_step`` (``original``; arguments input_tensor,
    output_tensor, ...) with the documents of the micro-batch whose output it back-propagates made
    current first -- what a recomputed layer's forward reads -- while a step shares them."""
    step = process.pipeline_step
    if step is not None:
        output = a[1] if len(a) > 1 else kw.get("output_tensor")
        i = step.outputs.pop(id(output), None)
        if i is None:
            raise RuntimeError("megatron_mesh: Megatron's schedule ran a backward step for an output no forward step "
                               "of this step returned, so the pipeline stages cannot tell whose documents it runs")
        step.activate(i)
    return original(*a, **kw)

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
2. before each micro-batch's forward step, make its boundaries current on every rank
   (:attr:`.process.ProcessState.pipeline_rows`, and :func:`.batch_layout.set_current` of their
   :class:`~.batch_layout.BatchLayout`): the batch split on the first and last stages splits by
   them, the layers and RoPE of the stages in between read them.

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
    before it). ``process``: whose flags say where the documents come from."""
    from megatron.training import training

    from . import bootstrap

    bootstrap.substitute(training, "get_forward_backward_func",
                         lambda get: functools.partial(_schedule, get, process))


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
    items, source = _step_sources(kw.get("data_iterator"), shape, SOURCE_KEY[settings.documents])
    if items is not None:
        kw["data_iterator"] = iter(items)
    kw["forward_step_func"] = _each_microbatch(kw["forward_step_func"], source.cpu(), args, settings,
                                               eod_token(settings.documents), process)
    try:
        return schedule(*a, **kw)
    finally:
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


def _each_microbatch(forward_step, source: torch.Tensor, args, settings: PluginSettings, eod: Optional[int],
                     process: ProcessState):
    """``forward_step`` (Megatron inspects its signature: kept) with micro-batch i's boundaries
    made current before its i-th call -- the schedules run the micro-batches' forward steps in
    order on every stage."""
    from megatron.core import parallel_state as mpu

    from .batch_layout import BatchLayout, document_rows, set_current

    calls = iter(range(source.shape[0]))
    source_name = "positions" if settings.documents == "positions" else "eod"

    @functools.wraps(forward_step)
    def step(*a, **kw):
        i = next(calls)
        rows = document_rows({SOURCE_KEY[settings.documents]: source[i]}, source_name, eod)
        process.pipeline_rows = rows
        if settings.documents in BATCH_DOCUMENTS:
            set_current(BatchLayout.of(rows, args, mpu.get_context_parallel_rank(), settings), process)
        return forward_step(*a, **kw)

    return step

"""Pretrain a GPT with Megatron's own training loop and the plugin's context-parallel modes.

Run with torchrun (``scripts/pretrain_gpt.sh`` does this from a YAML config)::

    torchrun --nproc-per-node 4 -m megatron_mesh.megatron.pretrain_gpt <Megatron flags> \\
        --context-parallel-size 4 --cp-comm-type mesh --mesh-tile-shape 2x2

It is ``megatron.training.pretrain`` with this module's batch, loss and dataset providers (mock
data or Megatron's indexed GPT datasets), the plugin's flags (:mod:`.args`) parsed and checked
inside Megatron's argument parsing (:func:`.bootstrap.install_argument_hook`: a bad setting stops
every rank with one message, before anything is initialised), carried on
:class:`~.args.MeshTransformerConfig`, and the layer spec :func:`~.spec.gpt_layer_spec` unless
``--spec`` names another. Without CUDA it loads :mod:`.cpu_compat` first (gloo backend, CPU
tensors). ``--cp-metrics-dir DIR`` writes loss, time, bytes, memory and the layers' modes as JSON
lines (:mod:`.metrics`).
"""

from __future__ import annotations

import sys
from functools import partial

from . import bootstrap
from .process import PROCESS

if __name__ == "__main__":
    bootstrap.quiet_interrupt()  # first: Ctrl-C while torch loads is quiet too
    bootstrap.pause_gc()  # before torch and Megatron load (resumed when the arguments are parsed)

import torch  # noqa: E402 -- after the pause above

DEFAULT_SPEC = ["megatron_mesh.megatron.spec", "gpt_layer_spec"]
ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


def parse_args(argv=None):
    """Megatron's arguments plus the plugin's, checked: the plugin checks run before Megatron's own
    validation, so a bad plugin setting fails before anything else."""
    from megatron.training import arguments

    from .args import add_args

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--spec" not in argv:  # this script's default layer spec
        argv = ["--spec", *DEFAULT_SPEC, *argv]
    sys.argv = [sys.argv[0], *argv]
    bootstrap.install_argument_hook()
    PROCESS.entry_packs_documents = True  # get_batch below hands the plugin layers their documents
    args = arguments.parse_and_validate_args(extra_args_provider=add_args, args_defaults=ARGS_DEFAULTS)
    _check_data_args(args)
    return args


def _check_data_args(args) -> None:
    for flag in ("sft", "hybrid_context_parallel", "dataloader_inter_document_masking"):
        if getattr(args, flag, False):
            bootstrap.fail(f"--{flag.replace('_', '-')} is not supported by this entry script; it packs documents with "
                           "--reset-attention-mask (boundaries at end-of-document tokens) or --cp-thd-packing "
                           "(Transformer Engine's THD layout)")


# -- batches and loss ---------------------------------------------------------------------------------
_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch(data_iterator, vp_stage=None):
    """This rank's micro-batch: TP rank 0 reads it, broadcasts it over the TP group, and every
    rank keeps its CP share -- the zigzag chunk (chunks r and 2*CP-1-r of each sequence); with
    --reset-attention-mask each sample's tokens of its own CP layout (:mod:`.batch_layout`:
    ``--cp-layout auto``, the default, ``balanced``, or the zigzag); with --cp-thd-packing its tokens of
    Transformer Engine's THD layout. With documents their boundaries travel as
    ``packed_seq_params`` (the last item) -- at PP > 1 those the stages share (:mod:`.pipeline`),
    on a middle stage alone (no batch there)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    from . import batch_layout
    from .groups import local_device
    from .settings import PluginSettings

    args = get_args()
    settings = PluginSettings.from_args(args, entry_packs_documents=True)
    if not is_first_or_last_pipeline_stage(vp_stage):  # no batch: the documents the stages share (.pipeline)
        return (None,) * len(_BATCH_KEYS) + (_stage_documents(args, settings),)
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        batch = {k: v.cuda(non_blocking=True) if torch.is_tensor(v) and torch.cuda.is_available() else v
                 for k, v in next(data_iterator).items()}
    last = mpu.is_pipeline_last_stage()
    batch = get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size, tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
        mtp_on_this_rank=bool(getattr(args, "mtp_num_layers", None)) and last,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(), is_pipeline_last_stage=last)
    packed = None
    cp_group = mpu.get_context_parallel_group()
    if settings.cp_thd_packing:  # every TP rank packs the same broadcast tokens: nothing more to send
        batch, packed = pack_thd(batch, batch_layout.eod_token("eod"), _thd_multiple(args, settings), cp_group.size(),
                                 cp_group.rank(), PROCESS.pipeline_rows)
    elif args.reset_attention_mask:  # each sample by its own layout (tokens, labels, loss mask, positions)
        split = batch_layout.split_batch(batch, "eod", args, cp_group, batch_layout.eod_token("eod"), settings)
        # MLA reads any packed_seq_params as THD (it squeezes the batch axis): its layers take the
        # boundaries from the current batch layout instead, as under Megatron-LM's own script
        packed = None if args.multi_latent_attention else split.packed_seq_params(local_device())
        batch = split.shard(batch, cp_group)
    else:
        batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=cp_group)
    return tuple(batch.get(k) for k in _BATCH_KEYS) + (packed,)


def _stage_documents(args, settings):
    """A pipeline stage between the first and the last: the packed_seq_params of the micro-batch
    whose documents the stages share (:mod:`.pipeline`), which are current -- THD's, or the
    boundaries of --reset-attention-mask (none for MLA: see get_batch) -- else None."""
    from . import batch_layout
    from .groups import local_device

    if settings.cp_thd_packing:
        if PROCESS.pipeline_rows is None:
            raise RuntimeError("megatron_mesh: a middle pipeline stage has no shared documents for this micro-batch: "
                               "Megatron's schedule must run wrapped by megatron_mesh.megatron.pipeline.install()")
        return thd_params(PROCESS.pipeline_rows[0], args.seq_length, _thd_multiple(args, settings),
                          args.context_parallel_size, local_device())[1]
    current = batch_layout.current()
    if not args.reset_attention_mask or args.multi_latent_attention or current is None:
        return None
    return current.packed_seq_params(local_device())


def _thd_multiple(args, settings) -> int:
    return settings.cp_thd_pad_multiple or 2 * args.context_parallel_size


def document_params(tokens: torch.Tensor, eod: int):
    """PackedSeqParams (qkv_format 'sbhd') whose cu_seqlens_q is [batch, k]: each sample's
    document boundaries over the global sequence (rows padded with the sequence length) -- what
    the plugin layers need instead of a dense [s, s] mask."""
    from .batch_layout import boundary_params, document_rows

    return boundary_params(document_rows({"tokens": tokens}, "eod", eod), tokens.device)


def thd_params(row, S: int, multiple: int, cp_size: int, device):
    """One sample's documents (boundaries ``row``: 0, starts..., S) packed for Transformer Engine's
    THD CP layout: each document padded to a multiple of ``multiple`` (a multiple of 2 x CP size),
    packed in order into the sample's S tokens (the last one cut to fit; the rest of the sample one
    sequence of padding). Returns ((source start, packed start, length) of each document, the
    PackedSeqParams: global cu_seqlens, real and padded) -- the same on every pipeline stage.
    E.g. row (0, 3, 8), multiple 4, S 8 -> documents (0, 0, 3), (3, 4, 4): cu_seqlens [0, 3, 7],
    padded [0, 4, 8]."""
    from megatron.core.packed_seq_params import PackedSeqParams

    spans, cu_real, cu_pad, pos = [], [0], [0], 0
    for a, b in zip(row, row[1:]):
        if pos >= S:
            break
        n = min(b - a, S - pos)
        spans.append((a, pos, n))
        pos += min(-(-n // multiple) * multiple, S - pos)
        cu_real.append(cu_real[-1] + n)
        cu_pad.append(pos)
    if pos < S:  # the rest of the sample: one sequence of padding only
        cu_real.append(cu_real[-1])
        cu_pad.append(S)
    real = torch.tensor(cu_real, dtype=torch.int32, device=device)
    padded = torch.tensor(cu_pad, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in zip(cu_pad, cu_pad[1:]))
    return spans, PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=padded,
                                  cu_seqlens_kv_padded=padded, max_seqlen_q=longest, max_seqlen_kv=longest)


def pack_thd(batch: dict, eod: int, multiple: int, cp_size: int, cp_rank: int, rows=None):
    """One sample's documents (cut at end-of-document tokens, or ``rows``: the boundaries the
    pipeline stages share, for a batch that may lack tokens) in Transformer Engine's THD CP layout
    (:func:`thd_params`; padding has loss mask 0), then this rank's tokens of every sequence
    (megatron_mesh.thd_shard, what TE's thd_get_partitioned_indices selects). Returns the sharded
    batch and its PackedSeqParams."""
    from ..plan import ThdLayout
    from ..runtime.api import thd_shard
    from .batch_layout import eod_starts

    present = {k: batch[k] for k in ("tokens", "labels", "loss_mask", "position_ids") if batch.get(k) is not None}
    some = next(iter(present.values()))
    if some.shape[0] != 1:
        raise ValueError(f"--cp-thd-packing packs one sample per micro-batch, got a batch of {some.shape[0]}")
    S = some.shape[1]
    row = rows[0] if rows is not None else tuple(eod_starts(batch["tokens"][0], eod)) + (S,)
    spans, packed = thd_params(row, S, multiple, cp_size, some.device)
    out = {k: torch.zeros_like(v) for k, v in present.items()}
    for a, pos, n in spans:
        for k in ("tokens", "labels", "loss_mask"):
            if k in out:
                out[k][0, pos:pos + n] = present[k][0, a:a + n]
        if "position_ids" in out:
            out["position_ids"][0, pos:pos + n] = torch.arange(n, device=some.device)
    cu_pad, cu_real = packed.cu_seqlens_q_padded.tolist(), packed.cu_seqlens_q.tolist()
    layout = ThdLayout(cp_size, tuple(cu_pad), tuple(b - a for a, b in zip(cu_real, cu_real[1:])))
    return {k: thd_shard(v, cp_rank, layout, dim=1) for k, v in out.items()}, packed


def loss_func(loss_mask, output_tensor):
    """(summed masked loss, token count, report): Megatron divides by the tokens of every
    data-parallel x context-parallel rank, so each CP rank contributes its own chunk's sum."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    if get_args().check_for_nan_in_loss_and_grad:
        machine = get_rerun_state_machine()
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(result=loss, rejection_func=reject, message=f"found {what} in local forward loss",
                                    tolerance=0.0, fatal=True)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids, packed = get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask, packed_seq_params=packed)
    return output, partial(loss_func, loss_mask)


# -- datasets ---------------------------------------------------------------------------------------------
def _is_dataset_built_on_rank(vp_stage=None) -> bool:
    from megatron.core import parallel_state as mpu
    from megatron.training.utils import is_first_or_last_pipeline_stage

    return is_first_or_last_pipeline_stage(vp_stage) and mpu.get_tensor_model_parallel_rank() == 0


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Mock data (``--mock-data``) or Megatron's indexed GPT datasets (``--data-path`` etc.)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer, print_rank_0
    from megatron.training.utils import get_blend_and_blend_per_split

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files, tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus)
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building {dataset_type.__name__} train, validation and test datasets ...")
    return BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples,
                                        partial(_is_dataset_built_on_rank, vp_stage=vp_stage), config).build()


train_valid_test_datasets_provider.is_distributed = True  # every rank builds (on its TP rank 0)


# -- main -------------------------------------------------------------------------------------------------
def build_config(args):
    """The GPTModelConfig: plugin settings and the sequence length on a MeshTransformerConfig."""
    from megatron.training.argument_utils import core_transformer_config_from_args, gpt_config_from_args

    from .args import MeshTransformerConfig, apply_args

    config = core_transformer_config_from_args(args, config_class=MeshTransformerConfig)
    # also where Megatron forces MLATransformerConfig (no plugin fields)
    apply_args(args, config, entry_packs_documents=PROCESS.entry_packs_documents)
    return gpt_config_from_args(args, config=config)


def start_checkpoint_results_queue(args) -> None:
    """A torch_dist checkpoint's writer threads hand their results over a multiprocessing Manager
    queue that Megatron starts at the first save with the 'spawn' method: a new process that runs
    this module again and imports torch to unpickle the results -- 3-4 s of CPU in every rank's
    first save, 10 s of a CP 4 run on 2 cores. Started here by fork instead (what Megatron's own
    persistent async writer does: ``get_write_results_queue(mp_mode="fork")``), before anything
    starts a thread (gloo, the lookahead) or CUDA; Megatron's saves then use this queue."""
    if args.save and args.ckpt_format == "torch_dist" and not args.async_save:
        from megatron.core.dist_checkpointing.strategies.filesystem_async import get_write_results_queue

        get_write_results_queue(mp_mode="fork")  # from the main thread: it dies with the rank (die_with_parent)


def _train(argv) -> None:
    """Parse ``argv`` and run Megatron's pretrain() with this script's providers."""
    args = parse_args(argv)
    start_checkpoint_results_queue(args)
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    from . import batch_layout, pipeline

    batch_layout.install_lookahead()
    pipeline.install()
    model_config = build_config(args)
    pretrain(pretrain_cfg_container_from_args(args, model_config), train_valid_test_datasets_provider,
             ModelType.encoder_or_decoder, forward_step)


def main(argv=None) -> None:
    bootstrap.die_with_parent()
    bootstrap.prepare_runtime()
    with bootstrap.entry_run():  # after torch's import: a node that stops stops the others, and back
        _train(argv)
    bootstrap.freeze_gc()  # a quicker exit


if __name__ == "__main__":
    main()

"""A small stand-in for Megatron-LM's ``pretrain_gpt.py`` (branch core_r0.19.0), written for the
tests: neither the megatron-core wheel nor its source distribution ships that file (it lives at the
root of the Megatron-LM repository). It keeps what the plugin has to cope with there:

* ``megatron.training`` imported at module level -- which needs ``typing.override``, new in Python
  3.12 -- and again in the process the torch_dist checkpoint writer spawns, which re-imports this
  file as ``__mp_main__``;
* arguments parsed with no provider for the plugin's flags
  (``parse_and_validate_args(extra_args_provider=None)``);
* a plain ``TransformerConfig`` from ``gpt_config_from_args(args)``, ``--spec`` naming the layer spec;
* batches as Megatron-LM's: TP rank 0 reads and broadcasts, every CP rank keeps its zigzag chunk
  (``get_batch_on_this_cp_rank``, imported by name at module level); the model called without
  ``packed_seq_params``; the loss summed per CP rank and divided by Megatron by the token count;
* data as Megatron-LM's: ``--mock-data`` or the indexed datasets of ``--data-path``.

The tests run the real file instead when ``MEGATRON_LM_DIR`` names a Megatron-LM checkout.
"""

from functools import partial

import torch
from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
from megatron.training import get_args, get_timers, pretrain, print_rank_0
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

KEYS = ("attention_mask", "labels", "loss_mask", "position_ids", "tokens")


def get_batch(data_iterator, vp_stage=None):
    args = get_args()
    config = core_transformer_config_from_args(args)  # a plain TransformerConfig, as the real script builds
    if not is_first_or_last_pipeline_stage(vp_stage):
        return [None] * len(KEYS)
    batch = {}
    if mpu.get_tensor_model_parallel_rank() == 0:
        batch = {k: (v.cuda(non_blocking=True) if torch.is_tensor(v) else v) for k, v in next(data_iterator).items()}
    batch = get_batch_on_this_tp_rank(
        batch, broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        cp_size=config.context_parallel_size, tp_rank=mpu.get_tensor_model_parallel_rank(),
        micro_batch_size=args.micro_batch_size, seq_length=args.seq_length, mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(), is_pipeline_last_stage=mpu.is_pipeline_last_stage())
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())
    return [batch.get(k) for k in KEYS]


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    attention_mask, labels, loss_mask, position_ids, tokens = get_batch(data_iterator)
    timers("batch-generator").stop()
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def is_dataset_built_on_rank(vp_stage=None):
    return mpu.get_tensor_model_parallel_rank() == 0 and is_first_or_last_pipeline_stage(vp_stage)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, path_to_cache=args.data_cache_path, tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus)
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    return BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples,
                                        partial(is_dataset_built_on_rank, vp_stage=vp_stage), config).build()


if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True
    args = parse_and_validate_args(extra_args_provider=None, args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    model_cfg = gpt_config_from_args(args)
    pretrain(pretrain_cfg_container_from_args(args, model_cfg), train_valid_test_datasets_provider,
             ModelType.encoder_or_decoder, forward_step)

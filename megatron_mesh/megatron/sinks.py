"""Attention sinks of the plugin's Megatron layers: ``config.softmax_type`` and Megatron's
``softmax_offset``, made as Megatron-Core 0.19's own core attention makes them.

``DotProductAttention`` (and ``TEDotProductAttention``) own the sink logits of their layer, one per
query head on this tensor-parallel rank:

* ``vanilla`` -- no sink, ``softmax_offset`` is None;
* ``off-by-one`` -- a fixed logit 0: a plain tensor attribute of zeros (no parameter, not in the
  checkpoint);
* ``learnable`` -- ``nn.Parameter`` [heads / TP] in ``params_dtype``, initialised by
  ``config.init_method``, saved under ``<layer>.self_attention.core_attention.softmax_offset``
  and sharded along its only axis over the tensor-parallel ranks.

:func:`make_softmax_offset` and :func:`sharded_state_dict` repeat exactly that (the same name,
shape, initialisation and checkpoint entry), so a checkpoint moves between Megatron's module (CP 1)
and the plugin's, and the parameter goes through Megatron's gradient reduction as any other:
each CP rank's engine returns d(softmax_offset) summed over the rows that rank finished
(:mod:`megatron_mesh.runtime.sinks`), and Megatron's DDP sums the gradients over the
data-parallel x CP group, which makes it the whole sequence's gradient.

Example: 8 heads, TP 2, ``softmax_type="learnable"`` -> each TP rank's layer holds a parameter of
4 logits, its own heads' (TP rank 1: heads 4-7); ``mm.attention`` gets it as ``softmax_offset``.
"""

from __future__ import annotations

import torch

__all__ = ["SOFTMAX_TYPES", "check_softmax_type", "make_softmax_offset", "sharded_state_dict", "attach", "describe"]

# TransformerConfig.softmax_type's values (Megatron's --softmax-type choices)
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def check_softmax_type(softmax_type, where: str) -> None:
    if softmax_type not in SOFTMAX_TYPES:
        raise ValueError(f"{where}: softmax_type {softmax_type!r} is not one of {', '.join(map(repr, SOFTMAX_TYPES))}")


def make_softmax_offset(module: torch.nn.Module, config, heads_per_partition: int) -> None:
    """Set ``module.softmax_offset`` for ``config.softmax_type`` as Megatron's DotProductAttention
    does (register a parameter for learnable sinks, so that the module's state dict and the
    optimizer see it under Megatron's name)."""
    kind = config.softmax_type
    if kind == "vanilla":
        module.softmax_offset = None
    elif kind == "off-by-one":
        module.softmax_offset = torch.zeros(heads_per_partition, device=torch.cuda.current_device(),
                                            dtype=config.params_dtype)
    else:
        module.register_parameter("softmax_offset", torch.nn.Parameter(torch.empty(
            heads_per_partition, device=torch.cuda.current_device(), dtype=config.params_dtype)))
        if config.perform_initialization:
            module.softmax_offset = config.init_method(module.softmax_offset)


def sharded_state_dict(module: torch.nn.Module, tp_group, prefix: str = "", sharded_offsets=(), metadata=None):
    """Megatron's checkpoint entry of the learnable offset (nothing for the other kinds): the
    parameter sharded along axis 0 over ``tp_group`` -- DotProductAttention.sharded_state_dict."""
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

    state = module.state_dict(prefix="", keep_vars=True) if module.config.softmax_type == "learnable" else {}
    return make_sharded_tensors_for_checkpoint(state, prefix, {"softmax_offset": 0}, sharded_offsets, tp_group=tp_group,
                                               dp_cp_group=ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"])


def attach(module: torch.nn.Module, config, pg_collection, where: str) -> None:
    """A plugin core-attention module's sinks: ``module.softmax_offset`` on this tensor-parallel
    rank's heads and ``module.tp_group`` (the checkpoint shards over it), as Megatron's own."""
    check_softmax_type(config.softmax_type, where)
    tp = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    if tp is None and config.softmax_type != "vanilla":
        from megatron.core import parallel_state

        tp = parallel_state.get_tensor_model_parallel_group()
    module.tp_group = tp
    tp_size = tp.size() if tp is not None else 1
    if config.num_attention_heads % tp_size:
        raise ValueError(f"{where}: {config.num_attention_heads} attention heads do not split over tensor-parallel "
                         f"size {tp_size}")
    make_softmax_offset(module, config, config.num_attention_heads // tp_size)


def describe(config) -> list:
    """The summary line's words for the layer's sinks (none for vanilla)."""
    return [] if config.softmax_type == "vanilla" else [f"sinks {config.softmax_type}"]

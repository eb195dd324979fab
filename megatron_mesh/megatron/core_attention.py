"""Megatron-Core core attention for the plugin's context-parallel modes.

Megatron-Core 0.19 builds core attention per layer as::

    core_attention(config=, layer_number=, attn_mask_type=, attention_type=, cp_comm_type=,
                   softmax_scale=, pg_collection=)          # MLA adds k_channels=, v_channels=

and calls ``forward(query, key, value, attention_mask, attn_mask_type=, attention_bias=,
packed_seq_params=)`` with query [sq, b, heads, head_dim] and key/value [sk, b, kv_heads,
head_dim] -- this rank's zigzag chunk of the sequence (CP rank r holds chunks r and 2*CP-1-r) --
returning [sq, b, heads * head_dim].

:class:`CPCoreAttention` is the builder to put in a layer spec. Per layer it reads the layer's
``cp_comm_type`` (``TransformerLayer`` passes each layer its entry of a per-layer list):

* ``mesh`` / ``tasp`` / ``ring`` -> :class:`PluginCoreAttention` (this package's engine);
* ``p2p`` / ``a2a`` / ``all_gather`` / ``a2a+p2p`` -> Transformer Engine's ``TEDotProductAttention``
  (an error naming the mode when Transformer Engine is not usable);
* CP size 1 -> Megatron's own core attention (``DotProductAttention``, or Transformer Engine's with
  ``--transformer-impl transformer_engine``): no context parallelism, nothing for the plugin to do,
  and everything Megatron's attention supports (dropout, masks) keeps working.

Example (CP 4, 2 layers): ``--cp-comm-type mesh tasp`` gives layer 1 Mesh-Attention (tile from
``--mesh-tile-shape``) and layer 2 TASP, both inside the same model.
"""

from __future__ import annotations

import math
from typing import Optional

import torch.distributed as dist
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention
from torch import Tensor

from . import PLUGIN_MODES, TE_MODES, telemetry
from .args import have_transformer_engine, plugin_settings, resolve_tile

__all__ = ["CPCoreAttention", "PluginCoreAttention"]

# Causal, or no mask at all; causal_bottom_right equals causal for self-attention (sq == sk).
_CAUSAL = {AttnMaskType.causal: True, AttnMaskType.causal_bottom_right: True, AttnMaskType.no_mask: False}


def _cp_size(config, pg_collection) -> int:
    cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    return cp.size() if cp is not None else config.context_parallel_size


class CPCoreAttention:
    """Core-attention builder: returns the module for this layer's ``cp_comm_type``.

    A class (not a function): MLA builds core attention through ``build_module``, which returns
    plain functions uncalled. ``ModuleSpec(module=CPCoreAttention, params=...)`` works too.
    """

    def __new__(cls, *, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                cp_comm_type: Optional[str] = None, softmax_scale: Optional[float] = None,
                pg_collection=None, **kwargs):
        common = dict(config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
                      attention_type=attention_type, softmax_scale=softmax_scale, pg_collection=pg_collection)
        if _cp_size(config, pg_collection) == 1:
            return _megatron_attention(config, common, kwargs)
        if cp_comm_type in PLUGIN_MODES:
            return PluginCoreAttention(cp_comm_type=cp_comm_type, **common, **kwargs)
        mode = "p2p" if cp_comm_type is None else cp_comm_type  # TE's default for None
        if mode not in TE_MODES:
            raise ValueError(f"layer {layer_number}: cp_comm_type {cp_comm_type!r} is not a context-parallel mode; "
                             f"allowed: {', '.join(PLUGIN_MODES)} (megatron_mesh) or {', '.join(TE_MODES)} "
                             "(Transformer Engine)")
        return _te_attention(mode, common, kwargs)


def _megatron_attention(config, common: dict, kwargs: dict):
    """CP size 1: the core attention Megatron's own spec would have built."""
    if config.transformer_impl == "transformer_engine":
        return _te_attention(None, common, kwargs)
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention(**common, **kwargs)  # as Megatron's local spec would build it, arguments and all


def _te_attention(mode: Optional[str], common: dict, kwargs: dict):
    usable, why = have_transformer_engine()
    if not usable:
        what = f"cp_comm_type {mode!r} is a Transformer Engine mode" if mode else "--transformer-impl transformer_engine"
        instead = "use ring (the same algorithm)" if mode == "p2p" else f"use one of {', '.join(PLUGIN_MODES)}"
        raise ValueError(f"layer {common['layer_number']}: {what}, but Transformer Engine is not usable here "
                         f"({why}); {instead if mode else 'pass --transformer-impl local'}")
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    return TEDotProductAttention(**({"cp_comm_type": mode} if mode else {}), **common, **kwargs)


class PluginCoreAttention(MegatronModule):
    """Attention over the CP group with this package's engine (mesh, tasp or ring).

    Supported: self-attention with a causal mask or none, MHA/GQA/MQA, any softmax scale, sbhd
    layout. Anything else raises ValueError naming the value and what is allowed; nothing falls
    back to another mode.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        self.layer_number = layer_number
        where = f"layer {layer_number} (cp_comm_type {cp_comm_type!r})"
        _check_config(config, where, layer_number, attention_type, attn_mask_type, attention_dropout,
                      k_channels, v_channels)
        self.attn_mask_type = attn_mask_type
        head_dim = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
            self.cp_group = pg_collection.cp
        else:
            from megatron.core import parallel_state

            self.cp_group = parallel_state.get_context_parallel_group()
        self.cp_size = self.cp_group.size()
        self.settings = plugin_settings(config)
        self.mode = cp_comm_type if self.cp_size > 1 else "ring"  # CP 1: one block, no transfers
        if self.mode not in PLUGIN_MODES:
            raise ValueError(f"{where}: PluginCoreAttention runs {', '.join(PLUGIN_MODES)}, not {cp_comm_type!r}")
        self.tile, self.contiguous = None, None  # Mesh: resolved by args.resolve_tile
        self.comm = telemetry.timed_communicator(self._communicator(config))
        self.ranks_per_node = None  # TASP: CP ranks per node (None: one node)
        if self.mode == "tasp" and self.cp_size > 1:
            from .groups import cp_ranks_per_node

            self.ranks_per_node = cp_ranks_per_node(config, self.cp_group)
        tile = f"{self.tile[0]}x{self.tile[1]}" if self.tile else None
        telemetry.register_layer(layer_number, self.describe(), dict(mode=self.mode, cp=self.cp_size, tile=tile),
                                 logs=_logs_for_its_stage(self.cp_group))

    def describe(self) -> str:
        """The mode and its settings (the per-stage summary line of :mod:`.telemetry`)."""
        s = self.settings
        if self.cp_size == 1:
            return f"single-rank attention (CP 1, kernel {s.kernel})"
        detail = {"mesh": f"tile {self.tile[0]}x{self.tile[1]}, schedule {s.schedule}, backward "
                          f"{s.backward_chunks}, contiguous {self.contiguous}" if self.tile else "",
                  "tasp": f"transport {s.tasp_transport}, CP ranks per node {self.ranks_per_node or self.cp_size}",
                  "ring": "zigzag ring"}[self.mode]
        return f"{self.mode} (CP {self.cp_size}, {detail}, kernel {s.kernel})"

    def _communicator(self, config):
        from . import groups

        if self.cp_size == 1 or self.mode == "ring":
            return groups.cp_communicator(self.cp_group)
        if self.mode == "mesh":
            self.tile, self.contiguous = resolve_tile(self.cp_size, config)
            return groups.mesh_communicator(config, self.cp_group, self.tile, self.contiguous)
        if self.settings.tasp_transport == "alltoall":
            return groups.alltoall_communicator(self.cp_group)
        return groups.tasp_communicator(config, self.cp_group)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias: Optional[Tensor] = None,
                packed_seq_params=None) -> Tensor:
        """query [sq, b, heads, d], key/value [sk, b, kv_heads, d] -> [sq, b, heads * d].

        ``attention_mask`` is not read: with a causal mask type it only repeats the causal
        structure (Transformer Engine ignores it the same way)."""
        where = f"layer {self.layer_number} ({self.mode})"
        if attention_bias is not None:
            raise ValueError(f"{where}: attention_bias is not supported by the plugin modes (allowed: None)")
        if packed_seq_params is not None:
            fmt = getattr(packed_seq_params, "qkv_format", None)
            raise ValueError(f"{where}: packed sequences (packed_seq_params, qkv_format={fmt!r}) are not supported "
                             "by the plugin modes (allowed: None, i.e. the sbhd layout)")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = _causal(mask_type, where)
        telemetry.on_forward()
        (query, key, value), mark_output = telemetry.mark_backward((query, key, value))
        with telemetry.compute_phase():
            out = self._attention(query, key, value, causal)
        out = mark_output(out)
        sq, b, h, d = out.shape
        return out.reshape(sq, b, h * d)

    def _attention(self, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
        from ..runtime.api import mesh_attention, ring_attention

        s = self.settings
        common = dict(causal=causal, softmax_scale=self.softmax_scale, kernel=s.kernel, comm=self.comm)
        if self.mode == "mesh":
            return mesh_attention(q, k, v, tile=self.tile, schedule=s.schedule, backward_chunks=s.backward_chunks,
                                  contiguous=self.contiguous, **common)
        if self.mode == "tasp":
            from ..runtime.api import tasp_attention

            return tasp_attention(q, k, v, group=self.cp_group, gpus_per_node=self.ranks_per_node,
                                  transport=s.tasp_transport, **common)
        return ring_attention(q, k, v, **common)


def _causal(mask_type: AttnMaskType, where: str) -> bool:
    if mask_type not in _CAUSAL:
        raise ValueError(f"{where}: attention mask type {mask_type.name!r} is not supported by the plugin modes; "
                         f"allowed: {', '.join(m.name for m in _CAUSAL)}")
    return _CAUSAL[mask_type]


def _check_config(config, where: str, layer_number: int, attention_type: str, attn_mask_type: AttnMaskType,
                  attention_dropout, k_channels, v_channels) -> None:
    if attention_type != "self":
        raise ValueError(f"{where}: attention_type {attention_type!r} is not supported (allowed: 'self')")
    _causal(attn_mask_type, where)
    dropout = config.attention_dropout if attention_dropout is None else attention_dropout
    if dropout:
        raise ValueError(f"{where}: attention dropout {dropout} is not supported (allowed: 0; "
                         "pass --attention-dropout 0)")
    if k_channels is not None and v_channels is not None and k_channels != v_channels:
        raise ValueError(f"{where}: key head dim {k_channels} != value head dim {v_channels} (MLA); "
                         "the plugin modes need equal dims")
    if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        raise ValueError(f"{where}: sliding-window attention (window_size={config.window_size}) is not supported "
                         "(allowed: None)")
    softmax_type = getattr(config, "softmax_type", "vanilla")
    if softmax_type != "vanilla":
        raise ValueError(f"{where}: softmax_type {softmax_type!r} is not supported (allowed: 'vanilla')")


def _logs_for_its_stage(cp_group) -> bool:
    """One rank per pipeline stage describes its layers (CP, TP and DP rank 0), so that every
    layer's line appears once, whichever stage holds it."""
    if not dist.is_initialized():
        return True
    try:
        from megatron.core import parallel_state as ps

        return (dist.get_rank(cp_group) == 0 and ps.get_tensor_model_parallel_rank() == 0
                and ps.get_data_parallel_rank() == 0)
    except Exception:  # noqa: BLE001 -- parallel_state not initialised (groups passed in): global rank 0 logs
        return dist.get_rank() == 0

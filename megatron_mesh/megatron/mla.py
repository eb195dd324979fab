"""Multi-latent attention (MLA, DeepSeek-V2/V3) in the plugin's core-attention builder.

Megatron-Core 0.19's ``MLASelfAttention`` builds its core attention twice: ``Attention.__init__``
(its base class) builds one with the layer's config but neither ``cp_comm_type`` nor the head dims,
then MLA builds its own with ``k_channels`` = ``qk_head_dim + qk_pos_emb_head_dim`` and
``v_channels`` = ``v_head_dim`` (and the layer's ``cp_comm_type``), which replaces the first. At
CP > 1 the first would be Transformer Engine's ``p2p`` (``cp_comm_type`` None): an error without
Transformer Engine, a module built for nothing with it. :func:`replaced_by_mla` tells that first
call, and the builder returns :class:`ReplacedByMLA` for it.

The plugin's layers take MLA's head dims as they come (``mm.attention`` takes a value head dim of
its own, [algorithms/sinks.md](../../docs/algorithms/sinks.md)). At CP 1 without Transformer Engine
MLA runs the plugin's single-rank attention: Megatron's local ``DotProductAttention`` takes no
``k_channels`` / ``v_channels`` (:func:`local_mla`).
"""

from __future__ import annotations

import torch

__all__ = ["replaced_by_mla", "local_mla", "ReplacedByMLA"]


def replaced_by_mla(config, kwargs: dict) -> bool:
    """The core attention ``Attention.__init__`` builds for an MLA layer (no head dims given)."""
    return bool(getattr(config, "multi_latent_attention", False)) and kwargs.get("k_channels") is None


def local_mla(config, kwargs: dict) -> bool:
    """MLA's own core attention (its head dims given) without Transformer Engine."""
    return config.transformer_impl != "transformer_engine" and kwargs.get("k_channels") is not None


class ReplacedByMLA(torch.nn.Module):
    """Stands where MLA's base class puts a core attention that MLA replaces at once."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this core attention was replaced by MLA's own (MLASelfAttention builds it with the "
                           "layer's head dims); it is never called")

"""THE decision of :mod:`.batch_layout`: which CP layout one sample of packed documents runs on in
Megatron (:func:`sample_layout`) -- Megatron's zigzag, the balanced layout, or per sample the one
``--cp-layout auto`` keeps (:func:`megatron_mesh.plan.choice.choose_layout`). The batch split and
the core attention both call it, so they cannot disagree.

Example: ``sample_layout([0, 8, 12, 16], args)`` at CP 2 under ``--cp-layout balanced`` -> rank 0
holds [0, 2) + [6, 12), rank 1 [2, 6) + [12, 16).
"""

from __future__ import annotations

import functools
from typing import Optional

from ..plan.balance import BalancedLayout, balanced_layout
from ..plan.choice import choose_layout
from ..plan.shape import AttentionShape
from ..plan.topology import Topology
from .placement import layer_shape, ranks_per_node
from ..plan.window import megatron_window
from .settings import BATCH_DOCUMENTS, cp_layout, layer_modes, plugin_modes_of, plugin_settings

__all__ = ["sample_layout", "uses_balanced_layout"]


def uses_balanced_layout(config) -> bool:
    """Whether batches under ``config`` (a transformer config carrying the plugin settings) may be
    split by the balanced layout: documents from the batch at CP > 1 under ``--cp-layout auto``,
    ``balanced`` or ``balanced-hide``."""
    return (getattr(config, "cp_documents", None) in BATCH_DOCUMENTS and config.context_parallel_size > 1
            and cp_layout(config) != "zigzag")


def _uniform_window(config):
    """The plugin window (left, right) when every layer has it, else None (the layout then
    balances the unwindowed work: the layers without a window dominate it)."""
    from megatron.core.transformer.utils import is_layer_window_attention

    size = getattr(config, "window_size", None)
    if not size:
        return None
    skip = getattr(config, "window_attn_skip_freq", None)
    if all(is_layer_window_attention(size, skip, n) for n in range(1, config.num_layers + 1)):
        return megatron_window(size)
    return None


def sample_layout(cu_seqlens, config) -> Optional[BalancedLayout]:
    """The CP layout of one sample with document boundaries ``cu_seqlens`` (0 = c0 < ... < cn = S)
    under ``config`` -- Megatron's parsed arguments or the transformer config, which carry the same
    fields: None for Megatron's zigzag (``--cp-layout zigzag``, or CP 1), else the balanced layout
    over ``context_parallel_size`` ranks, balanced per Ulysses group of U ranks (U from
    ``--hierarchical-context-parallel-sizes U M``), nodes first when the CP group spans nodes, for
    causal attention with the window when every layer has one -- under ``--cp-layout auto`` only
    where :func:`_keeps_balanced` says so (None otherwise). Cached: the batch split and every layer
    get the same object.

    Example: ``sample_layout([0, 8, 12, 16], args)`` at CP 2 under ``--cp-layout balanced`` -> rank
    0 holds [0, 2) + [6, 12), rank 1 [2, 6) + [12, 16); under ``auto`` None (16 tokens: a
    launch-bound step keeps the zigzag)."""
    cp = config.context_parallel_size
    if cp == 1 or cp_layout(config) == "zigzag":
        return None
    hcp = getattr(config, "hierarchical_context_parallel_sizes", None)
    group = int(hcp[0]) if hcp else 1
    window = _uniform_window(config)
    cu, nodes = tuple(int(c) for c in cu_seqlens), _nodes(config, group)
    if cp_layout(config) == "auto" and window is None and not _keeps_balanced(cu, cp, group, nodes, *_priced(config)):
        return None
    return _balanced(cu, cp, group, None if window is None else tuple(window), nodes,
                     cp_layout(config) == "balanced-hide")


def _priced(config) -> tuple:
    """What ``--cp-layout auto`` prices a sample for: the layers' mode (the first plugin mode of
    ``cp_comm_type``) and their per-rank heads, head dim and dtype."""
    modes = layer_modes(getattr(config, "cp_comm_type", None))
    plugin = plugin_modes_of(modes)
    mode = next((m for m in modes if m in plugin), "ring")
    shape = layer_shape(config, 1)
    return mode, shape.heads, shape.kv_heads, shape.head_dim, shape.itemsize


@functools.lru_cache(maxsize=512)
def _keeps_balanced(cu: tuple, cp: int, group: int, nodes: Optional[int], mode: str, heads: int, kv_heads: int,
                    head_dim: int, itemsize: int) -> bool:
    """``--cp-layout auto``: whether this sample's balanced layout is priced no slower than
    Megatron's zigzag for ``mode`` on the default machine (docs/performance.md, "Assumptions")
    with the CP group's ``nodes`` (:func:`megatron_mesh.plan.choice.choose_layout`)."""
    shape = AttentionShape(cu[-1] // cp, 1, heads, kv_heads, head_dim, itemsize)
    topo = Topology(nodes=cp // nodes if nodes else 1, gpus_per_node=nodes or cp)
    return choose_layout(_balanced(cu, cp, group, None, nodes, False), shape, topo, mode, group)[0] == "balanced"


def _nodes(config, group: int) -> Optional[int]:
    """CP ranks per node when the CP group spans nodes (the layout balances nodes first, keeping
    documents on a node's links), from the CP group's global ranks and the GPUs per node
    (``--tasp-gpus-per-node`` or torchrun's LOCAL_WORLD_SIZE); None: one node, no process groups
    yet, or nodes that do not hold whole Ulysses groups (the group level then decides alone)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    cp_ranks = tuple(parallel_state.get_context_parallel_global_ranks())
    n = ranks_per_node(cp_ranks, plugin_settings(config).gpus_per_node)
    return n if n is not None and n % group == 0 else None


@functools.lru_cache(maxsize=512)
def _balanced(cu: tuple, cp: int, group: int, window, nodes: Optional[int], hide: bool) -> BalancedLayout:
    return balanced_layout(cu, cp, causal=True, window=window, group=group, ranks_per_node=nodes, hide=hide)

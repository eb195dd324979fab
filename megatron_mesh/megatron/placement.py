"""Each plugin layer's :class:`~megatron_mesh.plan.Placement`, resolved once from the config.

The one place that turns Megatron's settings into a mode's placement: the per-rank attention
shape (heads per tensor-parallel rank, the real ``--seq-length`` per CP rank), the node layout of
the CP group (consecutive CP ranks per node: ``--tasp-gpus-per-node`` or torchrun's
``LOCAL_WORLD_SIZE`` over the CP group's global ranks), the Ulysses degree of a hybrid
(``--hierarchical-context-parallel-sizes U M``) and the mode's own flags. The process groups
(:mod:`.groups`), the core-attention modules and the summary line all read the result; the tile
``auto`` is chosen by :func:`megatron_mesh.plan.choose_tile` inside :func:`~megatron_mesh.plan.resolve`.

Example: CP 8 over 2 nodes of 4 (``LOCAL_WORLD_SIZE=4``), GQA 8/2 heads, ``--cp-comm-type a2a+mesh
--hierarchical-context-parallel-sizes 2 4``: the placement is an all-to-all over CP ranks {0,1},
{2,3}, ... and, per head slice, an inner Mesh over 4 ranks with the tile the simulator predicts
fastest for their two nodes (ties within :data:`~megatron_mesh.plan.autotile.TIME_TOLERANCE` going to
fewer inter-node bytes).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

from ..plan import AttentionShape
from ..plan.modes import Placement, get_mode, option_specs, resolve
from .settings import plugin_settings

__all__ = ["layer_shape", "resolve_placement", "node_blocks", "ranks_per_node"]

# A sequence length per rank for configs built outside an entry script that set none (Megatron-Core
# from Python): the fastest tile depends on it mildly.
DEFAULT_SEQ_LOCAL = 8192


def node_blocks(cp_ranks: tuple[int, ...], gpus: Optional[int]) -> list[tuple[int, ...]]:
    """The CP ranks (indices into ``cp_ranks``, global ranks) that share a node, node by node."""
    if not gpus:
        return [tuple(range(len(cp_ranks)))]
    nodes: dict[int, list[int]] = {}
    for i, g in enumerate(cp_ranks):
        nodes.setdefault(g // gpus, []).append(i)
    return [tuple(v) for _, v in sorted(nodes.items())]


def ranks_per_node(cp_ranks: tuple[int, ...], gpus: Optional[int]) -> Optional[int]:
    """Consecutive CP ranks per node (None: the whole CP group shares one node). Nodes must hold
    equal, consecutive blocks of CP ranks -- Megatron's rank order gives that."""
    blocks = node_blocks(cp_ranks, gpus)
    if len(blocks) == 1:
        return None
    n = len(blocks[0])
    if any(block != tuple(range(i * n, (i + 1) * n)) for i, block in enumerate(blocks)):
        raise ValueError(f"CP group {list(cp_ranks)} spans nodes unevenly ({blocks} by CP rank); the plugin modes "
                         "need the same number of consecutive CP ranks on every node (check --tasp-gpus-per-node)")
    return n


def layer_shape(config, cp_size: int) -> AttentionShape:
    """Per-rank attention shape of ``config``: heads per tensor-parallel rank, the real global
    sequence length (``--seq-length``, put on the config by the spec hook) over the CP size."""
    tp = config.tensor_model_parallel_size
    heads = max(1, config.num_attention_heads // tp)
    groups = config.num_query_groups or config.num_attention_heads
    kv_heads = max(1, groups // tp)
    itemsize = 4 if str(config.params_dtype) == "torch.float32" else 2
    seq = getattr(config, "cp_seq_length", None)
    seq_local = seq // cp_size if seq else DEFAULT_SEQ_LOCAL
    return AttentionShape(seq_local=max(2, seq_local - seq_local % 2), batch=1, heads=heads, kv_heads=kv_heads,
                          head_dim=config.kv_channels, itemsize=itemsize)


def resolve_placement(mode: str, config, cp_ranks: tuple[int, ...]) -> Placement:
    """The placement of layers running ``mode`` over the CP group of global ``cp_ranks``."""
    s = plugin_settings(config)
    hcp = getattr(config, "hierarchical_context_parallel_sizes", None)
    return _resolve(mode, tuple(cp_ranks), layer_shape(config, len(cp_ranks)), s.gpus_per_node,
                    tuple(sorted(s.options(mode).items())), tuple(hcp) if hcp else None)


@lru_cache(maxsize=64)
def _resolve(mode: str, cp_ranks: tuple[int, ...], shape: AttentionShape, gpus: Optional[int], options: tuple,
             hcp) -> Placement:
    cp = len(cp_ranks)
    kw = dict(options)
    if "ulysses_size" in {s.name for s in option_specs(get_mode(mode).Options)}:  # a Ulysses hybrid
        if not hcp or len(hcp) != 2:
            raise ValueError(f"--cp-comm-type {mode} needs --hierarchical-context-parallel-sizes U M (the all-to-all "
                             f"degree U and the inner CP size M, U * M = {cp}), got {hcp}")
        kw["ulysses_size"] = hcp[0]
    return resolve(mode, cp, shape, ranks_per_node=ranks_per_node(cp_ranks, gpus), **kw)

"""Each plugin layer's :class:`~megatron_mesh.plan.Placement`, resolved once from the config.

The one place that turns Megatron's settings into a mode's placement: the per-rank attention
shape (:meth:`~megatron_mesh.plan.megatron_problem.MegatronProblem.shape`: heads per tensor-parallel
rank, the real ``--seq-length`` per CP rank), the node layout of
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
from .settings import HIERARCHY_FLAG, plugin_settings, problem_of

__all__ = ["resolve_placement", "node_blocks", "ranks_per_node"]


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


def resolve_placement(mode: str, config, cp_ranks: tuple[int, ...]) -> Placement:
    """The placement of layers running ``mode`` over the CP group of global ``cp_ranks``, under
    ``config`` (a transformer config carrying the plugin settings, or Megatron's parsed arguments:
    the start-up check resolves it before the config exists)."""
    s = plugin_settings(config)
    problem = problem_of(config, s)
    return _resolve(mode, tuple(cp_ranks), problem.shape(len(cp_ranks)), s.gpus_per_node,
                    tuple(sorted(s.options(mode).items())), problem.hierarchy)


@lru_cache(maxsize=64)
def _resolve(mode: str, cp_ranks: tuple[int, ...], shape: AttentionShape, gpus: Optional[int], options: tuple,
             hcp) -> Placement:
    cp = len(cp_ranks)
    kw = dict(options)
    if "ulysses_size" in {s.name for s in option_specs(get_mode(mode).Options)}:  # a Ulysses hybrid
        if not hcp or len(hcp) != 2:
            raise ValueError(f"--cp-comm-type {mode} needs {HIERARCHY_FLAG} U M (the all-to-all degree U and the "
                             f"inner CP size M, U * M = {cp}), got {hcp}")
        kw["ulysses_size"] = hcp[0]
    return resolve(mode, cp, shape, ranks_per_node=ranks_per_node(cp_ranks, gpus), **kw)

"""megatron_mesh: Mesh-Attention and TASP context-parallel attention for Megatron-Core.

Public API (layout: Megatron's [s_local, batch, heads, head_dim], zigzag CP chunks)::

    from megatron_mesh import mesh_attention, ring_attention, comm_counter
    out = mesh_attention(q, k, v, group=cp_group, tile=(2, 2), causal=True)

The plan layer (:mod:`megatron_mesh.plan`) is pure Python; the Megatron adapter
(:mod:`megatron_mesh.megatron`) is the only module that imports Megatron.
"""

from .comm.base import CommCount, comm_counter
from .runtime.api import mesh_attention, ring_attention, zigzag_shard, zigzag_unshard

__all__ = ["mesh_attention", "ring_attention", "comm_counter", "CommCount", "zigzag_shard", "zigzag_unshard"]
__version__ = "0.1.0"

"""megatron_mesh: Mesh-Attention and TASP context-parallel attention for Megatron-Core.

Public API (layout: Megatron's [s_local, batch, heads, head_dim], zigzag CP chunks)::

    from megatron_mesh import mesh_attention, ring_attention, tasp_attention, hybrid_attention, comm_counter
    out = mesh_attention(q, k, v, group=cp_group, tile=(2, 2), causal=True)
    out = tasp_attention(q, k, v, group=cp_group, gpus_per_node=8)
    out = hybrid_attention(q, k, v, group=cp_group, ulysses_size=8, inner="mesh")
    out = mesh_attention(q, k, v, group=cp_group, cu_seqlens=docs, window=(4096, 0))   # packed docs, window
    out = tasp_attention(q, k, v, group=cp_group, mask=masks.documents(docs) & masks.chunked(8192))

The plan layer (:mod:`megatron_mesh.plan`) is pure Python and importable without torch, so the
top-level names below are resolved lazily; the Megatron adapter (:mod:`megatron_mesh.megatron`)
is the only module that imports Megatron.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "attention": "megatron_mesh.runtime.api",
    "mesh_attention": "megatron_mesh.runtime.api",
    "ring_attention": "megatron_mesh.runtime.api",
    "tasp_attention": "megatron_mesh.runtime.api",
    "hybrid_attention": "megatron_mesh.runtime.api",
    "zigzag_shard": "megatron_mesh.runtime.api",
    "zigzag_unshard": "megatron_mesh.runtime.api",
    "thd_shard": "megatron_mesh.runtime.api",
    "thd_unshard": "megatron_mesh.runtime.api",
    "layout_shard": "megatron_mesh.runtime.api",
    "layout_unshard": "megatron_mesh.runtime.api",
    "balanced_layout": "megatron_mesh.plan.balance",
    "BalancedLayout": "megatron_mesh.plan.balance",
    "PlanMismatchError": "megatron_mesh.runtime.agreement",
    "check_plans_over": "megatron_mesh.runtime.agreement",
    "ThdLayout": "megatron_mesh.plan.layout",
    "Mask": "megatron_mesh.plan.mask",
    "masks": None,  # the module megatron_mesh.masks
    "comm_counter": "megatron_mesh.comm.base",
    "CommCount": "megatron_mesh.comm.base",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megatron_mesh' has no attribute {name!r}")
    module = _EXPORTS[name]
    if module is None:
        return importlib.import_module(f"megatron_mesh.{name}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)

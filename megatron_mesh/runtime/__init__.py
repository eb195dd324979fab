"""Autograd functions and the executor that walks a plan."""

from .api import (attention_shape, group_communicator, mesh_attention, plan_attention, ring_attention,
                  zigzag_shard, zigzag_unshard)
from .executor import Executor, ForwardResult
from .merge import merge_partial_
from .tasp_api import tasp_attention

__all__ = ["attention_shape", "group_communicator", "mesh_attention", "plan_attention", "ring_attention",
           "zigzag_shard", "zigzag_unshard", "Executor", "ForwardResult", "merge_partial_", "tasp_attention"]

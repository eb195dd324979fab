"""The public API (api), its input checks (inputs), the autograd path (autograd), layouts on
tensors (sharding), plan agreement across ranks (agreement) and the executor that walks a plan."""

from .api import (attention, attention_shape, forward_backward, group_communicator, hybrid_attention, mesh_attention,
                  plan_attention, ring_attention, tasp_attention, thd_shard, thd_unshard, zigzag_shard,
                  zigzag_unshard)
from .executor import Executor, ForwardResult
from .merge import merge_partial_

__all__ = ["attention", "attention_shape", "forward_backward", "group_communicator", "hybrid_attention",
           "mesh_attention", "plan_attention", "ring_attention", "tasp_attention", "thd_shard", "thd_unshard",
           "zigzag_shard", "zigzag_unshard", "Executor", "ForwardResult", "merge_partial_"]

"""The per-rank problem shape of one attention call (a leaf: the type every plan module reads)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AttentionShape"]


@dataclass(frozen=True)
class AttentionShape:
    """Per-rank problem shape: ``seq_local`` tokens of ``batch`` sequences, ``heads`` query heads
    and ``kv_heads`` key/value heads of ``head_dim``, ``itemsize`` bytes per element of q, k, v
    (2 for bf16/fp16, 4 for fp32)."""

    seq_local: int
    batch: int = 1
    heads: int = 1
    kv_heads: int = 1
    head_dim: int = 1
    itemsize: int = 2

    def __post_init__(self) -> None:
        for name in ("seq_local", "batch", "heads", "kv_heads", "head_dim", "itemsize"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads}) "
                "(grouped-query attention shares each KV head among heads/kv_heads query heads)"
            )

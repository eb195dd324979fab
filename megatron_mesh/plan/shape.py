"""The per-rank problem shape of one attention call (a leaf: the type every plan module reads)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AttentionShape"]


@dataclass(frozen=True)
class AttentionShape:
    """Per-rank problem shape: ``seq_local`` tokens of ``batch`` sequences, ``heads`` query heads
    and ``kv_heads`` key/value heads; queries and keys of ``head_dim``, values (and so outputs
    and their gradients) of ``v_head_dim`` (None: ``head_dim``; MLA's differ, e.g. 192 and 128);
    ``itemsize`` bytes per element of q, k, v (2 for bf16/fp16, 4 for fp32)."""

    seq_local: int
    batch: int = 1
    heads: int = 1
    kv_heads: int = 1
    head_dim: int = 1
    itemsize: int = 2
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        for name in ("seq_local", "batch", "heads", "kv_heads", "head_dim", "itemsize", "v_head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads}) "
                "(grouped-query attention shares each KV head among heads/kv_heads query heads)"
            )

    def dim(self, which: str) -> int:
        """The last dimension of a tensor of dim kind ``which`` (:data:`~.ir.KINDS`): "qk" (q, k
        and their gradients) is ``head_dim``, "v" (v, the output, dout, dv) ``v_head_dim``, ""
        (the row statistics lse and delta) 1."""
        return {"qk": self.head_dim, "v": self.v_head_dim, "": 1}[which]

    @property
    def dims_text(self) -> str:
        """"head dim 128", or "head dim 192 (values 128)" where the value head dim differs."""
        values = f" (values {self.v_head_dim})" if self.v_head_dim != self.head_dim else ""
        return f"head dim {self.head_dim}{values}"

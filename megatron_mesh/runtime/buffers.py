"""The executor's named buffers of one rank: allocated per buffer kind (:data:`~..plan.ir.KINDS`:
each tensor at its own head count and last dim -- K and V may differ, MLA), filled with their
initial values where the plan says, and recycled through a pool (steady state: no new
allocations from one step to the next)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ..plan.ir import KINDS, Key, Plan
from .merge import part_of

__all__ = ["Buffers", "accumulator_dtype", "parts"]


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs: partial outputs and gradients never accumulate in 16 bits."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def segments(sel, n: int):
    return ((0, n),) if sel is None else sel


def parts(sel, total: int):
    """(start in the buffer, offset in the selection, length) of each range of ``sel``."""
    pos = 0
    for a, b in segments(sel, total):
        yield a, pos, b - a
        pos += b - a


class Buffers:
    """Named buffers of one rank plus a pool that recycles freed ones (steady state: no new
    allocations from one step to the next)."""

    def __init__(self, plan: Plan, heads: int, kv_heads: int, batch: int, dims: dict[str, int], dtype: torch.dtype,
                 device: torch.device, token_major: set[Key]):
        self.plan = plan
        self.heads, self.kv_heads, self.batch = heads, kv_heads, batch
        self.dims = dims  # a tensor's last dim by its kind's dim name (KINDS): "qk", "v"
        self.dtype, self.device = dtype, device
        self.acc_dtype = accumulator_dtype(dtype)
        self.token_major = token_major
        self.live: dict[Key, tuple[Tensor, ...]] = {}
        self.derived: dict[Key, tuple] = {}  # what a kernel makes of a live buffer once (backward_rows)
        self.owned: set[Key] = set()  # pool-allocated (user inputs are never recycled)
        # the caller's tensors (a cut may be a view of them) and the forward's saved buffers: no op
        # may write them (the validator proves it of a plan; this guards a plan never validated)
        self.read_only: set[Key] = set()
        self.pool: dict[tuple, list[tuple[Tensor, ...]]] = {}
        self.allocations = 0  # buffers created (not recycled): constant per call in steady state

    def _shape(self, key: Key) -> tuple:
        return (key.kind, self.plan.tokens(key), self.plan.head_counts(key, self.heads, self.kv_heads))

    def _new(self, key: Key) -> tuple[Tensor, ...]:
        self.allocations += 1
        kind, tokens, (h, g) = self._shape(key)
        out = []
        for side, dim, dtype in KINDS[kind].tensors:
            heads = h if side == "q" else g
            dt = self.dtype if dtype == "input" else self.acc_dtype
            d = self.dims.get(dim)  # None: a row statistic (lse, delta)
            if d is not None and key in self.token_major:  # the caller's [T, B, H, D] layout, seen as [B, H, T, D]
                t = torch.empty(tokens, self.batch, heads, d, dtype=dt, device=self.device)
                out.append(t.permute(1, 2, 0, 3))
            elif d is not None:
                out.append(torch.empty(self.batch, heads, tokens, d, dtype=dt, device=self.device))
            else:
                out.append(torch.empty(self.batch, heads, tokens, dtype=dt, device=self.device))
        return tuple(out)

    def alloc(self, key: Key) -> tuple[Tensor, ...]:
        if key in self.token_major:
            return self._new(key)
        free = self.pool.get(self._shape(key))
        return free.pop() if free else self._new(key)

    def put(self, key: Key, tensors: tuple[Tensor, ...], owned: bool) -> None:
        self.live[key] = tensors
        self.derived.pop(key, None)
        if owned:
            self.owned.add(key)

    def get(self, key: Key) -> tuple[Tensor, ...]:
        return self.live[key]

    def accumulator(self, key: Key, filled: bool = True, rows=None) -> tuple[Tensor, ...]:
        """The buffer ``key``, created on first use with its initial values (out = 0, lse = -inf;
        gradients and copies 0) in ``rows`` (None: all of them; the plan's ``creation_fills``
        name the rows its creator and later blocks do not write before anything reads them); not
        ``filled``: as allocated, for ops that write all of it first."""
        acc = self.live.get(key)
        if key in self.read_only:
            raise RuntimeError(f"the plan writes into {key}, an input or saved buffer (the caller's tensors or "
                               "what autograd keeps): a plan builder's defect")
        if acc is None:
            acc = self.alloc(key)
            if filled:
                self.fill(key, acc, rows)
            self.put(key, acc, owned=key not in self.token_major)
        return acc

    @staticmethod
    def fill(key: Key, tensors: tuple[Tensor, ...], rows=None) -> None:
        """Set ``rows`` (None: all) of ``tensors``, buffer ``key``, to its kind's initial values."""
        for i, t in enumerate(tensors):
            value = KINDS[key.kind].initial(i)
            for a, _, n in parts(rows, t.shape[2]):
                part_of(t, 2, a, n).fill_(value)

    def derive(self, key: Key, make: Callable[[], tuple]) -> tuple:
        """``make()`` of the live buffer ``key``, made once while it lives (many blocks read it)."""
        got = self.derived.get(key)
        if got is None:
            got = self.derived[key] = make()
        return got

    def free(self, key: Key) -> None:
        tensors = self.live.pop(key)
        self.derived.pop(key, None)
        self.read_only.discard(key)  # a later buffer of that name is a new one
        if key in self.owned:
            self.owned.discard(key)
            self.pool.setdefault(self._shape(key), []).append(tensors)

"""The executor's input cuts (a mixin of :class:`~.executor.Executor`): the rank plan's input
buffers taken from the local q, k, v (and dout, out, lse in the backward).

One token range of all heads is a view of the caller's tensor, and so is a head slice read by
copies alone (:func:`~megatron_mesh.plan.arena.copied_only`); several token ranges, or a head
slice a block reads or that is sent, are copied into their places in the rank's arena -- one copy
or one ``index_select`` per tensor for each group of such buffers laid out one after another
(:attr:`~megatron_mesh.plan.arena.ScratchLayout.cuts`). They read the executor's ``plan`` and
the input buffers it keeps for the backward (``_cut_keys``).

Example: a zigzag rank holding token ranges [0, 4) and [12, 16) of a 16-token sequence takes its
query buffer as one gather of those 8 rows into the arena; a buffer of the range [0, 4) alone is
a view of the caller's tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..plan.ir import Key
from .blocks import take as _take
from .buffers import Buffers, place_view, wire_of

__all__ = ["InputCuts"]


class InputCuts:
    """The input cutting of :class:`~.executor.Executor` (see the module docstring)."""

    def _inputs(self, bufs: Buffers, table: dict, sources: dict, views: frozenset = frozenset()) -> None:
        """Cut the rank plan's input buffers from the local tensors: one token range of all heads
        is a view, and so is a head slice in ``views`` (read by copies alone,
        :func:`~megatron_mesh.plan.arena.copied_only`); several ranges or another head slice are
        copied into their places in the arena, one gather per tensor for each group of them
        (:attr:`~megatron_mesh.plan.arena.ScratchLayout.cuts`)."""
        cut = {key for keys, *_ in bufs.layout.cuts for key in keys}
        copied = set(self._cut_keys[bufs.direction]) - cut  # kept for the backward: copied for the call
        for key, segs in table.items():
            if key not in cut:
                tensors = self._cut(bufs, key, segs, sources[key.kind])
                if key in copied:
                    own = bufs.own(key)
                    torch._foreach_copy_(list(own), list(tensors))
                    tensors = own
                bufs.put(key, tensors)
                bufs.read_only.add(key)
        for g, (keys, runs, slices) in enumerate(bufs.layout.cuts):
            self._gather(bufs, g, keys, runs, slices, table, sources[keys[0].kind])
            for key in keys:
                bufs.put(key, bufs.view((-1, key)), (-1, key))
                bufs.read_only.add(key)

    def _gather(self, bufs: Buffers, g: int, keys, runs, slices: int, table: dict, tensors) -> None:
        """Fill input cut group ``g`` (``keys``, laid out one after another per tensor in ``runs``,
        ``slices`` head slices after each other, :func:`~megatron_mesh.plan.arena_runs.cut_groups`) from
        the local ``tensors``: per tensor one copy (one token range) or one gather."""
        first = keys[:len(keys) // slices]  # the first head slice's keys: every slice has their tokens
        heads = None
        if keys[0].heads >= 0:
            heads = (self.plan.head_range(keys[0], bufs.heads, bufs.kv_heads)[0],
                     self.plan.head_range(keys[-1], bufs.heads, bufs.kv_heads)[1])
        segs = [seg for key in first for seg in table[key]]
        index = None
        for t, (x, run) in enumerate(zip(tensors, runs)):
            if not run.width:  # a row statistic, [B, H, T]: each buffer on its own
                for key in keys:
                    h = self.plan.head_range(key, bufs.heads, bufs.kv_heads)
                    (dst,) = (bufs.view((-1, key))[t],)
                    dst.copy_(_take(x if h is None else x.narrow(1, h[0], h[1] - h[0]), table[key]))
                continue
            if heads is not None:
                x = x.narrow(1, heads[0], heads[1] - heads[0])
            dst = bufs.views.get(("cut", g, t))
            if dst is None:
                dst = wire_of(place_view(bufs.arena, run, bufs.dtype))  # [T, B, H, W]
                if slices > 1:  # slice after slice: [T, B, slices, h, W] over [slices, T, B, h, W]
                    dst = dst.view(slices, -1, *dst.shape[1:]).permute(1, 2, 0, 3, 4)
                bufs.views[("cut", g, t)] = dst
            src = x.permute(2, 0, 1, 3)
            if slices > 1:
                src = src.unflatten(2, (slices, -1))
            if len(segs) == 1:
                dst.copy_(src[segs[0][0]:segs[0][1]])
                continue
            if index is None:
                index = bufs.views.get(("index", g))
                if index is None:
                    index = bufs.views[("index", g)] = torch.tensor(
                        [i for a, b in segs for i in range(a, b)], dtype=torch.long, device=x.device)
            torch.index_select(src, 0, index, out=dst)

    def _cut(self, bufs: Buffers, key: Key, segs, tensors) -> tuple[Tensor, ...]:
        """The view of input buffer ``key`` (one token range ``segs``, its head slice) of the
        local ``tensors``."""
        heads = self.plan.head_range(key, bufs.heads, bufs.kv_heads) if key.heads >= 0 else None
        out = []
        for t in tensors:
            if heads is not None and t is not None:
                t = t.narrow(1, heads[0], heads[1] - heads[0])
            out.append(_take(t, segs))
        return tuple(out)

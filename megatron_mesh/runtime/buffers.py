"""The executor's named buffers of one rank and direction.

Most live in the rank's **arena** (:mod:`megatron_mesh.plan.arena`: one block of bytes per
direction, laid out once per plan and shape, where each buffer the plan creates has a fixed
place): :class:`~.state.Scratch` keeps it, and the views of every buffer in it, from call to call, so a
step allocates nothing there and issues no view ops for it -- and a CUDA graph finds the same
addresses every replay. What the call returns (the rank's output and gradients, token-major as
Megatron reads them) and what outlives it (the buffers the forward keeps for the backward) are
allocated per call (:meth:`Buffers.own`).

Storage: each tensor of a head dim is token-major, [T, B, H, W] in memory, seen as [B, H, T, W];
a row statistic (lse, delta) is [B, H, T]. Every buffer's tensors are contiguous in that storage,
which is what a transfer sends and receives (:meth:`Buffers.wire`); an input that is a view of
the caller's [T, B, H, D] tensor is sent as it is.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ..plan.arena import TensorPlace, scratch_layout
from ..plan.ir import KINDS, Key, Plan
from ..plan.shape import AttentionShape
from .merge import part_of
from .state import RUNTIME, Arenas, Scratch

__all__ = ["Buffers", "Scratch", "Arenas", "scratch", "accumulator_dtype", "parts", "wire_of", "place_view", "zero",
           "one_allocation", "arena_run", "arena_run_by_buffer"]


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


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def place_view(arena: Tensor, p: TensorPlace, dtype: torch.dtype) -> Tensor:
    """The tensor at ``p`` in ``arena`` (bytes): [B, H, T, W] over token-major storage, or a row
    statistic [B, H, T]."""
    flat = arena[p.offset:p.offset + p.nbytes].view(dtype)
    if p.width:
        return flat.view(p.tokens, p.batch, p.heads, p.width).permute(1, 2, 0, 3)
    return flat.view(p.batch, p.heads, p.tokens)


def wire_of(t: Tensor) -> Tensor:
    """What a transfer moves of buffer tensor ``t``: its storage ([T, B, H, W] of a [B, H, T, W]
    view; a row statistic as it is) -- contiguous for every buffer the executor made; a copy
    where a caller's tensor is not."""
    w = t.permute(2, 0, 1, 3) if t.dim() == 4 else t
    return w if w.is_contiguous() else w.contiguous()


def scratch(device: torch.device, rank: int, arenas: Arenas | None = None, members: object = None) -> Scratch:
    """The arena of ``rank`` of the group ``members`` (:attr:`~megatron_mesh.comm.base.Communicator.members`)
    on ``device`` in ``arenas`` (None: the process's, ``RUNTIME.arenas``)."""
    return (RUNTIME.arenas if arenas is None else arenas).get(device, rank, members)


class Buffers:
    """Named buffers of one rank and direction: in the arena where the plan's layout places them
    (:meth:`create`), else allocated for the call (:meth:`own`)."""

    def __init__(self, plan: Plan, rank: int, direction: str, shape: AttentionShape, dtype: torch.dtype,
                 device: torch.device, arenas: Arenas | None = None, members: object = None):
        self.plan = plan
        self.heads, self.kv_heads, self.batch = shape.heads, shape.kv_heads, shape.batch
        self.shape = shape
        self.dims = {"qk": shape.head_dim, "v": shape.v_head_dim}
        self.dtype, self.device = dtype, device
        self.rank = rank
        self.acc_dtype = accumulator_dtype(dtype)
        self.direction = direction
        self.layout = scratch_layout(plan, rank, direction, shape)
        self.scratch = scratch(device, rank, arenas, members)
        size = max(scratch_layout(plan, rank, d, shape).size for d in ("forward", "backward"))
        self.views = self.scratch.bind(self.layout, device, (dtype, self.acc_dtype), size)
        self.arena = self.scratch.arena
        self.at = -1  # the index of the op being run (the layout places buffers by the op that makes them)
        self.live: dict[Key, tuple[Tensor, ...]] = {}
        self.ids: dict[Key, tuple] = {}  # live key -> its arena buffer (op index, key)
        self.made = None  # the arena buffer the last create() took (None: one of its own)
        self.derived: dict[Key, tuple] = {}  # what a kernel makes of a live buffer once (backward_rows)
        # the caller's tensors (a cut may be a view of them) and the forward's saved buffers: no op
        # may write them (the validator proves it of a plan; this guards a plan never validated)
        self.read_only: set[Key] = set()
        self.allocations = 0  # buffers allocated for the call (outputs, kept buffers)
        self.queue = None  # the executor's queue of copies and adds (:mod:`.deferred`)
        self.results: dict[Key, tuple[Tensor, ...]] = {}  # results in the inputs' dtype (results.py)

    def _dtype(self, kind: str, i: int) -> torch.dtype:
        return self.dtype if KINDS[kind].tensors[i][2] == "input" else self.acc_dtype

    def view(self, ident: tuple) -> tuple[Tensor, ...]:
        """The tensors of arena buffer ``ident`` (made once per arena and layout)."""
        got = self.views.get(ident)
        if got is None:
            kind = ident[1].kind
            got = self.views[ident] = tuple(place_view(self.arena, p, self._dtype(kind, i))
                                            for i, p in enumerate(self.layout.places[ident]))
        return got

    def wire(self, key: Key, tensors: tuple | None = None, ident_of=None) -> list[Tensor]:
        """What a transfer of buffer ``key`` moves (:func:`wire_of` of each tensor), made once per
        arena buffer; ``tensors``, ``ident_of``: a buffer just made for a receive (live at its
        wait) and its arena buffer."""
        ident = self.ids.get(key) if tensors is None else ident_of
        if ident is None:
            return [wire_of(t) for t in (self.live[key] if tensors is None else tensors)]
        got = self.views.get(("wire", ident))
        if got is None:
            got = self.views[("wire", ident)] = [wire_of(t) for t in self.view(ident)]
        return got

    def grad_span(self, i: int) -> tuple[Tensor, ...] | None:
        """The dK, dV runs backward block ``i``'s new gradient partials make together
        (:attr:`~megatron_mesh.plan.arena.ScratchLayout.grad_spans`)."""
        return self._runs("grads", self.layout.grad_spans, i, self.acc_dtype)

    def span(self, i: int) -> tuple[Tensor, ...] | None:
        """The key/value tensors op ``i`` reads as one run of the arena (:attr:`ScratchLayout.spans`)."""
        return self._runs("span", self.layout.spans, i, self.dtype)

    def _runs(self, what: str, table: dict, i: int, dtype: torch.dtype) -> tuple[Tensor, ...] | None:
        places = table.get(i)
        if places is None:
            return None
        got = self.views.get((what, i))
        if got is None:
            got = self.views[(what, i)] = tuple(place_view(self.arena, p, dtype) for p in places)
        return got

    def own(self, key: Key) -> tuple[Tensor, ...]:
        """A buffer allocated for this call, in the arena's storage order: one allocation for all
        its tensors (K and V's gradients, returned together), except a partial output's, whose
        lse outlives its values (a bf16 caller keeps the lse and a cast of the values)."""
        self.allocations += 1
        tokens = self.plan.tokens(key)
        h, g = self.plan.head_counts(key, self.heads, self.kv_heads)
        specs = []
        for i, (side, dim, _) in enumerate(KINDS[key.kind].tensors):
            heads, dt = (h if side == "q" else g), self._dtype(key.kind, i)
            specs.append(((tokens, self.batch, heads, self.dims[dim]) if dim else (self.batch, heads, tokens), dt))
        if key.kind == "o" or len({dt for _, dt in specs}) > 1:
            flats = [torch.empty(shape, dtype=dt, device=self.device) for shape, dt in specs]
            return tuple(f.permute(1, 2, 0, 3) if f.dim() == 4 else f for f in flats)
        return one_allocation([shape for shape, _ in specs], specs[0][1], self.device)

    def gather(self, i: int) -> tuple[Tensor, Tensor] | None:
        """K and V of op ``i``'s pieces, gathered together by one op where the layout says so
        (:attr:`~megatron_mesh.plan.arena.ScratchLayout.gathers`)."""
        g = self.layout.gathers.get(i)
        if g is None:
            return None
        ident = ("gather", i)
        got = self.views.get(ident)
        if got is None:
            window, delta, rows = g
            el = window.itemsize
            typed = self.arena[:self.arena.numel() // el * el].view(self.dtype)
            w = window.width
            pair = typed.as_strided((2, window.tokens, window.batch, window.heads, w),
                                    (delta // el, window.row // el, window.heads * w, w, 1), window.offset // el)
            got = self.views[ident] = (pair, torch.tensor(rows, dtype=torch.long, device=self.device))
        pair, index = got
        both = torch.index_select(pair, 1, index)
        return both[0].permute(1, 2, 0, 3), both[1].permute(1, 2, 0, 3)

    def create(self, key: Key) -> tuple[Tensor, ...]:
        """Buffer ``key`` as op :attr:`at` makes it: its place in the arena (:attr:`made` names
        it, for :meth:`put`), or its own memory (:attr:`made` None)."""
        ident = (self.at, key)
        if ident not in self.layout.places:
            self.made = None
            return self.own(key)
        queue = self.queue
        if queue and any(self.layout.overlap(ident, other) for other in queue.arena):
            queue.flush()  # queued writes still read or write the memory this buffer takes over
        self.made = ident
        return self.view(ident)

    def put(self, key: Key, tensors: tuple[Tensor, ...], ident=None) -> None:
        """``key`` is live with ``tensors``; ``ident``: its arena buffer (None: outside the arena)."""
        self.live[key] = tensors
        self.derived.pop(key, None)
        if ident is None:
            self.ids.pop(key, None)
        else:
            self.ids[key] = ident

    def get(self, key: Key) -> tuple[Tensor, ...]:
        return self.live[key]

    def ident(self, key: Key):
        """The arena buffer (op index, key) of live buffer ``key``; None outside the arena."""
        return self.ids.get(key)

    def accumulator(self, key: Key, filled: bool = True, rows=None, zeros: list | None = None) -> tuple[Tensor, ...]:
        """The buffer ``key``, created on first use with its initial values (out = 0, lse = -inf;
        gradients and copies 0) in ``rows`` (None: all of them; the plan's ``creation_fills``
        name the rows its creator and later blocks do not write before anything reads them); not
        ``filled``: as allocated, for ops that write all of it first. ``zeros``: where to leave
        the tensors to set to 0, for the caller to zero together with others (:func:`zero`)."""
        acc = self.live.get(key)
        if key in self.read_only:
            raise RuntimeError(f"the plan writes into {key}, an input or saved buffer (the caller's tensors or "
                               "what autograd keeps): a plan builder's defect")
        if acc is None:
            acc = self.create(key)
            ident = self.made
            if filled:
                self.fill(key, acc, rows, zeros)
            self.put(key, acc, ident)
        return acc

    @staticmethod
    def fill(key: Key, tensors: tuple[Tensor, ...], rows=None, zeros: list | None = None) -> None:
        """Set ``rows`` (None: all) of ``tensors``, buffer ``key``, to its kind's initial values
        (the zeros of all of them in one op; with ``zeros``, left there for the caller)."""
        mine = [] if zeros is None else zeros
        for i, t in enumerate(tensors):
            value = KINDS[key.kind].initial(i)
            for a, _, n in parts(rows, t.shape[2]):
                if value == 0:
                    mine.append(part_of(t, 2, a, n))
                else:
                    part_of(t, 2, a, n).fill_(value)
        if zeros is None:
            zero(mine)

    def derive(self, key: Key, make: Callable[[], tuple]) -> tuple:
        """``make()`` of the live buffer ``key``, made once while it lives (many blocks read it)."""
        got = self.derived.get(key)
        if got is None:
            got = self.derived[key] = make()
        return got

    def free(self, key: Key) -> None:
        self.live.pop(key)
        self.ids.pop(key, None)
        self.derived.pop(key, None)
        self.read_only.discard(key)  # a later buffer of that name is a new one


def one_allocation(shapes, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, ...]:
    """Tensors of ``shapes`` (token-major [T, B, H, W], or a row statistic's [B, H, T]) in one
    allocation, one after another, each seen as the executor sees it ([B, H, T, W])."""
    whole = torch.empty(sum(_numel(shape) for shape in shapes), dtype=dtype, device=device)
    out, pos = [], 0
    for shape in shapes:
        flat = whole[pos:pos + _numel(shape)].view(shape)
        out.append(flat.permute(1, 2, 0, 3) if flat.dim() == 4 else flat)
        pos += _numel(shape)
    return tuple(out)


def zero(tensors: list[Tensor]) -> None:
    """Set ``tensors`` to 0 in one op."""
    if len(tensors) > 1:
        torch._foreach_zero_(tensors)
    elif tensors:
        tensors[0].zero_()


def arena_run(bufs: Buffers, i: int, places: tuple, kind: str, side: str = "src") -> tuple[Tensor, ...]:
    """The tensors of a run of whole buffers of ``kind`` lying side by side in ``bufs``' arena
    (``places``: each tensor's, :class:`~megatron_mesh.plan.arena_runs.CopyRun`), made once per
    arena: ``side`` and op ``i`` name it."""
    ident = ("run", side, i)
    got = bufs.views.get(ident)
    if got is None:
        got = bufs.views[ident] = tuple(place_view(bufs.arena, p, bufs._dtype(kind, t)) for t, p in enumerate(places))
    return got


def arena_run_by_buffer(bufs: Buffers, i: int, buffers: int) -> tuple[Tensor, ...]:
    """The source run of op ``i``'s :class:`~megatron_mesh.plan.arena_runs.CopyRun` as [B, buffers,
    heads, T, W] per tensor: its ``buffers`` equal buffers side by side (made once per arena)."""
    ident = ("run by buffer", i)
    got = bufs.views.get(ident)
    if got is None:
        run = bufs.layout.copy_runs[i]
        kind = bufs.plan.rank(bufs.rank).ops(bufs.direction)[i].src.kind
        got = bufs.views[ident] = tuple(t.unflatten(2, (buffers, -1)).transpose(1, 2)
                                        for t in arena_run(bufs, i, run.src, kind))
    return got

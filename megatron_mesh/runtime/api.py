"""Public, differentiable entry points -- ``mesh_attention``, ``ring_attention``,
``tasp_attention``, ``hybrid_attention``, all thin wrappers of :func:`attention` -- plus the
layout helpers (shard / unshard under any layout).

Layout is Megatron's: q [s_local, batch, heads, head_dim], k/v [s_local, batch, kv_heads,
head_dim] (v's head dim may differ: MLA), each rank holding its chunk of the global sequence: Megatron's zigzag by default
(:class:`megatron_mesh.plan.ZigzagLayout`), or a layout that places documents (``layout=``):
the work-balanced :class:`megatron_mesh.BalancedLayout` (:func:`megatron_mesh.balanced_layout`)
or Transformer Engine's THD layout (:class:`megatron_mesh.plan.ThdLayout`). Every mode takes the
same inputs, so switching modes never touches the data.

One call: check the tensors and options (errors name the value and what is allowed) -> resolve
the mode's :class:`~megatron_mesh.plan.Placement` -> the plan for (placement, shape, mask,
layout) (cached) -> check that every rank of the group makes the same call (:mod:`.agreement`:
one small all-reduce per call) -> the executor, forward under autograd, backward when autograd
asks.
"""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.alltoall import AllToAllCommunicator
from ..comm.base import Communicator
from ..comm.torch_dist import TorchDistCommunicator
from ..kernels import BlockKernel, check_head_dims, get_kernel
from ..plan.ir import Plan
from ..plan.mask import Mask
from ..plan.maskkinds import MaskKind
from ..plan.modes import HYBRID_PREFIX, MODES, TRANSPORTS, Placement, option_specs, resolve
from ..plan.modes.mesh import MeshOptions, RingOptions
from ..plan.modes.tasp import TaspOptions
from ..plan.shape import AttentionShape
from ..plan.validate import validate_plan
from . import agreement
from .agreement import PlanMismatchError
from .autograd import PlanAttention, compiler_boundary, forward_backward
from .executor import Executor
from .inputs import attention_mask, attention_shape, check_scale, integer_scalar, scale_of
from .masks import mask_piece
from .sinks import check_offset, sink_kind
from .sharding import layout_shard, layout_unshard, thd_shard, thd_unshard, zigzag_shard, zigzag_unshard
from .state import RUNTIME, LayoutCalls

__all__ = ["attention", "mesh_attention", "ring_attention", "tasp_attention", "hybrid_attention", "plan_attention",
           "forward_backward", "zigzag_shard", "zigzag_unshard", "thd_shard", "thd_unshard", "layout_shard",
           "layout_unshard", "attention_shape",
           "group_communicator", "attention_mask", "PlanMismatchError", "prebuild"]


# -- communicators --------------------------------------------------------------------------------------
class _SingleRank(Communicator):
    rank, world_size = 0, 1

    def _start(self, sends, recvs):  # a one-rank plan has no transfers
        raise RuntimeError("a single-rank group has no peers")


def group_communicator(group, transport: str = "p2p") -> Communicator:
    """A communicator over ``group`` (None: the default group; without an initialised default
    group, a single rank). Made per call from the *live* group, so a re-initialised process group
    is never served a stale one (building one is cheap)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return _SingleRank()
    if transport == "alltoall":
        return AllToAllCommunicator(group)
    return TorchDistCommunicator(group)


@lru_cache(maxsize=128)
def _plan(placement: Placement, shape: AttentionShape, mask: Mask, layout) -> Plan:
    plan = placement.build(shape, mask, layout)
    if os.environ.get("MEGATRON_MESH_VALIDATE") == "1":  # debugging: prove every new plan before running it
        validate_plan(plan)
    return plan


def prebuild(layout, calls: LayoutCalls | None = None) -> int:
    """Build, now, the plans the coming calls on ``layout`` will need: for every attention call
    recently made on another layout of the same CP size and tokens per rank (same placement,
    shape, mask, rank; ``calls``: the memory of them, None: the process's, ``RUNTIME.calls``),
    this rank's plan of ``layout`` goes into the plan cache that :func:`prepare` reads. What a
    background thread runs for the next micro-batch's layouts
    (:mod:`megatron_mesh.megatron.batch_layout`), so that the step finds its plans built. Returns
    how many plans it built (0 before the first call on a layout).

    Example: after a step of ``attention(q, k, v, mode="tasp", layout=L1)`` on rank 3,
    ``prebuild(L2)`` builds rank 3's TASP plan of L2; the next step's call with ``layout=L2``
    finds it (no plan build on the step's critical path)."""
    calls = RUNTIME.calls if calls is None else calls
    built = 0
    for placement, shape, head, rank in calls.recent():
        if placement.world_size != layout.world_size or shape.seq_local != layout.seq_local:
            continue
        mask, normal = attention_mask(layout.world_size, shape, mask=head, layout=layout)
        _plan(placement, shape, mask, normal).rank(rank)
        built += 1
    return built


@dataclass
class Prepared:
    """Everything one rank needs to run one attention call (see :func:`prepare`)."""

    plan: Plan
    placement: Placement
    comm: Communicator
    kernel: BlockKernel
    scale: float

    def executor(self, timer=None) -> Executor:
        return Executor(self.plan, self.comm, self.kernel, self.scale, timer)


def prepare(q: Tensor, k: Tensor, v: Tensor, *, mode: str = "mesh", group=None, comm: Communicator | None = None,
            causal: bool | None = None, window=None, cu_seqlens=None, layout=None, softmax_scale: float | None = None,
            kernel: "str | BlockKernel" = "auto", placement: Placement | None = None, softmax_offset=None,
            mask: MaskKind | None = None, **settings) -> Prepared:
    """Check everything and build (or fetch) the plan of one call; ``settings`` go to the mode
    (see :func:`megatron_mesh.plan.resolve`). ``placement`` skips the resolution (the
    Megatron adapter resolves it once per layer). ``softmax_offset`` is checked and agreed on;
    the plan does not depend on it (a sink adds no bytes: :mod:`.sinks`)."""
    own = group_communicator(group) if comm is None else comm  # also checks this rank is in the group
    with agreement.joined_on_error(own):  # a rank whose input fails still joins the check: no rank waits for it
        shape = attention_shape(q, k, v)
        check_scale(softmax_scale)
        check_offset(softmax_offset, shape.heads, q.device)
        kern = get_kernel(kernel, q.device)
        mask_piece(q.device)  # this process's setting, read here: a bad one fails before the check, not after
        check_head_dims(kern, shape.head_dim, shape.v_head_dim)
        P = own.world_size
        mask, layout = attention_mask(P, shape, causal=causal, window=window, cu_seqlens=cu_seqlens, layout=layout,
                                      mask=mask)
        if "gpus_per_node" in settings:  # the wrappers' (and their docs') name for the plan's ranks_per_node
            if "ranks_per_node" in settings:
                raise ValueError("pass gpus_per_node or ranks_per_node (the same setting), not both")
            settings["ranks_per_node"] = settings.pop("gpus_per_node")
        if placement is None:
            items = tuple(sorted((k, _setting(k, v)) for k, v in settings.items()))
            placement = _resolve(mode, P, shape, Mask(mask.causal), items, repr(items))
        elif placement.world_size != P:
            raise ValueError(f"placement for {placement.world_size} ranks used on a CP group of {P}")
        plan = _plan(placement, shape, mask, layout)
        if layout.documents() is not None:  # a packed sample's layout: the next samples' plans can be built ahead
            RUNTIME.calls.remember(placement, shape, mask.without_documents(), own.rank)
    if comm is None:
        comm = own if placement.transport == "p2p" else group_communicator(group, placement.transport)
    scale = scale_of(shape, softmax_scale)
    agreement.check(comm, agreement.Call(plan, placement, tuple(q.shape), tuple(k.shape), q.dtype, scale, kern,
                                         backward_follows(q, k, v, softmax_offset), shape.v_head_dim,
                                         sink_kind(softmax_offset)))
    return Prepared(plan, placement, comm, kern, scale)


def backward_follows(q: Tensor, k: Tensor, v: Tensor, softmax_offset: Tensor | None = None) -> bool:
    """Whether autograd records this call, so that a backward (with its own transfers) follows it."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, softmax_offset))


@lru_cache(maxsize=256)
def _resolve(mode: str, P: int, shape: AttentionShape, mask: Mask, settings: tuple, typed_key: str) -> Placement:
    """The placement of a call's settings, cached. ``typed_key`` (the settings' repr) keeps 1, 1.0
    and True apart: they are one key to lru_cache, yet resolve accepts one and refuses the others,
    so a refused value must never be served the placement an equal valid one left in the cache."""
    kw = dict(settings)
    return resolve(mode, P, shape, ranks_per_node=kw.pop("ranks_per_node", None), mask=mask, **kw)


def _setting(name: str, v):
    """A setting's value as the plan layer takes it and the placement cache keys it: lists and
    numpy arrays as tuples, integer scalars of numpy / torch as ints; a value that cannot be a
    key (a dict, a set) is a ValueError naming the setting."""
    if type(v).__module__ == "numpy" and hasattr(v, "tolist"):  # arrays and scalars
        v = v.tolist()
    if isinstance(v, (list, tuple)):
        return tuple(_setting(name, x) for x in v)
    v = integer_scalar(v)
    try:
        hash(v)
    except TypeError:
        raise ValueError(f"setting {name} must be a number, a string or a sequence of them, got {v!r}") from None
    return v


@compiler_boundary
def attention(q: Tensor, k: Tensor, v: Tensor, *, mode: str = "mesh", group=None, mask: MaskKind | None = None,
              causal: bool | None = None, window=None, cu_seqlens=None, layout=None,
              softmax_scale: float | None = None, softmax_offset: Tensor | None = None,
              kernel: "str | BlockKernel" = "auto", comm: Communicator | None = None, timer=None,
              **settings) -> Tensor:
    """Context-parallel attention over the CP group ``group`` (None: the default process group)
    with CP mode ``mode`` (``"mesh"``, ``"ring"``, ``"tasp"``, ``"a2a+mesh"``, ``"a2a+tasp"``,
    ``"a2a+ring"``; ``settings`` are the mode's, see the wrappers below).

    Args:
        q: [s_local, batch, heads, head_dim], this rank's chunk of the global sequence.
        k, v: [s_local, batch, kv_heads, head_dim] and [s_local, batch, kv_heads, v_head_dim];
            heads % kv_heads == 0 (GQA / MQA); v_head_dim may differ from head_dim (MLA: 192 and
            128), the output then has v's head dim (CPU: every kernel; CUDA: see
            :func:`megatron_mesh.kernels.get_kernel`).
        mask: which (query, key) pairs attend, a mask of :mod:`megatron_mesh.masks` (e.g.
            ``masks.documents(cu) & masks.chunked(8192)``); or, instead of it (not both), the loose
            arguments below that build one.
        causal: causal (True, the default) or full (False) attention over the global sequence.
        window: (left, right) sliding window (None = unlimited on that side; right must be 0 or
            None when causal): query i attends key j only if i - j <= left and j - i <= right.
        cu_seqlens: packed documents -- their boundaries over the global (unsharded) sequence,
            0 = c0 < c1 < ... < cn = S (Megatron's zigzag layout with documents anywhere).
        layout: None (Megatron's zigzag), a :class:`megatron_mesh.BalancedLayout` (from
            :func:`megatron_mesh.balanced_layout`: work-balanced and document-aware; its documents
            are the mask's) or a :class:`megatron_mesh.ThdLayout` (Transformer Engine's THD layout:
            each packed sequence padded to 2 * CP and split on its own; its sequences are the
            documents). Either gives the documents: cu_seqlens must then be None. See
            :func:`layout_shard`.
        softmax_scale: defaults to 1 / sqrt(head_dim).
        softmax_offset: attention sinks (Megatron's ``softmax_offset``, ``softmax_type``
            "off-by-one": zeros, "learnable": a parameter): a tensor [heads], one logit per query
            head added to every row's softmax denominator (not scaled). Applied once where the
            rows' partial results are merged: no extra bytes. Where it requires grad, its
            gradient on each rank is the sum over the rows that rank finished, so the CP group's
            sum (Megatron's gradient reduction) is the whole gradient.
        kernel: block kernel backend ("auto", "torch", "math", "torch-flash", ...) or an instance.
        comm: an explicit communicator (tests, in-process transports).
        timer: ``timer("compute")`` / ``timer("wait")`` context managers around kernel calls and
            waits (e.g. Megatron's timers).

    Returns the attention output, [s_local, batch, heads, v_head_dim] in q's dtype; differentiable
    w.r.t. q, k, v and softmax_offset (one backward). Only the (query, key) pairs the mask allows
    are computed and only the tokens they need are sent. Under ``torch.autocast`` the inputs are
    cast to its dtype first and the output has it, as torch's own attention does (the partial
    results still accumulate in fp32); under ``torch.compile`` the call runs eagerly (one graph
    break, :func:`~.autograd.compiler_boundary`).
    """
    cast = _autocast_dtype(q)
    if cast is not None:  # the inputs in autocast's dtype, as autocast gives torch's own attention
        with torch.autocast(q.device.type, enabled=False):
            return attention(q.to(cast), k.to(cast), v.to(cast), mode=mode, group=group, mask=mask, causal=causal,
                             window=window, cu_seqlens=cu_seqlens, layout=layout, softmax_scale=softmax_scale,
                             softmax_offset=softmax_offset, kernel=kernel, comm=comm, timer=timer, **settings)
    call = prepare(q, k, v, mode=mode, group=group, comm=comm, causal=causal, window=window, cu_seqlens=cu_seqlens,
                   layout=layout, softmax_scale=softmax_scale, kernel=kernel, softmax_offset=softmax_offset, mask=mask,
                   **settings)
    return PlanAttention.apply(q, k, v, call.executor(timer), softmax_offset)


def _autocast_dtype(q: Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` gives torch's own attention on q's device type (it is on
    autocast's lower-precision list), or None where autocast is off there. Without it an fp32 model
    under autocast ran this attention in fp32 without a word: right, and slower than it asked for."""
    device = q.device.type
    if not q.is_floating_point() or q.dtype == torch.float64:  # autocast's rule: an fp64 reference stays fp64
        return None
    try:
        enabled = torch.is_autocast_enabled(device)
    except RuntimeError:  # a device type autocast does not know ("meta"): the kernel's check names the device
        return None
    return torch.get_autocast_dtype(device) if enabled else None


def _options_doc(options_type: type, names: tuple[str, ...]) -> str:
    """The ``Args`` lines of a wrapper's mode options, from the mode's Options (their one owner)."""
    helps = {s.name: s.help for s in option_specs(options_type)}
    return "\n".join(textwrap.fill(f"{name}: {helps[name]}", 100, initial_indent=" " * 8,
                                    subsequent_indent=" " * 12, break_on_hyphens=False) for name in names)


def _takes_options(options_type: type, *names: str):
    """The wrapper takes ``names``, options of ``options_type`` (their defaults are the Options'
    own, read in the signature); their help goes into its docstring."""
    def wrap(fn):
        fn.mode_options = (options_type, names)
        fn.__doc__ = fn.__doc__.rstrip() + "\n\n    Mode options (:class:`~megatron_mesh.plan.modes." + \
            f"{options_type.__module__.rsplit('.', 1)[-1]}.{options_type.__name__}`):\n" + \
            _options_doc(options_type, names) + "\n"
        return fn
    return wrap


@compiler_boundary
@_takes_options(MeshOptions, "tile", "contiguous", "schedule", "backward_chunks", "backward_keep_limit")
def mesh_attention(q: Tensor, k: Tensor, v: Tensor, *, group=None, tile=MeshOptions.tile, mask: MaskKind | None = None,
                   causal: bool | None = None,
                   window=None, cu_seqlens=None, layout=None, softmax_scale: float | None = None,
                   softmax_offset: Tensor | None = None, schedule: str = MeshOptions.schedule,
                   backward_chunks: str = MeshOptions.backward_chunks, contiguous: str = MeshOptions.contiguous,
                   backward_keep_limit: float = MeshOptions.backward_keep_limit,
                   gpus_per_node: int | None = None, kernel: "str | BlockKernel" = "auto",
                   comm: Communicator | None = None) -> Tensor:
    """Mesh-Attention (see :func:`attention` for the common arguments). ``tile`` is (a, b) with
    a * b == CP size, an "AxB" string or "auto" (chosen for nodes of ``gpus_per_node`` CP ranks,
    one node when None); (1, P) is ring attention."""
    return attention(q, k, v, mode="mesh", group=group, mask=mask, causal=causal, window=window, cu_seqlens=cu_seqlens,
                     layout=layout, softmax_scale=softmax_scale, softmax_offset=softmax_offset, kernel=kernel,
                     comm=comm, tile=tile, schedule=schedule, backward_chunks=backward_chunks, contiguous=contiguous,
                     backward_keep_limit=backward_keep_limit, ranks_per_node=gpus_per_node)


@compiler_boundary
@_takes_options(RingOptions, "backward_chunks", "backward_keep_limit")
def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, group=None, mask: MaskKind | None = None,
                   causal: bool | None = None, window=None,
                   cu_seqlens=None, layout=None, softmax_scale: float | None = None,
                   softmax_offset: Tensor | None = None, backward_chunks: str = RingOptions.backward_chunks,
                   backward_keep_limit: float = RingOptions.backward_keep_limit,
                   kernel: "str | BlockKernel" = "auto", comm: Communicator | None = None) -> Tensor:
    """Ring attention (zigzag, as Transformer Engine's ``p2p``): Mesh-Attention with tile (1, P).
    Same arguments and layout as :func:`attention`."""
    return attention(q, k, v, mode="ring", group=group, mask=mask, causal=causal, window=window, cu_seqlens=cu_seqlens,
                     layout=layout, softmax_scale=softmax_scale, softmax_offset=softmax_offset, kernel=kernel,
                     comm=comm, backward_chunks=backward_chunks, backward_keep_limit=backward_keep_limit)


@compiler_boundary
@_takes_options(TaspOptions, "transport", "backward_chunks", "backward_keep_limit")
def tasp_attention(q: Tensor, k: Tensor, v: Tensor, *, group=None, mask: MaskKind | None = None,
                   causal: bool | None = None, window=None,
                   cu_seqlens=None, layout=None, softmax_scale: float | None = None,
                   softmax_offset: Tensor | None = None, gpus_per_node: int | None = None,
                   transport: str = TaspOptions.transport, backward_chunks: str = TaspOptions.backward_chunks,
                   backward_keep_limit: float = TaspOptions.backward_keep_limit,
                   kernel: "str | BlockKernel" = "auto", comm: Communicator | None = None) -> Tensor:
    """TASP attention (see :func:`attention` for the common arguments).

    ``gpus_per_node``: None -- one Hamiltonian decomposition over the whole group (one node); m --
    the group spans nodes of m consecutive CP ranks: m rings chained over the nodes, one
    inter-node send per rank per step. Must divide the CP size; m = 3 and 5 are impossible (no
    Hamiltonian path decomposition exists) and raise ValueError. ``transport`` is ignored when
    ``comm`` is given.

    Each rank's local sequence must hold at least one token per ring in each zigzag half
    (s_local >= 2 * rings; on one node rings = CP size - 1, except CP sizes 4 and 6, which have
    no Hamiltonian decomposition and use 2 and 4 rings)."""
    return attention(q, k, v, mode="tasp", group=group, mask=mask, causal=causal, window=window, cu_seqlens=cu_seqlens,
                     layout=layout, softmax_scale=softmax_scale, softmax_offset=softmax_offset, kernel=kernel,
                     comm=comm, ranks_per_node=gpus_per_node, transport=transport, backward_chunks=backward_chunks,
                     backward_keep_limit=backward_keep_limit)


@compiler_boundary
def hybrid_attention(q: Tensor, k: Tensor, v: Tensor, *, group=None, ulysses_size: int, inner: str = "mesh",
                     gpus_per_node: int | None = None, mask: MaskKind | None = None, causal: bool | None = None,
                     window=None,
                     cu_seqlens=None, layout=None, softmax_scale: float | None = None,
                     softmax_offset: Tensor | None = None, kernel: "str | BlockKernel" = "auto",
                     comm: Communicator | None = None, **inner_settings) -> Tensor:
    """Ulysses x Mesh / TASP / ring: an all-to-all over ``ulysses_size`` consecutive CP ranks
    (inside a node) scatters heads and gathers tokens, then ``inner`` ("mesh", "tasp" or "ring")
    runs across the CP size / ulysses_size groups on that head slice; the reverse all-to-all
    brings the output back. Same input layout as the other modes (this rank's chunk over the
    whole CP group). Query heads must divide by ``ulysses_size``; KV heads must divide by it or
    divide it (then they are replicated). ``gpus_per_node`` is the CP ranks per node;
    ``inner_settings`` are the inner mode's options, as its wrapper takes them (e.g. ``tile``,
    ``schedule``; their defaults are the inner mode's). The inner rings run point-to-point:
    inner="tasp" with ``transport="alltoall"`` raises ValueError.
    """
    mode = HYBRID_PREFIX + str(inner)
    # checked where a rank that fails still joins the agreement check, as prepare's checks are: its
    # peers then raise naming its error instead of waiting for it
    with agreement.joined_on_error(group_communicator(group) if comm is None else comm):
        if mode not in MODES:
            raise ValueError(f"inner must be a mode with a Ulysses hybrid, one of "
                             f"{', '.join(m[len(HYBRID_PREFIX):] for m in MODES if m.startswith(HYBRID_PREFIX))}; "
                             f"got {inner!r}")
    return attention(q, k, v, mode=mode, group=group, mask=mask, causal=causal, window=window,
                     cu_seqlens=cu_seqlens, layout=layout, softmax_scale=softmax_scale, softmax_offset=softmax_offset,
                     kernel=kernel, comm=comm, ulysses_size=ulysses_size, ranks_per_node=gpus_per_node,
                     **inner_settings)


@compiler_boundary
def plan_attention(q: Tensor, k: Tensor, v: Tensor, plan: Plan, *, comm: Communicator,
                   softmax_scale: float | None = None, kernel: "str | BlockKernel" = "auto", timer=None,
                   softmax_offset: Tensor | None = None) -> Tensor:
    """Run an explicit ``plan`` (e.g. one parsed from text with :meth:`Plan.from_text`) on this
    rank, differentiably. The plan must match the tensors' shape and the communicator; the ranks of
    the communicator's group must pass the same plan, scale, dtype, shapes and kernel (checked on
    every call, as for :func:`attention`). Under ``torch.autocast`` the inputs are cast to its
    dtype first, as :func:`attention` does (it ran in the inputs' dtype: stop 79's review)."""
    cast = _autocast_dtype(q)
    if cast is not None:
        with torch.autocast(q.device.type, enabled=False):
            return plan_attention(q.to(cast), k.to(cast), v.to(cast), plan, comm=comm, softmax_scale=softmax_scale,
                                  kernel=kernel, timer=timer, softmax_offset=softmax_offset)
    with agreement.joined_on_error(comm):
        shape = attention_shape(q, k, v)
        check_scale(softmax_scale)
        check_offset(softmax_offset, shape.heads, q.device)
        if plan.seq_local != shape.seq_local or plan.world_size != comm.world_size:
            raise ValueError(f"plan for {plan.world_size} ranks x {plan.seq_local} tokens does not fit "
                             f"{comm.world_size} ranks x {shape.seq_local} tokens")
        kern = get_kernel(kernel, q.device)
        mask_piece(q.device)
        check_head_dims(kern, shape.head_dim, shape.v_head_dim)
    scale = scale_of(shape, softmax_scale)
    agreement.check(comm, agreement.Call(plan, None, tuple(q.shape), tuple(k.shape), q.dtype, scale, kern,
                                         backward_follows(q, k, v, softmax_offset), shape.v_head_dim,
                                         sink_kind(softmax_offset)))
    executor = Executor(plan, comm, kern, scale, timer)
    return PlanAttention.apply(q, k, v, executor, softmax_offset)

"""The public entry points' input checks: the tensors against each other, the softmax scale, and
the mask + layout of one call (errors name the value and what is allowed).

Worked example: q [8, 2, 4, 16] and k/v [8, 2, 2, 16] on 4 ranks are a GQA problem of 8 tokens per
rank (two zigzag halves of 4), batch 2, 4 query heads over 2 KV heads of 16: ``attention_shape``
returns AttentionShape(seq_local=8, batch=2, heads=4, kv_heads=2, head_dim=16); q [7, ...] raises
(s_local must be even); v [8, 2, 2, 12] gives values (and the output) of head dim 12
(``v_head_dim=12``, MLA's kind).
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from ..plan.layout import Layout
from ..plan.mask import Mask
from ..plan.maskkinds import MaskKind
from ..plan.units import as_int
from ..plan.problem import normalize
from ..plan.shape import AttentionShape
from .state import RUNTIME

# the inputs' dtypes the kernels take (fp32 accumulators for the halves, fp64 for fp64)
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

__all__ = ["INPUT_DTYPES", "attention_shape", "check_scale", "scale_of", "attention_mask", "integer_scalar",
           "host_values"]

# devices whose tensors host_values reads once per version: a read from them waits for the queued
# work; a CPU tensor is read every time (cheap, and numpy can change it without a new version)
CACHED_DEVICES = ("cuda",)


def host_values(t: Tensor, values: WeakIdKeyDictionary | None = None, devices: tuple = CACHED_DEVICES) -> list:
    """``t.tolist()``, read once per tensor and version. Document boundaries reach every layer of
    a model as the same tensor (Megatron's ``packed_seq_params``), often on the GPU, where each read
    waits for the queued work: once per step instead of once per layer. An in-place change (a new
    version) is read again; a tensor without a version counter (made under inference mode), or
    on another device than ``devices`` (:data:`CACHED_DEVICES`: a CPU read saves no wait), is read
    every time. The list is shared: callers copy what they change. ``values``: the memory of what
    was read (None: the process's, ``RUNTIME.values``)."""
    if t.device.type not in devices:
        return t.tolist()
    values = RUNTIME.values if values is None else values
    try:
        version = t._version
    except RuntimeError:  # an inference tensor
        return t.tolist()
    got = values.get(t)
    if got is not None and got[0] == version:
        return got[1]
    read = t.tolist()
    values[t] = (version, read)
    return read


def attention_shape(q: Tensor, k: Tensor, v: Tensor) -> AttentionShape:
    """Check q, k, v against each other (raising ValueError naming the values) and return the
    per-rank problem shape."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [s_local, batch, heads, head_dim] (Megatron's sbhd layout), "
                             f"got shape {tuple(x.shape)}")
        if 0 in x.shape[1:]:
            raise ValueError(f"{name} must have batch, heads and head_dim >= 1, got shape {tuple(x.shape)}")
    if k.shape[:3] != v.shape[:3]:  # the head dims may differ (MLA: 192 for q and k, 128 for v)
        raise ValueError(f"k and v must agree in s_local, batch and kv heads, got k {tuple(k.shape)} and v "
                         f"{tuple(v.shape)}")
    s, b, h, d = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (s, b, d):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in s_local, batch and head_dim")
    if h % k.shape[2]:
        raise ValueError(f"query heads ({h}) must be divisible by kv heads ({k.shape[2]}) "
                         "for grouped-query / multi-query attention")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in INPUT_DTYPES:  # fp8 passes is_floating_point, and the kernels have no fp8 path
        raise ValueError(f"q, k, v must be one of {', '.join(str(t) for t in INPUT_DTYPES)}, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on the same device, got {q.device}, {k.device}, {v.device}")
    if s % 2 or s == 0:
        raise ValueError(f"s_local ({s}) must be even and > 0: each rank holds two equal zigzag halves "
                         "(the global sequence must be divisible by 2 * CP size)")
    return AttentionShape(seq_local=s, batch=b, heads=h, kv_heads=k.shape[2], head_dim=d, itemsize=q.element_size(),
                          v_head_dim=v.shape[3])


def check_scale(softmax_scale) -> float | None:
    """``softmax_scale`` checked: None (1/sqrt(head_dim)) or a finite number > 0."""
    if softmax_scale is None:
        return None
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real) or \
            not math.isfinite(float(softmax_scale)) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a finite number > 0 (or None for 1/sqrt(head_dim)), got "
                         f"{softmax_scale!r}")
    return float(softmax_scale)


def scale_of(shape: AttentionShape, softmax_scale) -> float:
    """The softmax scale a call runs with: ``softmax_scale`` (checked) or 1/sqrt(head_dim)."""
    s = check_scale(softmax_scale)
    return s if s is not None else 1.0 / math.sqrt(shape.head_dim)


def integer_scalar(v):
    """``v`` as an int where it is an integer scalar of numpy or torch (as cu_seqlens and the
    layouts take them); anything else unchanged, for the checks that name it."""
    got = as_int(v)
    return v if got is None else got


def attention_mask(world_size: int, shape: AttentionShape, *, causal: bool | None = None, window=None,
                   cu_seqlens=None, layout=None, mask: MaskKind | None = None) -> tuple[MaskKind, Layout]:
    """The plan's (mask, layout) from the public arguments, checked: ``mask`` (a mask of
    :mod:`megatron_mesh.masks`; its documents cover the global sequence) or the loose arguments
    that build one -- ``causal`` (default True), ``window`` (left, right) with ints >= 0 or None,
    ``cu_seqlens`` the document boundaries of the global sequence (on Megatron's zigzag) -- not
    both; ``layout`` a layout that defines its own documents (:class:`BalancedLayout`: its
    documents; :class:`ThdLayout`: its sequences; the mask then brings none). Normalised by
    :func:`megatron_mesh.plan.normalize`."""
    if mask is not None:
        loose = {k: v for k, v in (("causal", causal), ("window", window), ("cu_seqlens", cu_seqlens)) if v is not None}
        if loose:
            raise ValueError(f"pass mask= or the loose causal/window/cu_seqlens arguments, not both: got mask "
                             f"{mask.summary() if isinstance(mask, MaskKind) else _named(mask)} and {', '.join(f'{k}={v!r}' for k, v in loose.items())}")
        if not isinstance(mask, MaskKind):
            raise ValueError(f"mask must be a mask of megatron_mesh.masks (e.g. masks.causal()), got {_named(mask)}")
    causal = True if causal is None else causal
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise ValueError(f"window must be (left, right) with ints >= 0 or None, got {window!r}")
        window = tuple(integer_scalar(v) for v in window)
    if layout is not None and not isinstance(layout, Layout):
        raise ValueError("layout must be None (Megatron's zigzag) or a megatron_mesh layout (BalancedLayout from "
                         f"balanced_layout(), ThdLayout), got {type(layout).__name__}")
    documents = cu_seqlens if mask is None else mask.documents
    if layout is not None and layout.documents() is not None and documents is not None:
        raise ValueError(f"{'cu_seqlens' if mask is None else 'the mask'} and a {type(layout).__name__} both give "
                         f"documents: the layout's documents are the ones attention sees, pass "
                         f"{'cu_seqlens=None' if mask is None else 'a mask without documents'}")
    if layout is not None and (layout.world_size != world_size or layout.seq_local != shape.seq_local):
        raise ValueError(f"{type(layout).__name__} over {layout.world_size} ranks x {layout.seq_local} tokens per rank "
                         f"does not match the CP size {world_size} and the local tensors' {shape.seq_local} tokens")
    S = world_size * shape.seq_local
    if mask is not None:
        if mask.documents is not None and mask.documents[-1][1] != S:
            raise ValueError(f"the mask's documents {mask.summary()!r} end at {mask.documents[-1][1]}, not at the "
                             f"global sequence length {S}")
    elif cu_seqlens is not None:
        mask = Mask.from_cu_seqlens(_boundaries(cu_seqlens), S, causal, window)
    else:
        mask = Mask(causal, window)
    return normalize(world_size, shape, mask, layout)


def _boundaries(cu_seqlens) -> list:
    """``cu_seqlens`` (a 1-D integer tensor or sequence) as a list of ints, checked."""
    if isinstance(cu_seqlens, Tensor):
        if cu_seqlens.device.type == "meta":
            raise ValueError(f"cu_seqlens is on the {cu_seqlens.device} device, which holds no values: pass the "
                             "document boundaries on the CPU or the inputs' device")
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor or sequence, got {cu_seqlens!r}")
        cu_seqlens = list(host_values(cu_seqlens))
    else:
        try:
            cu_seqlens = list(cu_seqlens)  # once: a generator is read one time only
        except TypeError:
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor or sequence, got {cu_seqlens!r}") from None
    if not all(isinstance(c, numbers.Integral) and not isinstance(c, bool) for c in cu_seqlens):
        raise ValueError(f"cu_seqlens must hold integers, got {cu_seqlens!r}")
    return cu_seqlens


def _named(value) -> str:
    """A value for an error message: a tensor by its type, shape and dtype (its repr prints every element)."""
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return repr(value)

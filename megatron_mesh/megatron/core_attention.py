"""Megatron-Core core attention for the plugin's context-parallel modes.

Megatron-Core 0.19 builds core attention per layer as::

    core_attention(config=, layer_number=, attn_mask_type=, attention_type=, cp_comm_type=,
                   softmax_scale=, pg_collection=)          # MLA adds k_channels=, v_channels=

and calls ``forward(query, key, value, attention_mask, attn_mask_type=, attention_bias=,
packed_seq_params=)`` with query [sq, b, heads, head_dim] and key/value [sk, b, kv_heads,
head_dim] -- this rank's zigzag chunk of the sequence (CP rank r holds chunks r and 2*CP-1-r) --
returning [sq, b, heads * head_dim]. With packed sequences (``packed_seq_params.qkv_format ==
"thd"``) they are [t, heads, head_dim]: this rank's tokens of Transformer Engine's THD layout.

:class:`CPCoreAttention` is the builder to put in a layer spec. Per layer it reads the layer's
``cp_comm_type`` (``TransformerLayer`` passes each layer its entry of a per-layer list):

* a plugin mode -- ``mesh``, ``tasp``, ``ring`` or a Ulysses hybrid ``a2a+mesh`` / ``a2a+tasp`` /
  ``a2a+ring`` (the registry :data:`megatron_mesh.plan.MODES`) -> :class:`PluginCoreAttention`;
* ``p2p`` / ``a2a`` / ``all_gather`` / ``a2a+p2p`` -> Transformer Engine's ``TEDotProductAttention``
  (an error naming the mode when Transformer Engine is not usable);
* CP size 1 -> Megatron's own core attention (``DotProductAttention``, or Transformer Engine's with
  ``--transformer-impl transformer_engine``): no context parallelism, nothing for the plugin to do,
  and everything Megatron's attention supports (dropout, masks) keeps working -- except where the
  batches carry document boundaries Megatron's own attention cannot read (packed THD sequences,
  documents from end-of-document tokens) or the layer has a sliding window or chunks: then the
  plugin's attention over one rank, the same exact mask.

Masks reach the plan as data: the layer's window (``--window-size``, per layer with
``--window-attn-skip-freq``), its chunks (Llama 4's chunked attention, the plugin's
``--attention-chunk-size``, on the layers ``--no-rope-freq`` leaves with RoPE), the documents of
``packed_seq_params`` (THD: Transformer Engine's layout, ``cu_seqlens_q`` / ``_padded``; ``sbhd``
with ``cu_seqlens_q`` [batch, k]: the global boundaries per sample, which megatron_mesh's entry
script derives from end-of-document tokens -- or, when the model call carries none, those
:mod:`.batch_layout` took from the current batch). With such documents each sample runs on its CP
layout (:func:`.batch_layout.sample_layout`: the balanced layout of ``--cp-layout balanced`` or
``auto``, or Megatron's zigzag), the one its batch was split by.

Example (CP 4, 2 layers): ``--cp-comm-type mesh tasp`` gives layer 1 Mesh-Attention (tile from
``--mesh-tile-shape``) and layer 2 TASP, both inside the same model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import Tensor

from ..plan.megatron_problem import CHUNK_FLAG, layer_chunked, layer_window
from ..plan.modes import DEFAULT_MODE
from ..runtime.autograd import compiler_boundary
from ..runtime.inputs import host_values
from . import TE_MODES, batch_layout, mla, plugin_modes, sinks
from .checks import have_transformer_engine
from .groups import PROCESS_GROUPS, CPGroups, cp_ranks
from .settings import BATCH_DOCUMENTS, plugin_settings
from .placement import resolve_placement
from .telemetry import Telemetry

__all__ = ["CPCoreAttention", "PluginCoreAttention", "CoreAttentionSpec", "core_attention_spec"]

# Causal, or no mask at all; causal_bottom_right equals causal for self-attention (sq == sk).
_CAUSAL = {AttnMaskType.causal: True, AttnMaskType.causal_bottom_right: True, AttnMaskType.no_mask: False}


def _cp_size(config, pg_collection) -> int:
    cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    return cp.size() if cp is not None else config.context_parallel_size


class CPCoreAttention:
    """Core-attention builder: returns the module for this layer's ``cp_comm_type``.

    A class (not a function): MLA builds core attention through ``build_module``, which returns
    plain functions uncalled. ``telemetry`` and ``groups`` go to the plugin's layers: the spec
    functions pass theirs (:func:`core_attention_spec`); None -- a telemetry of the layer's own
    and the process's groups.
    """

    def __new__(cls, *, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                cp_comm_type: Optional[str] = None, softmax_scale: Optional[float] = None,
                pg_collection=None, telemetry: Optional[Telemetry] = None, groups: Optional[CPGroups] = None,
                **kwargs):
        common = dict(config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
                      attention_type=attention_type, softmax_scale=softmax_scale, pg_collection=pg_collection)
        plugin = dict(telemetry=telemetry, groups=groups)
        if mla.replaced_by_mla(config, kwargs):
            return mla.ReplacedByMLA()
        if _cp_size(config, pg_collection) == 1:
            if not _needs_plugin_mask(config, layer_number) and not mla.local_mla(config, kwargs):
                return _megatron_attention(config, common, kwargs)
            return PluginCoreAttention(cp_comm_type=DEFAULT_MODE, **common, **plugin, **kwargs)
        if cp_comm_type in plugin_modes():
            return PluginCoreAttention(cp_comm_type=cp_comm_type, **common, **plugin, **kwargs)
        mode = "p2p" if cp_comm_type is None else cp_comm_type  # TE's default for None
        if mode not in TE_MODES:
            raise ValueError(f"layer {layer_number}: cp_comm_type {cp_comm_type!r} is not a context-parallel mode; "
                             f"allowed: {', '.join(plugin_modes())} (megatron_mesh) or {', '.join(TE_MODES)} "
                             "(Transformer Engine)")
        return _te_attention(mode, common, kwargs)


@dataclass
class CoreAttentionSpec(ModuleSpec):
    """``ModuleSpec(CPCoreAttention, params=dict(telemetry=..., groups=...))`` that can also be
    called like the class: Megatron's self-attention calls its ``core_attention`` submodule
    directly, MLA builds it with ``build_module``; both reach CPCoreAttention with the params."""

    def __call__(self, **kwargs):
        return build_module(self, **kwargs)


def core_attention_spec(telemetry: Optional[Telemetry] = None, groups: Optional[CPGroups] = None) -> CoreAttentionSpec:
    """The core attention of a plugin layer spec: every layer built from it reports to
    ``telemetry`` (None: a new one, the summary line only) and routes its transfers through
    ``groups`` (None: the process's, :data:`~.groups.PROCESS_GROUPS`)."""
    return CoreAttentionSpec(module=CPCoreAttention, params={
        "telemetry": telemetry if telemetry is not None else Telemetry(),
        "groups": groups if groups is not None else PROCESS_GROUPS})


def _layer_window(config, layer_number: int):
    """The plugin window (left, right) of this layer, or None (:func:`megatron_mesh.plan.megatron_problem.layer_window`)."""
    return layer_window(config.window_size, config.window_attn_skip_freq, layer_number)


def _layer_chunks(config, layer_number: int):
    """This layer's chunked attention (a ``Chunked`` mask) or None
    (:func:`megatron_mesh.plan.megatron_problem.layer_chunked`: Megatron's ``no_rope_freq`` marks
    the layers without chunks)."""
    return layer_chunked(plugin_settings(config).attention_chunk_size, config.no_rope_freq, layer_number)


def _needs_plugin_mask(config, layer_number: int) -> bool:
    """At CP 1: whether this layer's mask is one Megatron's own attention cannot apply here (a
    window, chunks, or documents carried as boundaries instead of a dense mask)."""
    return plugin_settings(config).documents is not None or _layer_window(config, layer_number) is not None or \
        _layer_chunks(config, layer_number) is not None


def _megatron_attention(config, common: dict, kwargs: dict):
    """CP size 1: the core attention Megatron's own spec would have built."""
    if config.transformer_impl == "transformer_engine":
        return _te_attention(None, common, kwargs)
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention(**common, **kwargs)  # as Megatron's local spec would build it, arguments and all


def _te_attention(mode: Optional[str], common: dict, kwargs: dict):
    usable, why = have_transformer_engine()
    if not usable:
        what = f"cp_comm_type {mode!r} is a Transformer Engine mode" if mode else "--transformer-impl transformer_engine"
        instead = "use ring (the same algorithm)" if mode == "p2p" else f"use one of {', '.join(plugin_modes())}"
        raise ValueError(f"layer {common['layer_number']}: {what}, but Transformer Engine is not usable here "
                         f"({why}); {instead if mode else 'pass --transformer-impl local'}")
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    return TEDotProductAttention(**({"cp_comm_type": mode} if mode else {}), **common, **kwargs)


class PluginCoreAttention(MegatronModule):
    """Attention over the CP group with this package's engine (any plugin mode).

    Supported: self-attention with a causal mask or none, sliding windows, chunked attention (causal
    layers), packed documents (THD or boundaries per sample), MHA/GQA/MQA, MLA's value head dim
    (``v_channels`` may differ from ``k_channels``: :mod:`.mla`), any softmax scale, attention sinks
    (``softmax_type``, Megatron's ``softmax_offset``: :mod:`.sinks`). Anything else raises
    ValueError naming the value and what is allowed; nothing falls back to another mode.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, telemetry=None, groups=None):
        super().__init__(config=config)
        self.telemetry = telemetry if telemetry is not None else Telemetry()
        self.layer_number = layer_number
        where = f"layer {layer_number} (cp_comm_type {cp_comm_type!r})"
        _check_config(config, where, layer_number, attention_type, attn_mask_type, attention_dropout)
        self.attn_mask_type = attn_mask_type
        sinks.attach(self, config, pg_collection, where)  # softmax_offset: Megatron's, by its name and shape
        head_dim = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
            self.cp_group = pg_collection.cp
        else:
            from megatron.core import parallel_state

            self.cp_group = parallel_state.get_context_parallel_group()
        self.cp_size = self.cp_group.size()
        self.settings = plugin_settings(config)
        self.mode = cp_comm_type if self.cp_size > 1 else DEFAULT_MODE  # CP 1: one block, no transfers
        if self.mode not in plugin_modes():
            raise ValueError(f"{where}: PluginCoreAttention runs {', '.join(plugin_modes())}, not {cp_comm_type!r}")
        self.window = _layer_window(config, layer_number)
        self.chunks = _layer_chunks(config, layer_number)
        self.documents = self.settings.documents
        # the CP layout of each sample's tokens, where documents come from the batch (batch_layout)
        self.layout = self.settings.cp_layout if self.documents in BATCH_DOCUMENTS and self.cp_size > 1 else None
        self.placement = resolve_placement(self.mode, config, cp_ranks(self.cp_group))
        self.comm = self.telemetry.timing.communicator((groups or PROCESS_GROUPS).communicator(config, self.cp_group,
                                                                                               self.placement))
        p = self.placement
        tile = f"{p.tile[0]}x{p.tile[1]}" if p.tile else None
        self.telemetry.summary.register_layer(layer_number, self.describe(),
                                 dict(mode=self.mode, cp=self.cp_size, tile=tile, ulysses=p.ulysses,
                                      window=list(self.window) if self.window else None,
                                      chunk=self.chunks.size if self.chunks else None, documents=self.documents,
                                      layout=self.layout),
                                 logs=_logs_for_its_stage(self.cp_group))

    def describe(self) -> str:
        """The mode and its settings (the per-stage summary line of :mod:`.telemetry`)."""
        if self.cp_size == 1:
            what = "single-rank attention (CP 1"
        else:
            what = self.placement.describe()[:-1]
        extras = [f"kernel {self.settings.kernel}", *sinks.describe(self.config)]
        if self.window:
            extras.append(f"window {self.window[0] if self.window[0] is not None else '-'},"
                          f"{self.window[1] if self.window[1] is not None else '-'}")
        if self.chunks:
            extras.append(f"chunks of {self.chunks.size}")
        if self.documents:
            extras.append(f"documents {self.documents}")
        if self.layout:
            extras.append(f"layout {self.layout}")
        return f"{what}, {', '.join(extras)})"

    @compiler_boundary  # a compiled model runs the layer's attention eagerly (runtime.autograd.compiler_boundary)
    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias: Optional[Tensor] = None,
                packed_seq_params=None) -> Tensor:
        """query [sq, b, heads, d] (or [t, heads, d] for THD), key/value likewise ->
        [sq, b, heads * d] (THD: [t, heads * d], as Transformer Engine gives it: MLA's THD path cuts
        the value head dim it padded per head from that 2-D form, and from a [t, 1, heads * d] one
        kept the first head only -- a shape error in its output projection, stop 81's review).

        ``attention_mask`` is not applied: with a causal mask type it only repeats the causal
        structure (Transformer Engine ignores it the same way); documents come as boundaries
        (``packed_seq_params``), not as a dense mask. A mask that says something else is an error,
        not silently dropped (checked at the layer's first call without documents: the check
        reads the whole mask and waits for the device)."""
        where = f"layer {self.layer_number} ({self.mode})"
        causal = _causal(attn_mask_type if attn_mask_type is not None else self.attn_mask_type, where)
        if attention_mask is not None and packed_seq_params is None and not self.documents and not self._mask_checked:
            self._mask_checked = True  # once: the check reads the whole mask and waits for the device
            check_dense_mask(attention_mask, query.shape[0], causal, self.window, self.cp_size, self.cp_group.rank(),
                             where)
        if attention_bias is not None:
            raise ValueError(f"{where}: attention_bias is not supported by the plugin modes (allowed: None)")
        self.telemetry.on_forward()
        (query, key, value), mark_output = self.telemetry.timing.mark_backward((query, key, value))
        with self.telemetry.timing.compute_phase():
            out = self._with_documents(query, key, value, causal, packed_seq_params, where)
        out = mark_output(out)
        if getattr(packed_seq_params, "qkv_format", None) == "thd":
            return out.reshape(out.shape[0], -1)
        return out.reshape(out.shape[0], out.shape[1], -1)

    _mask_checked = False

    def _with_documents(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, packed, where: str) -> Tensor:
        fmt = getattr(packed, "qkv_format", None) if packed is not None else None
        if fmt == "thd":
            from ..plan import ThdLayout

            if q.dim() != 3:
                raise ValueError(f"{where}: THD inputs must be [t, heads, head_dim], got {tuple(q.shape)}")
            cu_pad = packed.cu_seqlens_q_padded if packed.cu_seqlens_q_padded is not None else packed.cu_seqlens_q
            cu = host_values(packed.cu_seqlens_q)
            lens = [b - a for a, b in zip(cu, cu[1:])]
            layout = ThdLayout(self.cp_size, tuple(host_values(cu_pad)), tuple(lens))
            out = self._attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), causal, layout=layout)
            return out
        if fmt not in (None, "sbhd"):
            raise ValueError(f"{where}: packed_seq_params qkv_format {fmt!r} is not supported by the plugin modes "
                             "(allowed: 'thd', or 'sbhd' with per-sample document boundaries)")
        rows = self._document_rows(packed, where)
        if rows is None:
            return self._attention(q, k, v, causal)
        if len(rows) == 1:
            rows = rows * q.shape[1]
        if len(rows) != q.shape[1]:
            raise ValueError(f"{where}: {len(rows)} rows of document boundaries for a batch of {q.shape[1]}")
        # each sample's layout, by the decision the batch split made (the same cached object);
        # samples with the same documents share one call
        layouts = [batch_layout.sample_layout(r, self.config, self.settings) for r in rows]
        self._check_batch_split(rows, layouts, where)
        if len(set(rows)) == 1:
            return self._sample_attention(q, k, v, causal, rows[0], layouts[0])
        outs = [self._sample_attention(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], causal, r, layouts[i])
                for i, r in enumerate(rows)]
        return torch.cat(outs, dim=1)

    def _document_rows(self, packed, where: str):
        """Per-sample boundaries over the global sequence: ``packed_seq_params.cu_seqlens_q``
        [b, k] (padded with S), or -- for a script whose model call carries none (Megatron-LM's
        own, through run_script) -- those :mod:`.batch_layout` took from the current batch.
        None: no documents."""
        cu = getattr(packed, "cu_seqlens_q", None) if packed is not None else None
        if cu is not None and (cu.is_floating_point() or cu.is_complex() or cu.dtype == torch.bool):
            raise ValueError(f"{where}: packed_seq_params.cu_seqlens_q must be an integer tensor, got {cu.dtype}")
        if cu is not None:
            values = host_values(cu)  # once per step: every layer gets this tensor
            return [tuple(sorted(set(r))) for r in (values if cu.dim() == 2 else [values])]
        if self.documents is None:
            return None
        batch = batch_layout.current()
        if batch is None:
            raise ValueError(f"{where}: the batches were to carry document boundaries ({self.documents}) but "
                             "packed_seq_params is None and no batch layout is set: the model was called without them")
        return list(batch.rows)

    def _check_batch_split(self, rows, layouts, where: str) -> None:
        """The batch was split by the layouts the layer uses: both come from
        :func:`.batch_layout.sample_layout`, so only different settings could part them."""
        batch = batch_layout.current()
        if batch is None or list(batch.rows) != list(rows):
            if any(layout is not None for layout in layouts):  # tokens split another way: a wrong result, silently
                raise ValueError(
                    f"{where}: the samples' CP layout is one of their own (cp_layout "
                    f"{self.settings.cp_layout!r}; 'auto', the default with documents at CP > 1, chooses it per sample), "
                    "but this batch was not split by it (no megatron_mesh.megatron.batch_layout.BatchLayout of these "
                    "documents is current): split the batch with BatchLayout and set_current as the entry scripts' "
                    "get_batch does, or set cp_layout='zigzag' to keep Megatron's get_batch_on_this_cp_rank split")
            return
        if batch.layouts == tuple(layouts):
            return
        i = next(i for i, (a, b) in enumerate(zip(batch.layouts, layouts)) if a != b)
        text = [x.text()[:120] if x is not None else "Megatron's zigzag" for x in (batch.layouts[i], layouts[i])]
        raise RuntimeError(f"{where}: sample {i} was split by the layout {text[0]!r}, the layer's is {text[1]!r}: the "
                           "batch split and the layer read different settings")

    def _sample_attention(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, row, layout) -> Tensor:
        """One sample's (or several with the same documents) attention on its layout (None: Megatron's
        zigzag), with the boundaries unless the layout brings the documents itself."""
        if layout is not None and layout.documents() is not None:
            return self._attention(q, k, v, causal, layout=layout)
        return self._attention(q, k, v, causal, cu_seqlens=list(row), layout=layout)

    def _attention(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, cu_seqlens=None, layout=None) -> Tensor:
        from ..runtime.api import attention_shape, prepare
        from ..runtime.autograd import PlanAttention

        # runtime.api.attention's two steps, with the plan in hand for the metrics' attention work
        call = prepare(q, k, v, mode=self.placement.mode, placement=self.placement, comm=self.comm,
                       **_mask_args(self.chunks, causal, self.window, cu_seqlens), layout=layout,
                       softmax_scale=self.softmax_scale, kernel=self.settings.kernel, softmax_offset=self.softmax_offset)
        self.telemetry.summary.on_plan(self.layer_number, self.placement.tile, call.plan)
        if self.telemetry.records.metrics is not None:  # nothing to work out per call without --cp-metrics-dir
            self.telemetry.records.on_attention(call.plan, call.comm.rank, attention_shape(q, k, v),
                                   torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))
        return PlanAttention.apply(q, k, v, call.executor(), self.softmax_offset)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The learnable sinks' checkpoint entry, as Megatron's DotProductAttention writes it."""
        return sinks.sharded_state_dict(self, self.tp_group, prefix, sharded_offsets, metadata)


def _mask_args(chunks, causal: bool, window, cu_seqlens) -> dict:
    """prepare()'s mask arguments for a layer: its ``chunks`` as a mask kind, the documents (a
    layout's own, or these boundaries) inside it; else the loose causal / window / boundaries."""
    if chunks is None:
        return dict(causal=causal, window=window, cu_seqlens=cu_seqlens)
    if not causal:  # the layer was built causal (_check_config); a call may pass another mask type
        raise ValueError(f"{CHUNK_FLAG} {chunks.size}: chunked attention is causal inside each chunk, and this call's "
                         "attention mask type is not causal (allowed: causal)")
    from ..masks import documents

    return dict(mask=chunks if cu_seqlens is None else documents(cu_seqlens) & chunks)


def check_dense_mask(attention_mask: Tensor, sq: int, causal: bool, window, cp_size: int, rank: int,
                     where: str) -> None:
    """``attention_mask`` (Megatron's: True = masked, [b or 1, 1, this rank's ``sq`` queries, S] after
    get_batch_on_this_cp_rank) masks what a layer masks without it -- the causal structure at
    ``rank``'s zigzag positions (Megatron's dataloader mask), or that and the layer's ``window`` --
    or a ValueError says it would be ignored. E.g. a non-causal document or padding mask built
    in Python for a model at CP > 1."""
    from ..plan import Mask, ZigzagLayout

    S = attention_mask.shape[-1]
    if attention_mask.dim() != 4 or attention_mask.shape[-2] != sq or S != sq * cp_size:
        raise ValueError(f"{where}: attention_mask of shape {tuple(attention_mask.shape)} is not Megatron's "
                         f"[b, 1, {sq}, {sq * cp_size}] for this rank's queries; the plugin modes do not read "
                         "a dense mask: pass documents as packed_seq_params boundaries, or no mask")
    device = attention_mask.device
    pos = torch.cat([torch.arange(start, start + n, device=device)
                     for _, start, n in ZigzagLayout(cp_size, S).runs(rank)])
    keys = torch.arange(S, device=device)
    masked = attention_mask.to(torch.bool)
    # True = masked: equal to the mask's allowed matrix is a difference
    same = not bool((masked == Mask(causal).allowed(pos, keys)).any())
    if not same and window is not None:  # the window applied by the mask too
        same = not bool((masked == Mask(causal, tuple(window)).allowed(pos, keys)).any())
    if not same:
        raise ValueError(f"{where}: attention_mask masks other (query, key) pairs than this layer applies (causal "
                         "structure and window at the zigzag positions); the plugin modes do not read a dense mask: "
                         "pass documents as packed_seq_params boundaries (megatron_mesh.megatron.pretrain_gpt."
                         "document_params), or no mask")


def _causal(mask_type: AttnMaskType, where: str) -> bool:
    if mask_type not in _CAUSAL:
        raise ValueError(f"{where}: attention mask type {mask_type.name!r} is not supported by the plugin modes; "
                         f"allowed: {', '.join(m.name for m in _CAUSAL)}")
    return _CAUSAL[mask_type]


def _check_config(config, where: str, layer_number: int, attention_type: str, attn_mask_type: AttnMaskType,
                  attention_dropout) -> None:
    if attention_type != "self":
        raise ValueError(f"{where}: attention_type {attention_type!r} is not supported (allowed: 'self')")
    _causal(attn_mask_type, where)
    dropout = config.attention_dropout if attention_dropout is None else attention_dropout
    if dropout:
        raise ValueError(f"{where}: attention dropout {dropout} is not supported (allowed: 0; "
                         "pass --attention-dropout 0)")
    window = _layer_window(config, layer_number)
    if window is not None and window[1] not in (None, 0) and _CAUSAL.get(attn_mask_type, False):
        raise ValueError(f"{where}: window_size {config.window_size} on a causal layer: the right side must be 0 "
                         "(or -1, unlimited)")
    chunks = _layer_chunks(config, layer_number)
    if chunks is not None and (window is not None or not _CAUSAL[attn_mask_type]):
        what = f"window_size {config.window_size}" if window is not None else \
            f"attention mask type {attn_mask_type.name}"
        raise ValueError(f"{where}: {CHUNK_FLAG} {chunks.size} (chunked attention: causal inside each chunk) on a layer "
                         f"with {what}; the layers with chunks must be causal and have no window (--no-rope-freq "
                         "marks the layers without chunks)")


def _logs_for_its_stage(cp_group) -> bool:
    """One rank per pipeline stage describes its layers (CP, TP and DP rank 0), so that every
    layer's line appears once, whichever stage holds it."""
    if not dist.is_initialized():
        return True
    try:
        from megatron.core import parallel_state as ps

        return (dist.get_rank(cp_group) == 0 and ps.get_tensor_model_parallel_rank() == 0
                and ps.get_data_parallel_rank() == 0)
    except Exception:  # noqa: BLE001 -- parallel_state not initialised (groups passed in): global rank 0 logs
        return dist.get_rank() == 0

"""THE decision of :mod:`.batch_layout`: which CP layout one sample of packed documents runs on in
Megatron (:func:`sample_layout`) -- the one ``--cp-layout`` names, built for the sample by its
kind in the layout registry (:mod:`megatron_mesh.plan.layouts`: Megatron's zigzag, the balanced
layout, or per sample the one ``auto`` keeps, :func:`megatron_mesh.plan.choice.pick_layout`).
The batch split and the core attention both call it, so they cannot disagree.

Example: ``sample_layout([0, 8, 12, 16], args)`` at CP 2 under ``--cp-layout balanced`` -> rank 0
holds [0, 2) + [6, 12), rank 1 [2, 6) + [12, 16).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Optional

from ..plan.layout import Layout
from ..plan.layouts import REFERENCE_LAYOUT, Sample, get_layout_kind
from ..plan.maskkinds import Mask, MaskStack
from ..plan.megatron_problem import MegatronProblem
from ..plan.modes import DEFAULT_MODE
from ..plan.sparse_needs import KEEP_LIMIT, keep_limit_of
from .placement import ranks_per_node
from .settings import BATCH_DOCUMENTS, PluginSettings, layer_modes, plugin_modes_of, plugin_settings, problem_of

__all__ = ["sample_layout", "sample_kind", "sample_choice", "uses_balanced_layout", "layer_masks"]


def uses_balanced_layout(config) -> bool:
    """Whether batches under ``config`` (a transformer config carrying the plugin settings, or
    Megatron's arguments) may be split by a layout of each sample: documents from the batch at
    CP > 1 under a ``--cp-layout`` other than Megatron's zigzag (``auto``, the default, too)."""
    s = plugin_settings(config)
    return s.documents in BATCH_DOCUMENTS and config.context_parallel_size > 1 and s.layout.per_sample


def layer_masks(config, problem: MegatronProblem):
    """What the layout of a sample balances for the model's layers: (window, None) when every
    layer has the same band -- the layout of that one window (None: none) -- else (None, the
    layers' mask: one mask kind every layer has, Llama 4's chunks, or the
    :class:`~megatron_mesh.plan.maskkinds.MaskStack` of the layers' masks: e.g. windowed layers
    alternating with full ones, ``--window-attn-skip-freq``, or chunked layers with global ones,
    ``--no-rope-freq``), whose summed work one layout for every layer balances."""
    if any(problem.layer_chunks()):
        return None, MaskStack.of(problem.layer_masks(causal=True))  # one kind: the chunks themselves
    windows = problem.layer_windows(causal=False)  # as given: the layers check the causal side
    if len(set(windows)) == 1:
        return windows[0], None
    return None, MaskStack.of(Mask(True, w) for w in windows)


def sample_layout(cu_seqlens, config, settings: PluginSettings | None = None) -> Optional[Layout]:
    """The CP layout of one sample with document boundaries ``cu_seqlens`` (0 = c0 < ... < cn = S)
    under ``config`` -- Megatron's parsed arguments or the transformer config -- and its plugin
    ``settings`` (default: :func:`.settings.plugin_settings` of it): None for Megatron's zigzag (CP
    1, or a sample ``--cp-layout`` leaves on it), else the layout its kind builds over
    ``context_parallel_size`` ranks, per Ulysses group of U ranks (U from
    ``--hierarchical-context-parallel-sizes U M``), nodes first when the CP group spans nodes,
    for causal attention with the window when every layer has one (layers with different masks:
    their summed work, :func:`layer_masks`), priced (``auto``) for the layers' mode, shape and
    what its backward keeps (``--mesh-backward-chunks`` / ``--mesh-backward-keep-limit``, TASP's).
    Cached: the batch split and every layer get the same object.

    Example: ``sample_layout([0, 8, 12, 16], args)`` at CP 2 under ``--cp-layout balanced`` -> rank
    0 holds [0, 2) + [6, 12), rank 1 [2, 6) + [12, 16); under ``auto`` None (16 tokens: a
    launch-bound step keeps the zigzag)."""
    s = plugin_settings(config) if settings is None else settings
    if config.context_parallel_size == 1 or not s.layout.per_sample:
        return None
    return _decide(s.cp_layout, layout_sample(cu_seqlens, config, s))


def sample_kind(cu_seqlens, config, settings: PluginSettings | None = None) -> str:
    """The name of the layout kind the sample with boundaries ``cu_seqlens`` runs on (what
    :func:`sample_layout` built): ``--cp-layout``'s, or for a kind picked per sample (``auto``) the
    one it picked -- ``zigzag``, ``balanced`` or ``owners``; Megatron's zigzag at CP 1. Cached with
    the choice."""
    return sample_choice(cu_seqlens, config, settings)[1]


def sample_choice(cu_seqlens, config, settings: PluginSettings | None = None) -> tuple[Optional[Layout], str]:
    """:func:`sample_layout` and :func:`sample_kind` of one sample, what it is built for
    (:func:`layout_sample`) worked out once: the batch split asks both of every sample, the
    layout to split by, the kind for the log and the metrics."""
    s = plugin_settings(config) if settings is None else settings
    if config.context_parallel_size == 1 or not s.layout.per_sample:
        return None, REFERENCE_LAYOUT
    sample, kind = layout_sample(cu_seqlens, config, s), get_layout_kind(s.cp_layout)
    return _decide(s.cp_layout, sample), kind.pick(sample) if kind.derived_from else kind.name


def layout_sample(cu_seqlens, config, settings: PluginSettings) -> Sample:
    """What a layout of the sample with boundaries ``cu_seqlens`` is built for under ``config``
    (:func:`sample_layout`; the start-up check asks a kind about it, documents aside)."""
    cp, s = config.context_parallel_size, settings
    problem = problem_of(config, s)
    cu = tuple(int(c) for c in cu_seqlens)
    modes = layer_modes(config.cp_comm_type)
    plugin = plugin_modes_of(modes)
    mode = next((m for m in modes if m in plugin), DEFAULT_MODE)  # what auto prices: the layers' first plugin mode
    window, stack = layer_masks(config, problem)
    options = s.options(mode)
    keeps = keep_limit_of(options.get("backward_chunks", "auto"), options.get("backward_keep_limit", KEEP_LIMIT))
    return Sample(cu, cp, True, window, problem.ulysses, _nodes(s), mode,
                  replace(problem.shape(cp), seq_local=cu[-1] // cp), mask=stack, keep_limit=keeps,
                  layer_modes=tuple(dict.fromkeys(modes)), options=_hashable(options))


def _hashable(options: dict) -> tuple:
    """The mode's options as a Sample carries them (lists as tuples)."""
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items())


@functools.lru_cache(maxsize=512)
def _decide(name: str, sample: Sample) -> Optional[Layout]:
    return get_layout_kind(name).build(sample)


def _nodes(settings: PluginSettings) -> Optional[int]:
    """CP ranks per node when the CP group spans nodes (the layout balances nodes first, keeping
    documents on a node's links), from the CP group's global ranks and the GPUs per node
    (``--tasp-gpus-per-node`` or torchrun's LOCAL_WORLD_SIZE); None: one node, or no process
    groups yet."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return ranks_per_node(tuple(parallel_state.get_context_parallel_global_ranks()), settings.gpus_per_node)

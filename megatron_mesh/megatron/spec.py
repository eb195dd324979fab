"""GPT layer specs whose core attention is :class:`~.core_attention.CPCoreAttention`.

Every function takes ``(model_config, vp_stage=None)`` -- a ``GPTModelConfig`` (what
``--spec`` functions receive) or a plain ``TransformerConfig`` -- so it works both as::

    --spec megatron_mesh.megatron.spec gpt_layer_spec          # Megatron-LM command line

and from Python::

    model = GPTModel(config=config, transformer_layer_spec=gpt_local_layer_spec(config), ...)

Only ``core_attention`` changes; every other submodule is Megatron's own spec. Called by a
Megatron training script (any entry script: Megatron's parsed arguments are global), the functions
first check the plugin settings on those arguments (once; a bad one stops every rank with one
message) and put them, with the real sequence length, on the transformer config -- the script may
have built a plain ``TransformerConfig`` -- and install the plugin's telemetry in Megatron's log
(:mod:`.telemetry`: the run's :class:`~.telemetry.Telemetry`; from Python, one per spec). They
also create the plugin's process groups (collective: every rank builds its model at the same
point) in the process's :class:`~.groups.CPGroups`, and hand both objects to every plugin layer
of the spec (:func:`~.core_attention.core_attention_spec`).

* :func:`gpt_layer_spec` -- Megatron's default choice (Transformer Engine spec when
  ``transformer_impl == "transformer_engine"``, local otherwise; MoE block specs too);
* :func:`gpt_te_layer_spec` / :func:`gpt_local_layer_spec` -- force one of them;
* :func:`patch_spec` -- replace ``core_attention`` in an existing layer spec or block spec, in place
  (by default with a telemetry of its own and the process's groups).
"""

from __future__ import annotations

from megatron.core.transformer.spec_utils import ModuleSpec

from . import batch_layout, ensure_typing_override
from .args import apply_args
from .checks import have_transformer_engine
from .core_attention import core_attention_spec
from .groups import PROCESS_GROUPS

__all__ = ["gpt_layer_spec", "gpt_te_layer_spec", "gpt_local_layer_spec", "patch_spec"]


def _transformer_config(model_config):
    """(the TransformerConfig of ``model_config``, configured from Megatron's arguments when a
    training script parsed them; the core attention of the spec: the run's telemetry, or a new one
    outside a training script, and the process's groups, created for the config)."""
    t = getattr(model_config, "transformer", model_config)
    from . import bootstrap
    from .telemetry import Telemetry, install

    args = bootstrap.megatron_args()
    if args is not None:
        bootstrap.check_args(args)  # no-op when the entry script's argument hook already checked them
        apply_args(args, t, entry_packs_documents=bootstrap.ENTRY_PACKS_DOCUMENTS,
                   batch_documents=bootstrap.BATCH_DOCUMENTS)
    telemetry = install(args) if args is not None else Telemetry()
    batch_layout.add_rope_hook(model_config, t)  # RoPE follows the balanced layout (Megatron's builder runs it)
    return t, core_attention_spec(telemetry, PROCESS_GROUPS)


def _require_te(what: str) -> None:
    usable, why = have_transformer_engine()
    if not usable:
        raise ValueError(f"{what} needs Transformer Engine, which is not usable here ({why}); use "
                         "--transformer-impl local (or megatron_mesh.megatron.spec.gpt_local_layer_spec)")


def gpt_layer_spec(model_config, vp_stage=None):
    """Megatron's default GPT layer (or MoE block) spec for ``model_config``, with the plugin's
    core attention."""
    t, core_attention = _transformer_config(model_config)
    use_te = t.transformer_impl == "transformer_engine"
    if use_te:
        _require_te("transformer_impl 'transformer_engine'")
    PROCESS_GROUPS.initialize(t)
    if t is not model_config:  # a GPTModelConfig: let Megatron-LM pick exactly as it would
        ensure_typing_override()
        from megatron.training.models.gpt import default_layer_spec

        return patch_spec(default_layer_spec(model_config, vp_stage), core_attention)
    return patch_spec(_core_spec(t, use_te, vp_stage), core_attention)


def gpt_te_layer_spec(model_config, vp_stage=None):
    """Transformer Engine GPT layer spec with the plugin's core attention."""
    _require_te("the Transformer Engine layer spec")
    t, core_attention = _transformer_config(model_config)
    PROCESS_GROUPS.initialize(t)
    return patch_spec(_core_spec(t, True, vp_stage), core_attention)


def gpt_local_layer_spec(model_config, vp_stage=None):
    """Megatron-Core-only (no Transformer Engine) GPT layer spec with the plugin's core attention."""
    t, core_attention = _transformer_config(model_config)
    PROCESS_GROUPS.initialize(t)
    return patch_spec(_core_spec(t, False, vp_stage), core_attention)


def _core_spec(t, use_te: bool, vp_stage):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if t.num_moe_experts:
        return specs.get_gpt_decoder_block_spec(t, use_transformer_engine=use_te, normalization=t.normalization,
                                                qk_l2_norm=t.qk_l2_norm, vp_stage=vp_stage)
    common = dict(num_experts=None, moe_grouped_gemm=False, qk_layernorm=t.qk_layernorm,
                  multi_latent_attention=t.multi_latent_attention, qk_l2_norm=t.qk_l2_norm)
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(**common)
    return specs.get_gpt_layer_local_spec(normalization=t.normalization, **common)


def patch_spec(spec, core_attention=None):
    """Set ``core_attention`` of every self-attention in ``spec`` -- a TransformerLayer spec, a
    TransformerBlockSubmodules (``layer_specs``) or a block ModuleSpec -- in place; returns ``spec``.
    ``core_attention`` None: :func:`~.core_attention.core_attention_spec` (a telemetry of this
    spec's own, the process's groups). Raises ValueError when it finds no core-attention slot."""
    if core_attention is None:
        core_attention = core_attention_spec()
    patched = _patch(spec, core_attention, seen=set())
    if not patched:
        raise ValueError(f"no self_attention.submodules.core_attention found in {type(spec).__name__} spec")
    return spec


def _patch(spec, core_attention, seen: set) -> int:
    if id(spec) in seen:
        return 1
    seen.add(id(spec))
    subs = spec.submodules if isinstance(spec, ModuleSpec) else spec
    if hasattr(subs, "layer_specs"):  # a block: patch each layer
        return sum(_patch(layer, core_attention, seen) for layer in subs.layer_specs)
    attention = getattr(subs, "self_attention", None)
    attention_subs = getattr(attention, "submodules", None)
    if attention_subs is None or not hasattr(attention_subs, "core_attention"):
        return 0
    attention_subs.core_attention = core_attention
    return 1

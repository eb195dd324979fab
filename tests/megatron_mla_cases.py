"""DeepSeek-style layers through a Python-built GPTModel on Megatron's zigzag and the balanced
layout, run inside the shared Megatron spawn (tests/conftest.megatron_models,
:func:`megatron_cases.run_cases`).

Multi-latent attention (``MLATransformerConfig``): query/key head dim 16 + 8 (``qk_head_dim`` +
``qk_pos_emb_head_dim``), value head dim 12, low-rank q and kv projections, YaRN rotary
(``rope_type="yarn"``, scaling 4 over 16 original positions, so the 48-token samples use it, and
its scale 1.14 on the rotated part; plain RoPE too on the balanced layout), which
MLA applies itself at this rank's positions: the zigzag's, or on the balanced layout each local
token's global one (``batch_layout.follow_layout`` hooks MLA's own rotary). Per case, at CP 4
(mesh, tasp, ring, a2a+mesh) on both layouts and TP 2 x CP 2 (mesh 2x1, ring) on the zigzag, whole
sequences and end-of-document documents (and with documents on the balanced layout: a2a+tasp and
a2a+ring at CP 4, mesh 2x1 at TP 2 x CP 2), the loss summed over the CP group and every parameter
gradient all-reduced over it equal the same model at CP 1 -- where the plugin's single-rank
attention runs (Megatron's local DotProductAttention takes no separate value head dim; the
single-rank attention with d_v != d_qk is checked against the dense reference in
tests/runtime/test_sinks.py).
"""

from __future__ import annotations

import torch

import megatron_cases as mc

HCP = [2, 2]


def _mla_config(tp: int, cp: int, mode, documents, hcp, layout: str = "zigzag", rope: str = "yarn"):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_mesh.megatron.settings import PluginSettings

    config = MLATransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, tensor_model_parallel_size=tp,
        context_parallel_size=cp, cp_comm_type=mode if cp > 1 else None, use_cpu_initialization=True,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, attention_dropout=0.0, hidden_dropout=0.0,
        q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12, rope_type=rope,
        rotary_scaling_factor=4.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0.0,
        apply_rope_fusion=False, transformer_impl="local")
    config.hierarchical_context_parallel_sizes = hcp
    config.cp_settings = PluginSettings.of(seq_length=mc.SEQ_M, documents=documents, cp_layout=layout)
    return config


def _modes(cp: int) -> list:
    if cp != 4:
        return [("mesh 2x1", "mesh", None), ("ring", "ring", None)]
    return [("mesh", "mesh", None), ("tasp", "tasp", None), ("ring", "ring", None), ("a2a+mesh", "a2a+mesh", HCP)]


def _run(tp, cp, mode, what, hcp, full, pgc, cp_group, layout="zigzag", rope="yarn"):
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_mesh.megatron import batch_layout
    from megatron_mesh.megatron.pretrain_gpt import document_params
    from megatron_mesh.megatron.spec import gpt_local_layer_spec

    balanced = layout == "balanced"
    config = _mla_config(tp, cp, mode, "eod" if what == "documents" or balanced else None, hcp, layout, rope)
    model = mc._build_len(config, gpt_local_layer_spec(config), pgc, "rope")
    if balanced:  # each sample split by its own layout (whole: one document each); MLA's rotaries follow it
        rows = batch_layout.document_rows(full, "eod", mc.VOCAB - 1) if what == "documents" else \
            ((0, mc.SEQ_M),) * mc.BATCH
        split = batch_layout.BatchLayout.of(rows, config, cp_group.rank())
        assert split.balanced and batch_layout.follow_layout(model) == config.num_layers
        batch_layout.set_current(split)
        batch, packed = split.shard(dict(full), cp_group), None  # MLA's layers read the current boundaries
    else:
        packed = document_params(full["tokens"], mc.VOCAB - 1) if what == "documents" else None
        batch = full if cp == 1 else get_batch_on_this_cp_rank(dict(full), is_hybrid_cp=False, cp_group=cp_group)
    try:
        loss, grads = mc._run_masked(model, batch, packed)
    finally:
        batch_layout.set_current(None)
    attn = [layer.self_attention.core_attention for layer in model.decoder.layers]
    return loss, grads, attn


def gpt_mla_equivalence(rank: int, world: int, layouts) -> list[dict]:
    """For each (tp, cp) of ``layouts``: every mode of :func:`_modes`, whole sequences and EOD
    documents, on the zigzag (and at CP 4 the balanced layout), against CP 1; one record per run."""
    records = []
    for tp, cp, pgc, single_pgc, cp_group, full in mc.over_layouts(rank, world, layouts):
        for what in ("whole", "documents"):
            ref_loss, ref_grads, _ = _run(tp, 1, None, what, None, full, single_pgc, None)
            for layout in ("zigzag", "balanced") if cp == 4 else ("zigzag",):
                for label, mode, hcp in _modes(cp):
                    loss, grads, attn = _run(tp, cp, mode, what, hcp, full, pgc, cp_group, layout)
                    rec = mc._compare(f"TP={tp} CP={cp} MLA {what} {layout} {label}", loss, grads, ref_loss, ref_grads,
                                      cp_group)
                    rec.update(label=label, what=what, layout=layout, rope="yarn", tp=tp, cp=cp,
                               modes=[a.mode for a in attn], kinds=sorted({type(a).__name__ for a in attn}))
                    records.append(rec)
        # the other hybrids, and TP 2 x CP 2, with YaRN on the balanced layout: documents
        extra = [("a2a+tasp", "a2a+tasp", HCP), ("a2a+ring", "a2a+ring", HCP)] if cp == 4 else _modes(cp)[:1]
        ref_loss, ref_grads, _ = _run(tp, 1, None, "documents", None, full, single_pgc, None)
        for label, mode, hcp in extra:
            loss, grads, attn = _run(tp, cp, mode, "documents", hcp, full, pgc, cp_group, "balanced")
            rec = mc._compare(f"TP={tp} CP={cp} MLA documents balanced {label}", loss, grads, ref_loss, ref_grads,
                              cp_group)
            rec.update(label=label, what="documents", layout="balanced", rope="yarn", tp=tp, cp=cp,
                       modes=[a.mode for a in attn], kinds=sorted({type(a).__name__ for a in attn}))
            records.append(rec)
        if cp == 4:  # MLA's plain RoPE (rope_type "rope") on the balanced layout: documents, two modes
            ref_loss, ref_grads, _ = _run(tp, 1, None, "documents", None, full, single_pgc, None, rope="rope")
            for label, mode, hcp in _modes(cp)[::3]:
                loss, grads, attn = _run(tp, cp, mode, "documents", hcp, full, pgc, cp_group, "balanced", "rope")
                rec = mc._compare(f"TP={tp} CP={cp} MLA RoPE documents balanced {label}", loss, grads, ref_loss,
                                  ref_grads, cp_group)
                rec.update(label=label, what="documents", layout="balanced", rope="rope", tp=tp, cp=cp,
                           modes=[a.mode for a in attn], kinds=sorted({type(a).__name__ for a in attn}))
                records.append(rec)
    return records

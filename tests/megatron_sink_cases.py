"""gpt-oss-style layers through a Python-built GPTModel, run inside the shared Megatron spawn
(tests/conftest.megatron_models, :func:`megatron_cases.run_cases`).

Every layer has attention sinks (``config.softmax_type`` learnable or off-by-one: Megatron's
``softmax_offset``), layer 1 a sliding window of 5 tokens and layer 2 full attention
(``window_size=(5, 0)``, ``window_attn_skip_freq=2``), GQA (4 heads, 2 groups):

* ``plain``: whole sequences, against Megatron's own ``DotProductAttention`` at CP 1 (which owns
  the reference sinks: the same parameter name, shape and initialisation, or the gradient
  comparison reports it missing);
* ``zigzag`` / ``balanced``: end-of-document documents on Megatron's zigzag and on each sample's
  balanced layout, against the plugin's single-rank attention at CP 1 (Megatron's local attention
  drops a dense document mask on a window layer).

Per case, the loss summed over the CP group and every parameter gradient all-reduced over it
(what Megatron's DDP does over data x context-parallel ranks) -- the sinks' included -- against
the CP 1 reference (:func:`megatron_cases._compare`).
"""

from __future__ import annotations

import megatron_cases as mc

WINDOW = (5, 0)  # on layer 1; layer 2 full (window_attn_skip_freq 2)
HCP = [2, 2]


def _modes(cp: int, what: str) -> list:
    """(label, cp_comm_type, hierarchical sizes) of the modes each case runs."""
    if cp != 4:
        return [("mesh 2x1", "mesh", None), ("ring", "ring", None)]
    out = [("mesh", "mesh", None), ("tasp", "tasp", None), ("ring", "ring", None), ("a2a+mesh", "a2a+mesh", HCP)]
    if what == "plain":  # the other hybrids, and a per-layer list
        out += [("a2a+tasp", "a2a+tasp", HCP), ("a2a+ring", "a2a+ring", HCP),
                ("a2a+mesh / ring per layer", ["a2a+mesh", "ring"], HCP)]
    return out


def _model(tp, cp, mode, softmax_type, documents, layout, hcp, pgc):
    from megatron_mesh.megatron.spec import gpt_local_layer_spec

    config = mc._config(tp, cp, (4, 2), mode, WINDOW, _model_fields(softmax_type), seq_length=mc.SEQ_M,
                        documents=documents, cp_layout=layout)
    config.hierarchical_context_parallel_sizes = hcp
    return mc._build_len(config, gpt_local_layer_spec(config), pgc, "rope"), config


def _model_fields(softmax_type: str) -> dict:
    return dict(softmax_type=softmax_type, window_attn_skip_freq=2)


def _reference(tp, softmax_type, what, full, single_pgc):
    """The CP 1 loss and gradients: Megatron's own attention (plain), or the plugin's single-rank
    attention on the documents."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_mesh.megatron.pretrain_gpt import document_params

    if what == "plain":
        config = mc._config(tp, 1, (4, 2), None, WINDOW, _model_fields(softmax_type))
        model = mc._build_len(config, get_gpt_layer_local_spec(), single_pgc, "rope")
        return (*mc._run_masked(model, full), _sink_entries(model))
    model, _ = _model(tp, 1, None, softmax_type, "eod", None, None, single_pgc)
    return (*mc._run_masked(model, full, document_params(full["tokens"], mc.VOCAB - 1)), None)


def _sink_entries(model) -> dict:
    """The sinks' entries of the model's distributed checkpoint: key -> (global shape, this rank's
    offset in it), and the local shape and type of what is saved."""
    out = {}
    for key, entry in model.sharded_state_dict().items():
        if "softmax_offset" in key:
            out[key] = (list(entry.global_shape), list(entry.global_offset), list(entry.local_shape),
                        type(entry).__name__)
    return out


def _local_batch(what, full, config, model, cp_group):
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_mesh.megatron import batch_layout
    from megatron_mesh.megatron.pretrain_gpt import document_params

    if what == "balanced":  # each sample split by its own layout; RoPE follows it
        split = batch_layout.BatchLayout.of(batch_layout.document_rows(full, "eod", mc.VOCAB - 1), config,
                                            cp_group.rank())
        batch_layout.set_current(split)
        assert batch_layout.follow_layout(model) == 1
        return split.shard(dict(full), cp_group), split.packed_seq_params()
    packed = document_params(full["tokens"], mc.VOCAB - 1) if what == "zigzag" else None
    return get_batch_on_this_cp_rank(dict(full), is_hybrid_cp=False, cp_group=cp_group), packed


def _stacked(batch, cp: int, hcp) -> list[list[str]]:
    """Per sample the masks whose balanced layout is the one the batch ran on: "stack" (the
    layers' summed work: layer 1 windowed, layer 2 full), "full" (the full mask alone: what the
    layout decision balanced before) or "window" (the window alone)."""
    from megatron_mesh.plan.balance import balanced_layout
    from megatron_mesh.plan.maskkinds import Mask, MaskStack

    masks = {"stack": MaskStack.of([Mask(True, WINDOW), Mask(True)]), "full": Mask(True), "window": Mask(True, WINDOW)}
    group = hcp[0] if hcp else 1
    return [[name for name, m in masks.items() if balanced_layout(row, cp, mask=m, group=group) == layout]
            for row, layout in zip(batch.rows, batch.layouts)]


def gpt_sinks_equivalence(rank: int, world: int, layouts) -> list[dict]:
    """For each (tp, cp) of ``layouts``: learnable sinks in every case and mode, off-by-one on the
    plain and zigzag cases; one record per run (loss, gradient error, the sinks' gradient)."""
    from megatron_mesh.megatron import batch_layout

    records = []
    for tp, cp, pgc, single_pgc, cp_group, full in mc.over_layouts(rank, world, layouts):
        for softmax_type in ("learnable", "off-by-one"):
            for what in ("plain", "zigzag", "balanced"):
                if softmax_type == "off-by-one" and what == "balanced":
                    continue
                ref_loss, ref_grads, ref_entries = _reference(tp, softmax_type, what, full, single_pgc)
                for label, mode, hcp in _modes(cp, what):
                    documents = None if what == "plain" else "eod"
                    layout = "balanced" if what == "balanced" else "zigzag"
                    model, config = _model(tp, cp, mode, softmax_type, documents, layout, hcp, pgc)
                    local, packed = _local_batch(what, full, config, model, cp_group)
                    loss, grads = mc._run_masked(model, local, packed)
                    stacked = _stacked(batch_layout.current(), cp, hcp) if what == "balanced" else None
                    batch_layout.set_current(None)
                    rec = mc._compare(f"TP={tp} CP={cp} {softmax_type} {what} {label}", loss, grads, ref_loss,
                                      ref_grads, cp_group)
                    attn = [layer.self_attention.core_attention for layer in model.decoder.layers]
                    rec.update(label=label, what=what, tp=tp, cp=cp, softmax_type=softmax_type,
                               modes=[a.mode for a in attn], windows=[a.window for a in attn], stacked=stacked,
                               sink_grad=[g.tolist() for n, g in ref_grads.items() if n.endswith("softmax_offset")],
                               offsets=[None if a.softmax_offset is None else list(a.softmax_offset.shape) for a in attn],
                               entries=_sink_entries(model), ref_entries=ref_entries)
                    records.append(rec)
    return records

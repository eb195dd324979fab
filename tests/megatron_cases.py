"""Megatron test cases run inside spawned gloo process groups (see megatron_mesh.comm.spawn).

:func:`gpt_equivalence` builds a tiny Megatron-Core GPTModel twice with identical weights: with
context parallelism (the plugin's core attention, each rank holding Megatron's zigzag chunk of
every sequence) and without (CP size 1, Megatron's own local DotProductAttention, the full
sequence on every rank). Summed over the CP group, the per-token losses must equal the
reference's, and the parameter gradients all-reduced over the CP group (what Megatron's DDP does
over data x context parallel ranks) must equal the reference gradients.
"""

from __future__ import annotations

import copy
import itertools

import torch
import torch.distributed as dist

VOCAB, SEQ, BATCH = 128, 32, 2


def _setup_megatron():
    from megatron_mesh.megatron import cpu_compat

    cpu_compat.install_model_patches()


def _config(tp: int, cp: int, heads: tuple[int, int], cp_comm_type, window_size=None, model=None, **plugin):
    """A model config; ``plugin``: its plugin settings by flag dest (and seq_length, documents);
    ``model``: more TransformerConfig fields (e.g. softmax_type)."""
    from megatron_mesh.megatron.args import MeshTransformerConfig
    from megatron_mesh.megatron.settings import PluginSettings

    return MeshTransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=heads[0], num_query_groups=heads[1], ffn_hidden_size=128,
        tensor_model_parallel_size=tp, context_parallel_size=cp, cp_comm_type=cp_comm_type if cp > 1 else None,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        attention_dropout=0.0, hidden_dropout=0.0, window_size=window_size, cp_settings=PluginSettings.of(**plugin),
        **(model or {}))


def _build(config, spec, pgc, position):
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(1234)  # identical weights in both models and on every CP rank
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type=position, pg_collection=pgc)


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return dict(tokens=tokens, labels=torch.roll(tokens, -1, 1),
                position_ids=torch.arange(SEQ).expand(BATCH, SEQ).contiguous(), attention_mask=None)


def _run(model, batch):
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])  # [b, s_local]
    loss = losses.sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _reference(tp: int, heads, position, single_pgc):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    model = _build(_config(tp, 1, heads, None), get_gpt_layer_local_spec(), single_pgc, position)
    return _run(model, _batch(7))


def _compare(case, loss, grads, ref_loss, ref_grads, cp_group):
    loss = loss.clone()
    dist.all_reduce(loss, group=cp_group)
    worst = 0.0
    for name, g in grads.items():
        g = g.clone()
        dist.all_reduce(g, group=cp_group)
        want = ref_grads[name]
        worst = max(worst, ((g - want).abs().max() / want.abs().max().clamp_min(1e-12)).item())
    missing = sorted(set(ref_grads) ^ set(grads))
    return dict(case=case, loss=loss.item(), ref_loss=ref_loss.item(), grad_rel_err=worst, missing=missing)


def _cases(cp: int):
    """(label, cp_comm_type, plugin settings) of every CP mode to check at CP size ``cp``."""
    tiles = [f"{a}x{cp // a}" for a in range(1, cp + 1) if cp % a == 0]
    out = [(f"mesh {t}", "mesh", dict(mesh_tile_shape=t)) for t in tiles]
    if cp == 4:  # the other Mesh settings, and TASP over two emulated nodes of two CP ranks
        out.append(("mesh 2x2 kv-contiguous lockstep keep", "mesh",
                    dict(mesh_tile_shape="2x2", mesh_contiguous="kv", mesh_schedule="lockstep",
                         mesh_backward_chunks="keep", cp_kernel_backend="math")))
        out.append(("tasp 2 nodes", "tasp", dict(tasp_gpus_per_node=2)))
        out.append(("tasp alltoall", "tasp", dict(tasp_transport="alltoall")))
    out += [("mesh auto", "mesh", {}), ("tasp", "tasp", {}), ("ring", "ring", {}),
            ("per-layer mesh tasp", ["mesh", "tasp"], {})]
    return out


def _parallel_layout(tp: int, cp: int, single):
    """Megatron's parallel state for TP x CP; returns its process groups, the same with the CP
    group replaced by ``single`` (this rank alone: the CP 1 reference) and the CP group."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    single_pgc = copy.copy(pgc)
    single_pgc.cp = single
    return pgc, single_pgc, ps.get_context_parallel_group()


def gpt_equivalence(rank: int, world: int, layouts) -> list[dict]:
    """For each (tp, cp, positions, heads) in ``layouts``: every mode of :func:`_cases` vs CP=1."""
    _setup_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_mesh.megatron.groups import PROCESS_GROUPS
    from megatron_mesh.megatron.spec import gpt_local_layer_spec

    singles = [dist.new_group([r]) for r in range(world)]  # collective: every rank makes every group
    records = []
    for tp, cp, positions, head_sets in layouts:
        pgc, single_pgc, cp_group = _parallel_layout(tp, cp, singles[rank])
        local = get_batch_on_this_cp_rank(_batch(7), is_hybrid_cp=False, cp_group=cp_group)
        for position, heads in itertools.product(positions, head_sets):
            ref_loss, ref_grads = _reference(tp, heads, position, single_pgc)
            for label, mode, plugin in _cases(cp):
                config = _config(tp, cp, heads, mode, **plugin)
                model = _build(config, gpt_local_layer_spec(config), pgc, position)
                kinds = sorted({type(l.self_attention.core_attention).__name__ for l in model.decoder.layers})
                strided = _watch_strides(model)
                loss, grads = _run(model, local)
                rec = _compare(f"TP={tp} CP={cp} {position} heads={heads} {label}", loss, grads,
                               ref_loss, ref_grads, cp_group)
                rec.update(label=label, tp=tp, cp=cp, attention_modules=kinds, strided_inputs=sorted(strided))
                rec["modes"] = [l.self_attention.core_attention.mode for l in model.decoder.layers]
                records.append(rec)
        if cp == 4:
            records.append(_routing(rank, cp_group, _config(tp, cp, (4, 2), "mesh", mesh_tile_shape="2x2")))
            records.append(_cpu_check(rank, cp_group, _config(tp, cp, (4, 2), "mesh", mesh_tile_shape="2x2")))
        PROCESS_GROUPS.destroy()
        ps.destroy_model_parallel()
    return records


def _watch_strides(model) -> set:
    """Filled, as the model runs, with the names (q, k, v) of the core attention inputs that are
    not contiguous (Megatron's QKV split hands views of its fused projection)."""
    seen: set = set()

    def hook(module, args):
        seen.update(name for name, t in zip("qkv", args[:3]) if not t.is_contiguous())

    for layer in model.decoder.layers:
        layer.self_attention.core_attention.register_forward_pre_hook(hook)
    return seen


def _routing(rank, cp_group, config) -> dict:
    """Mesh through the Q/KV ring sub-groups vs everything over the CP group: same output and
    gradients bit for bit, and the same bytes counted."""
    import megatron_mesh as mm
    from megatron_mesh.comm.torch_dist import TorchDistCommunicator
    from megatron_mesh.megatron.groups import PROCESS_GROUPS, cp_ranks
    from megatron_mesh.megatron.placement import resolve_placement

    placement = resolve_placement("mesh", config, cp_ranks(cp_group))  # the groups were built for it
    tile, contiguous = placement.tile, placement.options.contiguous
    routed = PROCESS_GROUPS.communicator(config, cp_group, placement)
    flat = TorchDistCommunicator(cp_group)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(8, 2, h, 16, generator=g) for h in (4, 2, 2))
    results = []
    for comm in (routed, flat):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        with mm.comm_counter() as c:
            out = mm.mesh_attention(qq, kk, vv, tile=tile, contiguous=contiguous, comm=comm)
            out.sum().backward()
        results.append(((out.detach(), qq.grad, kk.grad, vv.grad), (c.bytes_sent, c.bytes_received)))
    (a, bytes_a), (b, bytes_b) = results
    return dict(case="routing", label="routing", tp=1, cp=4, routes=sorted(routed.routes), flat_routes=flat.routes,
                identical=all(torch.equal(x, y) for x, y in zip(a, b)), bytes=(bytes_a, bytes_b),
                route_ranks={p: sorted(dist.get_process_group_ranks(grp)) for p, grp in routed.routes.items()})


def _cpu_check(rank, cp_group, config) -> dict:
    """The plan check of an NCCL CP group runs over a gloo twin of it (gloo stands in for NCCL here:
    ``needs_cpu_check_group`` answers yes): CPGroups makes the twin, the layers' communicator's
    calls are checked there -- the check's all-reduce goes to the twin, never to the CP group --,
    the result is unchanged, ranks that disagree still all raise PlanMismatchError, and destroy
    gives the check back to the CP group."""
    import megatron_mesh as mm
    from megatron_mesh.comm.torch_dist import TorchDistCommunicator
    from megatron_mesh.megatron import groups
    from megatron_mesh.megatron.placement import resolve_placement
    from megatron_mesh.runtime.state import RUNTIME

    own, real = groups.CPGroups(), groups.needs_cpu_check_group
    groups.needs_cpu_check_group = lambda group: True
    try:
        own.initialize(config, cp_group)
        placement = resolve_placement("mesh", config, groups.cp_ranks(cp_group))
        comm = own.communicator(config, cp_group, placement)
    finally:
        groups.needs_cpu_check_group = real
    twin = RUNTIME.checks.check_group(cp_group)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(8, 2, h, 16, generator=g) for h in (4, 2, 2))
    seen, all_reduce = [], dist.all_reduce

    def spy(tensor, *args, group=None, **kwargs):
        seen.append("twin" if group is twin else "cp group" if group is cp_group else "other")
        return all_reduce(tensor, *args, group=group, **kwargs)

    dist.all_reduce = spy
    try:
        outs = [mm.mesh_attention(q, k, v, tile=placement.tile, comm=c) for c in (comm, TorchDistCommunicator(cp_group))]
        try:
            mm.mesh_attention(q, k, v, tile=placement.tile, comm=comm, softmax_scale=0.5 if rank == 0 else None)
            mismatch = None
        except mm.PlanMismatchError as e:
            mismatch = str(e)
    finally:
        dist.all_reduce = all_reduce
    ring = next(iter(comm.routes.values()))  # a sub-group of 2 of the CP group's ranks: not a twin of it
    try:
        RUNTIME.checks.use_cpu_group(cp_group, ring)
        refused = None
    except ValueError as e:
        refused = str(e)
    rec = dict(case="cpu_check", label="cpu_check", tp=1, cp=4, twin_backend=dist.get_backend(twin),
               twin_ranks=dist.get_process_group_ranks(twin), cp_ranks=dist.get_process_group_ranks(cp_group),
               is_cp_group=twin is cp_group, checked_on=seen, identical=torch.equal(outs[0], outs[1]),
               mismatch=mismatch, refused=refused)
    own.destroy()
    return dict(rec, after=RUNTIME.checks.check_group(cp_group) is cp_group)


# -- masks and hybrids at the model level -----------------------------------------------------------------
SEQ_M = 48  # divisible by 2 x CP for CP 4 (halves of 6) and by the THD padding multiple 8


def _doc_batch(seed: int):
    """Two samples of SEQ_M tokens with documents cut at end-of-document tokens (VOCAB - 1)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB - 1, (BATCH, SEQ_M), generator=g)
    tokens[0, [4, 5, 20, 31]] = VOCAB - 1  # a 1-token document, documents across rank chunks
    tokens[1, [9, 40]] = VOCAB - 1
    return dict(tokens=tokens, labels=torch.roll(tokens, -1, 1),
                position_ids=torch.arange(SEQ_M).expand(BATCH, SEQ_M).contiguous(), attention_mask=None)


def _owners_batch(seed: int):
    """Two samples of SEQ_M tokens whose documents Mesh's owners layout lays out at CP 4 (it names
    other ranks than the query's owner for 5 and 3 blocks; it refuses :func:`_doc_batch`'s)."""
    batch = _doc_batch(seed)
    tokens = batch["tokens"]
    tokens[tokens == VOCAB - 1] = 0
    tokens[0, [7, 21, 23, 28, 36]] = VOCAB - 1
    tokens[1, [10, 17, 36, 43, 45]] = VOCAB - 1
    return dict(batch, labels=torch.roll(tokens, -1, 1))


def _dense_doc_mask(tokens):
    """Megatron's --reset-attention-mask mask ([b, 1, s, s], True = masked): causal, and no token
    sees tokens at or before an end-of-document token that precedes it."""
    b, s = tokens.shape
    mask = torch.tril(torch.ones(b, s, s)).bool()
    for i in range(b):
        for eod in (tokens[i] == VOCAB - 1).nonzero().flatten().tolist():
            mask[i, eod + 1:, :eod + 1] = False
    return ~mask.unsqueeze(1)


CHUNK = 7  # chunked attention's chunks (Llama 4's, --attention-chunk-size): across the zigzag's halves of 6 at CP 4


def _dense_chunk_mask(tokens, size: int):
    """:func:`_dense_doc_mask` and chunked attention: a query sees only the keys of its own chunk
    of ``size`` tokens, counted from its document's start (True = masked)."""
    allowed = ~_dense_doc_mask(tokens)
    b, s = tokens.shape
    for i in range(b):
        starts = [0] + [e + 1 for e in (tokens[i] == VOCAB - 1).nonzero().flatten().tolist() if e + 1 < s]
        chunk = torch.empty(s, dtype=torch.long)
        for a, z in zip(starts, starts[1:] + [s]):
            chunk[a:z] = a * s + torch.arange(z - a) // size  # one id per (document, chunk)
        allowed[i, 0] &= chunk[:, None] == chunk[None, :]
    return ~allowed


def _run_masked(model, batch, packed=None):
    losses = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"],
                   packed_seq_params=packed)
    loss = (losses * batch.get("loss_mask", torch.ones_like(losses))).sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _masked_cases(cp: int):
    out = [("mesh 2x2", "mesh", dict(mesh_tile_shape="2x2")), ("mesh auto", "mesh", {}), ("tasp", "tasp", {}),
           ("ring", "ring", {})] if cp == 4 else [("mesh 2x1", "mesh", dict(mesh_tile_shape="2x1")), ("ring", "ring", {})]
    if cp == 4:
        out.append(("a2a+mesh U2 x M2", "a2a+mesh", dict(hierarchical_context_parallel_sizes=[2, 2])))
        out.append(("a2a+mesh / mesh per layer", ["a2a+mesh", "mesh"], dict(hierarchical_context_parallel_sizes=[2, 2])))
    return out


def model_failures(records, loss_rtol: float, grad_rtol: float) -> list[str]:
    """Every record whose loss or parameter gradients differ from its CP 1 reference beyond the
    tolerances, or whose gradients are missing, as one line each."""
    failures = []
    for rank, recs in enumerate(records):
        for rec in recs:
            if abs(rec["loss"] - rec["ref_loss"]) > loss_rtol * abs(rec["ref_loss"]):
                failures.append(f"rank {rank} {rec['case']}: loss {rec['loss']!r} vs CP 1 {rec['ref_loss']!r}")
            if not rec["grad_rel_err"] <= grad_rtol:
                failures.append(f"rank {rank} {rec['case']}: gradient error {rec['grad_rel_err']:.2e}")
            if rec["missing"]:
                failures.append(f"rank {rank} {rec['case']}: gradients missing for {rec['missing']}")
    return failures


def gpt_masked_equivalence(rank: int, world: int, layouts) -> list[dict]:
    """Window, end-of-document documents, THD packing and chunked attention (Llama 4's, on the
    balanced layout of the documents) through GPTModel at CP > 1 against Megatron's own attention
    at CP 1 with the same mask (a dense mask, or its sliding window)."""
    _setup_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_mesh.megatron import batch_layout
    from megatron_mesh.megatron.groups import PROCESS_GROUPS
    from megatron_mesh.megatron.pretrain_gpt import document_params, pack_thd
    from megatron_mesh.megatron.spec import gpt_local_layer_spec

    singles = [dist.new_group([r]) for r in range(world)]
    records = []
    for tp, cp in layouts:
        pgc, single_pgc, cp_group = _parallel_layout(tp, cp, singles[rank])
        for what in ("window", "documents", "balanced", "thd", "chunked") + (("owners",) if (tp, cp) == (1, 4) else ()):
            full = _owners_batch(11) if what == "owners" else _doc_batch(11)
            extra = dict(window_size=(5, 0)) if what == "window" else {}
            ref_cfg = _config(tp, 1, (4, 2), None, **extra)  # no documents: the reference reads the dense mask
            position = "rope"
            ref_model = _build_len(ref_cfg, get_gpt_layer_local_spec(), single_pgc, position)
            if what == "thd":
                packed_full, _ = pack_thd({k: v[:1] for k, v in full.items() if v is not None} | {"loss_mask": torch.ones(1, SEQ_M)},
                                          VOCAB - 1, 8, 1, 0)
                ref_batch = dict(packed_full)
                ref_batch["attention_mask"] = _thd_dense_mask(packed_full)
            else:
                documents = what in ("documents", "balanced", "owners")
                ref_batch = dict(full, attention_mask=_dense_doc_mask(full["tokens"]) if documents else
                                 _dense_chunk_mask(full["tokens"], CHUNK) if what == "chunked" else None)
            ref_loss, ref_grads = _run_masked(ref_model, ref_batch)
            # the mask must matter: the same model and batch with the plain causal mask differ
            unmasked_cfg = _config(tp, 1, (4, 2), None)
            unmasked_loss, unmasked_grads = _run_masked(_build_len(unmasked_cfg, get_gpt_layer_local_spec(), single_pgc, position),
                                           dict(ref_batch, attention_mask=None))
            mask_effect = max(((unmasked_grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
                              for n, g in ref_grads.items())
            for label, mode, plugin in _masked_cases(cp):
                if what == "owners" and mode != "mesh":  # only Mesh computes blocks where a layout names
                    continue
                plugin = dict(plugin)
                hcp = plugin.pop("hierarchical_context_parallel_sizes", None)
                # the hybrids on the balanced layout with their first and last documents set apart
                # (pretrain() runs them on the plain balanced layout)
                if what == "chunked":
                    plugin["attention_chunk_size"] = CHUNK
                config = _config(tp, cp, (4, 2), mode, **extra, **plugin, seq_length=SEQ_M,
                                 documents={"window": None, "thd": "thd"}.get(what, "eod"),
                                 cp_layout={"balanced": "balanced-hide" if hcp else "balanced", "chunked": "balanced",
                                            "owners": "owners"}.get(what, "zigzag"))
                if hcp:
                    config.hierarchical_context_parallel_sizes = hcp
                model = _build_len(config, gpt_local_layer_spec(config), pgc, position)
                owners = []
                if what in ("balanced", "owners", "chunked"):  # each sample split by its own layout; RoPE follows it
                    split = batch_layout.BatchLayout.of(batch_layout.document_rows(full, "eod", VOCAB - 1), config,
                                                        cp_group.rank())
                    batch_layout.set_current(split)
                    assert batch_layout.follow_layout(model) == 1
                    packed, local = split.packed_seq_params(), split.shard(dict(full), cp_group)
                    owners = [len(layout.owners) for layout in split.layouts]
                elif what == "thd":
                    local, packed = pack_thd({k: v[:1] for k, v in full.items() if v is not None}
                                             | {"loss_mask": torch.ones(1, SEQ_M)}, VOCAB - 1, 8, cp_group.size(),
                                             cp_group.rank())
                else:
                    packed = document_params(full["tokens"], VOCAB - 1) if what == "documents" else None
                    local = get_batch_on_this_cp_rank(dict(full), is_hybrid_cp=False, cp_group=cp_group)
                loss, grads = _run_masked(model, local, packed)
                batch_layout.set_current(None)
                rec = _compare(f"TP={tp} CP={cp} {what} {label}", loss, grads, ref_loss, ref_grads, cp_group)
                rec.update(label=label, what=what, tp=tp, cp=cp, unmasked_ref_loss=unmasked_loss.item(),
                           mask_effect=mask_effect, owners=owners,
                           modes=[l.self_attention.core_attention.mode for l in model.decoder.layers])
                records.append(rec)
        PROCESS_GROUPS.destroy()
        ps.destroy_model_parallel()
    return records


def gpt_mask_refusals(rank: int, world: int, layouts) -> list[dict]:
    """What a Python user of Megatron-Core gets wrong, at CP 4 (mesh): documents on a batch that
    Megatron's get_batch_on_this_cp_rank split while the layer's layout is the balanced one,
    and a dense attention_mask that is not the causal one (both ran silently with a wrong loss);
    the causal mask of the zigzag positions, which Megatron's dataloader makes, still runs. One
    record per case: the error's text, or the loss and the same model's loss without a mask."""
    _setup_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_mesh.megatron.groups import PROCESS_GROUPS
    from megatron_mesh.megatron.pretrain_gpt import document_params
    from megatron_mesh.megatron.spec import gpt_local_layer_spec

    single = [dist.new_group([r]) for r in range(world)][rank]
    records = []
    for tp, cp in layouts:
        pgc, _, cp_group = _parallel_layout(tp, cp, single)
        full = _doc_batch(11)
        causal = ~torch.tril(torch.ones(BATCH, SEQ_M, SEQ_M)).bool().unsqueeze(1)
        cases = [("balanced layout, zigzag split", "eod", dict(full), document_params(full["tokens"], VOCAB - 1)),
                 ("document mask, no documents", None, dict(full, attention_mask=_dense_doc_mask(full["tokens"])), None),
                 ("causal mask", None, dict(full, attention_mask=causal), None),
                 ("no mask", None, dict(full), None),
                 # a window layer given the dataloader's causal mask (Megatron-LM's script): its window is the
                 # config's, the mask only the causal structure
                 ("window, causal mask", None, dict(full, attention_mask=causal), None),
                 ("window, no mask", None, dict(full), None)]
        for name, documents, batch, packed in cases:
            # every sample on its balanced layout (auto may keep the zigzag)
            config = _config(tp, cp, (4, 2), "mesh", **(dict(window_size=(5, 0)) if "window" in name else {}),
                             seq_length=SEQ_M, documents=documents, cp_layout="balanced")
            model = _build_len(config, gpt_local_layer_spec(config), pgc, "rope")
            local = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=cp_group)
            try:
                loss, _ = _run_masked(model, local, packed)
                dist.all_reduce(loss, group=cp_group)
                records.append(dict(case=name, loss=loss.item()))
            except ValueError as e:
                records.append(dict(case=name, error=str(e)))
        PROCESS_GROUPS.destroy()
        ps.destroy_model_parallel()
    return records


def over_layouts(rank: int, world: int, layouts):
    """For each (tp, cp) of ``layouts``, Megatron's parallel state set up (and torn down after):
    yields (tp, cp, its process groups, the same with this rank alone as the CP group -- the CP 1
    reference --, the CP group, the two samples of documents of :func:`_doc_batch`)."""
    _setup_megatron()
    from megatron.core import parallel_state as ps

    from megatron_mesh.megatron.groups import PROCESS_GROUPS

    singles = [dist.new_group([r]) for r in range(world)]  # collective: every rank makes every group
    for tp, cp in layouts:
        pgc, single_pgc, cp_group = _parallel_layout(tp, cp, singles[rank])
        yield tp, cp, pgc, single_pgc, cp_group, _doc_batch(11)
        PROCESS_GROUPS.destroy()
        ps.destroy_model_parallel()


def _build_len(config, spec, pgc, position):
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(1234)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ_M,
                    position_embedding_type=position, pg_collection=pgc)


def _thd_dense_mask(packed):
    """The THD batch's mask as Megatron's dense [1, 1, s, s] (True = masked): causal inside each
    sequence's real tokens; padding attends nothing (rows fully masked; their loss mask is 0)."""
    s = packed["tokens"].shape[1]
    allowed = torch.zeros(s, s, dtype=torch.bool)
    pos = packed["position_ids"][0]
    # a document is a run where position ids count up from 0 and the loss mask is 1
    start = None
    real = packed["loss_mask"][0] > 0
    for i in range(s + 1):
        if i < s and real[i] and (start is None or pos[i] != 0):
            start = i if start is None else start
            continue
        if start is not None:
            allowed[start:i, start:i] = torch.tril(torch.ones(i - start, i - start)).bool()
            start = None
        if i < s and real[i]:
            start = i
    return ~allowed.view(1, 1, s, s)


def run_cases(rank: int, world: int, cases: dict) -> dict:
    """{name: records} of each case function of this module named in ``cases`` ({name: its
    layouts}), one after the other in the same process group (tests/conftest.megatron_models)."""
    from megatron_mla_cases import gpt_mla_equivalence
    from megatron_sink_cases import gpt_sinks_equivalence

    runners = {"gpt_equivalence": gpt_equivalence, "gpt_masked_equivalence": gpt_masked_equivalence,
               "gpt_mask_refusals": gpt_mask_refusals, "gpt_sinks_equivalence": gpt_sinks_equivalence,
               "gpt_mla_equivalence": gpt_mla_equivalence}
    return {name: runners[name](rank, world, layouts) for name, layouts in cases.items()}

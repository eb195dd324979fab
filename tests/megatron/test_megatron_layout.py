"""The balanced CP layout in Megatron (megatron_mesh/megatron/batch_layout.py), in one process:

* the one decision (:func:`sample_layout`): zigzag / CP 1 -> Megatron's zigzag, the Ulysses degree
  as the balancing group, the window only when every layer has it, one cached object per sample;
* documents from a batch: position-id resets = end-of-document tokens, as Megatron's dataset makes
  them (adjacent EODs, an EOD at the last position);
* the batch split: S/P tokens per rank per sample, each sample by its own layout, every tensor
  with a sequence dimension, the dense mask dropped;
* RoPE: the hooked rotary embedding of every CP rank is the full embedding gathered at the
  layout's positions -- per sample [s_local, b, 1, d], shared [s_local, 1, 1, d] -- and rotating
  this rank's queries with it equals rotating the full sequence and splitting it;
* Megatron-LM's scripts: ``install`` swaps ``get_batch_on_this_cp_rank`` for the layout's split
  and makes the batch current for the layers;
* the core attention refuses a batch split by layouts other than its own.

The losses through ``pretrain()``: tests/megatron/test_megatron_pretrain_masks.py; the GPTModel against
Megatron's attention with a dense mask: tests/megatron/test_megatron_masks.py.
"""

import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/setup_env.sh installs it)")

from megatron_mesh.megatron import batch_layout  # noqa: E402
from megatron_mesh.plan.balance import balanced_layout  # noqa: E402
from megatron_mesh.plan.layout import positions  # noqa: E402
from megatron_mesh.plan.maskkinds import Mask, MaskStack  # noqa: E402

pytestmark = pytest.mark.megatron

S, P, EOD = 32, 4, 31


def config(documents=None, **kw):
    """Megatron's arguments (the plugin's flags by dest), or -- ``documents`` -- a transformer config
    carrying the settings made from them, with where the documents come from."""
    from dataclasses import replace

    from megatron_mesh.megatron.settings import PluginSettings

    base = dict(context_parallel_size=P, cp_layout="balanced", cp_comm_type=None, num_layers=2, window_size=None,
                window_attn_skip_freq=None, hierarchical_context_parallel_sizes=None)
    ns = SimpleNamespace(**{**base, **kw})
    if documents is not None:
        ns.cp_settings = replace(PluginSettings.from_args(ns), documents=documents)
    return ns


class FakeGroup:
    """What RotaryEmbedding and the batch split ask of a CP group."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def _tokens():
    """Two samples of S tokens with different documents (EOD = 31): one-token documents, adjacent
    EODs, an EOD at the last position, a long document."""
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, EOD, (2, S), generator=g)
    tokens[0, [3, 4, 5, 17, S - 1]] = EOD
    tokens[1, [20]] = EOD
    return tokens


@pytest.fixture(autouse=True)
def _no_current_batch():
    yield
    batch_layout.set_current(None)


def test_sample_layout_is_the_one_decision():
    cu = (0, 3, 19, 24, 32)
    assert batch_layout.sample_layout(cu, config(cp_layout="zigzag")) is None
    assert batch_layout.sample_layout(cu, config(context_parallel_size=1)) is None
    layout = batch_layout.sample_layout(cu, config())
    assert layout is batch_layout.sample_layout(list(cu), config())  # one cached object
    assert layout.documents() == ((0, 3), (3, 19), (19, 24), (24, 32))
    assert {sum(n for _, n in r) for r in layout.rank_runs} == {S // P}
    hybrid = batch_layout.sample_layout(cu, config(hierarchical_context_parallel_sizes=[2, 2]))
    assert hybrid.group == 2 and layout.group == 1
    # --cp-layout balanced-hide: the hybrids' groups also set apart documents run first and last
    hidden = batch_layout.sample_layout(cu, config(cp_layout="balanced-hide",
                                                   hierarchical_context_parallel_sizes=[2, 2]))
    assert hidden.hide and not hybrid.hide and hidden.text() != hybrid.text()
    assert hidden == balanced_layout(cu, P, group=2, hide=True)
    assert batch_layout.uses_balanced_layout(config(cp_layout="balanced-hide", documents="eod"))
    assert not batch_layout.uses_balanced_layout(config(cp_layout="zigzag", documents="eod"))
    # a window on every layer changes the work to balance (here, the layout); on some layers only,
    # the layers' summed work: layer 1 windowed, layer 2 full (--window-attn-skip-freq 2)
    windowed = batch_layout.sample_layout(cu, config(window_size=(3, 0)))
    assert windowed != layout
    stacked = batch_layout.sample_layout(cu, config(window_size=(3, 0), window_attn_skip_freq=2))
    stack = MaskStack.of([Mask(True, (3, 0)), Mask(True)])
    assert stacked == balanced_layout(cu, P, mask=stack) and stacked not in (layout, windowed)
    # a 0/1 list with every layer windowed is the window's layout
    assert batch_layout.sample_layout(cu, config(window_size=(3, 0), window_attn_skip_freq=[1, 1])) is windowed


# the layers' mode and shape that --cp-layout auto prices a sample for (32/8 heads of 128 in bf16)
PRICED = dict(cp_comm_type="ring", num_attention_heads=32, num_query_groups=8, kv_channels=128,
              tensor_model_parallel_size=1, params_dtype=torch.bfloat16)


@pytest.mark.parametrize("mode, flags, want", [
    ("ring", {}, 2.0), ("ring", dict(mesh_backward_keep_limit=3.0), 3.0),
    ("tasp", dict(tasp_backward_keep_limit=0.5), 0.5), ("tasp", dict(tasp_backward_chunks="keep"), math.inf),
    ("mesh", dict(mesh_backward_chunks="refetch"), 0.0)])
def test_auto_prices_the_backward_the_layers_keep(monkeypatch, mode, flags, want):
    """--cp-layout auto prices a sample for what the layers' backward keeps of what a rank pulled:
    --mesh-backward-keep-limit / --tasp-backward-keep-limit under backward chunks 'auto', all of it
    under 'keep', none under 'refetch' (plan.sparse_needs.keep_limit_of)."""
    from megatron_mesh.megatron import layout_decision

    seen = []
    monkeypatch.setattr(layout_decision, "_decide", lambda name, sample: seen.append(sample))
    batch_layout.sample_layout((0, 3, 19, 24, 32), config(cp_layout="auto", **{**PRICED, "cp_comm_type": mode},
                                                          **flags))
    assert [(sample.mode, sample.keep_limit) for sample in seen] == [(mode, want)]


@pytest.mark.parametrize("modes, want", [("mesh", ("mesh",)), (["mesh", "ring"], ("mesh", "ring")),
                                         (["mesh", "mesh"], ("mesh",))])
def test_auto_knows_every_layer_s_mode(monkeypatch, modes, want):
    """--cp-layout auto offers Mesh's owners layout only where every layer runs Mesh: the sample
    carries the layers' modes (a per-layer list), each once."""
    from megatron_mesh.megatron import layout_decision

    seen = []
    monkeypatch.setattr(layout_decision, "_decide", lambda name, sample: seen.append(sample))
    batch_layout.sample_layout((0, 3, 19, 24, 32), config(cp_layout="auto", **{**PRICED, "cp_comm_type": modes}))
    assert [(sample.mode, sample.layer_modes) for sample in seen] == [("mesh", want)]


def test_auto_runs_mesh_on_its_owners_layout_where_it_simulates_faster():
    """--cp-layout auto with mesh on every layer at CP 8 (one node, 64K tokens, 32/8 heads of 128 in
    bf16): seed 0 of lognormal:4096 runs on Mesh's owners layout (4.75 ms simulated against 5.21 on
    the balanced layout), ring and a per-layer list with ring on the balanced layout; the sample
    carries the layers' Mesh options (what the price plans with); seed 1 on it beside the zigzag."""
    from megatron_mesh.megatron import layout_decision
    from megatron_mesh.megatron.settings import plugin_settings
    from megatron_mesh.plan.layouts import get_layout_kind
    from megatron_mesh.tools.plan_args import document_bounds

    n = 65536
    cu = tuple(document_bounds("lognormal:4096,1.0", n, 0))
    mesh = config(cp_layout="auto", **{**PRICED, "cp_comm_type": "mesh"}, context_parallel_size=8)
    got = batch_layout.sample_layout(cu, mesh)
    sample = layout_decision.layout_sample(cu, mesh, plugin_settings(mesh))
    assert got.owners and got == get_layout_kind("owners").build(sample)
    assert dict(sample.options)["schedule"] == "greedy" and dict(sample.options)["backward_chunks"] == "auto"
    for modes in ("ring", ["mesh", "ring"]):
        other = config(cp_layout="auto", **{**PRICED, "cp_comm_type": modes}, context_parallel_size=8)
        assert batch_layout.sample_layout(cu, other) == balanced_layout(cu, 8)
    # seed 1: the zigzag priced faster, and Mesh's owners layout faster than every plan of the zigzag
    # (4.87 ms against 5.38 at best): Mesh runs on it, ring on the zigzag
    cu = tuple(document_bounds("lognormal:4096,1.0", n, 1))
    got = batch_layout.sample_layout(cu, mesh)
    assert got.owners and got == get_layout_kind("owners").build(layout_decision.layout_sample(cu, mesh,
                                                                                              plugin_settings(mesh)))
    ring = config(cp_layout="auto", **PRICED, context_parallel_size=8)
    assert batch_layout.sample_layout(cu, ring) is None
    # the kind each sample ran on (the log's and the metrics'): what auto picked
    assert layout_decision.sample_kind(cu, mesh) == "owners" and layout_decision.sample_kind(cu, ring) == "zigzag"
    assert layout_decision.sample_kind(tuple(document_bounds("lognormal:4096,1.0", n, 0)), ring) == "balanced"
    assert layout_decision.sample_kind(cu, config(cp_layout="balanced", **PRICED, context_parallel_size=8)) == "balanced"
    assert layout_decision.sample_kind(cu, config(cp_layout="auto", **PRICED, context_parallel_size=1)) == "zigzag"
    # the batch split works each sample's layout and kind out at once, as the two calls give them
    rows = (cu, tuple(document_bounds("lognormal:4096,1.0", n, 0)))
    for cfg in (mesh, ring):
        split = batch_layout.BatchLayout.of(rows, cfg, 0)
        assert split.layouts == tuple(batch_layout.sample_layout(r, cfg) for r in rows)
        assert split.kinds == tuple(layout_decision.sample_kind(r, cfg) for r in rows)
    assert batch_layout.BatchLayout.of(rows, ring, 0).kinds == ("zigzag", "balanced")


def test_auto_keeps_the_zigzag_where_it_is_priced_faster():
    """--cp-layout auto (the default): per sample the balanced layout unless the zigzag is priced
    faster for the layers' mode (plan/choice.py) -- 32K tokens at CP 4, one node, the host priced:
    documents of 4096, 16384 and 12288 tokens cost 9.24 ms on the balanced layout and 15.21 on the
    zigzag (simulated 8.88 and 15.03), the 34 documents of ``lognormal:1024,1.0`` (seed 0) 1.93
    and 1.61 (1.72 and 1.57: the balanced layout's portions cost more host ops than its balance
    saves) -- and a batch with one sample of each splits each by its own: the zigzag one as
    Megatron's split takes it."""
    from megatron_mesh.megatron.settings import plugin_settings
    from megatron_mesh.plan import AttentionShape, Topology
    from megatron_mesh.plan.choice import choose_layout
    from megatron_mesh.plan.layout import ZigzagLayout
    from megatron_mesh.tools.plan_args import document_bounds

    n = 32768
    auto = config(cp_layout="auto", **PRICED)
    assert plugin_settings(config(cp_layout=None)).cp_layout == "auto"
    shape, topo = AttentionShape(n // P, 1, 32, 8, 128, 2), Topology(nodes=1, gpus_per_node=P)
    kept, dropped = (0, 4096, 20480, n), tuple(document_bounds("lognormal:1024,1.0", n, 0))
    for cu, want in ((kept, "balanced"), (dropped, "zigzag")):
        assert choose_layout(balanced_layout(cu, P), shape, topo, "ring")[0] == want
    assert batch_layout.sample_layout(kept, auto) == balanced_layout(kept, P)
    assert batch_layout.sample_layout(dropped, auto) is None
    assert batch_layout.sample_layout(dropped, config(**PRICED)) == balanced_layout(dropped, P)  # balanced: always
    full = dict(tokens=torch.arange(2 * n).view(2, n), attention_mask=None)
    for rank in range(P):
        split = batch_layout.BatchLayout.of((kept, dropped), auto, rank)
        assert split.balanced and split.layouts[1] is None
        local = split.shard(full, FakeGroup(P, rank))
        want = [positions(balanced_layout(kept, P), rank), positions(ZigzagLayout(P, n), rank)]
        assert local["tokens"].tolist() == [[i * n + p for p in want[i]] for i in range(2)]
        assert split.rope_positions().t().tolist() == want


def test_sample_layout_balances_nodes_first_when_the_group_spans_nodes(monkeypatch):
    """CP 4 over nodes of 2 GPUs (--tasp-gpus-per-node 2): the layout of balanced_layout(...,
    ranks_per_node=2); one node, or nodes that do not hold whole Ulysses groups: no node level."""
    from megatron.core import parallel_state

    from megatron_mesh.plan.balance import balanced_layout

    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(parallel_state, "get_context_parallel_global_ranks", lambda: [0, 1, 2, 3])
    cu = (0, 3, 19, 24, 32)
    got = batch_layout.sample_layout(cu, config(tasp_gpus_per_node=2))
    assert got == balanced_layout(cu, P, ranks_per_node=2)
    assert batch_layout.sample_layout(cu, config(tasp_gpus_per_node=4)) == balanced_layout(cu, P)
    hybrid = batch_layout.sample_layout(cu, config(tasp_gpus_per_node=1, hierarchical_context_parallel_sizes=[2, 2]))
    assert hybrid == balanced_layout(cu, P, group=2)


def test_documents_from_position_ids_equal_those_from_eod_tokens():
    """Megatron's dataset resets position ids exactly where --reset-attention-mask cuts."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    tokens = _tokens()
    positions_ = torch.stack([_get_ltor_masks_and_position_ids(row, EOD, True, True, False, False)[2]
                              for row in tokens])
    by_eod = batch_layout.document_rows({"tokens": tokens}, "eod", EOD)
    assert by_eod == batch_layout.document_rows({"position_ids": positions_}, "positions")
    assert by_eod == ((0, 4, 5, 6, 18, 32), (0, 21, 32))
    assert batch_layout.position_starts(torch.tensor([0, 1, 2, 0, 1, 0])) == [0, 3, 5]
    with pytest.raises(ValueError, match="documents come from 'eod' tokens or 'positions', got 'thd'"):
        batch_layout.document_rows({"tokens": tokens}, "thd")


def test_batch_split_gives_each_sample_its_own_layout():
    tokens = _tokens()
    rows = batch_layout.document_rows({"tokens": tokens}, "eod", EOD)
    full = dict(tokens=tokens, labels=tokens + 100, loss_mask=torch.rand(2, S), position_ids=torch.arange(S).repeat(2, 1),
                attention_mask=torch.ones(2, 1, S, S, dtype=torch.bool), extra=torch.randn(2, S, 3), max_seqlen=None)
    seen = torch.zeros(2, S, dtype=torch.int)
    for rank in range(P):
        split = batch_layout.BatchLayout.of(rows, config(), rank)
        assert split.layouts[0] is not split.layouts[1] and split.balanced
        local = split.shard(full, FakeGroup(P, rank))
        assert local["attention_mask"] is None and local["max_seqlen"] is None
        for i, layout in enumerate(split.layouts):
            mine = positions(layout, rank)
            assert len(mine) == S // P
            for key in ("tokens", "labels", "loss_mask", "position_ids", "extra"):
                assert torch.equal(local[key][i], full[key][i, mine]), key
            seen[i, mine] += 1
        assert split.packed_seq_params().cu_seqlens_q.tolist() == [list(rows[0]), list(rows[1]) + [S] * 3]
    assert bool((seen == 1).all())  # every token on exactly one rank


def _rotary(group, kind: str = "rope"):
    """Megatron's RoPE, or YaRN as MLA builds it (scaling 4 over 8 original positions; its scale 1.14)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    if kind == "yarn":
        return YarnRotaryEmbedding(kv_channels=16, use_cpu_initialization=True, scaling_factor=4.0,
                                   original_max_position_embeddings=8, mscale=1.0, mscale_all_dim=0.0, cp_group=group)
    return RotaryEmbedding(kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True, cp_group=group)


@pytest.mark.parametrize("kind", ["rope", "yarn"])
def test_rope_follows_the_layout(kind):
    """Every CP rank's hooked embedding (RoPE, or YaRN -- MLA's own rotary -- with its scale) is the
    full one at its tokens' global positions, and rotating its queries with it equals rotating the
    full sequence and splitting it."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from megatron_mesh.megatron import cpu_compat

    cpu_compat.install_model_patches()
    tokens = _tokens()
    full_emb, scale = _emb(_rotary(None, kind)(S))  # [S, 1, 1, d]
    q = torch.randn(S, 2, 3, 16, generator=torch.Generator().manual_seed(1))
    rotated = _apply_rotary_pos_emb_bshd(q, full_emb, mscale=scale)
    for same in (False, True):
        rows = batch_layout.document_rows({"tokens": tokens[:1].repeat(2, 1) if same else tokens}, "eod", EOD)
        for rank in range(P):
            rope = _rotary(FakeGroup(P, rank), kind)
            zigzag = rope(S)
            assert batch_layout.follow_layout(torch.nn.ModuleList([rope])) == 1
            split = batch_layout.BatchLayout.of(rows, config(), rank)
            batch_layout.set_current(split)
            emb, got_scale = _emb(rope(S))
            assert emb.shape == (S // P, 1 if same else 2, 1, 16) and got_scale == scale
            assert scale == (1.0 if kind == "rope" else pytest.approx(1 + 0.1 * math.log(4)))  # YaRN's, kept
            index = split.index  # [b, s_local]
            for i in range(2):
                assert torch.equal(emb[:, 0 if same else i], full_emb[index[i], 0]), (rank, i)
            local_q = torch.stack([q[index[i], i] for i in range(2)], dim=1)
            want = torch.stack([rotated[index[i], i] for i in range(2)], dim=1)
            assert torch.equal(_apply_rotary_pos_emb_bshd(local_q, emb, mscale=scale), want)
            batch_layout.set_current(batch_layout.BatchLayout.of(rows, config(cp_layout="zigzag"), rank))
            assert torch.equal(_emb(rope(S))[0], _emb(zigzag)[0])  # the zigzag: Megatron's own slice
    batch_layout.set_current(None)
    with pytest.raises(RuntimeError, match="no batch layout is set for this forward"):
        rope(S)


def _emb(output):
    """(embedding, scale) of a rotary's output: YaRN returns both, RoPE the embedding (scale 1)."""
    return output if isinstance(output, tuple) else (output, 1.0)


def test_rope_hook_refuses_other_rotaries_and_missing_hooks():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_mesh.megatron import cpu_compat

    class OtherRotary(RotaryEmbedding):  # a rotary with its own positions (as mRoPE's): its slicing unknown
        pass

    cpu_compat.install_model_patches()
    other = OtherRotary(kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True)
    with pytest.raises(ValueError, match="OtherRotary: --cp-layout balanced supports RoPE"):
        batch_layout.follow_layout(torch.nn.ModuleList([other]))
    assert batch_layout.follow_layout(torch.nn.Linear(2, 2)) == 0
    hooks = []
    model_config = SimpleNamespace(pre_wrap_hooks=hooks)
    transformer = config(documents="eod")
    batch_layout.add_rope_hook(model_config, transformer)
    batch_layout.add_rope_hook(model_config, transformer)
    assert len(hooks) == 1  # once, however many stages ask
    batch_layout.add_rope_hook(SimpleNamespace(pre_wrap_hooks=hooks), config(documents="eod", cp_layout="zigzag"))
    assert len(hooks) == 1


def test_megatron_scripts_get_the_layout_split(monkeypatch):
    """run_script's substitute for Megatron's get_batch_on_this_cp_rank: documents from the
    position ids of the full batch, the split by each sample's layout, the batch made current;
    batches without documents go to Megatron's own function."""
    from megatron.core import utils

    from megatron_mesh.megatron import bootstrap
    from megatron_mesh.megatron.pretrain_gpt import document_params
    from megatron_mesh.megatron.process import ProcessState

    monkeypatch.setattr(utils, "get_batch_on_this_cp_rank", utils.get_batch_on_this_cp_rank)
    megatrons = utils.get_batch_on_this_cp_rank
    process = ProcessState(batch_documents=True)  # this test's own, as under run_script
    batch_layout.install(process)
    batch_layout.install(process)
    assert utils.get_batch_on_this_cp_rank.__wrapped__ is megatrons
    tokens = _tokens()
    pos = torch.stack([torch.tensor(sum((list(range(b - a)) for a, b in zip(r, r[1:])), []))
                       for r in batch_layout.document_rows({"tokens": tokens}, "eod", EOD)])
    args = SimpleNamespace(**vars(config()), reset_attention_mask=True, reset_position_ids=True,
                           position_embedding_type="learned_absolute")
    monkeypatch.setattr(bootstrap, "megatron_args", lambda: args)
    full = dict(tokens=tokens, labels=tokens, loss_mask=torch.ones(2, S), position_ids=pos, attention_mask=None)
    local = utils.get_batch_on_this_cp_rank(dict(full), is_hybrid_cp=False, cp_group=FakeGroup(P, 2))
    current = batch_layout.current(process)
    assert current.rows == batch_layout.document_rows({"tokens": tokens}, "eod", EOD) and current.rank == 2
    assert process.layout_kinds == {"balanced": 2}  # for the log and the metrics (telemetry takes them)
    assert torch.equal(local["tokens"], current.shard(full, FakeGroup(P, 2))["tokens"])
    assert document_params(tokens, EOD).cu_seqlens_q.tolist() == current.packed_seq_params().cu_seqlens_q.tolist()
    calls = []
    monkeypatch.setattr(utils.get_batch_on_this_cp_rank, "__wrapped__", lambda *a, **k: calls.append(a) or "megatron")
    args.reset_attention_mask = False
    assert utils.get_batch_on_this_cp_rank(dict(full), False, None) == "megatron" and len(calls) == 1


def test_layer_refuses_a_batch_split_by_other_layouts():
    """The core attention checks that the current batch was split by the layouts it derives (the
    same decision, so only different settings could part them)."""
    from megatron_mesh.megatron.core_attention import PluginCoreAttention

    rows = batch_layout.document_rows({"tokens": _tokens()}, "eod", EOD)
    batch_layout.set_current(batch_layout.BatchLayout.of(rows, config(), 0))
    same = [batch_layout.sample_layout(r, config()) for r in rows]
    PluginCoreAttention._check_batch_split(None, list(rows), same, "layer 1 (mesh)")
    other = [batch_layout.sample_layout(r, config(hierarchical_context_parallel_sizes=[2, 2])) for r in rows]
    with pytest.raises(RuntimeError, match=r"layer 1 \(mesh\): sample 0 was split by the layout 'balanced P=4 U=1 .*', "
                                           r"the layer's is 'balanced P=4 U=2 .*': the batch split and the layer read "
                                           "different settings"):
        PluginCoreAttention._check_batch_split(None, list(rows), other, "layer 1 (mesh)")

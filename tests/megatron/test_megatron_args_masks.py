"""The start-up checks of masks and Ulysses hybrids, in one process: windows, documents from
end-of-document tokens and THD packing (valid under megatron_mesh's entry script, and for
documents through run_script, refused where the layers could not read them), --cp-layout (where
it applies, what the balanced layout needs), --hierarchical-context-parallel-sizes for the
hybrids, and the settings that combine badly with them -- each error naming the value and what is
allowed."""

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/setup_env.sh installs it)")

from megatron_mesh.megatron.checks import validate_args as _validate_args  # noqa: E402

pytestmark = pytest.mark.megatron


def validate_args(args, have_te: bool = False, entry_packs_documents: bool = False,
                  batch_documents: bool = False) -> list[str]:
    """The plugin's start-up check; Transformer Engine counts as absent unless ``have_te``."""
    return _validate_args(args, have_te=have_te, entry_packs_documents=entry_packs_documents,
                   batch_documents=batch_documents)


HEADS = ["--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--hidden-size", "64"]
PLUGIN = ["--spec", "megatron_mesh.megatron.spec", "gpt_layer_spec", "--transformer-impl", "local",
          "--attention-dropout", "0"]


PER_TOKEN = "--calculate-per-token-loss"  # the balanced layout (the default with documents at CP > 1) needs it
# DeepSeek-style attention: MLA, q/k head dim 16 + 8, v head dim 12, YaRN (configs/deepseek_tiny_cpu.yaml)
MLA = ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "32", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--rope-type", "yarn", "--position-embedding-type", "rope"]


@pytest.mark.parametrize("argv, documents", [
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--reset-attention-mask", PER_TOKEN], "eod"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--reset-attention-mask", "--cp-layout", "zigzag"],
     "eod"),
    (["--context-parallel-size", "4", "--cp-comm-type", "tasp", "--cp-thd-packing", "--cp-thd-pad-multiple", "16",
      "--seq-length", "64", "--micro-batch-size", "1"], "thd"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--window-size", "16,0"], None),
    (["--context-parallel-size", "2", "--cp-comm-type", "mesh", "--reset-attention-mask", PER_TOKEN,
      "--pipeline-model-parallel-size", "2"], "eod"),
    (["--context-parallel-size", "1", "--cp-thd-packing", "--seq-length", "64", "--pipeline-model-parallel-size", "3",
      "--num-layers", "3", "--micro-batch-size", "1"], "thd"),
    (["--context-parallel-size", "4", "--cp-comm-type", "ring", "--window-size", "16,-1", "--reset-attention-mask",
      PER_TOKEN, "--position-embedding-type", "rope", "--no-rope-fusion", "--micro-batch-size", "2"], "eod"),
    (["--context-parallel-size", "4", "--cp-comm-type", "ring", "--reset-attention-mask", PER_TOKEN,
      "--position-embedding-type", "rope", "--micro-batch-size", "1", "--cp-layout", "balanced"], "eod"),
    # Mesh on its owners layout on every layer (the layout is built per sample; auto offers it too)
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--reset-attention-mask", PER_TOKEN,
      "--cp-layout", "owners"], "eod"),
    # MLA with YaRN on the balanced layout: its own rotary follows the layout (unfused)
    (["--context-parallel-size", "4", "--cp-comm-type", "ring", "--reset-attention-mask", PER_TOKEN, *MLA,
      "--no-rope-fusion", "--cp-layout", "balanced"], "eod"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+mesh", "--hierarchical-context-parallel-sizes", "2", "2",
      "--mesh-tile-shape", "2x1", *HEADS], None),
    (["--context-parallel-size", "8", "--cp-comm-type", "a2a+tasp", "a2a+ring", "--hierarchical-context-parallel-sizes",
      "2", "4", *HEADS], None),
    (["--context-parallel-size", "1", "--reset-attention-mask", "--cp-comm-type", "mesh"], "eod"),
    # the CP runs' layout at CP 1: accepted, unused there (test_cp1_accepts_the_layout_of_the_cp_runs)
    (["--context-parallel-size", "1", "--reset-attention-mask", "--cp-comm-type", "mesh", "--cp-layout", "zigzag"],
     "eod"),
    (["--context-parallel-size", "1", "--window-size", "16,-1", "--num-layers", "4", "--window-attn-skip-freq",
      "[1,0,1,0]"], None),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--window-size=-1,0", "--window-attn-skip-freq",
      "2"], None),
    # Llama 4: chunks on the RoPE layers, every 4th layer global; with documents, THD, a window on the global
    # layers, and at CP 1 under the plugin's spec (TE's modes: test_chunks_need_the_plugins_layers)
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--attention-chunk-size", "8192", "--num-layers", "8",
      "--no-rope-freq", "4", "--reset-attention-mask", PER_TOKEN], "eod"),
    (["--context-parallel-size", "4", "--cp-comm-type", "tasp", "--attention-chunk-size", "12", "--cp-thd-packing",
      "--cp-thd-pad-multiple", "16", "--seq-length", "64", "--micro-batch-size", "1"], "thd"),
    (["--context-parallel-size", "4", "--cp-comm-type", "ring", "--num-layers", "4", "--attention-chunk-size", "16",
      "--no-rope-freq", "([0]*3+[1])", "--window-size", "32,0",
      "--window-attn-skip-freq", "([0]*3+[1])"], None),
    (["--context-parallel-size", "1", "--attention-chunk-size", "16", "--reset-attention-mask", "--cp-comm-type",
      "mesh"], "eod"),
])
def test_masks_and_hybrids_valid(megatron_args, our_entry, argv, documents):
    from megatron_mesh.megatron.args import MeshTransformerConfig, apply_args

    args = megatron_args(PLUGIN + argv)
    validate_args(args, **our_entry)
    config = MeshTransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    apply_args(args, config, **our_entry)
    assert config.cp_settings.documents == documents


@pytest.mark.parametrize("argv, message", [
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+mesh", *HEADS],
     "--cp-comm-type a2a+mesh needs --hierarchical-context-parallel-sizes U M (the all-to-all degree U inside a node "
     "and the inner CP size M, U * M = --context-parallel-size 4); got none"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+ring", "--hierarchical-context-parallel-sizes", "2", "3",
      *HEADS], "--hierarchical-context-parallel-sizes 2 3: U * M must equal --context-parallel-size 4"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+mesh", "--hierarchical-context-parallel-sizes", "4", "1",
      "--num-attention-heads", "6", "--hidden-size", "96"],
     "--cp-comm-type a2a+mesh at --context-parallel-size 4 with --hierarchical-context-parallel-sizes 4 1: query heads "
     "(6) must be divisible by the ulysses size (4)"),
    (["--context-parallel-size", "8", "--cp-comm-type", "a2a+mesh", "--hierarchical-context-parallel-sizes", "4", "2",
      "--tasp-gpus-per-node", "2", *HEADS],
     "--cp-comm-type a2a+mesh at --context-parallel-size 8 with --hierarchical-context-parallel-sizes 4 2, "
     "--tasp-gpus-per-node 2: ulysses_size 4 must divide the CP ranks per node 2: an all-to-all group stays inside a node"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+mesh", "--hierarchical-context-parallel-sizes", "2", "2",
      "--mesh-tile-shape", "2x2", *HEADS], "--cp-comm-type a2a+mesh at --context-parallel-size 4 with --mesh-tile-shape "
     "2x2, --hierarchical-context-parallel-sizes 2 2: CP mode 'a2a+mesh' at CP size 4 = all-to-all 2 x inner mesh over 2 ranks: tile 2x2 does not fit CP size 2"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--window-size", "16,4"],
     "--window-size 16,4: the plugin's causal layers attend no later key, so the right side must be 0"),
    (["--context-parallel-size", "1", "--window-size", "16,4"],  # CP 1: the plugin's layer applies the window too
     "--window-size 16,4: the plugin's causal layers attend no later key, so the right side must be 0"),
    (["--context-parallel-size", "1", "--window-size", "16,0", "--attention-dropout", "0.1"],
     "--attention-dropout 0.1: a sliding window runs the plugin's attention also at CP 1"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--window-size=-5,0"],
     "--window-size -5,0: LEFT -5 is not allowed; each side is a number of tokens >= 0, or -1 (unlimited)"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--window-size", "16,-2"],
     "--window-size 16,-2: RIGHT -2 is not allowed"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--window-size", "5"],
     "--window-size 5: give two values LEFT,RIGHT (keys before and after a query; -1: unlimited)"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--window-size", "5,0,0"],
     "--window-size 5,0,0: give two values LEFT,RIGHT"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--window-size", "16,0", "--num-layers", "4",
      "--window-attn-skip-freq", "[1,0]"],
     "--window-attn-skip-freq [1, 0]: the list needs one entry per layer (4 layers, --num-layers), got 2"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--window-size", "16,0",
      "--window-attn-skip-freq", "[1,2]"],
     "--window-attn-skip-freq [1, 2]: entries must be 1 (sliding window) or 0 (full attention)"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--window-size", "16,0", "--window-attn-skip-freq", "0"],
     "--window-attn-skip-freq 0: an integer N must be >= 1 (every N-th layer runs full attention)"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--cp-thd-pad-multiple", "16"],
     "--cp-thd-pad-multiple 16 applies to --cp-thd-packing, which is not given"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--cp-thd-packing", "--cp-thd-pad-multiple", "12",
      "--seq-length", "48"], "--cp-thd-pad-multiple 12 must be a multiple of 2 x --context-parallel-size = 8"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--cp-thd-packing", "--seq-length", "64",
      "--micro-batch-size", "2"], "--micro-batch-size must be 1, got 2"),
    # evaluation's micro-batch too: the run trained up to its first evaluation, then every rank raised
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--cp-thd-packing", "--seq-length", "64",
      "--eval-micro-batch-size", "2"], "--cp-thd-packing packs one sequence per micro-batch: --eval-micro-batch-size "
                                       "must be 1, got 2"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--cp-thd-packing", "--cp-thd-pad-multiple", "-8",
      "--seq-length", "64"], "--cp-thd-pad-multiple must be a positive integer, got -8"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--cp-thd-packing", "--cp-thd-pad-multiple", "0",
      "--seq-length", "64"], "--cp-thd-pad-multiple must be a positive integer, got 0"),
    # documents with Megatron's combined 1F1B schedule (one micro-batch's forward beside another's
    # backward): refused at PP > 1 and with recompute (test_megatron_pretrain_pipeline.py runs
    # documents with recompute and a virtual pipeline at PP 2)
    (["--context-parallel-size", "2", "--cp-comm-type", "mesh", "--reset-attention-mask", PER_TOKEN,
      "--pipeline-model-parallel-size", "2", "--overlap-moe-expert-parallel-comm"],
     "--overlap-moe-expert-parallel-comm with packed documents (--reset-attention-mask / --cp-thd-packing) and "
     "--pipeline-model-parallel-size 2: its combined 1F1B schedule runs one micro-batch's forward together with "
     "another's backward"),
    # --recompute-activations: Megatron makes it --recompute-granularity selective after these checks
    (["--context-parallel-size", "2", "--cp-comm-type", "mesh", "--reset-attention-mask", PER_TOKEN,
      "--recompute-activations", "--overlap-moe-expert-parallel-comm"],
     "and --recompute-granularity selective (--recompute-activations): its combined 1F1B schedule"),
    # at CP 1 too: the documents run the plugin's attention there as well
    (["--context-parallel-size", "1", "--cp-thd-packing", "--seq-length", "64", "--recompute-granularity", "full",
      "--recompute-method", "uniform", "--overlap-moe-expert-parallel-comm"],
     "and --recompute-granularity full: its combined 1F1B schedule"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--sft"],
     "--sft: Megatron's sft batches are not supported by the plugin modes"),
    # --cp-layout: where it applies (at no CP size without documents), and what the balanced layout needs
    (["--context-parallel-size", "1", "--cp-layout", "balanced"],
     "--cp-layout balanced applies to packed documents (--reset-attention-mask) at CP > 1, not here "
     "(no --reset-attention-mask); leave the flag out"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--cp-layout", "zigzag"],
     "--cp-layout zigzag applies to packed documents (--reset-attention-mask) at CP > 1, not here (no "
     "--reset-attention-mask)"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--cp-thd-packing", "--seq-length", "64",
      "--micro-batch-size", "1", "--cp-layout", "balanced"],
     "--cp-layout balanced applies to packed documents (--reset-attention-mask) at CP > 1, not here "
     "(--cp-thd-packing (Transformer Engine's THD layout))"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--reset-attention-mask"],
     "--cp-layout auto (the default with packed documents at CP > 1) needs --calculate-per-token-loss: the ranks "
     "hold different documents"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--no-cp-layout-lookahead"],
     "--no-cp-layout-lookahead applies to --cp-layout auto, balanced, balanced-hide and owners (packed documents, "
     "--reset-attention-mask, at CP > 1), which this run does not use; leave the flag out"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--reset-attention-mask", PER_TOKEN,
      "--cp-layout", "zigzag", "--no-cp-layout-lookahead"],
     "--no-cp-layout-lookahead applies to --cp-layout auto, balanced, balanced-hide and owners"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--reset-attention-mask", "--cp-layout", "balanced"],
     "--cp-layout balanced needs --calculate-per-token-loss"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--reset-attention-mask", PER_TOKEN,
      "--position-embedding-type", "yarn"],
     "--cp-layout auto (the default with packed documents at CP > 1) with --position-embedding-type yarn: "
     "supported are rope, learned_absolute and none"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--reset-attention-mask", PER_TOKEN,
      "--mtp-num-layers", "1"], "--mtp-num-layers 1 with --cp-comm-type mesh at CP 4: Megatron-Core builds the "
     "multi-token prediction layers from its own layer spec (Megatron's attention, not the plugin's), and its roll of "
     "the tokens, labels and loss mask one position along the sequence passes one token between the zigzag's "
     "neighbouring chunks (on the balanced layout a token's successor may be on any CP rank); allowed: "
     "--mtp-num-layers at CP 1 or with Transformer Engine's modes"),
    (["--context-parallel-size", "2", "--cp-comm-type", "ring", "--mtp-num-layers", "2"],  # no documents, any layout
     "--mtp-num-layers 2 with --cp-comm-type ring at CP 2: Megatron-Core builds the multi-token prediction layers"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--reset-attention-mask", PER_TOKEN, *MLA,
      "--cp-layout", "balanced"],
     "--cp-layout balanced with --multi-latent-attention and fused RoPE: MLA's fused RoPE kernels rotate each "
     "rank's zigzag positions; pass --no-rope-fusion (the layout's positions), or pass --cp-layout zigzag"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--reset-attention-mask", PER_TOKEN,
      "--position-embedding-type", "rope", "--micro-batch-size", "2"],
     "with fused RoPE and --micro-batch-size 2: each sample has its own layout, so its own rotary positions, and "
     "Transformer Engine's fused RoPE takes one [s, 1, 1, d] table per batch; pass --no-rope-fusion or "
     "--micro-batch-size 1, or pass --cp-layout zigzag"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--reset-attention-mask", PER_TOKEN,
      "--position-embedding-type", "rope", "--eval-micro-batch-size", "4"],
     "with fused RoPE and --eval-micro-batch-size 4: each sample has its own layout"),
    # the owners layout: only where every layer is Mesh, on up to 8 ranks, without Ulysses groups or a window
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "ring", "--num-layers", "2", "--reset-attention-mask",
      PER_TOKEN, "--cp-layout", "owners"],
     "--cp-layout owners: the owners layout names other ranks than the query's owner for some blocks: mesh computes "
     "them there, not ring; pass --cp-layout auto (the default: it runs each sample on the fastest layout its "
     "layers' modes run), or pass --cp-layout zigzag"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+mesh", "--hierarchical-context-parallel-sizes", "2", "2",
      "--reset-attention-mask", PER_TOKEN, "--cp-layout", "owners", *HEADS], "mesh computes them there, not a2a+mesh"),
    (["--context-parallel-size", "16", "--cp-comm-type", "mesh", "--reset-attention-mask", PER_TOKEN,
      "--cp-layout", "owners"], "--cp-layout owners: built for 2 to 8 CP ranks (its cost grows with the pairs of "
     "ranks), got 16; pass --cp-layout auto"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--reset-attention-mask", PER_TOKEN,
      "--window-size", "16,0", "--cp-layout", "owners"],
     "--cp-layout owners: built for causal documents without a window or another mask kind"),
    # balanced-hide without a Ulysses group would be the balanced layout, silently
    (["--context-parallel-size", "4", "--cp-comm-type", "ring", "--reset-attention-mask", PER_TOKEN, "--cp-layout",
      "balanced-hide"], "--cp-layout balanced-hide changes only the layouts of the Ulysses groups of the all-to-all "
     "modes (a2a+mesh, a2a+tasp, a2a+ring), and this run has no such group (no "
     "--hierarchical-context-parallel-sizes); use --cp-layout balanced, the same layout without them"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+mesh", "--hierarchical-context-parallel-sizes", "1", "4",
      "--reset-attention-mask", PER_TOKEN, "--cp-layout", "balanced-hide"],
     "this run has no such group (--hierarchical-context-parallel-sizes 1 4); use --cp-layout balanced"),
    # Llama 4's chunks: only the plugin's attention applies them, never a window on the same layer
    (["--context-parallel-size", "1", "--attention-chunk-size", "16", "--spec", "local"],
     "--attention-chunk-size 16: chunked attention is the plugin's (Megatron's own attention has none), and this run "
     "builds Megatron's own layers; add --spec megatron_mesh.megatron.spec gpt_layer_spec"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--attention-chunk-size", "16", "--window-size",
      "32,0", "--num-layers", "4", "--no-rope-freq", "4"],
     "--attention-chunk-size 16 with --window-size 32,0: layer 1 would have both, and chunked attention does not "
     "combine with a sliding window"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--attention-chunk-size", "16", "--num-layers", "4",
      "--no-rope-freq", "[0,1]"], "--no-rope-freq [0, 1]: the list needs one entry per layer (4 layers"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--attention-chunk-size", "16", "--num-layers", "4",
      "--no-rope-freq", "1"], "--attention-chunk-size 16 with --no-rope-freq 1: every layer is a NoPE layer"),
    (["--context-parallel-size", "1", "--cp-comm-type", "mesh", "--attention-chunk-size", "16", "--mtp-num-layers",
      "1"], "--attention-chunk-size 16 with --mtp-num-layers 1: Megatron-Core builds the multi-token prediction layers "
     "from its own layer spec, whose attention has no chunks"),
    (["--context-parallel-size", "2", "--cp-comm-type", "mesh", "--attention-chunk-size", "8", *MLA, "--no-rope-fusion",
      "--num-layers", "4", "--no-rope-freq", "2"], "--attention-chunk-size 8 with --multi-latent-attention and "
     "--no-rope-freq 2: Megatron's MLA rotates every layer (it does not read --no-rope-freq)"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--attention-chunk-size", "0"],
     "--attention-chunk-size must be a positive integer, got 0"),
    (["--context-parallel-size", "1", "--attention-chunk-size", "16", "--cp-comm-type", "mesh", "--attention-dropout",
      "0.1"], "--attention-dropout 0.1: chunked attention (--attention-chunk-size 16) runs the plugin's attention also "
     "at CP 1, which supports only 0"),
])
def test_masks_and_hybrids_invalid(megatron_args, our_entry, argv, message):
    args = megatron_args(PLUGIN + argv)
    with pytest.raises(ValueError) as e:
        validate_args(args, **our_entry)
    assert message in str(e.value)


def test_chunks_need_the_plugins_layers(megatron_args):
    """With Transformer Engine usable: its modes may run the global (NoPE) layers of a Llama 4 model,
    not a layer with chunks (TE has no chunked attention: the layer would train full causal
    attention, silently); nor may Megatron's default, TE's p2p, where --cp-comm-type is not given."""
    chunked = ["--context-parallel-size", "4", "--num-layers", "4", "--attention-chunk-size", "16", "--no-rope-freq",
               "([0]*3+[1])"]
    validate_args(megatron_args(PLUGIN + chunked + ["--cp-comm-type", "ring", "mesh", "tasp", "p2p"]), have_te=True)
    for modes, message in ((["--cp-comm-type", "ring", "a2a", "tasp", "p2p"], "layer 2 has chunks and runs "
                            "--cp-comm-type a2a, a Transformer Engine mode"),
                           ([], "layer 1 has chunks and runs --cp-comm-type p2p (also Megatron's default where "
                            "--cp-comm-type is not given), a Transformer Engine mode")):
        with pytest.raises(ValueError) as e:
            validate_args(megatron_args(PLUGIN + chunked + modes), have_te=True)
        assert f"--attention-chunk-size 16: {message}, which has no chunked attention; run the layers with chunks in " \
               "a plugin mode (ring, mesh, tasp, a2a+mesh, a2a+tasp, a2a+ring)" in str(e.value), str(e.value)


def test_dense_document_masks_of_other_scripts(megatron_args):
    """Another entry script's --reset-attention-mask is a dense mask: Megatron's own attention reads
    it at CP 1 (no plugin documents, dropout allowed); the plugin modes refuse it at CP > 1, and
    --cp-thd-packing needs our entry script."""
    from megatron_mesh.megatron.args import MeshTransformerConfig, apply_args

    args = megatron_args([*PLUGIN[:-2], "--context-parallel-size", "1", "--reset-attention-mask",
                          "--attention-dropout", "0.1"])
    validate_args(args)
    config = MeshTransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    apply_args(args, config)
    assert config.cp_settings.documents is None
    with pytest.raises(ValueError, match="--cp-thd-packing is an option of megatron_mesh's entry script"):
        validate_args(megatron_args(PLUGIN + ["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--cp-thd-packing",
                                          "--seq-length", "64"]))


def test_cp1_accepts_the_layout_of_the_cp_runs(megatron_args, our_entry):
    """One config for the CP 1 baseline and the CP runs of packed documents: --cp-layout and
    --no-cp-layout-lookahead matter only at CP > 1, so CP 1 accepts them and names them unused
    (until issue 49 --cp-layout zigzag stopped the CP 1 run: "leave the flag out")."""
    argv = PLUGIN + ["--context-parallel-size", "1", "--reset-attention-mask", "--cp-comm-type", "mesh"]
    assert validate_args(megatron_args(argv + ["--cp-layout", "zigzag"]), **our_entry) == ["--cp-layout zigzag"]
    assert validate_args(megatron_args(argv + ["--no-cp-layout-lookahead"]), **our_entry) == \
        ["--no-cp-layout-lookahead"]
    assert validate_args(megatron_args(argv), **our_entry) == []


def test_cp_layout_value_is_checked(megatron_args, our_entry):
    """argparse refuses a value on the command line; arguments built another way are checked too."""
    args = megatron_args(PLUGIN + ["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--reset-attention-mask",
                                   PER_TOKEN])
    args.cp_layout = "diagonal"
    with pytest.raises(ValueError, match="--cp-layout 'diagonal': allowed auto, zigzag, balanced, balanced-hide"):
        validate_args(args, **our_entry)


@pytest.mark.parametrize("reset_positions, documents", [(True, "positions"), (False, "eod")])
def test_documents_of_megatron_lm_scripts_through_run_script(megatron_args, reset_positions, documents):
    """Through run_script (batch_documents) Megatron-LM's own script gets the documents of
    --reset-attention-mask from its batches -- where the position ids restart, else after the EOD
    tokens -- at any CP size, under either layout; without it, its dense mask is refused at CP > 1."""
    from megatron_mesh.megatron.args import MeshTransformerConfig, apply_args

    argv = PLUGIN + ["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--reset-attention-mask", PER_TOKEN,
                     *(["--reset-position-ids"] if reset_positions else [])]
    for extra in ([], ["--cp-layout", "zigzag"]):
        args = megatron_args(argv + extra)
        validate_args(args, batch_documents=True)
        config = MeshTransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
        apply_args(args, config, batch_documents=True)
        assert config.cp_settings.documents == documents
        assert config.cp_settings.cp_layout == (extra[-1] if extra else "auto")
    with pytest.raises(ValueError, match="--reset-attention-mask: this entry script passes the documents as a dense "
                                         r"\[s, s\] attention mask, .* or run this script through "
                                         "scripts/run_megatron_script.sh"):
        validate_args(megatron_args(argv))
    cp1 = megatron_args([*PLUGIN[:-2], "--context-parallel-size", "1", "--reset-attention-mask",
                         "--attention-dropout", "0.1"])
    with pytest.raises(ValueError, match="packed documents run the plugin's attention also at CP 1"):
        validate_args(cp1, batch_documents=True)


def test_documents_from_eod_tokens_refuse_transformer_engine_layers(megatron_args, our_entry):
    """Our entry's per-sample boundaries are the plugin's format: a TE layer beside plugin layers
    would misread them, so the start-up check refuses the mix (THD packing stays allowed)."""
    args = megatron_args(PLUGIN + ["--context-parallel-size", "2", "--cp-comm-type", "mesh", "p2p",
                                   "--reset-attention-mask"])
    with pytest.raises(ValueError, match=r"--reset-attention-mask with Transformer Engine layers \(--cp-comm-type "
                                         r"p2p\): megatron_mesh's entry script hands the layers end-of-document"):
        validate_args(args, have_te=True, **our_entry)
    validate_args(megatron_args(PLUGIN + ["--context-parallel-size", "2", "--cp-comm-type", "mesh", "p2p",
                                      "--cp-thd-packing", "--seq-length", "64", "--micro-batch-size", "1"]), have_te=True,
                  **our_entry)


def test_documents_at_cp1_with_dropout_under_our_entry(megatron_args, our_entry):
    args = megatron_args([*PLUGIN[:-2], "--context-parallel-size", "1", "--reset-attention-mask",
                          "--attention-dropout", "0.1"])
    with pytest.raises(ValueError, match="packed documents run the plugin's attention also at CP 1"):
        validate_args(args, **our_entry)


def test_planners_megatron_flags_pass_the_start_up_checks(megatron_args, our_entry):
    """Every plugin row the planner compares side by side names flags that Megatron's start-up
    checks accept under our entry script (with the documents of --reset-attention-mask, or THD
    packing for the THD rows), and that select that row's mode, degree, tile and layout."""
    from megatron_mesh.megatron.settings import flags
    from megatron_mesh.plan import AttentionShape, Topology
    from megatron_mesh.plan.layouts import LAYOUTS
    from megatron_mesh.tools.plan_cli import megatron_flags
    from megatron_mesh.tools.layout_rows import layout_rows

    cp_layout = next(f for f in flags() if f.name == "--cp-layout")
    assert {k.flag.split()[-1] for k in LAYOUTS.values() if k.flag.startswith("--cp-layout ")} == set(cp_layout.choices)
    shape = AttentionShape(batch=1, heads=4, kv_heads=2, head_dim=16, seq_local=32, itemsize=2)
    rows, _ = layout_rows(4, shape, Topology(nodes=1, gpus_per_node=4), [0, 20, 50, 128],
                          modes=["ring", "mesh", "mesh-auto", "tasp", "a2a+mesh", "a2a+tasp", "a2a+ring"])
    seen = set()
    for r in rows:
        flags = megatron_flags(r, 4)
        if flags is None:
            assert r.mode.startswith("te-"), r.mode  # Transformer Engine's own rows
            continue
        argv = flags.split()
        argv += ["--seq-length", "128", "--micro-batch-size", "1", PER_TOKEN] + (
            ["--cp-thd-pad-multiple", "8"] if r.layout == "thd" else ["--reset-attention-mask"])
        args = megatron_args(PLUGIN + HEADS + ["--context-parallel-size", "4"] + argv)
        validate_args(args, **our_entry)
        assert args.cp_comm_type == [r.mode.removesuffix("-auto")], (args.cp_comm_type, r.mode)
        assert (args.hierarchical_context_parallel_sizes or [1, 4]) == [r.ulysses, 4 // r.ulysses]
        if "mesh" in r.mode:  # no tile: the mask leaves every tile the query owner's plan (the default auto)
            assert args.mesh_tile_shape == (f"{r.tile[0]}x{r.tile[1]}" if r.tile else None), (r.mode, r.layout)
        assert LAYOUTS[r.layout].flag in " ".join(argv)
        seen.add((r.layout, r.ulysses > 1))
    assert seen == {(layout, hybrid) for layout in ("zigzag", "thd", "balanced", "auto") for hybrid in (False, True)} | \
        {("balanced-hide", True)}


@pytest.mark.parametrize("argv", [
    ["--window-size", "5,0", "--window-attn-skip-freq", "2"], ["--window-size", "5,0", "--window-attn-skip-freq", "3"],
    ["--window-size", "5,0"], ["--window-size", "5,0", "--window-attn-skip-freq", "1"], [],
    ["--window-size", "5,0", "--window-attn-skip-freq", "([1]*2+[0])*2"],
    ["--window-size=-1,0", "--window-attn-skip-freq", "2"],
])
def test_the_layers_windows_are_megatrons(megatron_args, argv):
    """MegatronProblem.layer_windows (pure Python: the report's plans and the GPU prediction read
    a config's per-layer masks there) names the layers Megatron's own is_layer_window_attention
    gives a window -- the rule the layers run -- for Megatron's parsed arguments, and for the same
    flags as a YAML config's text (MegatronProblem.from_flags)."""
    from megatron.core.transformer.utils import is_layer_window_attention

    from megatron_mesh.plan.megatron_problem import MegatronProblem
    from megatron_mesh.plan.window import megatron_window

    args = megatron_args(["--num-layers", "6", "--num-attention-heads", "4", "--hidden-size", "64", *argv])
    megatron = tuple(megatron_window(args.window_size, causal=True)
                     if is_layer_window_attention(args.window_size, args.window_attn_skip_freq, n) else None
                     for n in range(1, 7))
    assert MegatronProblem.from_namespace(args).layer_windows() == megatron, argv
    given = [part for a in argv for part in a.split("=", 1)]  # --window-size=-1,0 as flag and value
    flags = {"--num-layers": "6", "--num-attention-heads": "4", "--hidden-size": "64", "--seq-length": "64",
             **dict(zip(given[::2], given[1::2]))}
    assert MegatronProblem.from_flags(flags).layer_windows() == megatron, argv


@pytest.mark.parametrize("no_rope", [None, "3", "2", "([0]*2+[1])*2", "[1,0,0,0,0,1]"])
def test_the_layers_with_chunks_are_megatrons_rope_layers(megatron_args, no_rope):
    """MegatronProblem.layer_chunks (the one reading of which layers run --attention-chunk-size's
    chunks: the layers, the layout and the prediction share it) gives chunks to exactly the layers
    Megatron's own TransformerConfig applies RoPE to (its no_rope_freq list, as the attention reads
    it), from Megatron's parsed arguments, from the model's config, and from a YAML config's text."""
    from megatron_mesh.megatron.args import MeshTransformerConfig
    from megatron_mesh.megatron.settings import problem_of
    from megatron_mesh.plan.megatron_problem import MegatronProblem

    argv = ["--num-layers", "6", "--num-attention-heads", "4", "--hidden-size", "64", "--attention-chunk-size", "8",
            *(["--no-rope-freq", no_rope] if no_rope else [])]
    args = megatron_args(argv)
    config = MeshTransformerConfig(num_layers=6, hidden_size=64, num_attention_heads=4, no_rope_freq=args.no_rope_freq)
    rope = [not (config.no_rope_freq[n] if config.no_rope_freq else False) for n in range(6)]
    for problem in (problem_of(args), MegatronProblem.from_namespace(config, chunk_size=8),
                    MegatronProblem.from_flags({**dict(zip(argv[::2], argv[1::2])), "--seq-length": "64"})):
        assert [c is not None and c.size == 8 for c in problem.layer_chunks()] == rope, (no_rope, problem)


def test_the_main_jobs_gpu_configs_pass_the_start_up_checks(megatron_args, our_entry):
    """The configs the main job predicts for (Llama-3-8B, gpt-oss-20b with sinks and alternating
    128-token windows, DeepSeek-V3's MLA with YaRN; each at 128K tokens, CP 16 x TP 2) and Llama 4
    Scout's (chunked layers, MoE) are flags
    Megatron parses and the plugin's start-up accepts with Transformer Engine, as a GPU run would."""
    import os

    from megatron_mesh.tools import predict, yaml_args

    scout = os.path.join(predict.ROOT, "configs", "llama4_scout_128k_cp16.yaml")  # Llama 4's chunks too
    for path in (*predict.DEFAULT_CONFIGS, scout):
        doc = yaml_args.load(path)
        args = megatron_args(yaml_args.model_args(doc, {**os.environ, **yaml_args.environment(doc)}))
        validate_args(args, have_te=True, **our_entry)
        assert (args.context_parallel_size, args.tensor_model_parallel_size, args.seq_length) == (16, 2, 131072), path

"""The start-up checks of masks and Ulysses hybrids, in one process: windows, documents from
end-of-document tokens and THD packing (valid under megatron_mesh's entry script, refused where the
layers could not read them), --hierarchical-context-parallel-sizes for the hybrids, and the
settings that combine badly with them -- each error naming the value and what is allowed."""

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/setup_env.sh installs it)")

from megatron_mesh.megatron.checks import validate_args as _validate_args  # noqa: E402

pytestmark = pytest.mark.megatron


def validate_args(args, have_te: bool = False, entry_packs_documents: bool = False) -> None:
    """The plugin's start-up check; Transformer Engine counts as absent unless ``have_te``."""
    _validate_args(args, have_te=have_te, entry_packs_documents=entry_packs_documents)


HEADS = ["--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--hidden-size", "64"]
PLUGIN = ["--spec", "megatron_mesh.megatron.spec", "gpt_layer_spec", "--transformer-impl", "local",
          "--attention-dropout", "0"]


@pytest.mark.parametrize("argv, documents", [
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--reset-attention-mask"], "eod"),
    (["--context-parallel-size", "4", "--cp-comm-type", "tasp", "--cp-thd-packing", "--cp-thd-pad-multiple", "16",
      "--seq-length", "64", "--micro-batch-size", "1"], "thd"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--window-size", "16,0"], None),
    (["--context-parallel-size", "4", "--cp-comm-type", "ring", "--window-size", "16,-1", "--reset-attention-mask"],
     "eod"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+mesh", "--hierarchical-context-parallel-sizes", "2", "2",
      "--mesh-tile-shape", "2x1", *HEADS], None),
    (["--context-parallel-size", "8", "--cp-comm-type", "a2a+tasp", "a2a+ring", "--hierarchical-context-parallel-sizes",
      "2", "4", *HEADS], None),
    (["--context-parallel-size", "1", "--reset-attention-mask", "--cp-comm-type", "mesh"], "eod"),
    (["--context-parallel-size", "1", "--window-size", "16,-1", "--num-layers", "4", "--window-attn-skip-freq",
      "[1,0,1,0]"], None),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--window-size=-1,0", "--window-attn-skip-freq",
      "2"], None),
])
def test_masks_and_hybrids_valid(megatron_args, our_entry, argv, documents):
    from megatron_mesh.megatron.args import MeshTransformerConfig, apply_args

    args = megatron_args(PLUGIN + argv)
    validate_args(args, **our_entry)
    config = MeshTransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    apply_args(args, config, **our_entry)
    assert config.cp_documents == documents


@pytest.mark.parametrize("argv, message", [
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+mesh", *HEADS],
     "--cp-comm-type a2a+mesh needs --hierarchical-context-parallel-sizes U M (the all-to-all degree U inside a node "
     "and the inner CP size M, U * M = --context-parallel-size 4); got none"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+ring", "--hierarchical-context-parallel-sizes", "2", "3",
      *HEADS], "--hierarchical-context-parallel-sizes 2 3: U * M must equal --context-parallel-size 4"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+mesh", "--hierarchical-context-parallel-sizes", "4", "1",
      "--num-attention-heads", "6", "--hidden-size", "96"],
     "--cp-comm-type a2a+mesh at --context-parallel-size 4: query heads (6) must be divisible by the ulysses size (4)"),
    (["--context-parallel-size", "8", "--cp-comm-type", "a2a+mesh", "--hierarchical-context-parallel-sizes", "4", "2",
      "--tasp-gpus-per-node", "2", *HEADS],
     "--cp-comm-type a2a+mesh at --context-parallel-size 8 with --tasp-gpus-per-node 2: ulysses_size 4 must divide the "
     "CP ranks per node 2: an all-to-all group stays inside a node"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+mesh", "--hierarchical-context-parallel-sizes", "2", "2",
      "--mesh-tile-shape", "2x2", *HEADS], "--cp-comm-type a2a+mesh at --context-parallel-size 4 with --mesh-tile-shape "
     "2x2: tile 2x2 does not fit CP size 2"),
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
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--cp-thd-packing", "--cp-thd-pad-multiple", "-8",
      "--seq-length", "64"], "--cp-thd-pad-multiple must be a positive integer, got -8"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--cp-thd-packing", "--cp-thd-pad-multiple", "0",
      "--seq-length", "64"], "--cp-thd-pad-multiple must be a positive integer, got 0"),
    (["--context-parallel-size", "2", "--cp-comm-type", "mesh", "--reset-attention-mask",
      "--pipeline-model-parallel-size", "2"],
     "--pipeline-model-parallel-size 2 with packed documents (--reset-attention-mask / --cp-thd-packing)"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--sft"],
     "--sft: Megatron's sft batches are not supported by the plugin modes"),
])
def test_masks_and_hybrids_invalid(megatron_args, our_entry, argv, message):
    args = megatron_args(PLUGIN + argv)
    with pytest.raises(ValueError) as e:
        validate_args(args, **our_entry)
    assert message in str(e.value)


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
    assert config.cp_documents is None
    with pytest.raises(ValueError, match="--cp-thd-packing is an option of megatron_mesh's entry script"):
        validate_args(megatron_args(PLUGIN + ["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--cp-thd-packing",
                                          "--seq-length", "64"]))


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

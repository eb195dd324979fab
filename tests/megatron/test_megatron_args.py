"""The plugin's Megatron flags, config, layer specs and core-attention contract, in one process:
flag validation (bad tile shapes, unknown modes, Transformer Engine modes without Transformer
Engine), the YAML -> flags translation, spec patching, unsupported features raising errors, and
CP size 1 behaving as plain attention."""

import copy
import dataclasses
import math
import os
import types

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/setup_env.sh installs it)")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

pytestmark = pytest.mark.megatron
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _validate(args, have_te=False, entry_packs_documents=False, have_cuda=False):
    from megatron_mesh.megatron.checks import validate_args

    return validate_args(args, have_te=have_te, entry_packs_documents=entry_packs_documents, have_cuda=have_cuda)


@pytest.mark.parametrize("argv", [
    ["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--mesh-tile-shape", "2x2"],
    ["--context-parallel-size", "4", "--cp-comm-type", "mesh", "tasp", "--mesh-tile-shape", "1x4",
     "--attention-dropout", "0"],
    ["--context-parallel-size", "6", "--cp-comm-type", "ring", "--attention-dropout", "0"],
    ["--context-parallel-size", "1"],  # Megatron's default cp_comm_type p2p is fine without CP
    ["--context-parallel-size", "1", "--cp-comm-type", "mesh", "--attention-dropout", "0.1"],  # CP 1: Megatron's
    ["--context-parallel-size", "4", "--cp-comm-type", "tasp", "--tasp-gpus-per-node", "2",    # attention
     "--tasp-transport", "alltoall", "--cp-kernel-backend", "math", "--log-cp-attention-bytes", "--seq-length", "64"],
    ["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--tasp-gpus-per-node", "2"],  # Mesh's node layout
    ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "ring", "--hierarchical-context-parallel-sizes",
     "2", "2"],
    ["--context-parallel-size", "4", "--cp-comm-type", "mesh", "tasp", "--softmax-type", "learnable",  # gpt-oss
     "--window-size", "128,0", "--window-attn-skip-freq", "2"],
    ["--context-parallel-size", "4", "--cp-comm-type", "a2a+ring", "--softmax-type", "off-by-one",
     "--hierarchical-context-parallel-sizes", "2", "2", "--num-attention-heads", "4"],
])
def test_valid_flags(megatron_args, argv):
    spec = ["--spec", "megatron_mesh.megatron.spec", "gpt_layer_spec", "--transformer-impl", "local"]
    args = megatron_args(spec + argv + (["--attention-dropout", "0"] if "--attention-dropout" not in argv else []))
    _validate(args, have_te=True)


@pytest.mark.parametrize("argv, message", [
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--mesh-tile-shape", "3x2"],
     "tile 3x2 does not fit CP size 4: a * b must equal the CP size; allowed tiles: 1x4, 2x2, 4x1"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--mesh-tile-shape", "2by2"],
     "--cp-comm-type mesh at --context-parallel-size 4 with --mesh-tile-shape 2by2: tile shape '2by2' must be 'AxB'"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--mesh-tile-shape", "0x4"], "allowed tiles"),
    (["--context-parallel-size", "4", "--cp-comm-type", "zigzag"],
     "--cp-comm-type 'zigzag' is not a context-parallel mode; allowed: plugin modes ring, mesh, tasp, a2a+mesh, "
     "a2a+tasp, a2a+ring; "
     "Transformer Engine modes p2p, a2a, all_gather, a2a+p2p"),
    (["--context-parallel-size", "1", "--cp-comm-type", "allgather"], "Transformer Engine spells it 'all_gather'"),
    # specs the plugin's modes cannot run in (stop 81's review of Megatron-LM's own scripts: a traceback per rank)
    (["--context-parallel-size", "2", "--cp-comm-type", "mesh", "--attention-dropout", "0", "--spec",
      "megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"],
     "--cp-comm-type mesh needs the plugin's layer spec: add --spec megatron_mesh.megatron.spec gpt_layer_spec "
     "(Megatron's own spec has no plugin attention) (given: --spec megatron.core.models.gpt.gpt_layer_specs "
     "get_gpt_layer_local_spec, Megatron's own)"),
    (["--context-parallel-size", "1", "--hybrid-layer-pattern", "*-*-"],
     "--spec megatron_mesh.megatron.spec gpt_layer_spec builds GPT layers (the plugin's attention in Megatron's GPT "
     "layer), not the layers of a hybrid (Mamba) model (--hybrid-layer-pattern *-*-)"),
    (["--context-parallel-size", "2", "--cp-comm-type", "mesh", "--spec", "megatron_mesh.megatron.spec",
      "gpt_te_layer_spec"], "--spec megatron_mesh.megatron.spec gpt_te_layer_spec needs Transformer Engine, which is "
     "not usable here (not installed); use --spec megatron_mesh.megatron.spec gpt_layer_spec"),
    (["--context-parallel-size", "4", "--cp-comm-type", "p2p"],
     "--cp-comm-type p2p (also Megatron's default where --cp-comm-type is not given) is a Transformer Engine mode, but "
     "Transformer Engine is not usable here (not installed); "
     "use ring (the same algorithm: zigzag ring attention)"),
    (["--context-parallel-size", "4", "--cp-comm-type", "all_gather"], "not installed); use one of ring, mesh, tasp, a2a+mesh, a2a+tasp, a2a+ring"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "a2a"], "a2a is a Transformer Engine mode"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "tasp", "ring"],
     "--cp-comm-type has 3 values; give one mode, or one per layer (2 layers)"),
    (["--context-parallel-size", "4", "--cp-comm-type", "tasp", "--attention-dropout", "0.1"],
     "--attention-dropout 0.1: the plugin modes (ring, mesh, tasp, a2a+mesh, a2a+tasp, a2a+ring) support only 0 "
     "at CP > 1"),
    # a flag given for a mode no layer runs is an error, never ignored
    (["--context-parallel-size", "4", "--cp-comm-type", "ring", "--mesh-tile-shape", "2x2", "--attention-dropout", "0"],
     "--mesh-tile-shape 2x2 is given, but no layer runs mesh or a2a+mesh at CP > 1 (--cp-comm-type ring); leave the "
     "flag out"),
    (["--context-parallel-size", "1", "--cp-comm-type", "ring", "--mesh-schedule", "lockstep"],  # not at any CP size
     "--mesh-schedule lockstep is given, but no layer runs mesh or a2a+mesh at CP > 1 (--context-parallel-size 1)"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--tasp-transport", "alltoall",
      "--attention-dropout", "0"], "--tasp-transport alltoall is given, but no layer runs tasp or a2a+tasp at CP > 1"),
    (["--context-parallel-size", "1", "--log-cp-attention-bytes"],
     "--log-cp-attention-bytes is given, but no layer runs a plugin mode (ring, mesh, tasp, a2a+mesh, a2a+tasp, "
     "a2a+ring) at CP > 1"),
    (["--context-parallel-size", "4", "--cp-comm-type", "ring", "--hierarchical-context-parallel-sizes", "2", "2",
      "--attention-dropout", "0"], "--hierarchical-context-parallel-sizes 2 2 applies only to the all-to-all modes "
     "(a2a+mesh, a2a+tasp, a2a+ring, a2a+p2p), which no layer runs here"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--attention-backend", "flash",
      "--attention-dropout", "0"], "--attention-backend flash: the mesh layers run the plugin's own kernels"),
    (["--context-parallel-size", "4", "--cp-comm-type", "tasp", "--seq-length", "8", "--attention-dropout", "0"],
     "--cp-comm-type tasp at --context-parallel-size 4: TASP over CP size 4 splits each KV chunk into 2 slots (one "
     "per ring), so each zigzag half needs at least 2 tokens: local sequence length 2 is too short (need >= 4)"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--reset-attention-mask", "--attention-dropout", "0"],
     "--reset-attention-mask: this entry script passes the documents as a dense [s, s] attention mask, which the "
     "plugin modes do not read; use megatron_mesh's entry script"),
    (["--context-parallel-size", "4", "--cp-comm-type", "tasp", "--attention-dropout", "0",
      "--tasp-gpus-per-node", "0"], "--tasp-gpus-per-node must be a positive integer, got 0"),
    (["--context-parallel-size", "4", "--cp-comm-type", "tasp", "--attention-dropout", "0",
      "--tasp-gpus-per-node", "3"], "--cp-comm-type tasp at --context-parallel-size 4 with --tasp-gpus-per-node 3: "
     "CP group [0, 1, 2, 3] spans nodes unevenly"),
    (["--context-parallel-size", "6", "--cp-comm-type", "tasp", "--attention-dropout", "0",
      "--tasp-gpus-per-node", "3"], "--cp-comm-type tasp at --context-parallel-size 6 with --tasp-gpus-per-node 3: "
     "the complete directed graph on 3 ranks has no decomposition"),
    # Megatron asserts these later, once per rank after initialising: one line here
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--attention-dropout", "0", "--seq-length", "60"],
     "--seq-length 60 must be divisible by 2 x --context-parallel-size (8): each CP rank holds two equal halves of "
     "the sequence (e.g. --seq-length 56)"),
    # the backward's keep limit: a number >= 0, only with backward chunks 'auto', only for the modes it names
    (["--context-parallel-size", "4", "--cp-comm-type", "ring", "--attention-dropout", "0",
      "--mesh-backward-keep-limit", "-1"], "backward_keep_limit must be a number >= 0"),
    (["--context-parallel-size", "4", "--cp-comm-type", "tasp", "--attention-dropout", "0",
      "--tasp-backward-keep-limit", "nan"], "got nan"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--attention-dropout", "0",
      "--mesh-backward-chunks", "refetch", "--mesh-backward-keep-limit", "3"],
     "backward_keep_limit 3.0 applies only with backward_chunks='auto', got backward_chunks='refetch'"),
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--attention-dropout", "0",
      "--tasp-backward-keep-limit", "3"], "--tasp-backward-keep-limit 3.0 is given, but no layer runs tasp or a2a+tasp"),
    # the kernel fails only at the first forward, on every rank
    (["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--attention-dropout", "0", "--cp-kernel-backend",
      "torch-flash"], "--cp-kernel-backend torch-flash runs on CUDA devices, and this machine has none; allowed here: "
     "auto, torch, math"),
])
def test_invalid_flags_name_the_value(megatron_args, argv, message):
    args = megatron_args(["--spec", "megatron_mesh.megatron.spec", "gpt_layer_spec", "--transformer-impl", "local",
                          *argv])
    with pytest.raises(ValueError) as e:
        _validate(args)
    assert message in str(e.value)


def test_cp1_accepts_the_settings_of_the_cp_runs_and_names_them_unused(megatron_args, caplog):
    """One config serves the CP 1 baseline and the CP runs: a plugin setting that would apply at CP > 1
    to a layer's mode is accepted at CP 1 (until issue 49 it stopped the run: "leave the flag out")
    and named among the settings unused there, which the start-up logs once; a setting no layer's
    mode takes at any CP size is still an error (test_invalid_flags_name_the_value)."""
    from megatron_mesh.megatron import bootstrap

    cp1 = ["--spec", "megatron_mesh.megatron.spec", "gpt_layer_spec", "--transformer-impl", "local",
           "--context-parallel-size", "1"]
    args = megatron_args(cp1 + ["--cp-comm-type", "mesh", "--mesh-tile-shape", "2x2", "--mesh-schedule", "lockstep",
                                "--tasp-gpus-per-node", "8", "--log-cp-attention-bytes"])
    assert _validate(args) == ["--tasp-gpus-per-node 8", "--log-cp-attention-bytes", "--mesh-tile-shape 2x2",
                               "--mesh-schedule lockstep"]
    assert _validate(megatron_args(cp1 + ["--cp-comm-type", "ring"])) == []
    with pytest.raises(ValueError, match="--tasp-gpus-per-node 8 is given, but no layer runs mesh or tasp"):
        _validate(megatron_args(cp1 + ["--cp-comm-type", "ring", "--tasp-gpus-per-node", "8"]))  # ring: at no CP size
    caplog.set_level("WARNING")
    bootstrap.check_args(args)
    bootstrap.check_args(args)  # once per arguments object
    said = [r.getMessage() for r in caplog.records if "unused at --context-parallel-size 1" in r.getMessage()]
    assert said == ["megatron_mesh: --tasp-gpus-per-node 8, --log-cp-attention-bytes, --mesh-tile-shape 2x2, "
                    "--mesh-schedule lockstep: only used at CP > 1, unused at --context-parallel-size 1 (accepted, so "
                    "that one config serves the CP 1 baseline and the CP runs)"], said


def test_cuda_kernel_backends_pass_where_cuda_is(megatron_args):
    args = megatron_args(["--spec", "megatron_mesh.megatron.spec", "gpt_layer_spec", "--transformer-impl", "local",
                          "--context-parallel-size", "4", "--cp-comm-type", "mesh", "--attention-dropout", "0",
                          "--cp-kernel-backend", "torch-flash"])
    _validate(args, have_cuda=True)
    with pytest.raises(ValueError, match="--cp-kernel-backend torch-flash runs on CUDA devices"):
        _validate(args, have_cuda=False)


@pytest.mark.parametrize("argv, message", [
    ([], "--cp-comm-type mesh needs the plugin's layer spec: add --spec megatron_mesh.megatron.spec gpt_layer_spec"),
    (["--spec", "megatron_mesh.megatron.spec", "gpt_layer_spec"],
     "--transformer-impl transformer_engine (Megatron's default) needs Transformer Engine"),
])
def test_plugin_modes_need_the_plugin_spec(megatron_args, argv, message):
    args = megatron_args(["--context-parallel-size", "4", "--cp-comm-type", "mesh", "--attention-dropout", "0", *argv])
    with pytest.raises(ValueError) as e:
        _validate(args)
    assert message in str(e.value)


def test_te_modes_detected_as_unusable_without_te(megatron_args):
    from megatron_mesh.megatron.checks import have_transformer_engine, validate_args

    usable, why = have_transformer_engine()
    if usable:
        pytest.skip("Transformer Engine is installed here")
    assert why
    args = megatron_args(["--context-parallel-size", "2", "--cp-comm-type", "all_gather", "--transformer-impl", "local"])
    with pytest.raises(ValueError, match="all_gather is a Transformer Engine mode"):
        validate_args(args)  # detection, not a forced have_te


@pytest.mark.parametrize("argv", [["--mesh-schedule", "fastest"], ["--mesh-backward-chunks", "never"],
                                  ["--mesh-contiguous", "rows"], ["--tasp-transport", "rdma"],
                                  ["--tasp-backward-chunks", "always"], ["--cp-kernel-backend", "cudnn9"],
                                  ["--softmax-type", "sink"]])  # Megatron's own flag (from TransformerConfig)
def test_unknown_choices_are_argparse_errors(megatron_args, argv, capsys):
    """One line (rank 0's) and status 2, as the plugin's own checks: not argparse's usage of every
    Megatron flag, from every rank."""
    with pytest.raises(SystemExit) as stop:
        megatron_args(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "usage:" not in err
    assert err.startswith(f"megatron_mesh: error: argument {argv[0]}: invalid choice: '{argv[1]}'") and \
        err.count("\n") == 1, err


def test_a_value_starting_with_a_minus_names_the_equals_form(megatron_args, capsys):
    """--window-size -1,0 (-1: unlimited) is argparse's "expected one argument": it takes -1,0 for a
    flag. The one line says how to give it (--window-size=-1,0, which parses)."""
    with pytest.raises(SystemExit) as stop:
        megatron_args(["--window-size", "-1,0"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("megatron_mesh: error: argument --window-size: expected one argument (a value starting with "
                          "'-' is written --flag=VALUE, e.g. --window-size=-1,0)"), err
    assert megatron_args(["--window-size=-1,0"]).window_size is not None


def test_flags_ride_on_the_transformer_config(megatron_args):
    from megatron.core.transformer import TransformerConfig
    from megatron.training.argument_utils import core_transformer_config_from_args

    from megatron_mesh.megatron.args import MeshTransformerConfig, apply_args
    from megatron_mesh.megatron.settings import PluginSettings, plugin_settings

    args = megatron_args(["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                          "--max-position-embeddings", "64", "--micro-batch-size", "1",
                          "--mesh-tile-shape", "2x2", "--mesh-schedule", "lockstep", "--mesh-contiguous", "kv",
                          "--tasp-gpus-per-node", "8", "--tasp-transport", "alltoall", "--tasp-backward-chunks", "keep",
                          "--mesh-backward-keep-limit", "3", "--cp-kernel-backend", "math"])
    from megatron.training.arguments import validate_args

    validate_args(args, {})
    config = core_transformer_config_from_args(args, config_class=MeshTransformerConfig)
    apply_args(args, config)
    settings = plugin_settings(config)
    given = dict(mesh_tile_shape="2x2", mesh_schedule="lockstep", mesh_contiguous="kv", tasp_gpus_per_node=8,
                 tasp_transport="alltoall", tasp_backward_chunks="keep", mesh_backward_keep_limit=3.0,
                 cp_kernel_backend="math")
    assert settings is config.cp_settings and settings == PluginSettings.of(**given, given=frozenset(given),
                                                                              seq_length=64)
    # typed and frozen: a bool for a switch, an int for a count, the registry's --cp-layout values
    assert (settings.cp_thd_packing, settings.tasp_gpus_per_node, settings.cp_layout) == (False, 8, "auto")
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.cp_layout = "zigzag"
    with pytest.raises(ValueError, match="--cp-thd-packing is on or off"):
        PluginSettings.of(cp_thd_packing="yes")
    assert settings.options("mesh") == {"tile": "2x2", "contiguous": "kv", "schedule": "lockstep",
                                        "backward_chunks": "auto", "backward_keep_limit": 3.0}  # chunks: the default
    # ring is Mesh 1 x CP: it shares the flags
    assert settings.options("ring") == {"backward_chunks": "auto", "backward_keep_limit": 3.0}
    assert settings.options("a2a+tasp") == {"transport": "alltoall", "backward_chunks": "keep",
                                            "backward_keep_limit": 2.0}  # the default
    assert settings.kernel == "math"
    plain = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    assert plugin_settings(plain) == PluginSettings.of()  # a plain config gets the defaults
    apply_args(args, plain)  # what the spec function does to any entry script's config
    assert plugin_settings(plain) == settings


@pytest.mark.parametrize("softmax_type", ["vanilla", "off-by-one", "learnable"])
def test_softmax_type_flag_reaches_the_config(megatron_args, softmax_type):
    """Megatron-Core 0.19 makes --softmax-type from TransformerConfig's field (its argument group
    generated from the dataclass), and core_transformer_config_from_args -- what every entry
    script builds its config with -- carries it: the plugin adds no flag of its own."""
    from megatron.training.argument_utils import core_transformer_config_from_args

    argv = ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings",
            "64", "--micro-batch-size", "1"]
    args = megatron_args(argv + (["--softmax-type", softmax_type] if softmax_type != "vanilla" else []))
    from megatron.training.arguments import validate_args

    validate_args(args, {})
    assert core_transformer_config_from_args(args).softmax_type == softmax_type


def test_settings_every_rank_must_share_compare_as_they_apply(monkeypatch):
    """What the ranks compare before creating process groups (groups.settings_of): settings as they
    apply (a default given or left out, a list or the equal tuple agree), not the per-rank output
    directory; a tile that differs is named with the ranks holding each value, tuples included."""
    from megatron_mesh.megatron.groups import settings_of
    from megatron_mesh.megatron.args import MeshTransformerConfig
    from megatron_mesh.megatron.settings import PluginSettings
    from megatron_mesh.runtime.agreement import differences

    def config(hierarchical_context_parallel_sizes, **kw):
        return MeshTransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, context_parallel_size=4,
                                     cp_comm_type=["mesh", "tasp"], cp_settings=PluginSettings.of(**kw),
                                     hierarchical_context_parallel_sizes=hierarchical_context_parallel_sizes)

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    base = settings_of(config(hierarchical_context_parallel_sizes=[2, 2]))
    same = settings_of(config(hierarchical_context_parallel_sizes=(2, 2), cp_layout="auto",
                              cp_metrics_dir="/scratch/node1"))
    assert differences([base, same]) == []
    tiled = settings_of(config(hierarchical_context_parallel_sizes=[2, 2], mesh_tile_shape="4x1"))
    assert differences([base, base, tiled, tiled]) == ["--mesh-tile-shape: ranks 0-1: auto, ranks 2-3: 4x1"]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # another node with more processes: TASP's rings would differ
    assert differences([base, settings_of(config(hierarchical_context_parallel_sizes=[2, 2]))]) == [
        "processes (GPUs) per node (--tasp-gpus-per-node, else torchrun's LOCAL_WORLD_SIZE): rank 0: 2, rank 1: 4"]


def test_megatron_arguments_that_time_the_collectives_or_the_training_are_compared_too(monkeypatch):
    """Where an entry script parsed Megatron's arguments, the ranks compare its SHARED_ARGS as well:
    two nodes with --train-iters 3 and 5 hung at the end of training without a word, with --seed
    99 on one trained a model neither asked for (stop 79). A model built in Python has none to
    compare; paths (a dataset at another path on each node) are not compared."""
    import argparse

    from megatron_mesh.megatron import ensure_typing_override
    from megatron_mesh.megatron.groups import SHARED_ARGS, settings_of, shared_args
    from megatron_mesh.megatron.args import MeshTransformerConfig
    from megatron_mesh.runtime.agreement import differences

    ensure_typing_override()  # megatron.training needs typing.override (Python 3.12) on 3.11
    from megatron.training import global_vars

    config = MeshTransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, context_parallel_size=4,
                                   cp_comm_type="mesh")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    global_vars.set_args(None)
    assert shared_args() == {}  # never parsed: nothing of Megatron's to compare
    base = dict({name: None for name in SHARED_ARGS}, seed=1234, train_iters=3, data_path=["/node0/docs"])
    try:
        global_vars.set_args(argparse.Namespace(**base))
        node0 = settings_of(config)
        global_vars.set_args(argparse.Namespace(**dict(base, data_path=["/node1/docs"])))
        assert differences([node0, settings_of(config)]) == []
        global_vars.set_args(argparse.Namespace(**dict(base, seed=99, train_iters=5)))
        assert differences([node0, node0, settings_of(config), settings_of(config)]) == [
            "--seed: ranks 0-1: 1234, ranks 2-3: 99", "--train-iters: ranks 0-1: 3, ranks 2-3: 5"]
    finally:
        global_vars.set_args(None)


def test_the_launchers_nnodes_is_compared(monkeypatch):
    """A node started with NNODES=4 beside one with NNODES=2 (world size 8 divides CP 4, so neither
    launcher refused): it trained, then hung at torchrun's exit barrier (stop 80's review). The
    ranks compare the launcher's NNODES; torchrun run directly sets none, and nothing is added."""
    from megatron_mesh.megatron.args import MeshTransformerConfig
    from megatron_mesh.megatron.groups import settings_of
    from megatron_mesh.runtime.agreement import differences

    config = MeshTransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, context_parallel_size=4,
                                   cp_comm_type="mesh")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("NNODES", raising=False)
    assert not any(k.startswith("NNODES") for k in settings_of(config))
    monkeypatch.setenv("NNODES", "2")
    two = settings_of(config)
    monkeypatch.setenv("NNODES", "4")
    assert differences([two, two, settings_of(config), settings_of(config)]) == [
        "NNODES (the job's nodes): ranks 0-1: 2, ranks 2-3: 4"]


def test_the_datasets_content_is_compared_not_its_path(tmp_path):
    """Nodes given different datasets (another DOC_DATA) failed at the first attention call with a
    PlanMismatchError traceback per rank, or on Megatron's index cache, never naming --data-path:
    the ranks compare each prefix's file sizes and a hash of its index. The same files at another
    path on each node agree; a blend's every prefix and weight is compared, a missing one is "missing"."""
    import argparse

    from megatron_mesh.megatron.groups import dataset_contents
    from megatron_mesh.runtime.agreement import differences

    def dataset(where, index: bytes):
        os.makedirs(tmp_path / where, exist_ok=True)
        (tmp_path / where / "docs.bin").write_bytes(b"tokens" * 10)
        (tmp_path / where / "docs.idx").write_bytes(index)
        return str(tmp_path / where / "docs")

    def contents(*data_path, **more):
        return dataset_contents(argparse.Namespace(data_path=list(data_path), mock_data=False, **more))

    same0, same1 = dataset("node0", b"MMIDIDX" + bytes(100)), dataset("node1", b"MMIDIDX" + bytes(100))
    other = dataset("other", b"MMIDIDX" + bytes(99) + b"\x01")  # one document's size differs
    assert differences([contents(same0), contents(same1)]) == []
    (got,) = differences([contents(same0), contents(same1), contents(other), contents(other)])
    assert got.startswith("the dataset --data-path (its files' content): ranks 0-1: .bin 60 B, .idx 107 B #"), got
    assert ", ranks 2-3: .bin 60 B, .idx 107 B #" in got and got.split("#")[1][:10] != got.split("#")[2][:10], got
    blend = contents("0.3", same0, "0.7", str(tmp_path / "gone" / "docs"))
    assert list(blend.values()) == ["0.3 x " + contents(same0)["the dataset --data-path (its files' content)"] +
                                    "; 0.7 x missing"]
    # the same files under other weights are another dataset (the review: they passed the comparison)
    (weights,) = differences([contents("0.5", same0, "0.5", other), contents("0.3", same0, "0.7", other)])
    assert weights.startswith("the dataset --data-path (its files' content): rank 0: 0.5 x .bin 60 B"), weights
    assert ", rank 1: 0.3 x .bin 60 B" in weights, weights
    assert dataset_contents(argparse.Namespace(data_path=[same0], mock_data=True)) == {}  # Megatron makes tokens up


def test_auto_tile_is_the_planners_choice(monkeypatch):
    from dataclasses import replace

    from megatron_mesh.megatron.args import MeshTransformerConfig
    from megatron_mesh.megatron.placement import resolve_placement
    from megatron_mesh.megatron.settings import PluginSettings, problem_of
    from megatron_mesh.plan import AttentionShape, Topology, choose_tile

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    ranks = tuple(range(16))
    for heads, groups in ((32, 8), (32, 32), (32, 1)):
        for per_node in (None, 8):
            config = MeshTransformerConfig(num_layers=2, hidden_size=4096, num_attention_heads=heads,
                                           num_query_groups=groups, context_parallel_size=16,
                                           cp_settings=PluginSettings.of(tasp_gpus_per_node=per_node,
                                                                         seq_length=16 * 4096))
            s = problem_of(config).shape(16)
            assert (s.heads, s.kv_heads, s.head_dim, s.seq_local) == (heads, groups, 128, 4096)
            shape = AttentionShape(4096, 1, heads, groups, 128, s.itemsize)
            topo = Topology(nodes=16 // (per_node or 16), gpus_per_node=per_node or 16)
            p = resolve_placement("mesh", config, ranks)
            assert (p.tile, p.options.contiguous) == choose_tile(16, shape, topo)
    config.cp_settings = replace(config.cp_settings, mesh_tile_shape="8x2")
    p = resolve_placement("mesh", config, ranks)
    assert p.tile == (8, 2) and p.options.contiguous in ("q", "kv")
    config.cp_settings = replace(config.cp_settings, mesh_contiguous="kv")
    p = resolve_placement("mesh", config, ranks)
    assert (p.tile, p.options.contiguous) == ((8, 2), "kv")


# -- layer specs ------------------------------------------------------------------------------------------
def _config(**kw):
    from megatron_mesh.megatron.args import MeshTransformerConfig

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, attention_dropout=0.0, hidden_dropout=0.0,
                use_cpu_initialization=True, transformer_impl="local")
    return MeshTransformerConfig(**{**base, **kw})


def test_local_spec_replaces_only_core_attention():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_mesh.megatron.core_attention import CPCoreAttention, CoreAttentionSpec
    from megatron_mesh.megatron.groups import PROCESS_GROUPS
    from megatron_mesh.megatron.spec import gpt_layer_spec, gpt_local_layer_spec
    from megatron_mesh.megatron.telemetry import Telemetry

    stock = get_gpt_layer_local_spec()
    stock_attention = stock.submodules.self_attention.submodules.core_attention
    for spec in (gpt_local_layer_spec(_config()), gpt_layer_spec(_config())):
        core = spec.submodules.self_attention.submodules.core_attention
        assert type(core) is CoreAttentionSpec and core.module is CPCoreAttention
        # the spec's own telemetry (no training script here) and the process's groups, for every layer
        assert type(core.params["telemetry"]) is Telemetry and core.params["groups"] is PROCESS_GROUPS
        stock.submodules.self_attention.submodules.core_attention = core
        assert repr(spec) == repr(stock)  # everything else is Megatron's own spec
    assert stock_attention is not CPCoreAttention


def test_moe_block_spec_patches_every_layer():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_mesh.megatron.core_attention import CPCoreAttention
    from megatron_mesh.megatron.spec import patch_spec

    config = _config(num_moe_experts=2, moe_router_topk=2, num_layers=3)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, pp_rank=0)
    assert patch_spec(block) is block and len(block.layer_specs) == 3
    cores = [s.submodules.self_attention.submodules.core_attention for s in block.layer_specs]
    assert all(c.module is CPCoreAttention for c in cores)
    assert len({id(c.params["telemetry"]) for c in cores}) == 1  # one summary for the block's layers


def test_patch_spec_rejects_specs_without_attention():
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_mesh.megatron.spec import patch_spec

    with pytest.raises(ValueError, match="no self_attention.submodules.core_attention"):
        patch_spec(ModuleSpec(module=torch.nn.Identity))


def test_te_spec_without_te_is_a_clear_error():
    from megatron_mesh.megatron.checks import have_transformer_engine
    from megatron_mesh.megatron.spec import gpt_layer_spec, gpt_te_layer_spec

    if have_transformer_engine()[0]:
        pytest.skip("Transformer Engine is installed here")
    with pytest.raises(ValueError, match="needs Transformer Engine.*--transformer-impl local"):
        gpt_te_layer_spec(_config())
    with pytest.raises(ValueError, match="transformer_impl 'transformer_engine' needs Transformer Engine"):
        gpt_layer_spec(_config(transformer_impl="transformer_engine"))


def test_spec_function_resolves_like_megatron_spec_flag():
    from megatron.core.transformer.spec_utils import import_module

    from megatron_mesh.megatron import spec
    from megatron_mesh.megatron.pretrain_gpt import DEFAULT_SPEC

    assert import_module(tuple(DEFAULT_SPEC)) is spec.gpt_layer_spec


# -- the core-attention contract ----------------------------------------------------------------------------
def _build(config, cp_comm_type, **kw):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_mesh.megatron.core_attention import CPCoreAttention

    args = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                cp_comm_type=cp_comm_type, softmax_scale=None, pg_collection=None)
    return CPCoreAttention(**{**args, **kw})


@pytest.mark.parametrize("mode", ["p2p", "a2a", "all_gather", "a2a+p2p", None])
def test_te_modes_without_te_raise_naming_the_mode(mode):
    from megatron_mesh.megatron.checks import have_transformer_engine

    if have_transformer_engine()[0]:
        pytest.skip("Transformer Engine is installed here")
    with pytest.raises(ValueError) as e:
        _build(_config(context_parallel_size=4), mode)
    assert f"layer 1: cp_comm_type '{mode or 'p2p'}' is a Transformer Engine mode, but Transformer Engine is " \
           "not usable here" in str(e.value)
    assert ("use ring (the same algorithm)" if mode in ("p2p", None)
            else "use one of ring, mesh, tasp, a2a+mesh, a2a+tasp, a2a+ring") in str(e.value)


def test_unknown_mode_raises():
    with pytest.raises(ValueError, match="cp_comm_type 'hamilton' is not a context-parallel mode"):
        _build(_config(context_parallel_size=4), "hamilton")


@pytest.mark.parametrize("change, message", [
    (dict(config=dict(attention_dropout=0.1)), "attention dropout 0.1 is not supported (allowed: 0"),
    (dict(config=dict(window_size=(128, 64))), "window_size (128, 64) on a causal layer: the right side must be 0"),
    (dict(config=dict(softmax_type="sink")), "softmax_type 'sink' is not one of 'vanilla', 'off-by-one', 'learnable'"),
    (dict(build=dict(attention_type="cross")), "attention_type 'cross' is not supported (allowed: 'self')"),
    (dict(build=dict(attn_mask_type="padding")), "attention mask type 'padding' is not supported"),
])
def test_unsupported_features_raise(change, message):
    from megatron.core.transformer.enums import AttnMaskType

    build = dict(change.get("build", {}))
    if build.get("attn_mask_type") == "padding":
        build["attn_mask_type"] = AttnMaskType.padding
    config = _config(context_parallel_size=4, **change.get("config", {}))
    with pytest.raises(ValueError) as e:
        _build(config, "mesh", **build)
    assert message in str(e.value) and "layer 1" in str(e.value)


@pytest.fixture()
def one_rank(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield types.SimpleNamespace(cp=dist.group.WORLD)
    from megatron_mesh.megatron.groups import PROCESS_GROUPS

    PROCESS_GROUPS.destroy()
    dist.destroy_process_group()


def test_cp1_is_plain_attention_and_forward_checks(one_rank):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_mesh.kernels import reference_attention
    from megatron_mesh.megatron.core_attention import PluginCoreAttention

    from megatron.core.transformer.enums import AttnMaskType as M

    module = PluginCoreAttention(config=_config(context_parallel_size=1), layer_number=1, attn_mask_type=M.causal,
                                 attention_type="self", softmax_scale=0.2, pg_collection=one_rank)
    assert module.cp_size == 1
    g = torch.Generator().manual_seed(0)
    q = torch.randn(12, 2, 4, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(12, 2, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    for mask_type, causal in ((AttnMaskType.causal, True), (AttnMaskType.no_mask, False)):
        out = module(q, k, v, None, attn_mask_type=mask_type)
        want = reference_attention(q, k, v, causal=causal, softmax_scale=0.2)
        assert out.shape == (12, 2, 64)
        torch.testing.assert_close(out, want.reshape(12, 2, 64), rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="attention_bias is not supported"):
        module(q, k, v, None, attn_mask_type=AttnMaskType.causal, attention_bias=torch.zeros(1))
    with pytest.raises(ValueError, match=r"THD inputs must be \[t, heads, head_dim\], got \(12, 2, 4, 16\)"):
        module(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=PackedSeqParams(qkv_format="thd"))
    with pytest.raises(ValueError, match=r"qkv_format 'bshd' is not supported by the plugin modes \(allowed: 'thd'"):
        module(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=PackedSeqParams(qkv_format="bshd"))
    cu = torch.tensor([[0, 5, 12], [0, 7, 12], [0, 12, 12]], dtype=torch.int32)
    with pytest.raises(ValueError, match="3 rows of document boundaries for a batch of 2"):
        module(q, k, v, None, attn_mask_type=AttnMaskType.causal,
               packed_seq_params=PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu))
    # per-sample documents at CP 1: each sample is masked by its own documents
    out = module(q, k, v, None, attn_mask_type=AttnMaskType.causal,
                 packed_seq_params=PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu[:2], cu_seqlens_kv=cu[:2]))
    for i, starts in enumerate(([0, 5], [0, 7])):
        bounds = starts + [12]
        for a, b in zip(bounds, bounds[1:]):
            want = reference_attention(q[a:b, i:i + 1], k[a:b, i:i + 1], v[a:b, i:i + 1], causal=True,
                                       softmax_scale=0.2)
            torch.testing.assert_close(out[a:b, i:i + 1], want.reshape(b - a, 1, 64), rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="attention mask type 'arbitrary' is not supported"):
        module(q, k, v, None, attn_mask_type=AttnMaskType.arbitrary)
    assert math.isclose(PluginCoreAttention(config=_config(context_parallel_size=1, kv_channels=16), layer_number=1,
                                            attn_mask_type=M.causal, attention_type="self",
                                            pg_collection=one_rank).softmax_scale, 16 ** -0.5)


def test_mla_core_attention(one_rank):
    """MLA's own core attention (k_channels != v_channels) at CP 1 without Transformer Engine is the
    plugin's single-rank attention (Megatron's DotProductAttention takes no head dims): exact
    against the reference with d_v 12 != d_qk 24; the one MLA's base class builds first (no head
    dims) is a stand-in MLA replaces, whatever the CP size."""
    from megatron_mesh.kernels import reference_attention
    from megatron_mesh.megatron.core_attention import PluginCoreAttention
    from megatron_mesh.megatron.mla import ReplacedByMLA

    pgs = types.SimpleNamespace(cp=one_rank.cp, tp=one_rank.cp)
    module = _build(_config(context_parallel_size=1, multi_latent_attention=True), "mesh", pg_collection=pgs,
                    k_channels=24, v_channels=12, softmax_scale=0.3)
    assert type(module) is PluginCoreAttention
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(12, 2, 4, 24, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(12, 2, 4, 12, generator=g, dtype=torch.float64)
    want = reference_attention(q, k, v, causal=True, softmax_scale=0.3)
    torch.testing.assert_close(module(q, k, v, None), want.reshape(12, 2, 48), rtol=1e-10, atol=1e-10)
    for cp in (1, 4):
        stand_in = _build(_config(context_parallel_size=cp, multi_latent_attention=True), None, pg_collection=pgs)
        assert type(stand_in) is ReplacedByMLA
        with pytest.raises(RuntimeError, match="replaced by MLA's own"):
            stand_in(q, k, v, None)


def test_chunked_layers_are_the_plugins_attention_with_llama4s_mask(one_rank):
    """--attention-chunk-size (Llama 4's chunked attention) under --no-rope-freq: the layers with
    RoPE attend inside chunks counted from each document's start -- the plugin's attention, at
    CP 1 too (Megatron's own has no such mask), exact against the dense fp64 reference with that
    mask, forward and backward; the NoPE layer is Megatron's own full causal attention at CP 1.
    A chunked layer that is not causal or has a window is refused, naming the flag."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_mesh import masks
    from megatron_mesh.kernels import reference_attention
    from megatron_mesh.megatron.core_attention import PluginCoreAttention
    from megatron_mesh.megatron.settings import PluginSettings

    pgs = types.SimpleNamespace(cp=one_rank.cp, tp=one_rank.cp)
    chunked = dict(num_layers=4, no_rope_freq=4, cp_settings=PluginSettings.of(attention_chunk_size=5))
    config = _config(context_parallel_size=1, **chunked)
    layers = [_build(config, "mesh", layer_number=n, pg_collection=pgs, softmax_scale=0.2) for n in (1, 2, 3, 4)]
    assert [type(m) for m in layers] == [PluginCoreAttention] * 3 + [DotProductAttention]
    assert "chunks of 5" in layers[0].describe()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(12, 2, 4, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(12, 2, 2, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    cu = torch.tensor([[0, 7, 12], [0, 3, 12]], dtype=torch.int32)
    for packed, rows in ((None, [[0, 12]] * 2), (PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu),
                                                  cu.tolist())):
        out = layers[0](q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=packed)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        for i, row in enumerate(rows):  # each sample: chunks of 5 from each of its documents' starts
            one = [x[:, i:i + 1].detach().requires_grad_() for x in (q, k, v)]
            want = reference_attention(*one, softmax_scale=0.2, mask=masks.documents(row) & masks.chunked(5))
            torch.testing.assert_close(out[:, i:i + 1], want.reshape(12, 1, 64), rtol=1e-10, atol=1e-10)
            for got, ref in zip(grads, torch.autograd.grad(want.sum(), one)):
                torch.testing.assert_close(got[:, i:i + 1], ref, rtol=1e-10, atol=1e-10)
        plain = reference_attention(q[:, :1], k[:, :1], v[:, :1], causal=True, softmax_scale=0.2)
        assert not torch.allclose(out[:, :1], plain.reshape(12, 1, 64))  # the chunks change the result
    with pytest.raises(ValueError, match="chunked attention is causal inside each chunk, and this call's attention "
                                         "mask type is not causal"):
        layers[0](q, k, v, None, attn_mask_type=AttnMaskType.no_mask)
    for change, message in ((dict(build=dict(attn_mask_type=AttnMaskType.no_mask)), "attention mask type no_mask"),
                            (dict(config=dict(window_size=(4, 0))), "window_size (4, 0)")):
        with pytest.raises(ValueError) as e:
            _build(_config(context_parallel_size=1, **chunked, **change.get("config", {})), "mesh", pg_collection=pgs,
                   **change.get("build", {}))
        assert f"layer 1 (cp_comm_type 'ring'): --attention-chunk-size 5 (chunked attention: causal inside each " \
               f"chunk) on a layer with {message}" in str(e.value), str(e.value)


def test_cp1_builder_hands_over_to_megatrons_attention(one_rank):
    """Under the plugin's spec, CP 1 is Megatron's own DotProductAttention -- dropout included."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    pgs = types.SimpleNamespace(cp=one_rank.cp, tp=one_rank.cp)
    module = _build(_config(context_parallel_size=1, attention_dropout=0.1), "mesh", pg_collection=pgs)
    assert type(module) is DotProductAttention and module.attention_dropout.p == 0.1


# -- YAML -> flags --------------------------------------------------------------------------------------
def _yaml_to_args():
    from megatron_mesh.tools import yaml_args

    return yaml_args


def test_yaml_translation(tmp_path):
    y = _yaml_to_args()
    path = tmp_path / "c.yaml"
    path.write_text("ENV_VARS:\n  CUDA_DEVICE_MAX_CONNECTIONS: 1\n  RUN_DIR: /runs\nMODEL_ARGS:\n"
                    "  --num-layers: 2\n  --use-cpu-initialization: true\n  --bf16: false\n  --lr: 1.0e-3\n"
                    "  --cp-comm-type: mesh tasp\n  --save: ${RUN_DIR}/ckpt\n  --data-path: [0.5, /a b, 0.5, /c]\n"
                    "TEST_TYPE: regular\n")
    doc = y.load(str(path))
    env = y.environment(doc, base={"RUN_DIR": "/mine"})
    assert env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "RUN_DIR": "/mine"}  # the environment wins
    assert y.model_args(doc, env) == ["--num-layers", "2", "--use-cpu-initialization", "--lr", "0.001",
                                      "--cp-comm-type", "mesh", "tasp", "--save", "/mine/ckpt",
                                      "--data-path", "0.5", "/a b", "0.5", "/c"]
    with pytest.raises(ValueError, match=r"--save: \$\{RUN_DIR\} is not set"):
        y.model_args(doc, {})
    assert y.model_args({"MODEL_ARGS": {"--x": "$A-$$"}}, {"A": "1"}) == ["--x", "1-$"]  # $VAR and $$, as string.Template
    # one value starting with '-' as flag=value (argparse would take "-1,0" for a flag); several stay apart
    assert y.model_args({"MODEL_ARGS": {"--window-size": "-1,0", "--x": "-1 -2", "--y": [-3]}}, {}) == \
        ["--window-size=-1,0", "--x", "-1", "-2", "--y=-3"]
    with pytest.raises(ValueError, match=r"--x: Invalid placeholder .* in '5\$ a' \(write \$\$ for a literal \$\)"):
        y.model_args({"MODEL_ARGS": {"--x": "5$ a"}}, {})


def test_tiny_cpu_config_parses(megatron_args):
    args = _config_args(megatron_args, "gpt_tiny_cpu.yaml")
    assert args.spec == ["megatron_mesh.megatron.spec", "gpt_layer_spec"]
    assert args.transformer_impl == "local" and args.cp_comm_type == ["mesh"]
    _validate(args)


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".yaml")))
def test_configs_parse_with_every_mode(megatron_args, our_entry, name):
    """Every flag of every config is one Megatron (or the plugin) knows, and the config is valid
    under each mode in the plugin's entry script (GPU configs assume Transformer Engine for TE's modes;
    a config with Llama 4's chunks refuses them: TE has no chunked attention)."""
    parsed = _config_args(megatron_args, name)
    layers = parsed.num_layers
    for modes in (["mesh"], ["tasp"], ["ring"], ["p2p"], (["mesh", "tasp", "ring"] * layers)[:layers]):
        args = copy.deepcopy(parsed)
        args.cp_comm_type = modes
        if modes == ["p2p"] and parsed.attention_chunk_size is not None and parsed.context_parallel_size > 1:
            with pytest.raises(ValueError, match="layer 1 has chunks and runs --cp-comm-type p2p"):
                _validate(args, have_te=True, **our_entry)
            continue
        _validate(args, have_te=True, **our_entry)


def _config_args(megatron_args, name, *extra):
    y = _yaml_to_args()
    doc = y.load(os.path.join(ROOT, "configs", name))
    argv = y.model_args(doc, {**os.environ, **y.environment(doc)})
    return megatron_args([*argv, *extra])


def test_te_modes_hand_over_to_te_dotproductattention(monkeypatch):
    """With Transformer Engine usable, TE's modes build TEDotProductAttention with the layer's
    arguments and mode (a stand-in records the call: TE itself needs CUDA)."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_mesh.megatron import core_attention

    class Recorder:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    monkeypatch.setattr(core_attention, "have_transformer_engine", lambda: (True, ""))
    monkeypatch.setattr(te_ext, "TEDotProductAttention", Recorder)
    config = _config(context_parallel_size=4)
    for mode in ("p2p", "a2a", "all_gather", "a2a+p2p"):
        built = _build(config, mode, k_channels=16, v_channels=16)
        assert isinstance(built, Recorder)
        assert built.kwargs == dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                    attention_type="self", softmax_scale=None, pg_collection=None,
                                    cp_comm_type=mode, k_channels=16, v_channels=16)


# -- masks, packing and the Ulysses hybrids ----------------------------------------------------------------

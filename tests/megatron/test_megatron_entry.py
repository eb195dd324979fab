"""The plugin from any Megatron entry script, in one process: Megatron's parser takes the plugin's
flags and runs its checks first (run_script's hook); the spec functions put the settings and the
real sequence length from Megatron's parsed arguments on a plain TransformerConfig, or stop the
start-up with one message; workers die with their launcher and exit on Ctrl-C without a traceback;
the CPU workaround for sequence parallelism with torch norms. The launcher: --help, and a bad
command line (a missing script, a world size that TP x PP x CP does not divide) refused in one line
before torchrun starts; the backend flag passed once; the exit status of failed ranks; missing
dataset files named at start-up."""

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import textwrap

import pytest
from helpers import MEGATRON_LM_SCRIPT, PRETRAIN, ROOT, RUN_SCRIPT, free_port

pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/setup_env.sh installs it)")

from megatron_mesh.megatron import bootstrap, ensure_typing_override  # noqa: E402
from megatron_mesh.megatron.process import ProcessState  # noqa: E402

pytestmark = pytest.mark.megatron
PLUGIN_SPEC = ["--spec", "megatron_mesh.megatron.spec", "gpt_layer_spec", "--transformer-impl", "local"]


@pytest.fixture()
def arguments(monkeypatch):
    """megatron.training.arguments, restored after the test (the hook replaces two functions)."""
    ensure_typing_override()
    from megatron.training import arguments

    monkeypatch.setattr(arguments, "parse_args", arguments.parse_args)
    monkeypatch.setattr(arguments, "validate_args", arguments.validate_args)
    monkeypatch.delenv("RANK", raising=False)
    return arguments


def _parse(arguments, monkeypatch, argv, provider=None):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--num-layers", "2", *argv])
    return arguments.parse_args(provider)


def test_argument_hook_adds_the_plugin_flags_and_checks_them_first(arguments, monkeypatch, capsys):
    bootstrap.install_argument_hook()
    bootstrap.install_argument_hook()  # idempotent
    # what Megatron-LM's pretrain_gpt.py does: no provider of its own
    args = _parse(arguments, monkeypatch, ["--context-parallel-size", "4", "--cp-comm-type", "mesh",
                                           "--mesh-tile-shape", "3x2", "--mesh-schedule", "lockstep"])
    assert (args.mesh_tile_shape, args.mesh_schedule) == ("3x2", "lockstep")
    with pytest.raises(SystemExit) as e:
        arguments.validate_args(args, {})  # the plugin's check runs before Megatron's own asserts
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("megatron_mesh: error:") == 1
    assert "megatron_mesh: error: --cp-comm-type mesh at --context-parallel-size 4 with --mesh-tile-shape 3x2" in err
    assert "tile 3x2 does not fit CP size 4" in err
    # a script that registers the flags itself keeps its registration (no argparse conflict)
    from megatron_mesh.megatron.args import add_args

    assert _parse(arguments, monkeypatch, ["--mesh-tile-shape", "2x2"], add_args).mesh_tile_shape == "2x2"


def test_plugin_flags_help_renders_a_literal_percent():
    """argparse reads help as a %-format: --mesh-tile-shape's tie rule ("ties within 1 %") is
    escaped, and --help shows it as written."""
    import argparse

    from megatron_mesh.megatron.args import add_args
    from megatron_mesh.plan.autotile import TIE_RULE

    parser = argparse.ArgumentParser()
    add_args(parser)
    assert TIE_RULE in " ".join(parser.format_help().split())


def test_only_rank_0_prints_the_error(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(SystemExit) as e:
        bootstrap.fail("bad")
    assert e.value.code == 2 and capsys.readouterr().err == ""


def test_a_rank_ended_by_another_node_waits_for_its_first_rank_to_say_so(monkeypatch):
    """A rank whose collective fails because another node stopped exits without a traceback, but
    only after its node's first rank has had the polls its watcher needs to print the one line: a
    rank other than the first exited at once, torchrun stopped the first before it printed, and
    the node ended with status 2 and no word (stop 79)."""
    import time

    from megatron_mesh.megatron import errors

    exits = []
    monkeypatch.setattr(errors, "_multi_node_job", lambda: True)
    monkeypatch.setattr(errors, "_another_node_stopped", lambda wait_s=0.0: True)
    monkeypatch.setattr(errors, "_exit_now", lambda: exits.append(time.monotonic()) or sys.exit(2))
    for first in (False, True):
        monkeypatch.setattr(errors, "_first_rank_of_node", lambda: first)
        start = time.monotonic()
        with pytest.raises(SystemExit) as e:
            with errors.crash_stops_other_nodes(ProcessState()):
                raise RuntimeError("Connection closed by peer")
        assert e.value.code == 2 and exits[-1] - start >= 2.5 * errors.WATCH_POLL_S, first


def test_a_rank_whose_watcher_heard_another_node_ends_without_a_traceback(monkeypatch):
    """Once this node's watcher has read another node's failure, node 0 may go (it waited for that
    read), taking torchrun's store: this rank, still in its rendezvous, fails with "Failed to recv
    ... Connection was likely closed" and the store no longer answers. It exits with the watcher's
    line, status 2 -- it printed a traceback after that line (stop 81's CI, three nodes)."""
    from megatron_mesh.megatron import errors

    exits = []
    monkeypatch.setattr(errors, "_multi_node_job", lambda: True)
    monkeypatch.setattr(errors, "_another_node_stopped", lambda wait_s=0.0: False)  # the store is gone
    monkeypatch.setattr(errors, "_tell_other_nodes", lambda message: None)
    monkeypatch.setattr(errors, "_exit_now", lambda: exits.append(1) or sys.exit(2))
    process = ProcessState()
    process.heard.set()
    process.exiting.set()  # no need to wait here for the watcher's polls
    failed = "Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?"
    with pytest.raises(SystemExit) as e:
        with errors.crash_stops_other_nodes(process):
            raise RuntimeError(failed)
    assert e.value.code == 2 and exits == [1]
    with pytest.raises(RuntimeError):  # not heard: the error is this rank's own
        with errors.crash_stops_other_nodes(ProcessState()):
            raise RuntimeError(failed)


def test_a_rank_whose_peer_went_away_waits_for_that_nodes_word(monkeypatch):
    """SIGTERM to one node's launcher: its ranks die at once, and the other nodes' collectives fail
    ("Connection reset by peer") before the launcher has told them why -- they printed a traceback
    per rank. A rank whose error says a peer went away asks the store again for PEER_LOST_WAIT_S;
    any other error asks once. (Three nodes end to end: test_three_nodes_all_hear_of_one_that_stops.)"""
    from megatron_mesh.megatron import errors

    asked = []
    monkeypatch.setattr(errors, "_multi_node_job", lambda: True)
    monkeypatch.setattr(errors, "_another_node_stopped", lambda wait_s=0.0: asked.append(wait_s) or False)
    monkeypatch.setattr(errors, "_tell_other_nodes", lambda message: None)
    for error in (RuntimeError("[pair.cc:537] Read error [127.0.0.1]:7074: Connection reset by peer"),
                  RuntimeError("Connection closed by peer [127.0.0.1]:1234"), ValueError("mine"), AssertionError()):
        with pytest.raises(type(error)):
            with errors.crash_stops_other_nodes(ProcessState()):
                raise error
    assert asked == [errors.PEER_LOST_WAIT_S, errors.PEER_LOST_WAIT_S, 0.0, 0.0]


def test_a_crash_is_told_to_other_nodes_in_one_line(monkeypatch):
    """What another node's log says of a rank's error (crash_stops_other_nodes; the multi-node jobs
    in test_megatron_pretrain_masks.py run it): its type and first line, or why it exited; exits on
    purpose (an integer status: Megatron's rerun state machine exits 16 on every rank) and fail()'s
    own exit tell nothing; outside a job of several nodes nothing is told and the error passes
    through as it was."""
    from megatron_mesh.megatron import errors

    assert errors._describe(AssertionError("bad header, cannot read: x.idx\nmore")) == (
        "AssertionError: bad header, cannot read: x.idx (the traceback is in that node's log)")
    assert errors._describe(RuntimeError()) == "RuntimeError (the traceback is in that node's log)"
    assert errors._describe(ValueError("x" * 1000)).startswith("ValueError: " + "x" * 285 + "...")
    assert errors._describe(SystemExit(130)) == "exit status 130 (interrupted)"
    assert errors._describe(KeyboardInterrupt()) == "interrupted"
    assert errors._describe(SystemExit("usage: ...\nmore")) == "usage: ..."

    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no text")

    told = []
    monkeypatch.setattr(errors, "_tell_other_nodes", told.append)
    process = ProcessState()  # this test's own: fail() sets the process's failing

    def run(error):
        with pytest.raises(type(error)) as got:
            with errors.crash_stops_other_nodes(process):
                raise error
        assert got.value is error  # raised as it was

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    run(KeyError("k"))
    assert told == []
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "3")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    for planned in (SystemExit(0), SystemExit(None), SystemExit(16), SystemExit(2)):
        run(planned)
    assert told == [] and not process.failing.is_set()
    monkeypatch.setenv("RANK", "3")  # not the node's first rank: fail() does not wait for it to print
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(SystemExit):
        with errors.crash_stops_other_nodes(process):
            errors.fail("bad flag", process=process)  # tells once, as itself
    assert told == ["bad flag"]
    process = ProcessState()
    run(KeyboardInterrupt())
    assert told[-1] == "interrupted"
    process = ProcessState()
    run(Unprintable())  # an error whose text fails still comes out as itself
    process = ProcessState()
    with errors.crash_stops_other_nodes(process):
        pass
    assert process.exiting.is_set()  # finished: it stops watching
    with pytest.raises(SystemExit):
        errors.fail("every rank alike", tell=False, process=process)  # each node says it itself: nothing told
    assert told == ["bad flag", "interrupted"]
    failed = []
    monkeypatch.setattr(errors, "fail", lambda message, **how: failed.append((message, how)))
    with errors.one_line_for(ValueError):  # the errors every rank raises alike
        raise ValueError("different flags")
    assert failed == [("different flags", {"at_once": True, "tell": False})]


def _plain_config():
    from megatron.core.transformer import TransformerConfig

    # what Megatron-LM's script builds: core_transformer_config_from_args(args) -- no plugin fields
    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                             context_parallel_size=4, cp_comm_type="mesh", attention_dropout=0.0)


def test_spec_configures_a_plain_config_from_megatrons_arguments(arguments, monkeypatch):
    """The settings reach the layers whatever config class the script built, and 'auto' plans for
    the real sequence length: this GQA model at CP 4 and 256K tokens gets the 2x2 tile, where the
    made-up default length (8K tokens per rank) would give the ring-equivalent 1x4. (With the host's
    cost per op priced, short sequences keep 1x4 too: 256K tokens is where this head shape needs 2x2.)"""
    from megatron_mesh.megatron import spec
    from megatron_mesh.megatron.args import add_args
    from megatron_mesh.megatron.settings import plugin_settings
    from megatron_mesh.megatron.placement import resolve_placement

    args = _parse(arguments, monkeypatch, [*PLUGIN_SPEC, "--context-parallel-size", "4", "--cp-comm-type", "mesh",
                                           "--mesh-schedule", "lockstep", "--seq-length", "262144",
                                           "--attention-dropout", "0"], add_args)
    monkeypatch.setattr(bootstrap, "megatron_args", lambda: args)
    assert resolve_placement("mesh", _plain_config(), (0, 1, 2, 3)).tile == (1, 4)  # without the arguments' sequence length
    config, _ = spec._transformer_config(_plain_config())
    assert plugin_settings(config).options("mesh")["schedule"] == "lockstep" and config.cp_settings.seq_length == 262144
    p = resolve_placement("mesh", config, (0, 1, 2, 3))
    assert (p.tile, p.options.contiguous) == ((2, 2), "q")


def test_spec_stops_a_bad_setting_once(arguments, monkeypatch, capsys):
    """An entry script without the argument hook: the spec function is the first plugin code to
    run, before any layer is built; it stops every rank, rank 0 printing the error once."""
    from megatron_mesh.megatron import spec
    from megatron_mesh.megatron.args import add_args

    args = _parse(arguments, monkeypatch, [*PLUGIN_SPEC, "--context-parallel-size", "4", "--cp-comm-type", "mesh",
                                           "--attention-dropout", "0.1"], add_args)
    monkeypatch.setattr(bootstrap, "megatron_args", lambda: args)
    with pytest.raises(SystemExit):
        spec._transformer_config(_plain_config())
    assert capsys.readouterr().err.count("megatron_mesh: error: --attention-dropout 0.1") == 1


_DIE = textwrap.dedent("""
    import os, sys
    os.environ["TORCHELASTIC_RUN_ID"] = "test"
    os.environ["MEGATRON_MESH_LAUNCHER_PID"] = sys.argv[1]
    from megatron_mesh.megatron import bootstrap
    bootstrap.die_with_parent()
    print("alive")
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_whose_launcher_is_already_gone_kills_itself():
    """die_with_parent closes the race where the launcher died before the worker asked to follow
    it: the worker's parent is not the launcher any more, so it kills itself at once."""
    here = subprocess.run([sys.executable, "-c", _DIE, str(os.getpid())], capture_output=True, text=True, timeout=60)
    assert here.returncode == 0 and here.stdout.strip() == "alive", here.stderr
    gone = subprocess.run([sys.executable, "-c", _DIE, "1"], capture_output=True, text=True, timeout=60)
    assert gone.returncode == -9 and "alive" not in gone.stdout


def test_torch_norm_with_sequence_parallelism_marks_its_parameters():
    """cpu_compat: Megatron's torch norm refuses --sequence-parallel; the workaround builds it and
    marks its parameters so that finalize_model_grads all-reduces their gradients over TP."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_mesh.megatron import cpu_compat

    cpu_compat._torch_norm_sequence_parallel()
    for sp in (True, False):
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                                   tensor_model_parallel_size=2, sequence_parallel=sp)
        norm = WrappedTorchNorm(config=config, hidden_size=8, eps=1e-5)
        assert config.sequence_parallel is sp  # the caller's config is left alone
        assert [p.sequence_parallel for p in norm.parameters()] == [sp]


_LAZY_COMPILE = textwrap.dedent("""
    import sys, torch
    from megatron_mesh.megatron import bootstrap
    bootstrap.prepare_runtime()
    import megatron.core, megatron.training
    from megatron.core.fusions.fused_bias_gelu import bias_gelu
    from megatron.core.models.gpt import GPTModel
    assert "torch._dynamo" not in sys.modules and "torch._inductor" not in sys.modules, "imported at start-up"
    assert not hasattr(bias_gelu, "_torchdynamo_orig_callable")  # Megatron's fusion: not compiled yet
    calls = []
    def f(x):
        calls.append(1)
        return x * 2 + 1
    g = torch.compile(f, backend="eager")
    assert "torch._dynamo" not in sys.modules and g.__wrapped__ is f
    assert torch.equal(g(torch.ones(3)), torch.full((3,), 3.0)) and calls
    assert "torch._dynamo" in sys.modules  # compiled at the first call
    h = torch.compile(backend="eager")(f)  # decorator form with options
    assert torch.equal(h(torch.zeros(2)), torch.ones(2))
    module = torch.compile(torch.nn.Linear(2, 2), backend="eager")  # modules go to torch.compile at once
    assert type(module).__name__ == "OptimizedModule"
    print("ok")
""")


def test_cpu_runs_compile_megatrons_fusions_at_their_first_call():
    """cpu_compat: Megatron decorates its fusions with torch.compile at import, which imports
    torch._dynamo and inductor (seconds per process); on a CPU run they are compiled at their
    first call instead -- same results, the import moves -- and modules still compile at once."""
    cpu_run = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # what the workaround is for: a run without CUDA
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", _LAZY_COMPILE], capture_output=True, text=True,
                         timeout=180, env=cpu_run)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_start_up_pauses_the_garbage_collector_and_gives_it_back(arguments, monkeypatch):
    """bootstrap.pause_gc / resume_gc: the entry scripts load torch and Megatron without cyclic
    garbage collection (its passes over the growing heap are a fifth of the import) and resume
    it, the start-up's objects frozen, when the arguments are parsed; importing the entry modules
    changes nothing, a launcher that fails at start-up gives collection back, and a collector the
    caller had turned off stays off."""
    import gc

    from megatron_mesh.megatron import launch, pretrain_gpt, run_script  # noqa: F401 -- as modules: no pause

    assert gc.isenabled() and gc.get_freeze_count() == 0
    try:
        assert launch.main(["pretrain", "/nowhere/config.yaml"]) == 2  # an error at start-up
        assert gc.isenabled()
        bootstrap.pause_gc()
        assert not gc.isenabled()
        bootstrap.install_argument_hook()
        _parse(arguments, monkeypatch, ["--hidden-size", "8", "--num-attention-heads", "2"])
        frozen = gc.get_freeze_count()  # the hook ended the start-up: what exists is frozen
        assert gc.isenabled() and frozen > 0, frozen
        bootstrap.resume_gc()  # once only
        assert gc.get_freeze_count() == frozen
        gc.disable()  # a caller that runs without the collector keeps it off
        bootstrap.pause_gc()
        bootstrap.resume_gc()
        assert not gc.isenabled()
    finally:  # this process's collector as it was
        bootstrap.resume_gc()  # where a failed check left it paused
        gc.unfreeze()
        gc.enable()


# the shape of Megatron-LM's megatron/core/datasets/Makefile: `python3` and `python3-config` on PATH
# decide the includes and the file name -- here a python3 without pybind11 (the machine's own)
_HELPERS_MAKEFILE = """\
CXXFLAGS += -O1 -shared -std=c++17 -fPIC
CPPFLAGS += $(shell python3 -m pybind11 --includes)
LIBEXT = $(shell python3-config --extension-suffix)
helpers_cpp$(LIBEXT): helpers.cpp
\t$(CXX) $(CXXFLAGS) $(CPPFLAGS) $< -o $@
"""


@pytest.mark.skipif(not all(shutil.which(t) for t in ("make", "g++")), reason="needs make and g++")
def test_a_megatron_checkouts_dataset_helpers_are_built_with_this_interpreter(tmp_path, monkeypatch):
    """A Megatron-LM checkout has no built helpers; its Makefile would ask PATH's python3 (here one
    without pybind11, or none) for the includes and the extension suffix: the plugin builds them
    with the interpreter that runs the training, and the module imports."""
    (tmp_path / "Makefile").write_text(_HELPERS_MAKEFILE)
    (tmp_path / "helpers.cpp").write_text(
        "#include <pybind11/pybind11.h>\nPYBIND11_MODULE(helpers_cpp, m) { m.def(\"answer\", []() { return 42; }); }\n")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    bootstrap._compile_dataset_helpers(str(tmp_path))
    built = list(tmp_path.glob("helpers_cpp*"))
    assert [p.name for p in built] == [f"helpers_cpp{sysconfig.get_config_var('EXT_SUFFIX')}"]
    spec = importlib.util.spec_from_file_location("helpers_cpp", built[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.answer() == 42


def test_a_checkout_whose_helpers_cannot_be_built_stops_every_rank_with_one_message(tmp_path, monkeypatch, capsys):
    """Checked on every rank before Megatron's rank-0-only build: no pybind11 in this interpreter,
    or no compiler, is one message naming the way out, and exit status 2."""
    import importlib.util as util

    real = util.find_spec
    monkeypatch.setattr(util, "find_spec", lambda name, *a: None if name == "pybind11" else real(name, *a))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as stop:
        bootstrap._check_helpers_build(str(tmp_path))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"the dataset helpers of the Megatron checkout at {tmp_path} are not built" in err
    assert f"{sys.executable} -m pip install pybind11" in err
    monkeypatch.setattr(util, "find_spec", real)
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(SystemExit):
        bootstrap._check_helpers_build(str(tmp_path))
    assert "no no-such-compiler on PATH" in capsys.readouterr().err


# -- the launcher (megatron_mesh.megatron.launch, scripts/pretrain_gpt.sh, scripts/run_megatron_script.sh) --
CONFIG = os.path.join(ROOT, "configs", "gpt_tiny_cpu.yaml")


def _script(*argv: str, timeout: float = 60, **env: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of one of the shell scripts, run under a timeout."""
    full_env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", **env)
    run = subprocess.run(["bash", *argv], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    return run.returncode, run.stdout, run.stderr


def test_launch_scripts_print_their_usage_on_help():
    for script, first in ((PRETRAIN, "Pretrain a GPT with Megatron's training loop"),
                          (RUN_SCRIPT, "Run any Megatron training script")):
        for flag in ("-h", "--help"):
            rc, out, err = _script(script, flag)
            assert rc == 0 and err == "", (script, flag, err)
            assert out.startswith(first) and "CP_COMM_TYPE" in out and "No such file" not in out, out
        rc, out, err = _script(script)  # nothing given: the usage on stderr, status 2
        assert rc == 2 and out == "" and err.startswith(first)


@pytest.mark.parametrize("script, env, words", [
    # a Megatron script that is not there: before torchrun starts
    ((RUN_SCRIPT, "/nonexistent/pretrain_gpt.py", CONFIG), {}, ["script: no such file: /nonexistent/pretrain_gpt.py"]),
    # world sizes Megatron would refuse after every rank had imported it
    ((PRETRAIN, CONFIG), {"NPROC": "3", "CP": "2"}, ["world size NPROC x NNODES = 3 x 1 = 3 is not a multiple of CP = 2",
                                                     "make NPROC x NNODES a multiple of 2"]),
    ((RUN_SCRIPT, MEGATRON_LM_SCRIPT, CONFIG), {"NPROC": "2", "CP": "4"}, ["= 2 x 1 = 2 is not a multiple of CP = 4"]),
    ((PRETRAIN, CONFIG), {"CP": "four"}, ["CP (--context-parallel-size) must be a positive integer, got 'four'"]),
    # torchrun settings it could not start with: a NODE_RANK past the nodes waited silently for ever
    ((PRETRAIN, CONFIG), {"CP": "2", "NNODES": "2", "NODE_RANK": "2"},
     ["NODE_RANK must be an integer in 0..1 (NNODES=2), got '2': the job would wait for ever"]),
    ((PRETRAIN, CONFIG), {"NPROC": "0", "CP": "1"},
     ["NPROC (processes on this node) must be an integer >= 1 or one of auto, cpu, gpu, xpu, got '0'"]),
    ((PRETRAIN, CONFIG), {"NNODES": "0"}, ["NNODES must be an integer >= 1 (or MIN:MAX, "]),
    ((PRETRAIN, CONFIG), {"MASTER_PORT": "99999"}, ["MASTER_PORT must be a TCP port 1..65535, got '99999'"]),
    ((PRETRAIN, CONFIG), {"CP": "2", "NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "no-such-host.invalid"},
     ["MASTER_ADDR 'no-such-host.invalid' does not resolve", "set it to the address of the machine with NODE_RANK=0"]),
    ((PRETRAIN, CONFIG, "--tensor-model-parallel-size", "2"), {"NPROC": "2", "CP": "2", "NNODES": "1"},
     ["= 2 x 1 = 2 is not a multiple of TP x CP = 2 x 2 = 4 (--tensor-model-parallel-size, --context-parallel-size)"]),
])
def test_launcher_refuses_a_bad_command_line_in_one_line_before_torchrun(script, env, words):
    rc, out, err = _script(*script, **env)
    assert rc == 2 and out == "", (rc, out, err)
    assert len(err.splitlines()) == 1 and err.startswith("megatron_mesh.megatron.launch: error: "), err
    assert "torchrun" not in err  # nothing was started
    for w in words:
        assert w in err, (w, err)


def test_launcher_checks_the_world_size_against_tp_pp_cp_from_the_flags():
    from megatron_mesh.megatron.launch import training_command

    def command(nproc, *flags, **env):
        return training_command("pretrain", [CONFIG, *flags], {"NPROC": str(nproc), "PATH": os.environ["PATH"], **env})

    # fits: 2 nodes x 2 = CP 4; TP 2 x PP 2 x CP 2 in 8 processes (data parallel 1); 4 = CP 2 x data parallel 2
    command(2, NNODES="2", CP="4")
    command(8, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size=2", CP="2")
    command(4, CP="2")
    command("gpu", CP="3")  # torchrun's own counts are left to torchrun
    with pytest.raises(ValueError, match=r"= 4 x 1 = 4 is not a multiple of PP x CP = 2 x 4 = 8 "
                                         r"\(--pipeline-model-parallel-size, --context-parallel-size\)"):
        command(4, "--pipeline-model-parallel-size", "2", CP="4")
    with pytest.raises(ValueError, match=r"= 4 x 1 = 4 is not a multiple of CP = 8"):  # the last flag wins
        command(4, "--context-parallel-size", "8", CP="2")


def test_launcher_checks_torchruns_settings(tmp_path):
    """Each value torchrun could not start with is named; its own words for NPROC and elastic NNODES pass."""
    from megatron_mesh.megatron.launch import training_command

    def command(**env):
        return training_command("pretrain", [CONFIG], {"PATH": os.environ["PATH"], **env})

    command(NPROC="gpu", CP="3")
    command(NPROC="2", NNODES="1:4", NODE_RANK="3")  # elastic: up to 4 nodes
    command(NPROC="2", NNODES="2", NODE_RANK="1", MASTER_PORT="65535")
    for env, words in (({"NPROC": "abc"}, "NPROC (processes on this node) must be an integer >= 1 or one of "),
                       ({"NNODES": "2:1"}, "NNODES must be an integer >= 1 (or MIN:MAX, 1 <= MIN <= MAX"),
                       ({"NNODES": "x"}, "NNODES must be"), ({"NODE_RANK": "-1"}, "NODE_RANK must be an integer in 0..0"),
                       ({"NNODES": "1:4", "NODE_RANK": "4"}, "NODE_RANK must be an integer in 0..3 (NNODES=1:4)"),
                       ({"MASTER_PORT": "0"}, "MASTER_PORT must be a TCP port 1..65535, got '0'"),
                       ({"MASTER_PORT": "http"}, "MASTER_PORT must be")):
        with pytest.raises(ValueError) as e:
            command(**env)
        assert str(e.value).startswith(words), (env, str(e.value))
    # a ${VAR} set nowhere: the config that says it is named
    config = tmp_path / "c.yaml"
    config.write_text("MODEL_ARGS:\n  --seed: ${MEGATRON_MESH_TEST_UNSET}\n")
    with pytest.raises(ValueError) as e:
        training_command("pretrain", [str(config)], {"PATH": os.environ["PATH"]})
    assert str(e.value) == f"{config}: --seed: ${{MEGATRON_MESH_TEST_UNSET}} is not set (export it or add it to ENV_VARS)"


def test_node_0_warns_where_master_addr_is_another_machine():
    """A second machine given NODE_RANK=0 (a copied command line) hosts a store of its own and waits
    with the real node 0 for the other nodes until torchrun's timeout: node 0 says so where
    MASTER_ADDR is not one of its addresses. A warning, as an address routed here (a Kubernetes
    service's) works; the other nodes and an elastic job have nothing to check."""
    from megatron_mesh.megatron.launch_nodes import master_addr_warning

    for here in ("127.0.0.1", "localhost", socket.gethostname(), "0.0.0.0"):
        assert master_addr_warning({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": here}) is None, here
    warning = master_addr_warning({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "192.0.2.1"})  # TEST-NET-1
    assert warning.startswith("MASTER_ADDR 192.0.2.1 is not an address of this machine, yet NODE_RANK=0 (NNODES=2) "
                              "hosts the job's store: if 192.0.2.1 is another machine, give this one its own NODE_RANK"), warning
    assert master_addr_warning({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "192.0.2.1"}) is None
    assert master_addr_warning({"NNODES": "1:4", "NODE_RANK": "0", "MASTER_ADDR": "192.0.2.1"}) is None


def test_a_taken_master_port_is_one_line():
    """A second job on a machine, MASTER_PORT left at the first's: torchrun's store cannot listen
    there -- one line naming the port, status 2, instead of torchrun's 45-line traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc, out, err = _script(PRETRAIN, CONFIG, "--train-iters", "1", CP="1", MASTER_PORT=str(port))
    assert rc == 2 and "Traceback" not in err, (rc, err[-3000:])
    assert err.splitlines()[-1] == (f"megatron_mesh.megatron.launch: error: MASTER_PORT {port} on 127.0.0.1 is in use "
                                    "(another job, or another launcher on this machine with NODE_RANK=0: each node "
                                    "needs its own NODE_RANK): set MASTER_PORT to a free port"), err[-3000:]


def test_ctrl_c_while_a_node_waits_for_the_others_stops_it_at_once():
    """Node 1 of 2 started, node 0 never: it waits at torchrun's rendezvous, in C++ loops that retry
    an interrupted call -- Ctrl-C did nothing there, or printed C++ frames and went on waiting (stop
    79). Now one line within seconds, status 130, and no process left."""
    import signal
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free, and nobody listens: node 0 never comes
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", CP="2", NPROC="1", NNODES="2", NODE_RANK="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    proc = subprocess.Popen(["bash", PRETRAIN, CONFIG, "--train-iters", "1"], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        for line in proc.stderr:  # the launcher's line: torchrun starts now, and waits for node 0
            if "process(es) per node x 2 node(s)" in line:
                break
        time.sleep(3)
        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the terminal: the whole foreground group
        try:
            _, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail("Ctrl-C did not stop a node waiting for the others within 20 s")
        rc = proc.returncode
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert rc == 130 and time.monotonic() - start < 10, (rc, err[-3000:])
    assert err.strip().splitlines()[-1] == ("megatron_mesh.megatron.launch: interrupted (SIGINT) while waiting for the "
                                            "other nodes (torchrun's rendezvous): no rank had started"), err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def test_launcher_refuses_a_world_size_before_it_imports_torch():
    """The launcher refuses NPROC x NNODES against TP x PP x CP, and CP=four, before it finds the
    backend (whether CUDA is there: torch's import, 1.5 s on 2 cores); the error comes at once."""
    code = textwrap.dedent(f"""
        import sys
        from megatron_mesh.megatron.launch import training_command
        for env in ({{"NPROC": "3", "CP": "2"}}, {{"CP": "four"}}):
            try:
                training_command("pretrain", [{CONFIG!r}], env)
            except ValueError as e:
                print(e)
            else:
                raise SystemExit("not refused: " + repr(env))
        print("torch imported" if "torch" in sys.modules else "torch not imported")
    """)
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "world size NPROC x NNODES = 3 x 1 = 3 is not a multiple of CP = 2 (--context-parallel-size); "
        "make NPROC x NNODES a multiple of 2",
        "CP (--context-parallel-size) must be a positive integer, got 'four'", "torch not imported"], run.stdout


def test_launcher_passes_the_backend_once():
    """The config names --distributed-backend gloo and the launcher names the backend too: the
    command carries one, the one that wins by the documented order (config < launcher < flags)."""
    from megatron_mesh.megatron.launch import training_command

    def backends(entry, args, **env):
        argv, _ = training_command(entry, args, {"PATH": os.environ["PATH"], **env})
        return [argv[i + 1] for i, a in enumerate(argv) if a == "--distributed-backend"]

    assert backends("pretrain", [CONFIG], CP="2") == ["nccl" if torch_cuda() else "gloo"]
    assert backends("pretrain", [CONFIG], BACKEND="nccl") == ["nccl"]
    assert backends("pretrain", [CONFIG, "--distributed-backend", "gloo"], BACKEND="nccl") == ["gloo"]
    assert backends("script", [MEGATRON_LM_SCRIPT, CONFIG], BACKEND="nccl") == ["gloo"]  # the config's; nothing added
    assert backends("script", [MEGATRON_LM_SCRIPT, CONFIG], BACKEND="gloo") == ["gloo"]


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_launcher_returns_the_ranks_exit_status_when_they_agree():
    """Once a rank fails torchrun stops the others with SIGTERM: those do not count. The plugin's
    start-up error exits every rank that gets there with 2, so the launcher returns 2."""
    from types import SimpleNamespace

    from megatron_mesh.megatron.launch import _failure_status

    def status(*codes):
        return _failure_status(SimpleNamespace(failures={r: SimpleNamespace(exitcode=c) for r, c in enumerate(codes)}))

    assert status(2, -15, -15, -15) == 2
    assert status(2, 2) == 2
    assert status(1, -15) == 1
    assert status(2, 1) == 1  # they differ
    assert status(-9, -15) == 137  # one rank killed (kill -9, out of memory), the others stopped: as a shell says it
    assert status(-9, -6) == 1  # killed by different signals


def test_launcher_keeps_only_torchrun_lines_that_say_something_new():
    """torchrun's lines after a start-up error (its rank printed the one line, status 2) or a
    signal are dropped; a rank that failed otherwise is still named."""
    import logging

    from megatron_mesh.megatron.launch import _QuietShutdown

    keep = _QuietShutdown().filter

    def record(msg, *args):
        return logging.LogRecord("torch.distributed.elastic.multiprocessing.api", logging.ERROR, "api.py", 1, msg,
                                 args, None)

    assert not keep(record(_QuietShutdown.SENDING, 123, "SIGTERM"))
    assert not keep(record(_QuietShutdown.RECEIVED, "SIGINT"))
    assert not keep(record(_QuietShutdown.FAILED, 2, 0, 123, "python"))
    assert keep(record(_QuietShutdown.FAILED, 1, 0, 123, "python"))  # a crash: which rank, with its traceback
    assert keep(record(_QuietShutdown.FAILED, -9, 1, 124, "python"))  # killed (out of memory?)
    assert keep(record("Starting elastic_operator with launch configs:"))


def test_launcher_tells_other_nodes_of_a_rank_killed_by_a_signal(monkeypatch):
    """A rank killed outright (SIGKILL: kill -9, the OOM killer) cannot tell the other nodes; its
    launcher does, from torchrun's report (the three-node job in test_megatron_pretrain_masks.py
    runs it). Not SIGTERM (torchrun stopping the other ranks), SIGINT, or a rank that exited by
    itself (it told them); not in a job of one node or an elastic one."""
    import logging

    from megatron_mesh.megatron import launch, launch_nodes

    told = []
    monkeypatch.setattr(launch_nodes, "tell_other_nodes_from_launcher", lambda message, **job: told.append((message, job)))
    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    before = list(logger.handlers)
    try:
        launch_nodes.tell_other_nodes_of_a_killed_rank(["--nproc-per-node", "4", "--nnodes", "1", "--node-rank", "0",
                                                         "--master-addr", "h", "--master-port", "29500", "-m", "x"])
        launch_nodes.tell_other_nodes_of_a_killed_rank(["--nproc-per-node", "4", "--nnodes", "1:4", "--node-rank", "0",
                                                         "--master-addr", "h", "--master-port", "29500", "-m", "x"])
        launch_nodes.tell_other_nodes_of_a_killed_rank(["--nproc-per-node", "4", "--nnodes", "3", "--max-restarts", "1",
                                                         "--master-addr", "h", "--master-port", "29500", "-m", "x"])
        assert logger.handlers == before
        launch_nodes.tell_other_nodes_of_a_killed_rank(["--nproc-per-node", "4", "--nnodes", "3", "--node-rank", "2",
                                                         "--master-addr", "h", "--master-port", "29500", "-m", "x"])
        (handler,) = [h for h in logger.handlers if h not in before]
    finally:
        for h in logger.handlers[:]:
            if h not in before:
                logger.removeHandler(h)

    def report(code, local_rank=1):
        handler.handle(logging.LogRecord(logger.name, logging.ERROR, "api.py", 1, launch_nodes.TORCHRUN_FAILED,
                                         (code, local_rank, 123, "python"), None))

    for code in (1, 2, -15, -2):
        report(code)
    assert told == []
    report(-9, 3)
    assert told == [("rank 11 (local rank 3) was killed by signal SIGKILL (kill -9, or the kernel's OOM killer)",
                     dict(node=2, nodes=3, local=4, addr="h", port=29500, run_id="none"))]
    report(-11)
    assert told[-1][0] == "rank 9 (local rank 1) was killed by signal SIGSEGV"


def test_cpu_runs_hide_megatrons_warnings_about_gpu_libraries(monkeypatch):
    """Megatron warns at import that TE / Apex / absl are missing (ten warnings a process): CPU runs
    hide exactly those, unless the user asked for warnings (-W / PYTHONWARNINGS)."""
    import sys
    import warnings

    from megatron_mesh.megatron import cpu_compat

    def shown(message):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("default")
            cpu_compat._quiet_missing_library_warnings.__wrapped__()
            warnings.warn(message, UserWarning)
            warnings.warn("something else", UserWarning)
        return [str(w.message) for w in got]

    monkeypatch.setattr(sys, "warnoptions", [])
    for message in ("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
                    "Apex is not installed. Falling back to Torch Norm",
                    "absl.logging is not installed. Using logging.getLogger(__name__) instead.",
                    "Only transformer-engine>=1.7.0 supports MoE experts, but your version is 0.0.0. Use local"):
        assert shown(message) == ["something else"], message
    monkeypatch.setattr(sys, "warnoptions", ["default"])
    assert shown("Apex is not installed. Falling back to Torch Norm") == [
        "Apex is not installed. Falling back to Torch Norm", "something else"]


_INTERRUPT = textwrap.dedent("""
    import os, signal, sys, time
    os.environ["TORCHELASTIC_RUN_ID"] = "test"
    os.environ["MEGATRON_MESH_LAUNCHER_PID"] = str(os.getppid())
    from megatron_mesh.megatron import bootstrap
    bootstrap.quiet_interrupt()
    child = os.fork()
    if child == 0:  # a forked child (a data-loader worker) keeps Python's KeyboardInterrupt
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            os._exit(7)
        os._exit(0)
    assert os.WEXITSTATUS(os.waitpid(child, 0)[1]) == 7
    print("ready", flush=True)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    finally:
        print("unwound", flush=True)  # finally blocks run, as with KeyboardInterrupt
""")


def _ctrl_c_as_in_a_terminal():
    """A child's SIGINT as a terminal's, also where the tests run with it ignored (a job a shell
    without job control put in the background: children inherit the ignore, and Python then
    never raises KeyboardInterrupt)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_rank_of_the_launcher_exits_130_on_ctrl_c_without_a_traceback():
    run = subprocess.run([sys.executable, "-c", _INTERRUPT], capture_output=True, text=True, timeout=60,
                         preexec_fn=_ctrl_c_as_in_a_terminal)
    assert run.returncode == 130 and run.stdout.split() == ["ready", "unwound"], (run.returncode, run.stdout, run.stderr)
    assert run.stderr == ""
    # outside the launcher Ctrl-C stays KeyboardInterrupt
    plain = _INTERRUPT.replace('os.environ["MEGATRON_MESH_LAUNCHER_PID"] = str(os.getppid())', "")
    run = subprocess.run([sys.executable, "-c", plain], capture_output=True, text=True, timeout=60,
                         preexec_fn=_ctrl_c_as_in_a_terminal)
    assert run.returncode != 130 and "KeyboardInterrupt" in run.stderr


_INTERRUPT_IN_DEL = textwrap.dedent("""
    import os, signal, time
    os.environ["TORCHELASTIC_RUN_ID"] = "test"
    os.environ["MEGATRON_MESH_LAUNCHER_PID"] = str(os.getppid())
    from megatron_mesh.megatron import bootstrap
    bootstrap.quiet_interrupt()

    class Finalised:
        def __del__(self):  # the handler runs here, where its exit cannot be raised
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)

    try:
        Finalised()
        print("after the finaliser", flush=True)
        time.sleep(5)
        print("trained on", flush=True)
    finally:
        print("unwound", flush=True)
""")


def test_ctrl_c_where_python_cannot_raise_still_stops_the_rank_quietly():
    """Ctrl-C inside a finaliser (or logging's at-fork hook while the data loader forks): Python
    prints "Exception ignored in ..." and drops the handler's exit -- the rank trained on until its
    peers were gone, a traceback each. Now the exit comes at the next step: status 130, no output."""
    run = subprocess.run([sys.executable, "-c", _INTERRUPT_IN_DEL], capture_output=True, text=True, timeout=60,
                         preexec_fn=_ctrl_c_as_in_a_terminal)
    assert run.returncode == 130 and "trained on" not in run.stdout and "unwound" in run.stdout, \
        (run.returncode, run.stdout, run.stderr)
    assert run.stderr == "", run.stderr


def test_missing_dataset_files_are_named_at_start_up(tmp_path, monkeypatch):
    """check_data_files (bootstrap.check_args runs it in both entry scripts): a --data-path prefix
    without its .bin / .idx stops the start-up naming them; the document configs' prefix
    (DOC_DATA, data/tiny_docs) gets the command that writes it; mock data is not checked."""
    from types import SimpleNamespace

    from megatron_mesh.megatron import data_checks as checks

    def args(**kw):
        return SimpleNamespace(**{"mock_data": False, "data_path": None, **kw})

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DOC_DATA", raising=False)
    (tmp_path / "a.bin").write_bytes(b"")
    (tmp_path / "a.idx").write_bytes(b"")
    (tmp_path / "b.idx").write_bytes(b"")
    checks.check_data_files(args(data_path=["a"]))
    checks.check_data_files(args(data_path=["0.3", "a", "0.7", str(tmp_path / "a")]))
    checks.check_data_files(args(mock_data=True, data_path=["nowhere"]))
    checks.check_data_files(args())  # no data flags: Megatron's own affair
    # --cp-metrics-dir: a directory, or a path to create; an existing file failed on every rank
    checks.check_data_files(args(cp_metrics_dir=str(tmp_path)))
    checks.check_data_files(args(cp_metrics_dir=str(tmp_path / "new" / "metrics")))
    with pytest.raises(ValueError, match=r"^--cp-metrics-dir .*a\.bin: that is a file, not a directory"):
        checks.check_data_files(args(cp_metrics_dir=str(tmp_path / "a.bin")))
    assert (tmp_path / "new" / "metrics").is_dir()  # made here: every rank would fail to, with a traceback each
    with pytest.raises(ValueError, match=r"^--cp-metrics-dir .*a\.bin/sub: cannot make that directory \(Not a "
                                         r"directory\); name a directory this process may write in$"):
        checks.check_data_files(args(cp_metrics_dir=str(tmp_path / "a.bin" / "sub")))
    with pytest.raises(ValueError) as e:
        checks.check_data_files(args(data_path=["0.5", "a", "0.5", "b"]))
    assert str(e.value) == (f"--data-path 0.5 a 0.5 b: no dataset there, b.bin not found (relative to {tmp_path}); give "
                            "the prefix of an existing Megatron indexed dataset (PREFIX.bin + PREFIX.idx), or --mock-data")
    with pytest.raises(ValueError, match=r"^--valid-data-path /x/y: no dataset there, /x/y\.bin, /x/y\.idx not found; "):
        checks.check_data_files(args(valid_data_path=["/x/y"]))
    with pytest.raises(ValueError, match=r"^--data-args-path list\.txt: no such file$"):
        checks.check_data_files(args(data_args_path="list.txt"))
    (tmp_path / "list.txt").write_text("1 a\n1 c\n")
    with pytest.raises(ValueError, match=r"^--data-args-path list\.txt: no dataset there, c\.bin, c\.idx not found"):
        checks.check_data_files(args(data_args_path="list.txt"))
    # the document configs' data, in a checkout (its .venv and scripts/make_doc_dataset.py)
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "make_doc_dataset.py").write_text("")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").write_text("")
    monkeypatch.setattr(checks, "ROOT", str(tmp_path))
    monkeypatch.setenv("DOC_DATA", "data/tiny_docs")
    with pytest.raises(ValueError) as e:
        checks.check_data_files(args(data_path=["data/tiny_docs"]))
    assert str(e.value) == (f"--data-path data/tiny_docs: no dataset there, data/tiny_docs.bin, data/tiny_docs.idx not "
                            f"found (relative to {tmp_path}); write the documents first: .venv/bin/python "
                            "scripts/make_doc_dataset.py data/tiny_docs (DOC_DATA sets the prefix the document configs "
                            "read)")


_FORKED = textwrap.dedent("""
    import multiprocessing, os, sys, threading, time
    os.environ["TORCHELASTIC_RUN_ID"] = "test"
    os.environ["MEGATRON_MESH_LAUNCHER_PID"] = str(os.getppid())
    from megatron_mesh.megatron import bootstrap
    bootstrap.die_with_parent()
    import torch
    # as pretrain_gpt.start_checkpoint_results_queue starts Megatron's result queue: a forked Manager
    manager = multiprocessing.get_context("fork").Manager()
    # a data-loader worker, as Megatron's loader forks them (torch's default context on Linux)
    loader = iter(torch.utils.data.DataLoader(range(1000), num_workers=1, prefetch_factor=1))
    next(loader)
    # forked from another thread: not tied (the signal fires when the forking thread ends)
    outside = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    thread = threading.Thread(target=outside.start)
    thread.start(); thread.join()
    time.sleep(1)  # the thread has ended: its child lives on
    print(manager._process.pid, loader._workers[0].pid, outside.pid, int(outside.is_alive()), flush=True)
    time.sleep(60)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_ranks_forked_helpers_die_when_it_is_killed():
    """kill -9 of a rank (a torchrun worker after die_with_parent): what it forked from its main
    thread goes at once -- the checkpoint result-queue manager (which outlived it for ever before
    stop 78) and a data-loader worker (which torch's watchdog took 2-20 s to stop, stop 80's review);
    PR_SET_PDEATHSIG is not inherited across fork. A process forked from another thread is not tied
    (it outlives that thread's end, and the rank)."""
    import signal
    import time

    import psutil

    proc = subprocess.Popen([sys.executable, "-c", _FORKED], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    pids = []
    try:
        *pids, alive = map(int, proc.stdout.readline().split())
        manager, worker, outside = pids
        assert alive == 1, "a child of an ended thread was killed with it"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 1.5  # torch's watchdog alone would take longer (it polls every 5 s)
        for pid, name in ((manager, "the forked manager"), (worker, "the data-loader worker")):
            while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                assert time.monotonic() < deadline, f"{name} outlived the killed process"
                time.sleep(0.05)
        assert psutil.pid_exists(outside)
    finally:
        proc.kill()
        for pid in pids:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_missing_index_cache_file_is_one_line_naming_data_cache_path(monkeypatch):
    """A node that cannot read Megatron's dataset index cache (rank 0 writes it beside its own copy
    of the dataset, named after its path) stops with one line saying every node needs the dataset
    at the same path; any other FileNotFoundError is raised as it was. (Two nodes end to end: test_two_nodes_train_as_one_and_refuse_different_flags.)"""
    from megatron_mesh.megatron import errors

    said = []

    def fail(message, **kwargs):
        said.append((message, kwargs))
        raise SystemExit(2)

    monkeypatch.setattr(errors, "fail", fail)
    cache = "/node1/docs/cache/GPTDataset_indices/2655b7c1-GPTDataset-train-document_index.npy"
    with pytest.raises(SystemExit), errors.index_cache_missing_is_one_line():
        raise FileNotFoundError(2, "No such file or directory", cache)
    (message, kwargs), = said
    assert message.startswith(f"no {cache} here: that is Megatron's dataset index cache, which global rank 0 alone "
                              "writes"), message
    # Megatron names the cache's files after the dataset's path: a shared --data-cache-path alone does not do
    assert "give every node the dataset at the same path" in message and kwargs == {"at_once": True}
    for other in ("/data/docs.idx", "/x/cache/GPTDataset_indices/h-GPTDataset-train-document_index.npy.tmp", None):
        with pytest.raises(FileNotFoundError), errors.index_cache_missing_is_one_line():
            raise FileNotFoundError(2, "No such file or directory", other)
    assert len(said) == 1


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_node_waiting_for_the_others_says_so_then_a_signal_stops_it(sig):
    """A node whose peers never come (started with another NNODES or NPROC, refused, or not
    started) waited until torchrun's timeout without a word: while no rank has started it says
    where it waits and what must match, first after WAITING_NOTICE_S, then 4x as long each time;
    Ctrl-C or SIGTERM (which killed it without a word) then stops it with one line, 130 / 143. (The launcher's thread alone, in a small process: the
    launcher around it, end to end: test_ctrl_c_while_a_node_waits_for_the_others_stops_it_at_once.)"""
    import signal
    import time

    from megatron_mesh.megatron.launch_nodes import WAITING_NOTICE_S, waiting_notice

    env = {"NNODES": "2", "NODE_RANK": "1", "NPROC": "2", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500"}
    assert waiting_notice(env, WAITING_NOTICE_S) == (
        "megatron_mesh.megatron.launch: still waiting for the other nodes after 20 s (torchrun's rendezvous at "
        "10.0.0.5:29500; this node: NODE_RANK=1 of NNODES=2, NPROC=2): start every node with the same NNODES and "
        "NPROC and its own NODE_RANK (a node that refused to start says why in its own log); Ctrl-C stops this one")
    code = textwrap.dedent(f"""
        import signal, sys, time
        from megatron_mesh.megatron.launch_nodes import watch_while_waiting_for_the_nodes
        # as in the launcher, whose main thread then sits in C++ loops that never raise it
        signal.signal(signal.SIGINT, lambda *_: None)
        watch_while_waiting_for_the_nodes({env!r}, notice_s=0.25)
        print("ready", flush=True)
        time.sleep(30)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        assert proc.stdout.readline() == "ready\n"
        time.sleep(1.6)  # notices at 0.25 s and 1.25 s; the next at 4.25 s
        proc.send_signal(signal.Signals[sig])
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    lines = err.strip().splitlines()
    assert proc.returncode == 128 + signal.Signals[sig] and len(lines) == 3, (proc.returncode, err)
    # two notices (due 0.25 s and 1.25 s after the start; a loaded machine prints them late, in order)
    waited = [float(line.split(" s (")[0].rsplit("after ", 1)[1]) for line in lines[:2]]
    assert waited == sorted(waited), lines
    assert lines[0].startswith("megatron_mesh.megatron.launch: still waiting for the other nodes after "), lines
    assert lines[2] == (f"megatron_mesh.megatron.launch: interrupted ({sig}) while waiting for the other nodes "
                        "(torchrun's rendezvous): no rank had started"), lines


def test_a_node_gone_without_a_word_is_named_and_not_waited_for(monkeypatch):
    """kill -9 of one node's launcher: nobody tells, and node 0 waited 30 s for that node to read its
    message, then printed a gloo traceback per rank (41 s, status 1: stop 80's review). Each node's
    watcher beats in the store once a poll (_Job.beat): a node that beat and then stopped for
    GONE_AFTER_S is named as gone (_gone_nodes) and not waited for (wait_until_read); where the
    store itself does not answer, node 0 -- whose torchrun held it -- is the one gone."""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from megatron_mesh.megatron import errors

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "gone-test")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "3")
    monkeypatch.setenv("GROUP_RANK", "0")
    job = errors._Job.of_worker()
    nodes = {n: job._replace(node=n) for n in ("1", "2")}
    nodes["2"].beat(server)  # node 2 beat once, then went
    alive = threading.Event()

    def node_1_beats():
        while not alive.is_set():
            nodes["1"].beat(server)
            time.sleep(0.3)
    beating = threading.Thread(target=node_1_beats, daemon=True)
    beating.start()
    try:
        assert errors._gone_nodes() == (["2"], "its watcher stopped")
        server.set(f"{job.key}/read/1", "1")  # node 1 read the message; node 2 never will
        start = time.monotonic()
        job.wait_until_read(server, "0")  # node 0's own failure: up to STORE_NODE_WAIT_S for the others
        assert time.monotonic() - start < errors.GONE_AFTER_S + 2 < errors.STORE_NODE_WAIT_S
    finally:
        alive.set()
        beating.join()
    del server  # node 0 gone, and its store with it
    monkeypatch.setenv("GROUP_RANK", "1")
    assert errors._gone_nodes() == (["0"], "torchrun's store, which it held, with it")

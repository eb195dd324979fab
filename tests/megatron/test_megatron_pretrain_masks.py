"""Masks through Megatron's real pretrain() loop (scripts/pretrain_gpt.sh, gloo, CPU): packed
documents and sliding windows under the plugin modes at CP > 1 log the losses of CP 1 (where a
layer with a window or documents runs the plugin's single-rank attention; tests/megatron/test_megatron_masks.py
checks that one against Megatron's own attention with a dense mask).

Data: documents of mixed lengths (1 to ~150 tokens, ~10 % a lone end-of-document token) written by
scripts/make_doc_dataset.py; samples of 64 tokens, so at CP 4 a rank holds two zigzag halves of 8
tokens and most samples hold documents that cross, start and end inside halves.

* ``--reset-attention-mask`` (EOD documents) on Megatron's global zigzag layout (``--cp-layout
  zigzag``) together with ``--window-size 5,0`` (a window shorter than a half) at CP 4, one layer
  per mode: Mesh with the tile 4x1, TASP, ring, with selective recompute; that run writes a
  checkpoint which resumes under ring at CP 2 on the balanced layout with the same next loss;
* the same documents and window on the balanced layout (``--cp-layout balanced``; ``auto``, the
  default, keeps it under a window) at CP 4 with two samples per
  micro-batch, one layer per mode (mesh, tasp, ring, a2a+mesh with
  ``--hierarchical-context-parallel-sizes 2 2``), through the plugin's entry script (documents from
  EOD tokens) and through Megatron-LM's pretrain_gpt.py run by scripts/run_megatron_script.sh
  (documents from the position ids); the first writes a checkpoint which resumes under the zigzag
  at CP 2 with the same next loss;
* THD packed sequences of mixed lengths (``--cp-thd-packing``, Transformer Engine's CP layout) at
  CP 4 under ring, Mesh ``auto``, TASP and a2a+mesh (``--hierarchical-context-parallel-sizes 2 2``);
* THD at TP 2 x CP 2 under Mesh.

Every CP run logs the losses of its CP 1 run to 1e-5 relative (fp32). ``--megatron-matrix`` adds
each mask alone (window, EOD documents, THD) x each mode (mesh 2x2, mesh auto, tasp, ring) in its
own run (EOD documents also on the zigzag, and through Megatron-LM's script).
"""

import os
import shutil
import signal
import socket
import time

import psutil
import pytest
from helpers import assert_losses_equal, run_ok, MEGATRON_LM_SCRIPT, ROOT, losses, run_all, run_config, run_nodes

pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/setup_env.sh installs it)")

pytestmark = [pytest.mark.megatron, pytest.mark.slow, pytest.mark.timeout(1200)]

ITERS = 3
RTOL = 1e-5
WINDOW = ("--window-size", "5,0")
HCP = ("--hierarchical-context-parallel-sizes", "2", "2")


def config(name: str) -> str:
    return os.path.join(ROOT, "configs", f"gpt_tiny_cpu_{name}.yaml")


def masked_run(doc_data, name: str, nproc: int, cp: int, modes: str, *flags: str) -> tuple[int, str]:
    """One run of ``configs/gpt_tiny_cpu_<name>.yaml``; ``name`` "mlm:docs" runs Megatron-LM's
    pretrain_gpt.py (through scripts/run_megatron_script.sh) on that config instead of ours."""
    script = (MEGATRON_LM_SCRIPT,) if name.startswith("mlm:") else ()
    return run_config(config(name.removeprefix("mlm:")), nproc, cp, modes, "--train-iters", str(ITERS), *flags,
                      script=script, env={"DOC_DATA": doc_data}, timeout=300)


@pytest.fixture(scope="module")
def runs(doc_data, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    balanced_ckpt = str(tmp_path_factory.mktemp("balanced_ckpt"))
    # the balanced layout: one layer per mode, the Ulysses hybrid's U = 2 as the balancing group,
    # the window on every layer, two samples (two layouts) per micro-batch
    balanced = ("mesh tasp ring a2a+mesh", *WINDOW, *HCP, "--micro-batch-size", "2", "--cp-layout", "balanced")
    blend = ("0.5", doc_data, "0.5", doc_data)
    plan = {
        "docs_cp1": ("docs", 1, 1, "mesh", *WINDOW),
        "docs_cp4": ("docs", 4, 4, "mesh tasp ring mesh", *WINDOW, "--mesh-tile-shape", "4x1", "--cp-layout", "zigzag",
                     "--recompute-granularity", "selective", "--save", ckpt, "--save-interval", "2"),
        "docs_resume": ("docs", 2, 2, "ring", *WINDOW, "--load", ckpt, "--ckpt-step", "2"),
        "balanced_cp4": ("docs", 4, 4, *balanced, "--save", balanced_ckpt, "--save-interval", "2"),
        "balanced_resume": ("docs", 2, 2, "mesh", *WINDOW, "--cp-layout", "zigzag", "--load", balanced_ckpt,
                            "--ckpt-step", "2"),
        "mlm_docs_cp1": ("mlm:docs", 1, 1, "mesh", *WINDOW),
        "mlm_balanced_cp4": ("mlm:docs", 4, 4, *balanced),
        # a blend (Megatron's BlendedDataset adds a per-sample dataset_id to the batch), balanced layout
        "blend_cp1": ("docs", 1, 1, "mesh", *WINDOW, "--data-path", *blend),
        "blend_cp4": ("docs", 4, 4, *balanced, "--data-path", *blend),
        "thd_cp1": ("thd", 1, 1, "mesh"),
        "thd_cp4": ("thd", 4, 4, "ring mesh tasp a2a+mesh", *HCP),
        "thd_tp2_cp1": ("thd", 2, 1, "mesh", "--tensor-model-parallel-size", "2"),
        "thd_tp2_cp2": ("thd", 4, 2, "mesh", "--tensor-model-parallel-size", "2"),
    }
    return run_all(lambda *spec: masked_run(doc_data, *spec), plan,
                   together=("docs_cp1", "mlm_docs_cp1", "thd_cp1", "thd_tp2_cp1", "blend_cp1"),
                   then_together=("docs_resume", "balanced_resume"))


def _summary(text: str) -> str:
    summary = [line for line in text.splitlines() if "megatron_mesh: pipeline stage" in line]
    assert len(summary) == 1, summary  # one line, from the first rank of the stage
    return summary[0]


def test_documents_with_window_cp4_match_cp1(runs):
    want = losses(run_ok(runs, "docs_cp1"))
    assert sorted(want) == list(range(1, ITERS + 1))
    text = run_ok(runs, "docs_cp4")
    assert_losses_equal(losses(text), want, rel=RTOL)
    summary = _summary(text)
    for part in ("layer 1: mesh (CP 4, tile 4x1", "layer 2: tasp (CP 4, transport p2p", "layer 3: ring (CP 4",
                 "layer 4: mesh (CP 4, tile 4x1", "window 5,0, documents eod, layout zigzag)"):
        assert part in summary, (part, summary)


def test_two_nodes_train_as_one_and_refuse_different_flags(doc_data, runs, tmp_path):
    """A job over two "nodes" of 2 processes (two launchers on this machine, NNODES 2, as on two
    machines), CP 4 on the balanced layout, one layer per mode: the CP 1 losses, TASP's rings
    and the balanced layout following the nodes (2 CP ranks per node, from torchrun's
    LOCAL_WORLD_SIZE). Then the nodes started with different flags (a tile and a mode, one run):
    every rank stops at start-up, each node's log says why in one line, status 2 -- not ranks
    waiting for each other for ever in the first process group one node creates. And a node that
    stops at start-up by itself stops the other at once, which names it -- so does one whose
    rank crashes during the run (an error of Megatron's own)."""
    flags = ("--train-iters", str(ITERS), *WINDOW, *HCP)
    modes = "mesh tasp ring a2a+mesh"
    done = run_nodes(config("docs"), 2, 4, [(modes, flags), (modes, flags)], env={"DOC_DATA": doc_data}, timeout=300)
    for rc, text in done:
        assert rc == 0, text[-3000:]
    assert_losses_equal(losses(done[1][1]), losses(run_ok(runs, "docs_cp1")), rel=RTOL)  # the last rank logs them
    assert "tasp (CP 4, transport p2p, CP ranks per node 2" in _summary(done[0][1])
    # the nodes started with a different tile and a different mode: one run, both named
    nodes = [("mesh", ("--train-iters", "1", "--mesh-tile-shape", "2x2")),
             ("mesh tasp ring mesh", ("--train-iters", "1", "--mesh-tile-shape", "4x1"))]
    for rc, text in run_nodes(config("docs"), 2, 4, nodes, env={"DOC_DATA": doc_data}, timeout=120):
        assert rc == 2, text[-3000:]
        assert text.count("megatron_mesh: error:") == 1, text[-3000:]
        assert "megatron_mesh: error: the ranks were started with different settings" in text, text[-3000:]
        for want in ("--cp-comm-type: ranks 0-1: mesh, ranks 2-3: mesh tasp ring mesh",
                     "--mesh-tile-shape: ranks 0-1: 2x2, ranks 2-3: 4x1"):
            assert want in text, text[-3000:]
        assert "Traceback" not in text and "iteration        1/" not in text
    # one node without the dataset: it stops at start-up, and the other -- which would wait in its
    # first collective until the distributed timeout (10 min) -- stops within seconds, naming it;
    # also when the node that stops is node 0, whose torchrun holds the store they meet in
    missing = doc_data + "_missing"
    for bad in (1, 0):
        nodes = [("mesh", ("--train-iters", "1") + (("--data-path", missing) if n == bad else ())) for n in (0, 1)]
        done = run_nodes(config("docs"), 2, 4, nodes, env={"DOC_DATA": doc_data}, timeout=60)
        assert [rc for rc, _ in done] == [2, 2], [text[-2000:] for _, text in done]
        ranks = "ranks 2-3" if bad else "ranks 0-1"
        told = done[1 - bad][1]
        assert (f"megatron_mesh: error: node {bad} ({socket.gethostname()}, {ranks}) stopped at start-up: --data-path "
                f"{missing}: no dataset there") in told, told[-3000:]
        assert f"megatron_mesh: error: --data-path {missing}: no dataset there" in done[bad][1], done[bad][1][-3000:]
        assert all("DistStoreError" not in text and "Traceback" not in text for _, text in done)
    # an error of Megatron's own on one node during the run (its --save is a file: the first save
    # fails there; one at start-up: test_three_nodes_all_hear_of_one_that_stops): the failing node's
    # traceback, the other stops at once. (A dataset whose index is garbage no longer gets that far:
    # the ranks compare their datasets' content at start-up, groups.dataset_contents.)
    not_a_dir = os.path.join(str(tmp_path), "a_file")
    open(not_a_dir, "w").close()
    save = ("--train-iters", "1", "--save-interval", "1", "--save")
    nodes = [("mesh", (*save, os.path.join(str(tmp_path), "ckpt"))), ("mesh", (*save, not_a_dir))]
    (rc0, text0), (rc1, text1) = run_nodes(config("docs"), 2, 4, nodes, env={"DOC_DATA": doc_data}, timeout=90)
    assert (rc0, rc1) == (2, 1), (text0[-2000:], text1[-2000:])
    assert (f"megatron_mesh: error: node 1 ({socket.gethostname()}, ranks 2-3) stopped: NotADirectoryError: [Errno 20] "
            f"Not a directory: '{not_a_dir}/iter_0000001' (the traceback is in that node's log)") in text0, text0[-3000:]
    assert "Traceback" not in text0 and "DistStoreError" not in text0, text0[-3000:]
    assert "Traceback" in text1 and "megatron_mesh: error" not in text1, text1[-3000:]
    # node 1's copy of the dataset at another path: Megatron's index cache, which rank 0 writes
    # beside node 0's copy (named after its path), is not there -- one line per node saying so,
    # not a FileNotFoundError traceback per rank
    copy = os.path.join(str(tmp_path), "copy", "docs")
    os.makedirs(os.path.dirname(copy))
    for ext in (".bin", ".idx"):
        shutil.copy(doc_data + ext, copy + ext)
    nodes = [("mesh", ("--train-iters", "1")), ("mesh", ("--train-iters", "1", "--data-path", copy))]
    done = run_nodes(config("docs"), 2, 4, nodes, env={"DOC_DATA": doc_data}, timeout=90)
    assert [rc for rc, _ in done] == [2, 2], [text[-2000:] for _, text in done]
    cache = f"no {os.path.dirname(copy)}/docs/cache/GPTDataset_indices/"
    assert f"megatron_mesh: error: {cache}" in done[1][1] and "Traceback" not in done[1][1], done[1][1][-3000:]
    assert f"megatron_mesh: error: node 1 ({socket.gethostname()}, ranks 2-3) stopped: {cache}" in done[0][1], done[0][1][-3000:]
    assert "give every node the dataset at the same path" in done[1][1]


def test_three_nodes_all_hear_of_one_that_stops(doc_data):
    """Three nodes of one process (data parallel 3): node 1's Megatron stops at start-up; node 0 -- whose
    torchrun holds the store they meet in -- and node 2 both stop within seconds naming it (node 0
    waits until node 2 has read the message before it goes, taking the store with it); so do they
    when a rank of node 1 is killed outright (its launcher tells them)."""
    flags = ("--train-iters", "1", "--global-batch-size", "3")
    nodes = [("mesh", flags), ("mesh", (*flags, "--warmup", "3")), ("mesh", flags)]
    done = run_nodes(config("docs"), 1, 1, nodes, env={"DOC_DATA": doc_data}, timeout=60)
    assert [rc for rc, _ in done] == [2, 1, 2], [text[-2000:] for _, text in done]
    for n in (0, 2):
        assert (f"megatron_mesh: error: node 1 ({socket.gethostname()}, rank 1) stopped at start-up: AssertionError: "
                "--warmup argument is no longer valid") in done[n][1], done[n][1][-3000:]
        assert "Traceback" not in done[n][1], done[n][1][-3000:]
    # a rank killed outright (kill -9, the OOM killer) says nothing: its node's launcher tells --
    # here while the ranks start, when the others would wait in the rendezvous for it
    done = run_nodes(config("docs"), 1, 1, [("mesh", flags)] * 3, env={"DOC_DATA": doc_data}, timeout=60,
                     during=_kill_a_rank_of(1))
    assert [rc for rc, _ in done] == [2, 128 + signal.SIGKILL, 2], [text[-2000:] for _, text in done]
    for n in (0, 2):
        assert (f"megatron_mesh: error: node 1 ({socket.gethostname()}, rank 1) stopped: rank 1 (local rank 0) was "
                "killed by signal SIGKILL (kill -9, or the kernel's OOM killer)") in done[n][1], done[n][1][-3000:]
    # SIGTERM to node 1's launcher alone (a scheduler preempting one node, a user's kill): the others
    # printed a gloo traceback per rank and exited 1; now its launcher tells them once torchrun has
    # stopped its ranks, and theirs, whose peer went away, wait for that word (errors.PEER_LOST_WAIT_S)
    long = ("--train-iters", "500", "--global-batch-size", "3")
    done = run_nodes(config("docs"), 1, 1, [("mesh", long)] * 3, env={"DOC_DATA": doc_data}, timeout=90,
                     during=_sigterm_the_launcher_of(1, after_s=8))
    assert [rc for rc, _ in done] == [2, 128 + signal.SIGTERM, 2], [text[-2000:] for _, text in done]
    assert "megatron_mesh.megatron.launch: interrupted (SIGTERM): stopped torchrun and its 1 rank(s) on this node" \
        in done[1][1], done[1][1][-3000:]
    for n in (0, 2):
        assert (f"megatron_mesh: error: node 1 ({socket.gethostname()}, rank 1) stopped: interrupted (SIGTERM to its "
                "launcher)") in done[n][1], done[n][1][-3000:]
        assert "Traceback" not in done[n][1], done[n][1][-3000:]


def _sigterm_the_launcher_of(node: int, after_s: float):
    """For run_nodes(during=...): SIGTERM to ``node``'s launcher ``after_s`` seconds after it started a rank."""
    def term(procs) -> None:
        launcher = psutil.Process(procs[node].pid)  # the script execs the launcher, which runs torchrun
        deadline = time.monotonic() + 60
        def ranks():
            for child in launcher.children():
                try:
                    yield "megatron_mesh.megatron.pretrain_gpt" in " ".join(child.cmdline())
                except psutil.NoSuchProcess:
                    pass

        while not any(ranks()):
            if time.monotonic() > deadline:
                pytest.fail(f"node {node}'s launcher started no rank in 60 s")
            time.sleep(0.05)
        time.sleep(after_s)
        launcher.terminate()
    return term


def _kill_a_rank_of(node: int):
    """For run_nodes(during=...): SIGKILL the first rank of ``node`` as soon as its launcher has
    started it."""
    def kill(procs) -> None:
        launcher = psutil.Process(procs[node].pid)  # the script execs the launcher, which runs torchrun
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for child in launcher.children():
                try:
                    if "megatron_mesh.megatron.pretrain_gpt" in " ".join(child.cmdline()):
                        child.kill()
                        return
                except psutil.NoSuchProcess:  # a process that was already gone
                    pass
            time.sleep(0.05)
        pytest.fail(f"node {node}'s launcher started no rank in 30 s")
    return kill


def test_a_blended_dataset_cp4_matches_cp1(runs):
    """A blended --data-path: Megatron's BlendedDataset adds dataset_id (one value per sample) to
    each batch, and splitting it as a sequence stopped every rank of any blend at CP > 1 with an
    IndexError, on the zigzag and the balanced layout, under both entry scripts (stop 80's review)."""
    assert_losses_equal(losses(run_ok(runs, "blend_cp4")), losses(run_ok(runs, "blend_cp1")), rel=RTOL)


def test_checkpoint_under_zigzag_resumes_under_balanced(runs):
    want = losses(run_ok(runs, "docs_cp1"))
    text = run_ok(runs, "docs_resume")
    assert_losses_equal(losses(text), want, iterations=[3], rel=RTOL)
    assert "layers 1-4: ring (CP 2, zigzag ring, kernel auto, window 5,0, documents eod, layout auto)" in text


@pytest.mark.parametrize("entry, cp1, cp4, documents", [
    ("megatron_mesh", "docs_cp1", "balanced_cp4", "eod"),
    ("Megatron-LM", "mlm_docs_cp1", "mlm_balanced_cp4", "positions"),  # position ids: --reset-position-ids
])
def test_balanced_layout_cp4_matches_cp1(runs, entry, cp1, cp4, documents):
    """The balanced layout through both entry scripts: each sample of a micro-batch
    of two split by its own layout, RoPE at the layout's positions, Mesh / TASP / ring / a2a+mesh
    layers on it -- the losses of CP 1."""
    want = losses(run_ok(runs, cp1))
    assert sorted(want) == list(range(1, ITERS + 1))
    assert_losses_equal(losses(run_ok(runs, cp4)), want, rel=RTOL)
    summary = _summary(run_ok(runs, cp4))
    for part in ("layer 1: mesh (CP 4", "layer 2: tasp (CP 4", "layer 3: ring (CP 4", "layer 4: a2a+mesh (CP 4"):
        assert part in summary, (part, summary)
    assert summary.count(f"window 5,0, documents {documents}, layout balanced)") == 4, summary
    # the next micro-batch's layouts and plans were built on the background thread (batch_layout.Lookahead)
    assert "and this rank's plans of them" in run_ok(runs, cp4) and "were built ahead of its step" in run_ok(runs, cp4)


def test_both_entry_scripts_train_alike_on_documents(runs):
    """Megatron-LM's script (documents from its position ids) and ours (from EOD tokens) at CP 1."""
    assert_losses_equal(losses(run_ok(runs, "mlm_docs_cp1")), losses(run_ok(runs, "docs_cp1")), rel=RTOL)


def test_checkpoint_under_balanced_resumes_under_zigzag(runs):
    want = losses(run_ok(runs, "docs_cp1"))
    text = run_ok(runs, "balanced_resume")
    assert_losses_equal(losses(text), want, iterations=[3], rel=RTOL)
    assert "documents eod, layout zigzag)" in _summary(text)


def test_thd_packed_sequences_cp4_match_cp1(runs):
    want = losses(run_ok(runs, "thd_cp1"))
    assert sorted(want) == list(range(1, ITERS + 1))
    text = run_ok(runs, "thd_cp4")
    assert_losses_equal(losses(text), want, rel=RTOL)
    for line in ("layer 1: ring (CP 4", "layer 2: mesh (CP 4, tile ", "layer 3: tasp (CP 4",
                 "layer 4: a2a+mesh (CP 4"):
        assert line in text, (line, text[-3000:])


def test_thd_tp2_cp2_matches_tp2_cp1(runs):
    assert_losses_equal(losses(run_ok(runs, "thd_tp2_cp2")), losses(run_ok(runs, "thd_tp2_cp1")), rel=RTOL)


# -- opt-in: each mask alone x each mode ----------------------------------------------------------------
# (config, flags, flags of the CP 4 run only)
MASKS = {"window": ("window", WINDOW, ()), "docs": ("docs", (), ()),
         "docs-zigzag": ("docs", (), ("--cp-layout", "zigzag")), "docs-megatron-lm": ("mlm:docs", (), ()),
         "thd": ("thd", (), ())}
MODES = {"mesh-2x2": ("mesh", "--mesh-tile-shape", "2x2"), "mesh-auto": ("mesh",), "tasp": ("tasp",),
         "ring": ("ring",)}
_REFERENCES: dict = {}


@pytest.mark.megatron_matrix
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_matrix_each_mask_each_mode_cp4_matches_cp1(doc_data, mask, mode):
    name, flags, cp_flags = MASKS[mask]
    if mask not in _REFERENCES:
        rc, text = masked_run(doc_data, name, 1, 1, "mesh", *flags)
        assert rc == 0, text[-6000:]
        _REFERENCES[mask] = losses(text)
    cp_mode, *mode_flags = MODES[mode]
    rc, text = masked_run(doc_data, name, 4, 4, cp_mode, *flags, *cp_flags, *mode_flags)
    assert rc == 0, text[-6000:]
    assert_losses_equal(losses(text), _REFERENCES[mask], rel=RTOL)
    assert f"layers 1-4: {cp_mode} (CP 4" in text

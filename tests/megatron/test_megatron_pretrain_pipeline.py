"""Packed documents with pipeline parallelism through Megatron's real pretrain() loop (gloo, CPU,
fp32): every pipeline stage's layers run each micro-batch on its documents and its CP layout
(megatron_mesh/megatron/pipeline.py) -- a middle stage, which Megatron gives no batch, too
(Megatron-Bridge #2952: documents contaminated each other in the middle stages).

configs/gpt_tiny_cpu_docs.yaml (EOD documents of 1 to ~150 tokens, samples of 64), two
micro-batches per step (1F1B: stage 0 runs micro-batch 1's forward before micro-batch 0's backward,
so a recomputed layer runs micro-batch 0's forward again after micro-batch 1's):

* through the plugin's entry script, one layer per mode, on a virtual pipeline (two model chunks
  of one layer per stage: stage 1 runs layers 1 and 3, and each chunk's forward and backward
  steps interleave with the other's): PP 2 x CP 2 (mesh, tasp, ring, mesh) on Megatron's zigzag
  with full recompute, and PP 2 x CP 4 (a2a+mesh with --hierarchical-context-parallel-sizes 2 2,
  tasp, ring, a2a+mesh; 8 processes) on the balanced layout with selective recompute, log the
  PP 2 x CP 1 losses (the same virtual pipeline: it initialises the layers in another order);
* PP 3 x CP 2 with 3 layers (ring, mesh, tasp: Mesh in the middle stage) on the balanced layout
  with selective recompute through Megatron-LM's pretrain_gpt.py run by
  scripts/run_megatron_script.sh (documents from the position ids; its get_batch gives the middle
  stage nothing at all) logs the PP 3 x CP 1 losses;
* THD packing (configs/gpt_tiny_cpu_thd.yaml) at PP 3 x CP 2 (tasp, ring, mesh) with full recompute
  through the plugin's entry script (whose middle stage hands its layers the shared documents as
  packed_seq_params) logs PP 3 x CP 1's.

Before the stages made each step's own micro-batch current (megatron_mesh/megatron/pipeline.py) a
virtual pipeline stopped at its first step, and a recomputed layer on the balanced layout found
another micro-batch's layout current and stopped (on the zigzag it would have read that
micro-batch's documents); both were refused at start-up.

All to 1e-5 relative. (The entry script's EOD documents on the balanced layout at PP 3 x CP 2 take
the paths of these two middle stages together: left out for time.) Before the stages shared the
documents these runs stopped at start-up ("the document boundaries reach only the first and last
pipeline stages' batches"), and without that check they crash (a middle stage's layers have no
documents); a middle stage that runs another micro-batch's documents moves the losses by ~2e-3.
"""

import os

import pytest
from helpers import MEGATRON_LM_SCRIPT, ROOT, assert_losses_equal, losses, run_all, run_config, run_ok

pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/setup_env.sh installs it)")

pytestmark = [pytest.mark.megatron, pytest.mark.slow, pytest.mark.timeout(900)]

ITERS = 3
RTOL = 1e-5
PP2 = ("--pipeline-model-parallel-size", "2")
PP3 = ("--pipeline-model-parallel-size", "3", "--num-layers", "3")  # one layer per stage
PP2_MODES = "mesh tasp ring mesh"
HYBRID_MODES = "a2a+mesh tasp ring a2a+mesh"
HCP = ("--hierarchical-context-parallel-sizes", "2", "2")
PP3_MODES = "ring mesh tasp"
VPP = ("--num-layers-per-virtual-pipeline-stage", "1")  # PP 2 with 4 layers: two model chunks per stage
FULL = ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")
SELECTIVE = ("--recompute-granularity", "selective")
THD_MODES = "tasp ring mesh"


def config(name: str) -> str:
    return os.path.join(ROOT, "configs", f"gpt_tiny_cpu_{name}.yaml")


@pytest.fixture(scope="module")
def runs(doc_data):
    def run(name, script, nproc, cp, modes, *flags):
        return run_config(config(name), nproc, cp, modes, "--train-iters", str(ITERS), *flags, script=script,
                          env={"DOC_DATA": doc_data}, timeout=300)

    mlm = (MEGATRON_LM_SCRIPT,)
    plan = {
        "pp2_cp1": ("docs", (), 2, 1, "mesh", *PP2, *VPP),
        "pp3_cp1": ("docs", (), 3, 1, "mesh", *PP3),
        "thd_pp3_cp1": ("thd", (), 3, 1, "mesh", *PP3),
        "pp2_zigzag_cp2": ("docs", (), 4, 2, PP2_MODES, *PP2, *VPP, *FULL, "--cp-layout", "zigzag"),
        "pp2_balanced_cp4": ("docs", (), 8, 4, HYBRID_MODES, *PP2, *VPP, *SELECTIVE, *HCP, "--cp-layout", "balanced"),
        "mlm_pp3_balanced_cp2": ("docs", mlm, 6, 2, PP3_MODES, *PP3, *SELECTIVE, "--cp-layout", "balanced"),
        "thd_pp3_cp2": ("thd", (), 6, 2, THD_MODES, *PP3, *FULL),
    }
    return run_all(lambda *spec: run(*spec), plan, together=("pp2_cp1", "pp3_cp1", "thd_pp3_cp1"))


def _stages(text: str) -> list[str]:
    """The summary line of each pipeline stage, in stage order."""
    lines = [line.split("megatron_mesh: ", 1)[1] for line in text.splitlines() if "megatron_mesh: pipeline stage" in line]
    return sorted(set(lines))


@pytest.mark.parametrize("name, reference, modes, tail", [
    ("pp2_zigzag_cp2", "pp2_cp1", PP2_MODES, "documents eod, layout zigzag)"),
    ("pp2_balanced_cp4", "pp2_cp1", HYBRID_MODES, "documents eod, layout balanced)"),
    ("mlm_pp3_balanced_cp2", "pp3_cp1", PP3_MODES, "documents positions, layout balanced)"),
    ("thd_pp3_cp2", "thd_pp3_cp1", THD_MODES, "documents thd)"),
])
def test_documents_with_pipeline_match_cp1(runs, name, reference, modes, tail):
    want = losses(run_ok(runs, reference))
    assert sorted(want) == list(range(1, ITERS + 1))
    text = run_ok(runs, name)
    assert_losses_equal(losses(text), want, rel=RTOL)
    stages = _stages(text)
    pp, cp = (3, 2) if "pp3" in name else (2, int(name[-1]))
    assert len(stages) == pp, stages  # one line per stage: every stage ran its plugin layers
    per_chunk = 1 if "pp2" in name else len(modes.split()) // pp  # layers of a model chunk (virtual stage)
    for i, mode in enumerate(modes.split()):
        at = i // per_chunk % pp  # the stages take the chunks in turn: PP 2's stage 1 runs layers 1 and 3
        stage = stages[at]
        assert stage.startswith(f"pipeline stage {at + 1}/{pp}: "), stages
        part = f"layer {i + 1}: {mode} (CP {cp}"
        assert part in stage, (part, stage)
        assert tail in stage.split(part, 1)[1].split("; layer")[0], (tail, stage)

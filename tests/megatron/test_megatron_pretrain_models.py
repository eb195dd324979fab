"""Today's models' attention through Megatron's real pretrain() loop, gloo on CPU, fp32.

gpt-oss-style layers (configs/gpt_oss_tiny_cpu.yaml:
learnable attention sinks, a 5-token window on layers 1 and 3 alternating with full attention on
layers 2 and 4, GQA, documents cut at end-of-document tokens), gloo on CPU, fp32:

* CP 4 on Megatron's zigzag, one layer per mode (mesh, tasp, ring, a2a+mesh with
  ``--hierarchical-context-parallel-sizes 2 2``), through the plugin's entry script, saving a
  checkpoint at iterations 2 and 3;
* CP 4 on the balanced layout, the modes in another order (so each mode runs a window layer in one
  run and a full layer in the other), through the plugin's entry script and through Megatron-LM's
  pretrain_gpt.py run by scripts/run_megatron_script.sh (documents from its position ids);
* the zigzag run's iteration-2 checkpoint resumed at CP 2 under ring on the balanced layout.

Each logs the CP 1 losses to 1e-5 relative; the learnable sinks (Megatron's ``softmax_offset``,
its checkpoint entry) after three steps equal CP 1's -- which they would not if a CP rank's share of
their gradient missed Megatron's gradient reduction over the data-parallel x CP group
(tests/megatron/test_megatron_sinks.py compares the gradients themselves).

DeepSeek-style layers (configs/deepseek_tiny_cpu.yaml: multi-latent attention, query/key head dim
24, value head dim 12, YaRN, EOD documents), one layer per mode, as the gpt-oss runs:

* CP 4 on Megatron's zigzag (mesh, tasp, ring, a2a+mesh) through the plugin's entry script;
* CP 4 on the balanced layout (tasp, mesh, a2a+mesh, ring), where MLA rotates each token at its
  global position, through the plugin's entry script (saving a checkpoint at iteration 2) and
  Megatron-LM's pretrain_gpt.py;
* the balanced run's iteration-2 checkpoint resumed at CP 2 under ring on the zigzag through
  Megatron-LM's pretrain_gpt.py;
* CP 4 on THD packed sequences (``--cp-thd-packing``; ring, mesh, tasp, a2a+mesh).

Each logs the CP 1 losses to 1e-5 relative.

Llama-4-style layers (configs/llama4_tiny_cpu.yaml: chunked attention, chunks of 12 tokens from each
document's start, on layers 1-3 and global attention on layer 4 without RoPE, EOD documents): CP 4
on the default layout (``--cp-layout auto``: per sample the balanced layout of the layers' summed
work, or the zigzag), one layer per mode, logs the CP 1 losses (the plugin's single-rank attention
with the same chunks) to 1e-5 relative.
"""

import glob
import os

import pytest
from helpers import MEGATRON_LM_SCRIPT, ROOT, assert_losses_equal, losses, run_all, run_config, run_ok

pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/setup_env.sh installs it)")

pytestmark = [pytest.mark.megatron, pytest.mark.slow, pytest.mark.timeout(900)]

ITERS = 3
RTOL = 1e-5
CONFIG = os.path.join(ROOT, "configs", "gpt_oss_tiny_cpu.yaml")
MLA_CONFIG = os.path.join(ROOT, "configs", "deepseek_tiny_cpu.yaml")
LLAMA4_CONFIG = os.path.join(ROOT, "configs", "llama4_tiny_cpu.yaml")
HCP = ("--hierarchical-context-parallel-sizes", "2", "2")
ZIGZAG_MODES = "mesh tasp ring a2a+mesh"
BALANCED_MODES = "tasp mesh a2a+mesh ring"
THD_MODES = "ring mesh tasp a2a+mesh"
MLA_THD = ("--cp-thd-packing", "--cp-thd-pad-multiple", "8", "--calculate-per-token-loss")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {name: str(tmp_path_factory.mktemp(name)) for name in ("cp1", "zigzag", "mla_balanced")}


@pytest.fixture(scope="module")
def runs(doc_data, ckpts):
    def run(config, script, nproc, cp, modes, *flags):
        return run_config(config, nproc, cp, modes, "--train-iters", str(ITERS), *flags, script=script,
                          env={"DOC_DATA": doc_data}, timeout=300)

    mlm = (MEGATRON_LM_SCRIPT,)

    plan = {
        "cp1": (CONFIG, (), 1, 1, "mesh", "--save", ckpts["cp1"], "--save-interval", str(ITERS)),
        "zigzag_cp4": (CONFIG, (), 4, 4, ZIGZAG_MODES, *HCP, "--cp-layout", "zigzag", "--save", ckpts["zigzag"],
                       "--save-interval", "2"),
        "balanced_cp4": (CONFIG, (), 4, 4, BALANCED_MODES, *HCP, "--cp-layout", "balanced"),
        "mlm_balanced_cp4": (CONFIG, mlm, 4, 4, BALANCED_MODES, *HCP, "--cp-layout", "balanced"),
        "resume_cp2": (CONFIG, (), 2, 2, "ring", "--cp-layout", "balanced", "--load", ckpts["zigzag"], "--ckpt-step", "2"),
        "mla_cp1": (MLA_CONFIG, (), 1, 1, "mesh"),
        "mla_zigzag_cp4": (MLA_CONFIG, (), 4, 4, ZIGZAG_MODES, *HCP, "--cp-layout", "zigzag"),
        "mla_balanced_cp4": (MLA_CONFIG, (), 4, 4, BALANCED_MODES, *HCP, "--cp-layout", "balanced", "--save",
                             ckpts["mla_balanced"], "--save-interval", "2"),
        "mlm_mla_balanced_cp4": (MLA_CONFIG, mlm, 4, 4, BALANCED_MODES, *HCP, "--cp-layout", "balanced"),
        # THD packed sequences (Megatron pads MLA's values to the query head dim for them): the
        # padding multiple fixed, and the loss per token, so that both CP sizes train alike
        "mla_thd_cp1": (MLA_CONFIG, (), 1, 1, "mesh", *MLA_THD),
        "mla_thd_cp4": (MLA_CONFIG, (), 4, 4, THD_MODES, *HCP, *MLA_THD),
        # Mesh's owners layout needs long documents: these samples have none
        "mla_owners_cp2": (MLA_CONFIG, (), 2, 2, "mesh", "--cp-layout", "owners"),
        "llama4_cp1": (LLAMA4_CONFIG, (), 1, 1, "mesh"),
        "llama4_cp4": (LLAMA4_CONFIG, (), 4, 4, ZIGZAG_MODES, *HCP),
        # Megatron-LM's script on the zigzag, resuming the balanced run's checkpoint
        "mlm_mla_resume_cp2": (MLA_CONFIG, mlm, 2, 2, "ring", "--cp-layout", "zigzag", "--load",
                               ckpts["mla_balanced"], "--ckpt-step", "2"),
    }
    return run_all(lambda *spec: run(*spec), plan, together=("cp1", "mla_cp1", "mla_thd_cp1", "llama4_cp1"),
                   then_together=("resume_cp2", "mlm_mla_resume_cp2", "mla_owners_cp2"))


def _summary(text: str) -> str:
    summary = [line for line in text.splitlines() if "megatron_mesh: pipeline stage" in line]
    assert len(summary) == 1, summary
    return summary[0]


def _matches_cp1(runs, baseline: str, name: str) -> str:
    """Run ``name`` logs its CP 1 ``baseline``'s losses (every iteration, to RTOL); its stage summary."""
    want = losses(run_ok(runs, baseline))
    assert sorted(want) == list(range(1, ITERS + 1))
    assert_losses_equal(losses(run_ok(runs, name)), want, rel=RTOL)
    return _summary(run_ok(runs, name))


@pytest.mark.parametrize("name, modes, layout, documents", [
    ("zigzag_cp4", ZIGZAG_MODES, "zigzag", "eod"),
    ("balanced_cp4", BALANCED_MODES, "balanced", "eod"),
    ("mlm_balanced_cp4", BALANCED_MODES, "balanced", "positions"),  # Megatron-LM's script: from the position ids
])
def test_gpt_oss_layers_cp4_match_cp1(runs, name, modes, layout, documents):
    summary = _matches_cp1(runs, "cp1", name)
    for i, mode in enumerate(modes.split(), 1):
        window = ", window 5,0" if i % 2 else ""  # --window-attn-skip-freq 2: layers 2 and 4 are full
        part = f"layer {i}: {mode} (CP 4"
        assert part in summary, (part, summary)
        tail = f"sinks learnable{window}, documents {documents}, layout {layout})"
        assert tail in summary.split(part, 1)[1].split("; layer")[0], (tail, summary)


def _sinks(ckpt_dir: str, tmp_path) -> dict:
    """{checkpoint key: tensor} of the sinks in the last checkpoint of ``ckpt_dir`` (Megatron's
    torch_dist format, read back into one state dict)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    (last,) = sorted(glob.glob(os.path.join(ckpt_dir, "iter_0000003")))
    out = str(tmp_path / f"{os.path.basename(ckpt_dir)}.pt")
    dcp_to_torch_save(last, out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if k.endswith("softmax_offset")}


def test_learnable_sinks_and_their_gradients_equal_cp1(runs, ckpts, tmp_path):
    """Megatron's checkpoint entries of the sinks (one [layers, heads] tensor, as its own module
    writes it) after three steps of Adam at CP 4 (four plugin modes) equal CP 1's: the parameter,
    and Adam's moments -- exp_avg is a running mean of the reduced gradients themselves (scale
    included), exp_avg_sq of their squares."""
    import torch

    run_ok(runs, "cp1"), run_ok(runs, "zigzag_cp4")
    want, got = _sinks(ckpts["cp1"], tmp_path), _sinks(ckpts["zigzag"], tmp_path)
    key = "decoder.layers.self_attention.core_attention.softmax_offset"
    assert sorted(want) == [key, f"optimizer.state.exp_avg.{key}", f"optimizer.state.exp_avg_sq.{key}"], list(want)
    assert sorted(got) == sorted(want)
    for name in want:
        assert want[name].shape == (4, 4)  # 4 layers x 4 heads
        assert want[name].abs().min() > 0, name  # every head trained
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=RTOL * want[name].abs().max().item(), msg=name)


def test_checkpoint_resumes_at_cp2_under_another_mode_and_layout(runs):
    text = run_ok(runs, "resume_cp2")
    assert_losses_equal(losses(text), losses(run_ok(runs, "cp1")), iterations=[3], rel=RTOL)
    assert "layers 1-4: ring (CP 2" in text or "layer 1: ring (CP 2" in text, text[-3000:]
    assert "sinks learnable, window 5,0, documents eod, layout balanced)" in _summary(text)


@pytest.mark.parametrize("name, modes, layout, documents", [
    ("mla_zigzag_cp4", ZIGZAG_MODES, "zigzag", "eod"),
    ("mla_balanced_cp4", BALANCED_MODES, "balanced", "eod"),
    ("mlm_mla_balanced_cp4", BALANCED_MODES, "balanced", "positions"),  # Megatron-LM's script: from the position ids
])
def test_mla_with_yarn_cp4_matches_cp1(runs, name, modes, layout, documents):
    summary = _matches_cp1(runs, "mla_cp1", name)
    for i, mode in enumerate(modes.split(), 1):
        assert f"layer {i}: {mode} (CP 4" in summary, summary
    assert summary.count(f"documents {documents}, layout {layout})") == 4, summary


def test_mla_checkpoint_resumes_at_cp2_under_another_mode_layout_and_script(runs):
    """The balanced CP 4 run's checkpoint through Megatron-LM's script at CP 2, ring, on the zigzag."""
    text = run_ok(runs, "mlm_mla_resume_cp2")
    assert_losses_equal(losses(text), losses(run_ok(runs, "mla_cp1")), iterations=[3], rel=RTOL)
    assert "layers 1-4: ring (CP 2" in text or "layer 1: ring (CP 2" in text, text[-3000:]
    assert _summary(text).count("documents positions, layout zigzag)") >= 1, _summary(text)


def test_mla_on_thd_packed_sequences_cp4_matches_cp1(runs):
    """MLA with --cp-thd-packing: Megatron pads the values to the query head dim for THD and cuts
    the padding per head from the core attention's [t, heads x dim] output -- a [t, 1, heads x
    dim] one lost every head but the first, and the output projection raised a shape error at CP 1
    and CP > 1 alike (stop 81's review)."""
    summary = _matches_cp1(runs, "mla_thd_cp1", "mla_thd_cp4")
    for i, mode in enumerate(THD_MODES.split(), 1):
        assert f"layer {i}: {mode} (CP 4" in summary, summary
    assert summary.count("documents thd)") == 4, summary


def test_llama4_chunked_layers_cp4_match_cp1(runs):
    """Llama 4's chunked layers (--attention-chunk-size 12 on the RoPE layers 1-3, --no-rope-freq 4:
    layer 4 global) under four modes on the default layout equal the plugin's single-rank
    attention at CP 1 with the same chunks; the stage summary names the chunks on exactly those
    layers, at both CP sizes."""
    summary = _matches_cp1(runs, "llama4_cp1", "llama4_cp4")
    for i, mode in enumerate(ZIGZAG_MODES.split(), 1):
        part = f"layer {i}: {mode} (CP 4"
        assert part in summary, (part, summary)
        assert ("chunks of 12" in summary.split(part, 1)[1].split("; layer")[0]) == (i < 4), (i, summary)
    assert "layers 1-3: single-rank attention (CP 1, kernel auto, chunks of 12, documents eod); layer 4: " \
           "single-rank attention (CP 1, kernel auto, documents eod)" in _summary(run_ok(runs, "llama4_cp1"))


def test_a_sample_the_owners_layout_cannot_lay_out_stops_the_run_in_one_line(runs):
    """--cp-layout owners on samples without a long document passes start-up (other samples could
    have one) and stops at the first such sample: one line per node naming the sample and the
    layouts that lay out every one, status 2 -- not a traceback per rank (stop 81's review)."""
    rc, text = runs["mla_owners_cp2"]
    assert rc == 2, text[-3000:]
    assert text.count("megatron_mesh: error: --cp-layout owners: no layout of a sample of ") == 1, text[-3000:]
    assert "--cp-layout balanced lays out every sample" in text and "Traceback" not in text, text[-3000:]

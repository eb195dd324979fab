#!/usr/bin/env bash
# The main job: the same long-context pretraining (Megatron's real pretrain() loop) under each CP
# mode -- CP=1 baseline, ring, mesh (auto and an explicit tile), tasp, plus Transformer Engine's
# modes when TE is installed -- and a side-by-side report (Markdown, CSV, PNG plots) of loss,
# time per iteration, attention bytes per rank per step and peak memory, the planner's bytes next
# to the measured ones and its prediction for real models on GPUs (--predict CONFIG.yaml; default
# Llama-3-8B, gpt-oss-20b and DeepSeek-V3's attention at 128K: configs/*_128k_cp16.yaml). Sets up
# .venv first. Extra arguments go to scripts/compare_cp_modes.py (e.g. --cp 8 --iters 10 --modes
# ring mesh:2x4; --long for the long-context preset: 8192 tokens, documents under both CP layouts
# and a window, ~15 min on 2 cores;
# --config configs/gpt_oss_tiny_cpu.yaml or configs/deepseek_tiny_cpu.yaml for the gpt-oss- and
# DeepSeek-style layers, docs/megatron.md "Masks").
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHON=.venv/bin/python
exec .venv/bin/python scripts/compare_cp_modes.py "$@"

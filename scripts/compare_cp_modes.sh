#!/usr/bin/env bash
# The main job: the same long-context pretraining (Megatron's real pretrain() loop) under each CP
# mode -- CP=1 baseline, ring, mesh (auto and an explicit tile), tasp, plus Transformer Engine's
# modes when TE is installed -- and a side-by-side report (Markdown, CSV, PNG plots) of loss,
# time per iteration, attention bytes per rank per step and peak memory. Sets up .venv first.
# Extra arguments go to scripts/compare_cp_modes.py (e.g. --cp 8 --iters 10 --modes ring mesh:2x4).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHON=.venv/bin/python
exec .venv/bin/python scripts/compare_cp_modes.py "$@"

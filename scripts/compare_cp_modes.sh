#!/usr/bin/env bash
# The main job: compare CP attention modes side by side on this machine (sets up .venv first).
# Extra arguments go to scripts/compare_attention.py.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python scripts/compare_attention.py "$@"

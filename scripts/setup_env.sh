#!/usr/bin/env bash
# Create or refresh the project's virtual environment (.venv) with everything megatron_mesh and its
# tests need. Idempotent: does nothing when pyproject.toml and this script are unchanged since the
# last successful run. Used by scripts/test.sh and scripts/compare_cp_modes.sh.
#
# Environment: PYTHON (interpreter, default python3.11), VENV (default .venv),
#              TORCH_SPEC (default torch==2.13.0: the CPU wheel on this machine's local disk; an
#              unpinned torch would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
stamp="$VENV/.megatron_mesh_setup"
want="$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-16) $TORCH_SPEC"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi
echo "setting up $VENV (one-time, a few minutes) ..." >&2
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" "$TORCH_SPEC"
# pybind11: a Megatron-LM checkout's dataset helpers are built with it at start-up (the wheel ships them built)
"${PIP[@]}" "numpy<2.5" einops packaging pyyaml psutil typing_extensions pytest pytest-timeout pytest-xdist hypothesis \
  matplotlib pybind11
# megatron-core 0.19.2 declares Python >= 3.12 but runs on 3.11; `import megatron.core` needs triton
# (a CPU-importable wheel). See docs/megatron.md.
"${PIP[@]}" "triton==3.8.0"
"${PIP[@]}" --no-deps --ignore-requires-python "megatron-core==0.19.2"
"${PIP[@]}" --no-deps -e .
echo "$want" > "$stamp"

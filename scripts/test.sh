#!/usr/bin/env bash
# Run the whole test suite on CPU (sets up .venv first). Extra arguments go to pytest.
#
# TEST_PYTHON=python3 scripts/test.sh -m gpu: use that interpreter as it is -- no .venv, the
# checkout on PYTHONPATH -- e.g. on a GPU machine whose own torch has CUDA and which cannot build
# the .venv (no network, no CPU torch wheel). Tests whose packages it lacks skip (megatron-core).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
workers=${TEST_WORKERS:-2}
if ! [[ "$workers" =~ ^[0-9]+$ ]]; then
  echo "scripts/test.sh: TEST_WORKERS must be a whole number of pytest-xdist workers (0: one process), got '$workers'" >&2
  exit 2
fi
if [ -n "${TEST_PYTHON:-}" ]; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  exec "$TEST_PYTHON" -m pytest -q -ra "$@"  # no paths given: pyproject.toml's testpaths (tests)
fi
scripts/setup_env.sh
# The tests start ~150 Python processes (ranks, training runs); where PYTHONDONTWRITEBYTECODE is set
# (as on this project's machines) each would compile the package's sources again: compile them once.
# (only a speed-up: a file it cannot compile or write is left to pytest to report)
.venv/bin/python -m compileall -q megatron_mesh tests scripts > /dev/null || true
# Two pytest-xdist workers (TEST_WORKERS; 0: none): one runs the tests that start several processes
# (they use both cores), the other the single-process tests beside them (tests/conftest.py)
xdist=()
[ "$workers" = 0 ] || xdist=(-n "$workers")
exec .venv/bin/python -m pytest -q -ra "${xdist[@]}" "$@"

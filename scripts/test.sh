#!/usr/bin/env bash
# Run the whole test suite on CPU (sets up .venv first). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -q -ra tests "$@"

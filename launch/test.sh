#!/usr/bin/env bash
# Install everything (first run) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
source launch/process_group.sh
run_group python -m pytest -q -p no:cacheprovider tests "$@"

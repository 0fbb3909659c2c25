#!/usr/bin/env bash
# Install everything (first run) and run the whole test suite, on two pytest-xdist workers (tests/conftest.py
# keeps each module on one). Extra arguments go to pytest (`-n 0` runs it in this process).
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
source launch/process_group.sh
run_group python -m pytest -q -p no:cacheprovider -n 2 tests "$@"

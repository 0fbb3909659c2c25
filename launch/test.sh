#!/usr/bin/env bash
# Install everything (first run) and run the whole test suite, on two pytest-xdist workers (tests/conftest.py
# keeps each module on one). Extra arguments go to pytest (`-n 0` runs it in this process). A worker that dies
# (killed for memory, a segfault) ends the run naming its test: xdist would otherwise rerun that test on a new
# worker after every crash.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
source launch/process_group.sh
run_group python -m pytest -q -p no:cacheprovider -n 2 --max-worker-restart=0 tests "$@"

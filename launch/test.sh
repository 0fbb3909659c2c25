#!/usr/bin/env bash
# Install everything (first run) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
python -m pytest -q -p no:cacheprovider tests "$@"

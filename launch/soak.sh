#!/usr/bin/env bash
# The soak test (tests/multiprocess/test_soak.py, outside the default suite): 2,000 steps at 2 ranks on both transports
# with a checkpoint every 500 steps and a resume from the middle, against stock ZeRO-2; prints each rank's
# peak RSS at step 200 and step 2,000.  bash launch/soak.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
source launch/process_group.sh
run_group python -m pytest -q -p no:cacheprovider -m soak -s tests/multiprocess/test_soak.py "$@"

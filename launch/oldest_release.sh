#!/usr/bin/env bash
# The quick tier against the oldest supported DeepSpeed (0.16.0, in its own venv .venv-ds0.16.0 with
# torch 2.13.0, made on first use): the import check, the equivalence cases against its stock ZeRO and
# the checkpoint round trips (tests/multiprocess/test_versions.py). Run it before a change lands (CI does not: its time).
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
python -m tests.helpers.venvs ds0.16.0
python -m tests.helpers.venvs --build ds0.16.0
python -m pytest -q -p no:cacheprovider -m versions -k "0.16.0" tests/multiprocess/test_versions.py "$@"

#!/usr/bin/env bash
# DeepSpeed's own unit tests as the conformance bar: each test file of a DeepSpeed source tree (at the installed
# release's tag; docs/testing.md says how to get it) runs stock, then with ds_tensorshard forced on for every ZeRO
# stage 1/2 engine, and one table per file says how the tests that pass stock fare with the plugin.
# usage: bash launch/deepspeed_tests.sh DEEPSPEED_SRC [FILE ...] [--resume] [--out DIR] [--ranks N] [--modes ...]
#        (FILEs relative to DEEPSPEED_SRC/tests, e.g. unit/v1/zero/test_zero.py; --help for the rest)
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
exec python -m tests.helpers.deepspeed_suite.run "$@"

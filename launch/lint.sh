#!/usr/bin/env bash
# Style and types, as CI checks them before the tests: ruff (lint + format) over the repository, mypy over
# ds_tensorshard/ (configured in pyproject.toml). `ruff check --fix . && ruff format .` repairs most findings.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
ruff check .
ruff format --check .
mypy

#!/usr/bin/env bash
# The newest torch ds_tensorshard supports, 2.15.0 (a CUDA build, which runs on the CPU too), in a venv of its own
# (.venv-torch2.15, made on first use: about 3.5 GB of downloads; pip's site configuration is set aside, its
# constraints cap torch at an older release), with the newest DeepSpeed the range admits: the unit tier, the
# equivalence and fidelity tests, and the emulated-CUDA tier (-m cuda_emulated). The oldest supported torch, 2.13.0,
# is the default suite's (launch/test.sh). Extra arguments go to pytest. Time: docs/testing.md.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_CONFIG_FILE=/dev/null VENV=.venv-torch2.15 TORCH_SPEC=torch==2.15.0
source launch/setup_env.sh
source launch/process_group.sh
python -c "import torch; assert torch.__version__.startswith('2.15.0'), torch.__version__; print('torch', torch.__version__)"
run_group python -m pytest -q -p no:cacheprovider -n 2 --max-worker-restart=0 tests/unit \
    tests/multiprocess/test_equivalence.py tests/multiprocess/test_fidelity.py tests/multiprocess/test_cuda_emulated.py \
    "$@"

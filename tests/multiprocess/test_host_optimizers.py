"""ZeRO-Offload with DeepSpeed's CPU Adagrad and Lion (``tests/unit/test_config.py`` has AdamW's DeepSpeedCPUAdam).

These run in the test process, as the unit tests do, but each needs a DeepSpeed op that the install does not build
(``launch/setup_env.sh`` builds FusedAdam, DeepSpeedCPUAdam and the shared-memory all-reduce) and that no other test
loads: a JIT build of about a minute each on 2 cores. So they stay out of the fast tier (``-m "not multiprocess"``,
which an empty ``TORCH_EXTENSIONS_DIR`` would otherwise make build both) and run with ``-m extended``.
"""

import pytest

from tests.unit.test_config import assert_stocks_cpu_optimizer_steps_on_host_masters

pytestmark = [pytest.mark.usefixtures("single_rank_world"), pytest.mark.extended]


@pytest.mark.parametrize(
    "optimizer,inner",
    [
        ({"type": "Adagrad", "params": {"lr": 1e-2}}, "DeepSpeedCPUAdagrad"),
        ({"type": "Lion", "params": {"lr": 1e-4}}, "DeepSpeedCPULion"),
    ],
    ids=["adagrad", "lion"],
)
def test_offload_runs_stocks_cpu_optimizer_on_host_masters(optimizer, inner):
    assert_stocks_cpu_optimizer_steps_on_host_masters(optimizer, inner)

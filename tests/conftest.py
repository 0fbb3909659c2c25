import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def single_rank_world():
    """torch.distributed in the test process itself: one gloo rank."""
    import deepspeed
    from ranks import free_port

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    deepspeed.init_distributed(dist_backend="gloo")


# The fast tier is `pytest -m "not multiprocess"`: every test that starts other processes (ranks, launchers,
# the command line) is marked, because its module only does that, because it uses a fixture that launches
# ranks, because it belongs to a longer tier, or by its own decorator.
MULTIPROCESS_MODULES = {
    "test_bench",
    "test_equivalence",
    "test_many",
    "test_module_runner",
    "test_mpi",
    "test_optimizers",
    "test_reliability",
    "test_scale",
    "test_soak",
    "test_launchers",
    "test_frameworks",
    "test_versions",
    "test_gpu",
    "test_progress",
}
LAUNCHING_FIXTURES = {
    "runs",
    "tp",
    "tp_checkpoints",
    "pipeline",
    "ulysses",
    "features",
    "trained",
    "world",
    "many",
    "mpi_world",
    "scaled",
    "split_checkpoints",
    "stock",
}
LONGER_TIERS = {"scale", "soak", "launchers", "versions", "frameworks", "gpu"}


def pytest_collection_modifyitems(items):
    for item in items:
        if (
            item.module.__name__ in MULTIPROCESS_MODULES
            or LAUNCHING_FIXTURES & set(item.fixturenames)
            or LONGER_TIERS & {mark.name for mark in item.iter_markers()}
        ):
            item.add_marker(pytest.mark.multiprocess)

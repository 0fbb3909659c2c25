import os
import runpy
import sys
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# every process the tests start probes the CPU once for all (tests/site/sitecustomize.py says why)
SITE = os.path.join(HERE, "site")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SITE, os.environ.get("PYTHONPATH")) if p)
os.environ.setdefault("DS_TENSORSHARD_TEST_CPUINFO", os.path.join(tempfile.mkdtemp(prefix="ts-tests-"), "cpuinfo.json"))
runpy.run_path(os.path.join(SITE, "sitecustomize.py"))  # and this process

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
LONGER_TIERS = {"scale", "extended", "soak", "launchers", "versions", "frameworks", "gpu"}


def pytest_collection_modifyitems(items):
    for item in items:
        if (
            item.module.__name__ in MULTIPROCESS_MODULES
            or LAUNCHING_FIXTURES & set(item.fixturenames)
            or LONGER_TIERS & {mark.name for mark in item.iter_markers()}
        ):
            item.add_marker(pytest.mark.multiprocess)

import os
import runpy
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# every process the tests start probes the CPU once for all (tests/helpers/site/sitecustomize.py says why) and
# imports the tests package (tests.helpers, tests.workers) from the repository
SITE = os.path.join(ROOT, "tests", "helpers", "site")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SITE, ROOT, os.environ.get("PYTHONPATH")) if p)
os.environ.setdefault("DS_TENSORSHARD_TEST_CPUINFO", os.path.join(tempfile.mkdtemp(prefix="ts-tests-"), "cpuinfo.json"))
runpy.run_path(os.path.join(SITE, "sitecustomize.py"))  # and this process

import pytest  # noqa: E402  (after the environment every test process inherits)


@pytest.fixture(autouse=True)
def no_shared_memory_left():
    """After each test, DeepSpeed's /dev/shm segments of the test's launches are removed (ranks/launch_segments)."""
    yield
    from tests.helpers.ranks import remove_launch_segments

    remove_launch_segments()


@pytest.fixture(autouse=True)
def no_stopped_builds_lock_left():
    """After each test, the JIT build lock that a build the test stopped left (its ranks killed midway) is removed,
    as the next ``import ds_tensorshard`` would (ds_tensorshard.build_locks): a later test's run that does not
    import the plugin would otherwise wait on it forever."""
    yield
    from ds_tensorshard.build_locks import remove_stopped_and_say

    remove_stopped_and_say()


@pytest.fixture(scope="session")
def single_rank_world():
    """torch.distributed in the test process itself: one gloo rank."""
    import deepspeed

    from tests.helpers.ranks import free_port

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    deepspeed.init_distributed(dist_backend="gloo")


@pytest.fixture(scope="session")
def equivalence_runs(tmp_path_factory):
    """``runs(n)``: every case of the equivalence worker (fp32/bf16/fp16 x stock/ds_tensorshard x stages 1
    and 2, the stripes and flat cases; at 2 ranks also its ZeRO-Offload pairs) at ``n`` ranks, run once per session for
    all the tests that compare against them; returns ``load(case, rank)``."""
    import torch

    from tests.helpers import WORKERS
    from tests.helpers.ranks import run_ranks
    from tests.workers.equivalence_worker import CASES, FLAT_CASES, OFFLOAD_CASES, STRIPE_CASES

    loaders = {}

    def runs(n: int):
        if n not in loaders:
            out = tmp_path_factory.mktemp(f"eq{n}")
            offload = OFFLOAD_CASES if n == 2 else []  # ZeRO-Offload's default pairs: at 2 ranks, where it is exact
            cases = [*CASES, *STRIPE_CASES, *FLAT_CASES, *offload]
            run_ranks([os.path.join(WORKERS, "equivalence_worker.py"), str(out), *cases], n)
            loaders[n] = lambda case, rank: torch.load(out / f"{case.replace(':', '_')}.rank{rank}.pt")
        return loaders[n]

    return runs


@pytest.fixture
def engine(single_rank_world):
    """``engine(**model_args)``: a ds_tensorshard ZeRO-2 engine of TinyGPT in this process."""
    from tests.helpers.one_rank import make_engine

    return lambda **model_args: make_engine(**model_args)


@pytest.fixture(scope="module")
def laid_out_for_two(single_rank_world, tmp_path_factory):
    """A ds_tensorshard checkpoint laid out for two ranks, made in this process (tests.helpers.one_rank)."""
    from tests.helpers.one_rank import lay_out_for_two

    return lay_out_for_two(tmp_path_factory.mktemp("two"))


@pytest.fixture
def saved(single_rank_world, tmp_path):
    """A ds_tensorshard ZeRO-2 checkpoint (tag ``t``) saved by one rank in this process."""
    from tests.helpers.one_rank import make_engine, train_and_save

    train_and_save(make_engine(), tmp_path / "ckpt")
    return tmp_path / "ckpt"


# The fast tier is `pytest -m "not multiprocess"`: tests/multiprocess/ holds every test that starts other
# processes (ranks, launchers, the command line) or needs a DeepSpeed op that launch/setup_env.sh does not build
# (test_host_optimizers.py), tests/unit/ the in-process ones, which JIT-build nothing.
# launch/test.sh runs two pytest-xdist workers (`-n 2`): a test module runs whole on one of them, so that its
# module fixtures run once, and test_mpi with test_equivalence, whose session runs it shares.
SHARED_WORKER = {"tests/multiprocess/test_mpi.py": "tests/multiprocess/test_equivalence.py"}


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: pytest runs without pytest-xdist too (-n 0)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadFileScheduling

    class ByModule(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return SHARED_WORKER.get(module, module)

    return ByModule(config, log)


def pytest_collection_modifyitems(items):
    for item in items:
        if "multiprocess" in item.path.parts:
            item.add_marker(pytest.mark.multiprocess)
    items.sort(key=lambda item: "multiprocess" not in item.path.parts)  # the long modules first, the quick to fill in

"""Every Python process of a DeepSpeed-suite run imports this at start-up (``launch/deepspeed_tests.sh`` puts this
folder first on ``PYTHONPATH``): the pytest process and every rank that DeepSpeed's ``DistributedTest`` starts
(forked from a forkserver, or spawned). DeepSpeed's files are not changed. It

- shares one py-cpuinfo probe of the CPU between the processes, as the project's own tests do
  (``tests/helpers/site/sitecustomize.py``);
- once ``deepspeed`` has been imported, runs :func:`tests.helpers.deepspeed_suite.events.instrument` for the run's
  mode (``DS_TENSORSHARD_SUITE_MODE``): in the plugin run that imports ds_tensorshard, so with ``DS_TENSORSHARD=1``
  every ZeRO stage 1/2 engine of every rank is ds_tensorshard's; in both runs it records what each engine was built
  with.
"""

import importlib.abc
import os
import sys


class _AfterDeepSpeed(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``deepspeed`` through the other finders and instruments it once its ``__init__`` has run."""

    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed":
            return None
        sys.meta_path.remove(self)  # once
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                self._loader = spec.loader
                spec.loader = self
                return spec
        return None

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        from tests.helpers.deepspeed_suite.events import instrument

        instrument(os.environ["DS_TENSORSHARD_SUITE_MODE"])


if os.environ.get("DS_TENSORSHARD_TEST_CPUINFO"):
    import tests.helpers.site.sitecustomize  # noqa: F401  (shares the probe)
if os.environ.get("DS_TENSORSHARD_SUITE_MODE") in ("stock", "plugin"):
    sys.meta_path.insert(0, _AfterDeepSpeed())

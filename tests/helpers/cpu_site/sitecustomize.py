"""Test-only, for the framework tests on CPU ranks (tests/multiprocess/test_frameworks.py puts this folder on
PYTHONPATH, so every Python process of a run imports it at startup). It lifts exactly two "CUDA only" checks, and
nothing else, once the module that holds each is imported:

- Accelerate (used by HF Trainer too): ``PartialState._prepare_backend`` finds no device accelerator on a
  CPU-only machine and returns no backend, unless ``cpu=True``, and ``cpu=True`` rules DeepSpeed out. With
  DeepSpeed requested (``ACCELERATE_USE_DEEPSPEED``) and launched ranks (``LOCAL_RANK``), it returns gloo /
  MULTI_CPU here, what Accelerate itself picks for CPU ranks.
- Lightning: ``DeepSpeedStrategy.setup_environment`` raises "only supported on CUDA GPUs" for a CPU
  accelerator; here it goes on to the parent's ``setup_environment`` (the real path on GPUs:
  launch/gpu_check.sh).
"""

import importlib.abc
import importlib.util
import os
import sys


def _patch_accelerate(state) -> None:
    original = state.PartialState._prepare_backend

    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        chosen, kind = original(self, cpu, sagemaker_dp, backend)
        deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        if (
            chosen is None
            and kind == state.DistributedType.NO
            and deepspeed
            and not cpu
            and int(os.environ.get("LOCAL_RANK", -1)) != -1
        ):
            return "gloo", state.DistributedType.MULTI_CPU
        return chosen, kind

    state.PartialState._prepare_backend = _prepare_backend


def _patch_lightning(deepspeed_strategy) -> None:
    def setup_environment(self) -> None:
        deepspeed_strategy.DDPStrategy.setup_environment(self)  # the CUDA check skipped, the rest as is

    deepspeed_strategy.DeepSpeedStrategy.setup_environment = setup_environment


PATCHES = {"accelerate.state": _patch_accelerate, "lightning.pytorch.strategies.deepspeed": _patch_lightning}


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the modules in PATCHES through the other finders and patches each once it has executed."""

    def find_spec(self, name, path=None, target=None):
        if name not in PATCHES:
            return None
        others = [finder for finder in sys.meta_path if finder is not self]
        for finder in others:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                self._loaders = getattr(self, "_loaders", {})
                self._loaders[name] = spec.loader
                spec.loader = self
                return spec
        return None

    def create_module(self, spec):
        return self._loaders[spec.name].create_module(spec)

    def exec_module(self, module) -> None:
        self._loaders[module.__name__].exec_module(module)
        PATCHES[module.__name__](module)


sys.meta_path.insert(0, _PatchOnImport())

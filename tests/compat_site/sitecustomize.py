"""Test-only (tests/test_versions.py, the ``shimmed`` runs): gives a DeepSpeed release older than 0.19.8 the
helpers ds_tensorshard imports from 0.19.8, each with 0.19.8's meaning, only where missing, so the
version tests can see whether anything else differs. None of them is in 0.16.0-0.19.0:

- ``DeepSpeedEngine.zero_compute_grad_norm()``: the ``zero_optimization.compute_grad_norm`` key (true when
  the release has no such key: older stock ZeRO always computes the norm);

- ``deepspeed.comm.pg_utils.is_parallel(group)``: ``group`` is not None and spans more than one rank;
- ``deepspeed.runtime.utils.is_invalid_grad_norm(norm)``: a norm that is not finite or is negative;
- ``deepspeed.runtime.utils.combine_grad_norm_groups(norms)``: the L2 norm of the per-group norms, +inf if
  any of them is invalid (older stock ZeRO takes ``vector_norm`` of the stacked norms, the same for finite
  norms, and detects fp16 overflow on the gradients instead).
"""

import importlib.abc
import importlib.util
import math
import sys
import types


def is_parallel(group) -> bool:
    import deepspeed.comm as dist

    return group is not None and dist.get_world_size(group) > 1


def is_invalid_grad_norm(norm) -> bool:
    import torch

    if torch.is_tensor(norm):
        return bool((~torch.isfinite(norm) | (norm < 0)).any())
    return not math.isfinite(float(norm)) or norm < 0


def combine_grad_norm_groups(norm_groups, norm_type=2):
    import torch

    norms = list(norm_groups)
    device = next((n.device for n in norms if torch.is_tensor(n)), None)
    stacked = torch.stack([n if torch.is_tensor(n) else torch.tensor(float(n), device=device) for n in norms])
    combined = torch.linalg.vector_norm(stacked, ord=norm_type)
    invalid = (~torch.isfinite(stacked) | (stacked < 0)).any()
    return torch.where(invalid, torch.full_like(combined, float("inf")), combined)


def _zero_compute_grad_norm(self) -> bool:
    return bool(getattr(self._config.zero_config, "compute_grad_norm", True))


def _fill_utils(module) -> None:
    for fn in (is_invalid_grad_norm, combine_grad_norm_groups):
        if not hasattr(module, fn.__name__):
            setattr(module, fn.__name__, fn)


class _Compat(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Provides ``deepspeed.comm.pg_utils`` where no finder has it; fills deepspeed.runtime.utils once loaded."""

    def find_spec(self, name, path=None, target=None):
        if name not in ("deepspeed.comm.pg_utils", "deepspeed.runtime.utils", "deepspeed.runtime.engine"):
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    if name in ("deepspeed.runtime.utils", "deepspeed.runtime.engine"):
                        self._loaders = getattr(self, "_loaders", {})
                        self._loaders[name] = spec.loader
                        spec.loader = self
                    return spec
        if name == "deepspeed.comm.pg_utils":
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        if spec.name in getattr(self, "_loaders", {}):
            return self._loaders[spec.name].create_module(spec)
        return types.ModuleType(spec.name)

    def exec_module(self, module) -> None:
        if module.__name__ == "deepspeed.runtime.utils":
            self._loaders[module.__name__].exec_module(module)
            _fill_utils(module)
        elif module.__name__ == "deepspeed.runtime.engine":
            self._loaders[module.__name__].exec_module(module)
            if not hasattr(module.DeepSpeedEngine, "zero_compute_grad_norm"):
                module.DeepSpeedEngine.zero_compute_grad_norm = _zero_compute_grad_norm
        else:
            module.is_parallel = is_parallel
            import deepspeed.comm

            deepspeed.comm.pg_utils = module


sys.meta_path.insert(0, _Compat())

"""The benchmark: stock DeepSpeed, DDP + ZeroRedundancyOptimizer, FSDP2 and ds_tensorshard side by side.

:mod:`.runner` is the ``ds-tensorshard bench`` command; :mod:`.worker` is one configuration's rank, run
under ``mpiexec``. The worker wraps torch and DeepSpeed internals to time and count them, so it stays out
of the data path's modules.
"""

from ds_tensorshard.bench.runner import add_arguments, run

__all__ = ["add_arguments", "run"]

"""The benchmark: stock DeepSpeed, DDP + ZeroRedundancyOptimizer, FSDP2 and ds_tensorshard side by side.

:mod:`.runner` is the ``ds-tensorshard bench`` command; :mod:`.worker` is one configuration's rank, run
under ``mpiexec``, which builds it with :mod:`.setups` (the configurations named in :mod:`.configs`) and measures
it with :mod:`.clock`, :mod:`.traffic`, :mod:`.accounting` and :mod:`.op_count`; :mod:`.figure` merges several
runs into one published figure. The worker wraps torch and DeepSpeed internals to time and count them, so it
stays out of the data path's modules.
"""

from ds_tensorshard.bench.runner import add_arguments, run

__all__ = ["add_arguments", "run"]

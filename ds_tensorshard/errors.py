"""Every exception a user of ds_tensorshard can meet. Each message names the key, file, tensor or rank."""

from __future__ import annotations


class TensorShardConfigError(ValueError):
    """A DeepSpeed config (or a model, optimizer or call) that ds_tensorshard cannot run; names the key."""


class RefusedAsStock(TensorShardConfigError, AssertionError):
    """A config stock ZeRO-1/2 refuses with an ``assert`` in its constructor (which ds_tensorshard replaces):
    refused at ``deepspeed.initialize`` with stock's own message, and an ``AssertionError`` too, as stock's is."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded or written; the message names the file or tensor."""


class UnsupportedDeepSpeedVersion(ImportError):
    """The installed DeepSpeed is outside the tested range."""


class UnsupportedTorchVersion(ImportError):
    """The installed torch is outside the tested range."""


class CollectiveTimeout(RuntimeError):
    """A collective of the data path did not complete within ``tensorshard.timeout_s``."""


class StepMismatch(RuntimeError):
    """The ranks of one data-parallel group are at different optimizer steps."""


class PlanError(ValueError):
    """An ownership plan asked for what it cannot give (a tensor not in it, the one owner of a split tensor),
    or given inputs it cannot plan; the message names the tensor or argument."""


class ModelSourceError(ValueError):
    """A model description a command cannot read (a config.json, a preset with overrides); names the file
    and key."""


class TensorShardUsageError(RuntimeError):
    """A use of the engine that ds_tensorshard cannot follow as stock does; names the parameter and the fix."""


class CallRefusedAsStock(TensorShardUsageError, NotImplementedError):
    """A call stock refuses with ``NotImplementedError`` for this engine (``engine.coalesce_grad_reduction()`` where
    stock would use BF16_Optimizer): refused with stock's message, and a ``NotImplementedError`` too, as stock's is."""


class TensorAccessError(ValueError):
    """A ``deepspeed.utils`` ``safe_get_full_*``/``safe_set_full_*`` call a ds_tensorshard engine cannot answer:
    a value of another shape than the tensor, an optimizer-state key the inner optimizer does not keep (or no
    state before its first step), a gradient outside the step's window; names the tensor and the key. A
    ValueError, as stock's own refusal there."""


class ElasticStoreError(RuntimeError):
    """A torchrun round's store could not be had; names what was waited for and torchrun's own remedy."""


class HostWorkError(RuntimeError):
    """The host's part of ZeRO-Offload (adds of reduced gradients, early updates on the host worker) failed in
    backward; raised at the step, the failure chained."""


class PeerLost(RuntimeError):
    """A rank waited past ``tensorshard.timeout_s`` for the others at start-up or at exit; names the wait."""

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


class TensorAccessError(ValueError):
    """A ``deepspeed.utils`` ``safe_get_full_*``/``safe_set_full_*`` call a ds_tensorshard engine cannot answer:
    a value of another shape than the tensor, an optimizer-state key the inner optimizer does not keep (or no
    state before its first step), a gradient outside the step's window; names the tensor and the key. A
    ValueError, as stock's own refusal there."""

"""Every exception a user of ds_tensorshard can meet. Each message names the key, file, tensor or rank."""

from __future__ import annotations


class TensorShardConfigError(ValueError):
    """A DeepSpeed config (or a model, optimizer or call) that ds_tensorshard cannot run; names the key."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded or written; the message names the file or tensor."""


class UnsupportedDeepSpeedVersion(ImportError):
    """The installed DeepSpeed is outside the tested range."""


class CollectiveTimeout(RuntimeError):
    """A collective of the data path did not complete within ``tensorshard.timeout_s``."""


class StepMismatch(RuntimeError):
    """The ranks of one data-parallel group are at different optimizer steps."""

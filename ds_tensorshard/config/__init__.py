"""The ``"tensorshard"`` config block and the checks a DeepSpeed config must pass to use it, one topic a module:

- ``schema``: the block's keys (``TensorShardConfig``) and their parsing, from the config or the environment;
- ``engine_checks``: which engine configs are accepted, left to stock DeepSpeed, or refused;
- ``unfollowed_keys``: the DeepSpeed keys (most of them 0.17-0.19) refused because ds_tensorshard does not follow them;
- ``deepspeed_keys``: DeepSpeed's own keys read as stock reads them;
- ``parallel_layout``: the parallel layouts supported and the refusal of the others;
- ``zero_mapping``: how each ``zero_optimization`` key is treated;
- ``elastic``: the warning for torchrun restarts that reuse a stale store.

Every check runs at the start of ``DeepSpeedEngine.__init__``, before the model is moved or any optimizer state
exists, and raises :class:`TensorShardConfigError` naming the offending key.
"""

from ds_tensorshard.config.elastic import elastic_store_warning
from ds_tensorshard.config.engine_checks import validate_engine_config
from ds_tensorshard.config.parallel_layout import validate_parallel_layout
from ds_tensorshard.config.schema import BLOCK, TensorShardConfig, parse_block
from ds_tensorshard.config.zero_mapping import describe_zero_mapping, zero_key_treatment

__all__ = [
    "BLOCK",
    "TensorShardConfig",
    "describe_zero_mapping",
    "elastic_store_warning",
    "parse_block",
    "validate_engine_config",
    "validate_parallel_layout",
    "zero_key_treatment",
]

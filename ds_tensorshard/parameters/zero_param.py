"""The type of a parameter DeepSpeed converted for ZeRO stage 3: a ``torch.nn.Parameter`` with the ``ds_*``
attributes and bound methods its ``zero.Init`` gives it (``ds_id``, ``ds_shape``, ``ds_numel``, ``ds_status``,
``ds_tensor``, ``all_gather``, ``partition`` ...) and ds_tensorshard's ``ts_blocks`` (its owners); attributes a
type checker cannot see, so it is ``Any``."""

from __future__ import annotations

from typing import Any

ZeroParam = Any

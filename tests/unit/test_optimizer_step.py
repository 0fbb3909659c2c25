"""The step's unscale-and-clip pass: skipped where its divisor is exactly 1 and readable without a device sync."""

import torch

from ds_tensorshard.optimizer import _is_one_on_host


def test_a_divisor_of_exactly_one_on_the_host_skips_the_pass():
    # clipping's divisor is clamp(norm / clip, min=1): 1 when the norm is within the clip; x * (1 / 1.0) is x
    assert _is_one_on_host(1.0) and _is_one_on_host(torch.tensor(1.0, dtype=torch.float64))
    assert not _is_one_on_host(2.0) and not _is_one_on_host(torch.tensor(1.0000001))
    assert not _is_one_on_host(torch.ones(2))

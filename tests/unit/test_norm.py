"""The norm/overflow/clip arithmetic (ds_tensorshard.datapath.norm) in one process, against stock's rules."""

from __future__ import annotations

import math

import torch

from ds_tensorshard.datapath.norm import Decision, NormRules, decide, global_norm, read_on_host

RULES = NormRules(clip=1.0, compute_norm=True, checks_overflow=True, overflow_norm_is_inf=True)


def test_group_norms_combine_in_fp32_and_an_invalid_group_makes_the_norm_inf():
    norm, invalid = global_norm(torch.tensor([9.0, 16.0]))
    assert not bool(invalid) and norm.dtype == torch.float32 and float(norm) == 5.0  # sqrt(3^2 + 4^2)
    for bad in (float("inf"), float("nan")):
        norm, invalid = global_norm(torch.tensor([9.0, bad]))
        assert bool(invalid) and math.isinf(float(norm))


def test_the_host_reads_the_steps_the_unscaled_norm_and_the_overflow_at_once():
    norm, invalid = global_norm(torch.tensor([9.0, 16.0]))
    assert read_on_host(torch.tensor(6.0), norm, invalid, 2.0) == (6.0, 2.5, False)
    norm, invalid = global_norm(torch.tensor([9.0, float("nan")]))
    assert read_on_host(torch.tensor(6.0), norm, invalid, 2.0) == (6.0, math.inf, True)


def test_clipping_divides_by_the_clip_coefficient_times_the_scale_after_its_update():
    # loss-scaled norm 8 at scale 2 before and 4 after: the reported norm uses the scale before (4.0),
    # the divisor the scale after, as stock: ((8 / 4) + 1e-6) / 1.0 * 4
    decision = decide(torch.tensor(8.0), 4.0, False, 2.0, 4.0, RULES, previous=None)
    assert decision.overflow is False and decision.reported == 4.0
    assert abs(float(decision.divisor) - (2.0 + 1e-6) * 4.0) < 1e-6
    small = decide(torch.tensor(0.5), 0.5, False, 1.0, 1.0, RULES, previous=None)  # below the clip: only the scale
    assert float(small.divisor) == 1.0


def test_nothing_to_divide_without_clipping_at_scale_one_and_only_the_scale_without_a_norm():
    no_clip = NormRules(clip=0.0, compute_norm=True, checks_overflow=True, overflow_norm_is_inf=True)
    assert decide(torch.tensor(8.0), 8.0, False, 1.0, 1.0, no_clip, None) == Decision(False, None, 8.0)
    assert decide(torch.tensor(8.0), 2.0, False, 4.0, 4.0, no_clip, None).divisor == 4.0
    no_norm = NormRules(clip=1.0, compute_norm=False, checks_overflow=True, overflow_norm_is_inf=True)
    assert decide(torch.tensor(8.0), 2.0, False, 4.0, 2.0, no_norm, 3.0) == Decision(False, 2.0, None)


def test_an_overflow_skips_and_reports_inf_or_the_last_norm_by_release():
    assert decide(torch.tensor(math.inf), math.inf, True, 4.0, 2.0, RULES, 3.0) == Decision(True, None, math.inf)
    older = NormRules(clip=1.0, compute_norm=True, checks_overflow=True, overflow_norm_is_inf=False)
    assert decide(torch.tensor(math.inf), math.inf, True, 4.0, 2.0, older, 3.0) == Decision(True, None, 3.0)
    no_norm = NormRules(clip=1.0, compute_norm=False, checks_overflow=True, overflow_norm_is_inf=True)
    assert decide(torch.tensor(math.inf), math.inf, True, 4.0, 2.0, no_norm, 3.0) == Decision(True, None, None)

"""The whole-tensor parameter protocol (``parameters/owned.py``) on one process, its collectives instant."""

from __future__ import annotations

import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from ds_tensorshard.datapath.plan import Block
from ds_tensorshard.examples.host_cost import InstantComm
from ds_tensorshard.parameters.owned import OwnedParameters


def _zero_param(ds_id: int, numel: int) -> torch.nn.Parameter:
    """A parameter with the ``ds_*`` attributes DeepSpeed's conversion gives it, not yet kept by an owner."""
    param = torch.nn.Parameter(torch.arange(numel, dtype=torch.float32))
    param.ds_id, param.ds_shape, param.ds_numel = ds_id, param.shape, numel
    param.ds_status, param.ds_tensor, param.ds_active_sub_modules = ZeroParamStatus.AVAILABLE, None, set()
    return param


def test_a_move_drops_the_gather_layouts_that_name_the_old_owners():
    """A model built under ``zero.Init`` is gathered (``GatheredParameters``, loading its weights) with its
    construction owners; ``deepspeed.initialize`` then moves it to its planned owners. A batch gathered again
    must be laid out by the new owners: a layout kept from before has this rank send a tensor it no longer keeps
    (HF's ``from_pretrained``: the first step's forward read uninitialized memory)."""
    owned = OwnedParameters(InstantComm(2), torch.device("cpu"), lambda p: (Block(0, 0, p.ds_numel),))
    weight, bias = _zero_param(0, 6), _zero_param(1, 2)
    for param in (weight, bias):
        owned.adopt(param)
        owned.keep(param, has_been_updated=False, free_data=True)
    assert [span[0] for span in owned.layout_of([weight, bias]).spans] == [0]  # this rank keeps both
    owned.move([weight], [(Block(1, 0, 6),)])
    assert weight.ds_tensor.numel() == 0 and bias.ds_tensor.numel() == 2
    assert owned.layout_of([weight, bias]).spans == [(0, 0, 2), (1, 2, 6)]


class _Done:
    def wait(self) -> None:
        return None


def test_a_parameter_whose_blocks_lie_back_to_back_is_a_view_of_the_gather_buffer():
    """A parameter in dim-0 blocks on both ranks, alone in its batch, lies rank 0's block then rank 1's in the
    buffer: the gathered tensor is a view of the buffer, not a second whole copy (``from_pretrained``'s peak
    RSS, docs/stage3.md); two such parameters in one batch interleave, and each is put together from its blocks."""
    from types import SimpleNamespace

    from ds_tensorshard.parameters.gather import GatherInFlight, GatherLayout

    one = SimpleNamespace(ds_shape=(4, 2))
    layout = GatherLayout.of([[Block(0, 0, 4), Block(1, 4, 8)]], rank=1)
    flat = torch.arange(8.0)
    (whole,) = GatherInFlight([one], layout, flat, _Done()).wait()
    assert whole.data_ptr() == flat.data_ptr() and torch.equal(whole, torch.arange(8.0).view(4, 2))
    two = SimpleNamespace(ds_shape=(2, 2))
    layout = GatherLayout.of([[Block(0, 0, 2), Block(1, 2, 4)], [Block(0, 0, 2), Block(1, 2, 4)]], rank=0)
    flat = torch.tensor([0.0, 1.0, 10.0, 11.0, 2.0, 3.0, 12.0, 13.0])  # rank 0's blocks, then rank 1's
    first, second = GatherInFlight([two, two], layout, flat, _Done()).wait()
    assert torch.equal(first.flatten(), torch.tensor([0.0, 1.0, 2.0, 3.0]))
    assert torch.equal(second.flatten(), torch.tensor([10.0, 11.0, 12.0, 13.0]))

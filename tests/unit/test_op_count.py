"""The benchmark's operator counter: what it counts on CPU tensors, and a device's host syncs on emulated CUDA."""

import torch

from ds_tensorshard.bench.op_count import OpCounter
from tests.helpers.emulated_cuda import EmulatedTensor


def test_counts_every_operator_by_name_and_the_scalar_reads():
    with OpCounter() as counted:
        x = torch.arange(4.0)  # aten.arange
        y = x * 2  # aten.mul
        y.add_(1)  # aten.add_
        total = y.sum().item()  # aten.sum, then aten._local_scalar_dense: a host sync
        host = torch.zeros(3)  # aten.zeros
        host.copy_(x[:3])  # aten.slice, aten.copy_ (host to host: no sync)
    assert total == 16.0
    assert counted.ops == {
        "aten.arange": 1,
        "aten.mul": 1,
        "aten.add_": 1,
        "aten.sum": 1,
        "aten._local_scalar_dense": 1,
        "aten.zeros": 1,
        "aten.slice": 1,
        "aten.copy_": 1,
    }
    assert counted.total == 8 and counted.host_syncs == 1 and counted.device_to_host == 0
    torch.ones(2) + 1  # after the block: not counted
    assert counted.total == 8


def test_device_to_host_copies_are_host_syncs():
    device = EmulatedTensor(torch.arange(3.0), torch.device("cuda", 0))
    with OpCounter() as counted:
        device.cpu()  # aten._to_copy to the CPU: a sync
        host = torch.empty(3)
        host.copy_(device)  # into host memory from the device: a sync
        device.sum().item()  # a scalar read: a sync
        (device * 2).add_(1)  # stays on the device
        torch.empty(3).copy_(host)  # host to host
    assert counted.device_to_host == 2 and counted.host_syncs == 3
    assert counted.ops == {
        "aten._to_copy": 1,
        "aten.empty": 2,
        "aten.copy_": 2,
        "aten.sum": 1,
        "aten._local_scalar_dense": 1,
        "aten.mul": 1,
        "aten.add_": 1,
    }

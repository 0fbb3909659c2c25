"""Tensors where CUDA wants them: no tensor factory of the data path, the transports or the checkpoints builds
on the default device (the CPU on a GPU machine) where the engine's device was meant, and host buffers say so;
the mpi transport's device rules (thread level, what MPI may read when)."""

from __future__ import annotations

import ast
import os

import pytest
import torch

import ds_tensorshard
from ds_tensorshard.errors import TensorShardConfigError

PACKAGE = os.path.dirname(ds_tensorshard.__file__)
FOLDERS = ("datapath", "transports", "checkpoints")
# torch's functions that make a tensor from nothing but sizes or data: without device= it lands on the CPU
FACTORIES = {
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "logspace", "eye",
    "rand", "randn", "randint", "randperm", "empty_strided", "scalar_tensor", "frombuffer",
}  # fmt: skip
HOST_ONLY = {"frombuffer"}  # always host memory by definition (MPI's buffers)


def device_less_factories(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of each ``torch.FACTORY(...)`` call in ``source`` without a ``device=`` argument."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner, name = node.func.value, node.func.attr
        if isinstance(owner, ast.Name) and owner.id == "torch" and name in FACTORIES - HOST_ONLY:
            if not any(keyword.arg == "device" for keyword in node.keywords):
                found.append((node.lineno, name))
    return found


def test_every_tensor_factory_names_its_device():
    offenders = []
    for folder in FOLDERS:
        for root, _, files in os.walk(os.path.join(PACKAGE, folder)):
            for file in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(root, file)
                with open(path) as f:
                    offenders += [f"{os.path.relpath(path, PACKAGE)}:{line} torch.{name}" for line, name in
                                  device_less_factories(f.read())]  # fmt: skip
    assert offenders == []


def test_the_check_finds_a_device_less_factory():
    source = "import torch\nx = torch.tensor([1])\ny = torch.zeros(3, device=d)\nz = torch.empty_like(x)\n"
    assert device_less_factories(source) == [(2, "tensor")]


def test_mpi_on_an_accelerator_needs_a_thread_level_that_lets_hooks_call_it(monkeypatch):
    MPI = pytest.importorskip("mpi4py.MPI")
    from ds_tensorshard.transports.mpi_comm import check_thread_level

    for level, name in ((MPI.THREAD_SINGLE, "MPI_THREAD_SINGLE"), (MPI.THREAD_FUNNELED, "MPI_THREAD_FUNNELED")):
        monkeypatch.setattr(MPI, "Query_thread", lambda level=level: level)
        with pytest.raises(TensorShardConfigError, match=f"MPI_THREAD_SERIALIZED or better.*{name}"):
            check_thread_level(torch.device("cuda", 0))
        check_thread_level(torch.device("cpu"))  # hooks run on the training thread: any level serves
    for level in (MPI.THREAD_SERIALIZED, MPI.THREAD_MULTIPLE):
        monkeypatch.setattr(MPI, "Query_thread", lambda level=level: level)
        check_thread_level(torch.device("cuda", 0))

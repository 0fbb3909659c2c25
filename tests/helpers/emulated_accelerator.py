"""Test-only: DeepSpeed on an emulated CUDA device (:mod:`tests.helpers.emulated_cuda`) over a process group that
holds NCCL's device rule, on a CPU-only torch.

:func:`install` (before ``deepspeed.initialize``):

- makes DeepSpeed's accelerator an :class:`EmulatedCudaAccelerator`: device ``cuda:LOCAL_RANK`` (``device_count``
  devices), not a synchronized device (so DeepSpeed and the plugin take their GPU paths: streams, events, pinned
  host memory), streams and events that count host waits, a caching allocator's ``memory_reserved`` (freed memory
  stays reserved until ``empty_cache``), and DeepSpeed's CPU op builders;
- registers the torch.distributed backend ``emulated_nccl``: gloo underneath, with every collective checked by the
  emulation (device tensors only, NCCL's error otherwise);
- lets torch accept ``device="cuda"`` (its CUDA lazy initialisation is skipped) and activates
  :class:`~tests.helpers.emulated_cuda.EmulatedCuda` on the calling thread;
- hands DeepSpeed's compiled FusedAdam kernel the CPU data of emulated tensors (the kernel that stands in for
  the CUDA one: same arithmetic as a CPU run's, so runs compare bit for bit).
"""

from __future__ import annotations

import functools
import gc
import importlib
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as tdist
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

from tests.helpers.emulated_cuda import CURRENT, LEDGER, EmulatedCuda, EmulatedTensor, device_of

BACKEND = "emulated_nccl"
EMULATED = {"EMULATED_CUDA": "1"}  # a worker's environment: run on emulated CUDA


class EmulatedStream:
    """A stream: ordering between streams costs the host nothing; ``synchronize`` is a host wait."""

    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.device = device

    def wait_stream(self, other: EmulatedStream) -> None:
        pass

    def wait_event(self, event: EmulatedEvent) -> None:
        pass

    def record_event(self, event: EmulatedEvent | None = None) -> EmulatedEvent:
        event = event or EmulatedEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        LEDGER.sync("stream synchronize")
        LEDGER.settle()

    def query(self) -> bool:
        return True


class EmulatedEvent:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.recorded = False

    def record(self, stream: EmulatedStream | None = None) -> None:
        self.recorded = True

    def wait(self, stream: EmulatedStream | None = None) -> None:
        pass

    def synchronize(self) -> None:
        LEDGER.sync("event synchronize")
        LEDGER.settle()

    def query(self) -> bool:
        return True


class EmulatedCudaAccelerator(CPU_Accelerator):
    """DeepSpeed's view of an emulated CUDA machine with ``device_count`` devices."""

    def __init__(self, device_count: int) -> None:
        super().__init__()
        self._name = "cuda"
        self._communication_backend_name = BACKEND
        self._device_count = device_count
        self._current = 0
        self.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        self._stream = EmulatedStream()
        self.reserved = 0  # the caching allocator's reserved bytes (the peak since the last empty_cache)
        self.peak = 0  # the largest memory_allocated() seen since the last reset_peak_memory_stats()

    def is_synchronized_device(self) -> bool:
        return False

    def use_host_timers(self) -> bool:
        return True

    def device_name(self, device_index: int | None = None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cuda", self._current if device_index is None else device_index)

    def set_device(self, device_index: int | torch.device) -> None:
        """As ``torch.cuda.set_device``: an index or a device (stock ZeRO-3's ``zero.Init`` passes a device)."""
        if isinstance(device_index, torch.device):
            device_index = self._current if device_index.index is None else device_index.index
        if not 0 <= int(device_index) < self._device_count:
            raise RuntimeError(f"CUDA error: invalid device ordinal (emulated: {self._device_count} device(s))")
        self._current = int(device_index)
        CURRENT[0] = torch.device("cuda", self._current)

    def current_device(self) -> int:
        return self._current

    def current_device_name(self) -> str:
        return f"cuda:{self._current}"

    def device_count(self) -> int:
        return self._device_count

    def synchronize(self, device_index: int | None = None) -> None:
        LEDGER.sync("device synchronize")
        LEDGER.settle()

    @property
    def Stream(self) -> type:  # noqa: N802 (DeepSpeed's name)
        return EmulatedStream

    @property
    def Event(self) -> type:  # noqa: N802
        return EmulatedEvent

    def stream(self, stream: EmulatedStream) -> Any:
        return _noop()

    def current_stream(self, device_index: int | None = None) -> EmulatedStream:
        return self._stream

    def default_stream(self, device_index: int | None = None) -> EmulatedStream:
        return self._stream

    def _typed(self, dtype: torch.dtype) -> Any:
        """``get_accelerator().FloatTensor(data)`` and the like: a tensor on the device, as CUDA's."""
        return functools.partial(torch.tensor, dtype=dtype, device=self.current_device_name())

    BFloat16Tensor = property(lambda self: self._typed(torch.bfloat16))  # noqa: N815 (DeepSpeed's names)
    ByteTensor = property(lambda self: self._typed(torch.uint8))  # noqa: N815
    DoubleTensor = property(lambda self: self._typed(torch.float64))  # noqa: N815
    FloatTensor = property(lambda self: self._typed(torch.float32))  # noqa: N815
    HalfTensor = property(lambda self: self._typed(torch.float16))  # noqa: N815
    IntTensor = property(lambda self: self._typed(torch.int32))  # noqa: N815
    LongTensor = property(lambda self: self._typed(torch.int64))  # noqa: N815

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return device_of(tensor).type == "cuda"

    def memory_allocated(self, device_index: int | None = None) -> int:
        """The bytes of the storages of every emulated tensor alive on the device (found by the garbage
        collector: slow, for tests)."""
        gc.collect()
        storages = {}
        with warnings.catch_warnings():  # looking at every object touches deprecated module attributes
            warnings.simplefilter("ignore")
            on_device = [o for o in gc.get_objects() if isinstance(o, EmulatedTensor) and o.emu_device.type == "cuda"]
        for tensor in on_device:
            storage = tensor.elem.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        allocated = sum(storages.values())
        self.reserved = max(self.reserved, allocated)
        self.peak = max(self.peak, allocated)
        return allocated

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """The largest :meth:`memory_allocated` seen: there is no allocator to count every allocation, so this is
        the peak of the samples taken (tests/workers/probe_worker.py samples around every module), not the
        process's peak RSS that DeepSpeed's CPU accelerator reports."""
        return self.peak

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self.peak = 0

    def memory_reserved(self, device_index: int | None = None) -> int:
        return max(self.memory_allocated(device_index), self.reserved)

    def empty_cache(self) -> None:
        self.reserved = 0

    # pinned host memory, tracked by the emulation
    _torch_pins_host_memory = True

    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor:
        if make_copy:
            return LEDGER.pin(tensor.clone())
        return LEDGER.pin(torch.empty(tensor.shape if match_shape else (tensor.numel(),), dtype=tensor.dtype))

    def _torch_pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return LEDGER.pin(tensor.clone())

    def _torch_empty_pinned(self, tensor: torch.Tensor, shape: Any) -> torch.Tensor:
        return LEDGER.pin(torch.empty(shape, dtype=tensor.dtype))

    def _torch_is_pinned(self, tensor: torch.Tensor) -> bool:
        return LEDGER.is_pinned(tensor)


@contextmanager
def _noop():
    yield


def _gloo(store: Any, rank: int, size: int, timeout: Any) -> Any:
    return tdist.ProcessGroupGloo(store, rank, size, timeout)


def _fused_adam_on_host_data() -> None:
    """FusedAdam's compiled CPU kernel, handed the CPU data of emulated tensors."""
    from deepspeed.ops.adam import fused_adam

    if getattr(fused_adam.FusedAdam, "_emulated", False):
        return
    original = fused_adam.FusedAdam.__init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        kernel = self.multi_tensor_adam

        def on_host(chunk_size: int, noop: torch.Tensor, lists: list, *rest: Any) -> Any:
            host = [[t.elem if isinstance(t, EmulatedTensor) else t for t in tensors] for tensors in lists]
            return kernel(chunk_size, noop, host, *rest)

        self.multi_tensor_adam = on_host

    fused_adam.FusedAdam.__init__ = __init__
    fused_adam.FusedAdam._emulated = True


def _refuse_mixed_set_data() -> None:
    """``cpu_param.data = emulated`` would graft a storage-less wrapper into a CPU tensor (a crash later, not an
    error): refuse it, so that a model is built on the emulated device (:func:`model_device`) instead."""
    compatible = torch._has_compatible_shallow_copy_type

    def checked(input: torch.Tensor, from_: torch.Tensor) -> bool:  # torch's own signature (dynamo checks it)
        if isinstance(input, EmulatedTensor) != isinstance(from_, EmulatedTensor):
            raise RuntimeError("emulated CUDA: a CPU tensor given emulated data; build the model on the device")
        return compatible(input, from_)

    torch._has_compatible_shallow_copy_type = checked


def _unbound_process_groups() -> None:
    """DeepSpeed binds the process group to ``cuda:LOCAL_RANK`` (``device_id``), which torch checks against the
    accelerator it was built for: the emulated groups stay unbound (gloo underneath). Their object collectives
    (``broadcast_object_list``, ...) go through device tensors, as an NCCL group's do."""
    if getattr(tdist.init_process_group, "_emulated", False):
        return
    from torch.distributed import distributed_c10d

    object_device = distributed_c10d._get_object_coll_device
    distributed_c10d._get_object_coll_device = lambda group=None: (
        str(CURRENT[0]) if tdist.get_backend(group) == BACKEND else object_device(group)
    )
    original = tdist.init_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("device_id", None)
        return original(*args, **kwargs)

    init_process_group._emulated = True  # type: ignore[attr-defined]
    tdist.init_process_group = init_process_group


def _data_factories_through_dispatch() -> None:
    """``torch.tensor(data, device=...)`` and ``torch.as_tensor`` build on the CPU and move the result with
    dispatch turned off (so torch would call CUDA): here they build on the CPU, then move through dispatch."""
    if getattr(torch.tensor, "_emulated", False):
        return
    for name in ("tensor", "as_tensor"):
        original = getattr(torch, name)

        def factory(*args: Any, _original: Any = original, **kwargs: Any) -> torch.Tensor:
            device = kwargs.pop("device", None)
            made = _original(*args, **kwargs)
            return made if device is None or torch.device(device).type == "cpu" else made.to(device)

        factory._emulated = True  # type: ignore[attr-defined]
        setattr(torch, name, factory)
    # deepspeed.zero.Init wraps torch.tensor around the one it saw at import, and puts that one back on exit
    from deepspeed.runtime.zero import partition_parameters

    # torch's compiler, imported first inside zero.Init (as the emulation's factories reach it there), refuses
    # the tensor constructor zero.Init has put in place; a forked rank has it already (tests/helpers/forkserver.py)
    importlib.import_module("torch._dynamo")

    partition_parameters._orig_torch_tensor = torch.tensor


def _threads_on_the_device() -> None:
    """Every thread started from here on runs under the emulation too (a dispatch mode is per thread): the
    plugin's host worker and watchdog make and copy device tensors."""
    if getattr(threading.Thread.run, "_emulated", False):
        return
    original = threading.Thread.run

    def run(self: threading.Thread) -> None:
        with EmulatedCuda():
            original(self)

    run._emulated = True  # type: ignore[attr-defined]
    threading.Thread.run = run  # type: ignore[method-assign]


def _indexless_cuda_is_the_current_device(accelerator: EmulatedCudaAccelerator) -> None:
    """CUDA reads ``.to("cuda")`` (no index) as the current device; a CPU-only build refuses that device in its
    argument parser, before dispatch: here it becomes ``cuda:N`` (stock ZeRO-3's gathers move so)."""
    if getattr(torch.Tensor.to, "_emulated", False):
        return
    original = torch.Tensor.to

    def current(device: Any) -> Any:
        if isinstance(device, (str, torch.device)) and torch.device(device) == torch.device("cuda"):
            return accelerator.current_device_name()
        return device

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args:
            args = (current(args[0]), *args[1:])
        if "device" in kwargs:
            kwargs["device"] = current(kwargs["device"])
        return original(self, *args, **kwargs)

    to._emulated = True  # type: ignore[attr-defined]
    torch.Tensor.to = to  # type: ignore[method-assign]


def install(device_count: int | None = None) -> EmulatedCudaAccelerator:
    """Emulated CUDA for this process (see the module docstring); returns the accelerator."""
    from deepspeed.accelerator import set_accelerator

    torch.cuda._lazy_init = lambda: None  # torch would refuse device="cuda" on a CPU-only build before dispatch
    _refuse_mixed_set_data()
    _unbound_process_groups()
    _data_factories_through_dispatch()
    _threads_on_the_device()
    torch.cuda.get_device_capability = lambda device=None: (9, 0)  # an H100/H200 (torch.distributed asks)
    if BACKEND.upper() not in vars(tdist.Backend):
        tdist.Backend.register_backend(BACKEND, _gloo, devices=["cpu"])
    count = device_count or int(os.environ.get("EMULATED_CUDA_DEVICES", os.environ.get("LOCAL_WORLD_SIZE", 1)))
    accelerator = EmulatedCudaAccelerator(count)
    set_accelerator(accelerator)
    _indexless_cuda_is_the_current_device(accelerator)
    _fused_adam_on_host_data()
    if os.environ.get("EMULATED_CUDA_AWARE_MPI") == "1":  # the MPI takes device buffers (their host data here)
        from ds_tensorshard.transports import mpi_comm

        mpi_comm._cuda_aware = lambda: True
    EmulatedCuda().__enter__()
    return accelerator


def emulating() -> bool:
    """Whether this process runs on emulated CUDA (``EMULATED_CUDA=1`` in its environment)."""
    return all(os.environ.get(key) == value for key, value in EMULATED.items())


def install_if_asked() -> None:
    """A worker's first call: :func:`install` where ``EMULATED_CUDA=1``."""
    if emulating():
        install()


def model_device() -> Any:
    """Where a worker builds its model: on the emulated device when emulating (a CPU model moved there would
    change identity), else where it always did (the CPU; ``deepspeed.initialize`` moves it)."""
    from contextlib import nullcontext

    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name()) if emulating() else nullcontext()


def init_worker() -> None:
    """A worker's start: emulated CUDA where ``EMULATED_CUDA=1``, then torch.distributed on the accelerator's
    backend (``DIST_BACKEND`` overrides it: e.g. gloo for ranks sharing one GPU) at ``MASTER_PORT``."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    install_if_asked()
    backend = os.environ.get("DIST_BACKEND", get_accelerator().communication_backend_name())
    deepspeed.init_distributed(dist_backend=backend, distributed_port=int(os.environ.get("MASTER_PORT", "29500")))


def serve_cases(run_case: Callable[[str, str], None], out_dir: str, cases: Sequence[str]) -> None:
    """A case worker's body: :func:`init_worker`, fp16 reported supported (a CPU reports none; the path is
    exercised anyway), ``run_case(case, out_dir)`` for each case in turn, then the process group closed."""
    from deepspeed.accelerator import get_accelerator

    from ds_tensorshard.transports.torch_comm import close_process_group

    init_worker()
    get_accelerator().is_fp16_supported = lambda: True
    for case in cases:
        run_case(case, out_dir)
    close_process_group()

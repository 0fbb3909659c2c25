"""Test-only: CUDA's device rules on a CPU-only torch, with real data.

A tensor "on the GPU" is an :class:`EmulatedTensor`: a wrapper subclass whose data is an ordinary CPU tensor
(``elem``) and whose ``device`` reads ``cuda:N``. Every ATen operator on such tensors, and every operator while
:class:`EmulatedCuda` is active, goes through :func:`_dispatch`, which

- runs the operator on the CPU data, so values are exactly those of a CPU run (the same kernels, same order);
- raises where CUDA would: tensors of two devices in one operator ("Expected all tensors to be on the same
  device"), except CPU 0-dim tensors in a device operator (allowed on CUDA) and the copies between devices;
  a CUDA 0-dim tensor entering a CPU operator is refused, as CUDA refuses it;
- holds NCCL's rule on the process group: a collective (``c10d`` operator) on a tensor that is not on the device
  raises NCCL's "No backend type associated with device type cpu";
- makes factories asked for ``device="cuda"`` (``torch.empty(n, device=...)``, ``.to("cuda")``) emulated tensors;
- counts what the host would wait for (:class:`HostLedger`): ``.item()`` of a device tensor and device-to-host
  copies that block; a non-blocking device-to-host copy marks its destination unreadable until an event or
  stream it was recorded on is synchronized (reading it earlier raises), and pinned host memory is tracked.

What cannot be emulated this way: autograd and every C++ kernel see CPU tensors (so backward runs on the
calling thread, not on a device thread), and DeepSpeed's compiled ops get the CPU data (see
:mod:`tests.helpers.emulated_accelerator`).
"""

from __future__ import annotations

import copy
import threading
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, return_and_correct_aliasing
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten
CPU = torch.device("cpu")
NCCL_CPU_ERROR = "No backend type associated with device type cpu"
# operators that take tensors of two devices by design (the copies), and c10d's barrier, whose tensor is its own
_CROSS_DEVICE = {aten.copy_.default, aten._to_copy.default, aten._foreach_copy_.default, aten._foreach_copy.default}
_PIN_ARG = "pin_memory"
# The device C++ (autograd) sees for an emulated tensor: "meta", so that what autograd makes from a tensor's
# options (a gradient cast back, zeros for a missing gradient) says so, and is put on the emulated device here.
_AUTOGRAD_DEVICE = torch.device("meta")


class HostLedger:
    """What the host did that a GPU would make it wait for, and the host memory it pinned."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ops: Counter[str] = Counter()
        self.host_syncs: Counter[str] = Counter()
        self.pinned: dict[int, int] = {}  # pinned storage data_ptr -> bytes
        self.unsynced: dict[int, str] = {}  # host storage data_ptr -> the copy still in flight into it
        self.written: set[int] = set()  # device storages kernels wrote since the last synchronize
        self.on_sync: list = []  # callbacks for tests

    def sync(self, why: str) -> None:
        with self.lock:
            self.host_syncs[why] += 1
        for callback in self.on_sync:
            callback(why)

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self.pinned[storage.data_ptr()] = storage.nbytes()
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return _host(tensor).untyped_storage().data_ptr() in self.pinned

    def settle(self) -> None:
        """Every kernel and copy in flight has completed (an event or the stream it was on was synchronized)."""
        self.unsynced.clear()
        self.written.clear()


LEDGER = HostLedger()
CURRENT = [torch.device("cuda", 0)]  # the emulated current device (the accelerator sets it)


class EmulatedTensor(torch.Tensor):
    """A tensor on an emulated device (or moved off it: ``emu_device`` cpu), its data in ``elem``."""

    elem: torch.Tensor
    emu_device: torch.device

    @staticmethod
    def __new__(cls, elem: torch.Tensor, device: torch.device) -> EmulatedTensor:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=_AUTOGRAD_DEVICE,
            requires_grad=elem.requires_grad,
        )
        wrapper.elem, wrapper.emu_device = elem, device
        return wrapper

    @property  # type: ignore[override]
    def device(self) -> torch.device:
        return self.emu_device

    @property  # type: ignore[override]
    def is_cuda(self) -> bool:
        return self.emu_device.type == "cuda"

    @property  # type: ignore[override]
    def is_meta(self) -> bool:
        return False

    def get_device(self) -> int:
        return self.emu_device.index if self.emu_device.type == "cuda" else -1

    def data_ptr(self) -> int:
        return self.elem.data_ptr()

    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        return torch.Tensor.data.__get__(self)  # a detached EmulatedTensor sharing ``elem``'s storage

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        """``param.data = t`` (DeepSpeed, offloading): the wrapper takes ``t``'s data and device."""
        new = new if isinstance(new, EmulatedTensor) else EmulatedTensor(new, new.device)
        torch.Tensor.data.__set__(self, new)
        self.elem, self.emu_device = new.elem, new.emu_device

    def untyped_storage(self) -> torch.UntypedStorage:
        return self.elem.untyped_storage()

    @property
    def __dlpack__(self) -> Any:  # type: ignore[override]
        """Absent: other libraries (mpi4py) then take the device memory through ``__cuda_array_interface__``."""
        raise AttributeError("emulated CUDA tensors give their memory through __cuda_array_interface__")

    @property
    def __cuda_array_interface__(self) -> dict:  # type: ignore[override]
        """Device memory handed to another library (a CUDA-aware MPI): it reads it now, on the host's time, so a
        kernel that may still be writing it (no synchronize since) is an error here."""
        if self.elem.untyped_storage().data_ptr() in LEDGER.written:
            raise RuntimeError(
                "emulated CUDA: device memory handed to another library (__cuda_array_interface__) while a kernel "
                "may still be writing it; synchronize the stream that produced it first"
            )
        typestr = {torch.float32: "<f4", torch.float64: "<f8", torch.int16: "<i2", torch.int64: "<i8"}[self.dtype]
        strides = tuple(s * self.element_size() for s in self.stride())
        return {
            "shape": tuple(self.shape),
            "typestr": typestr,
            "data": (self.elem.data_ptr(), False),
            "strides": strides,
            "version": 3,
        }

    def record_stream(self, stream: Any) -> None:  # type: ignore[override]
        """The caching allocator's note that ``stream`` uses this memory: nothing to keep here (one stream)."""

    def tolist(self) -> Any:  # type: ignore[override]
        """As CUDA's: a copy to the host (a host sync, dispatched: counted), then its values."""
        return self.to("cpu").tolist()

    def numpy(self, *, force: bool = False) -> Any:  # type: ignore[override]
        if self.emu_device.type != "cpu":
            raise TypeError(f"can't convert {self.emu_device} device type tensor to numpy (emulated CUDA)")
        return self.elem.numpy(force=force)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"EmulatedTensor({self.elem!r}, device='{self.emu_device}')"

    def __reduce_ex__(self, protocol: int) -> Any:
        """Saved as its CPU data, as ``torch.load(..., map_location="cpu")`` gives a CUDA tensor back."""
        return self.elem.__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> EmulatedTensor:
        copied = EmulatedTensor(copy.deepcopy(self.elem, memo), self.emu_device)
        copied.requires_grad_(self.requires_grad)
        return copied

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


def device_of(tensor: torch.Tensor) -> torch.device:
    return tensor.emu_device if isinstance(tensor, EmulatedTensor) else tensor.device


def _host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.elem if isinstance(tensor, EmulatedTensor) else tensor


def _common_device(func, tensors: list[torch.Tensor]) -> torch.device | None:
    """The device the operator runs on, by CUDA's rule (CPU 0-dim tensors may join a device operator)."""
    common, from_cpu_scalar = None, False
    for tensor in tensors:
        device = device_of(tensor)
        cpu_scalar = device.type == "cpu" and tensor.dim() == 0
        if common is None:
            common, from_cpu_scalar = device, cpu_scalar
        elif device == common:
            from_cpu_scalar = from_cpu_scalar and cpu_scalar
        elif cpu_scalar:
            continue
        elif from_cpu_scalar:
            common, from_cpu_scalar = device, False
        else:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, {common} and "
                f"{device}! (emulated CUDA, in {func})"
            )
    return common


def _requested_device(kwargs: dict, tensors: list[torch.Tensor]) -> torch.device | None:
    """The device an operator's ``device=`` asks for; "meta" (autograd, from an emulated tensor's options) means
    the emulated device: its inputs' or, for a factory, the current one."""
    device = kwargs.get("device")
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "meta":
        return next((device_of(t) for t in tensors), None) or CURRENT[0]
    return CURRENT[0] if device.type == "cuda" and device.index is None else device


def _check_readable(func, tensors: list[torch.Tensor]) -> None:
    """A host tensor that a non-blocking copy is still writing must not be read or written by the host."""
    if not LEDGER.unsynced:
        return
    for tensor in tensors:
        if device_of(tensor).type == "cpu":
            pending = LEDGER.unsynced.get(_host(tensor).untyped_storage().data_ptr())
            if pending is not None:
                raise RuntimeError(
                    f"emulated CUDA: {func} touches host memory that {pending} is still writing; record an event "
                    "after the copy and synchronize it before the host reads"
                )


def _dispatch(func, args: tuple, kwargs: dict) -> Any:
    LEDGER.ops[str(func)] += 1
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if func.namespace == "c10d":
        return _collective(func, args, kwargs, tensors)
    requested = _requested_device(kwargs, tensors)
    if func in _CROSS_DEVICE:
        out_device = _copy_rules(func, args, kwargs, requested)
    elif func is aten._local_scalar_dense.default:
        if device_of(args[0]).type != "cpu":
            LEDGER.sync("item")
        out_device = CPU
    elif func is aten.is_pinned.default:
        return device_of(args[0]).type == "cpu" and LEDGER.is_pinned(args[0])
    else:
        if not func.is_view:  # a view reads nothing
            _check_readable(func, tensors)
        common = _common_device(func, tensors)
        out_device = requested or common or CPU
    pin = bool(kwargs.get(_PIN_ARG))
    if func in (aten._pin_memory.default, aten.pin_memory.default):
        return LEDGER.pin(tree_map(_host, args[0]).clone())
    unwrapped_args, unwrapped_kwargs = tree_map(_host, (args, kwargs))
    if requested is not None:
        unwrapped_kwargs["device"] = CPU
    unwrapped_kwargs.pop(_PIN_ARG, None)
    out = func(*unwrapped_args, **unwrapped_kwargs)
    if pin:
        LEDGER.pin(out)
    # results on the host are plain CPU tensors (as on CUDA); an operator writing into an emulated tensor that
    # lives on the host (a parameter offloaded by ``param.data = ...``) returns that tensor
    emulated_input = any(isinstance(t, EmulatedTensor) for t in tensors)
    wrap = out_device.type != "cpu" or (emulated_input and func._schema.is_mutable)
    wrapped = tree_map(lambda t: EmulatedTensor(t, out_device) if isinstance(t, torch.Tensor) and wrap else t, out)
    if out_device.type != "cpu" and not func.is_view:  # a kernel wrote these (in stream order): until a sync,
        for tensor in tree_flatten(out)[0]:  # not for another library to read (a view is no kernel)
            if isinstance(tensor, torch.Tensor):
                LEDGER.written.add(tensor.untyped_storage().data_ptr())
    if wrap and emulated_input:
        return return_and_correct_aliasing(func, args, kwargs, wrapped)
    return wrapped


def _copy_rules(func, args: tuple, kwargs: dict, requested: torch.device | None) -> torch.device:
    """Copies between devices: count the host waits and track non-blocking copies to the host."""
    if func is aten._to_copy.default:
        source, target = device_of(args[0]), requested or device_of(args[0])
        if source.type != "cpu" and target.type == "cpu":
            LEDGER.sync("device-to-host copy")
        return target
    if func is aten.copy_.default:
        destination, source = args[0], args[1]
        if device_of(destination).type == "cpu" and device_of(source).type != "cpu":
            if kwargs.get("non_blocking") or (len(args) > 2 and args[2]):
                where = _host(destination).untyped_storage().data_ptr()
                LEDGER.unsynced[where] = "a non-blocking device-to-host copy"
            else:
                LEDGER.sync("device-to-host copy")
        else:
            _check_readable(func, [source])
        return device_of(destination)
    return device_of(args[0][0]) if args[0] else CPU


def _collective(func, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> Any:
    """A c10d operator: NCCL takes device tensors only; it runs on the CPU data over the real (gloo) group."""
    if func.overloadpacket.__name__ != "barrier" and any(device_of(t).type == "cpu" for t in tensors):
        raise RuntimeError(f"{NCCL_CPU_ERROR} (emulated NCCL rule, in {func})")
    originals = {id(_host(t)): t for t in tensors}
    out = func(*tree_map(_host, args), **tree_map(_host, kwargs))
    return tree_map(lambda t: originals.get(id(t), t) if isinstance(t, torch.Tensor) else t, out)


class EmulatedCuda(TorchDispatchMode):
    """Active on a thread: factories asked for the emulated device make :class:`EmulatedTensor`, and every
    operator (on emulated tensors or not) follows :func:`_dispatch`'s rules."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})

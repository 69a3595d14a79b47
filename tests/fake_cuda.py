"""A stand-in for CuPy and the CUDA driver, so the CUDA backend's host side runs on a CPU.

:func:`fake_backend` returns a :class:`~pat_core.cuda_backend.CudaBackend` whose "device" is
host memory: arrays are NumPy arrays seen through ``__cuda_array_interface__``, a host-to-
device copy is a ``memmove`` (so the plan buffer holds what the kernels would read), compiling
a variant hands back a numbered function, and every kernel launch is recorded (function,
grid, block, shared memory, stream) instead of run.  Nothing here computes attention: the
tests built on it check what the backend decides and enqueues (states, prepared inputs,
launches, grids, the merge), the part of the CUDA path a machine without a GPU can check.
"""
from __future__ import annotations

import ctypes
import itertools
import sys
import types

import numpy as np

PROPS = {"name": b"NVIDIA H100 80GB HBM3", "major": 9, "minor": 0,
         "multiProcessorCount": 132, "sharedMemPerBlockOptin": 232448}


class FakeArray:
    """A "device" array: NumPy storage, ``.data.ptr`` its address, CUDA array interface."""

    def __init__(self, shape=None, dtype=None, zero=True, base=None):
        self.a = base if base is not None else (np.zeros if zero else np.empty)(shape, dtype)
        self.data = types.SimpleNamespace(ptr=self.a.ctypes.data)
        self.shape, self.dtype = self.a.shape, self.a.dtype
        self.size, self.nbytes = self.a.size, self.a.nbytes

    @classmethod
    def of(cls, host: np.ndarray) -> "FakeArray":
        return cls(base=np.array(host))

    def __getitem__(self, index) -> "FakeArray":
        """A view (same memory), as slicing a device array gives."""
        return FakeArray(base=self.a[index])

    def fill(self, value):
        self.a.fill(value)

    @property
    def __cuda_array_interface__(self):
        strides = None if self.a.flags.c_contiguous else self.a.strides
        return {"shape": self.a.shape, "typestr": self.a.dtype.str, "strides": strides,
                "data": (self.a.ctypes.data, False), "version": 3}


class _Event:
    """An event: remembers the stream it was last recorded on; ``done`` is False while the
    fake's ``busy`` is set (work "still running"); every ``synchronize`` is counted."""

    def __init__(self, fake, disable_timing=False):
        self.fake = fake
        self.stream = None

    def record(self, stream=None):
        self.stream = None if stream is None else int(stream.ptr)

    def synchronize(self):
        self.fake.event_waits.append(self)

    @property
    def done(self):
        return not self.fake.busy


class _Device:
    def __init__(self, fake, id=0):
        self.fake = fake
        self.id = 0 if id is None else int(id)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        self.fake.device_syncs += 1


class _Stream:
    def __init__(self, ptr=0):
        self.ptr = int(ptr)

    @classmethod
    def from_external(cls, obj):
        return cls(obj.__cuda_stream__()[1])


class FakeCuda:
    """The module-like object the backend uses as ``cp``; ``launches`` lists every launch as
    ``(function key, grid, block, smem, stream, parameter struct bytes)``."""

    int32, float32 = np.int32, np.float32

    def __init__(self):
        self.launches: list = []
        self._keys: dict = {}        # fake function handle -> variant key
        self._handles = itertools.count(0x1000)
        self._pinned: list = []
        self.device_syncs = 0        # Device.synchronize() calls
        self.event_waits: list = []  # events waited for (Event.synchronize), in order
        self.busy = False            # events report not done while set
        # ("memset" | "memcpy", device pointer, bytes, stream) of every asynchronous copy/fill
        self.copies: list = []
        rt = types.SimpleNamespace(
            getDeviceCount=lambda: 1, getDevice=lambda: 0,
            getDeviceProperties=lambda dev: dict(PROPS),
            memcpyHostToDevice=1, memcpyAsync=self._memcpy, memsetAsync=self._memset)
        driver = types.SimpleNamespace(launchKernel=self._launch)
        self.cuda = types.SimpleNamespace(
            runtime=rt, driver=driver, Device=lambda id=None: _Device(self, id),
            Event=lambda disable_timing=False: _Event(self, disable_timing), Stream=_Stream,
            ExternalStream=lambda handle, device: _Stream(handle),
            get_current_stream=lambda: _Stream(0),
            alloc_pinned_memory=self._alloc_pinned)

    def zeros(self, shape, dtype):
        return FakeArray(shape, dtype)

    def empty(self, shape, dtype):
        return FakeArray(shape, dtype, zero=False)

    def _alloc_pinned(self, nbytes):
        buf = (ctypes.c_char * max(1, int(nbytes)))()
        self._pinned.append(buf)
        return buf

    def _memset(self, ptr, value, nbytes, stream):
        self.copies.append(("memset", int(ptr), int(nbytes), int(stream)))
        ctypes.memset(int(ptr), int(value), int(nbytes))

    def _memcpy(self, dst, src, nbytes, kind, stream):
        self.copies.append(("memcpy", int(dst), int(nbytes), int(stream)))
        ctypes.memmove(int(dst), int(src), int(nbytes))

    def _launch(self, fptr, gx, gy, gz, bx, by, bz, smem, stream, args, extra):
        from pat_core import kernel_params as kp
        key = self._keys[int(fptr)]
        # the kernel's one argument: a parameter struct (its bytes, as the kernel would read)
        struct = kp.MergeParams if key.startswith("pat_merge") else kp.FwdParams
        params = ctypes.string_at(ctypes.c_void_p.from_address(int(args)).value,
                                  ctypes.sizeof(struct))
        self.launches.append((key, (gx, gy, gz), (bx, by, bz), int(smem), int(stream), params))

    def function(self, key):
        """A compiled-function stand-in for variant ``key`` (its launches are recorded)."""
        handle = next(self._handles)
        self._keys[handle] = key
        return types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=handle))


def fake_backend(monkeypatch):
    """A CudaBackend on :class:`FakeCuda` (returned as ``(backend, fake)``); the process-wide
    compiled-function cache is swapped for a fresh one, and restored, by ``monkeypatch``."""
    from pat_core import cuda_backend as cb
    from pat_core import cuda_launch
    fake = FakeCuda()
    # no programmatic dependent launches: those go to the real driver's cuLaunchKernelEx
    monkeypatch.setattr(cuda_launch, "_LAUNCH_EX", [None])
    # stream objects made for the fake stay out of the process-wide cache real runs use
    monkeypatch.setattr(cuda_launch, "_EXTERNAL", {})
    # the launcher takes CuPy's driver binding by import
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=fake.cuda))
    monkeypatch.setitem(sys.modules, "cupy.cuda", fake.cuda)
    monkeypatch.setattr(cb, "_import_cupy", lambda: fake)
    monkeypatch.setattr(cb, "_compile_in_workers", lambda *a, **kw: None)
    monkeypatch.setattr(cb.CudaBackend, "_functions", {})
    monkeypatch.setattr(cb.CudaBackend, "_modules", {})

    def _function(self, variant):
        key = (0, variant.key, self.defines)
        fn = self._functions.get(key)
        if fn is None:
            fn = self._functions[key] = fake.function(variant.key)
        return fn
    monkeypatch.setattr(cb.CudaBackend, "_function", _function)
    return cb.CudaBackend(), fake

"""The few CUDA driver calls the CUDA transports make directly (ctypes over ``libcuda``): 1-D and 2-D async copies.

``Tensor.copy_`` records and waits on an event pair per copy between devices and cannot express a 2-D copy, so a
copy plan (``kvmove.transport.copies``) runs here: ``cuMemcpyAsync`` per 1-D row and ``cuMemcpy2DAsync_v2``
per 2-D row, both with unified addressing (the driver infers each pointer's device, so one call serves a copy
inside one GPU and a peer copy over NVLink alike). Every call's return code is checked. A 2-D copy the driver
refuses as an invalid value (a pitch or width past this GPU's limits) is redone as its rows, with a warning
naming the copy: never silently; any other error raises.
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from typing import Any, NamedTuple

from kvmove.transport.base import TransportError
from kvmove.transport.copies import CopyPlan

CU_MEMORYTYPE_UNIFIED = 4
CUDA_ERROR_INVALID_VALUE = 1


class CUDA_MEMCPY2D(ctypes.Structure):
    """``CUDA_MEMCPY2D`` of ``cuda.h`` (128 bytes on 64-bit hosts)."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


class Driver(NamedTuple):
    memcpy: Any
    """``cuMemcpyAsync(dst, src, nbytes, stream)``"""
    memcpy2d: Any
    """``cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D*, stream)``"""
    error_name: Any
    """``cuGetErrorName(code, const char**)``"""


@functools.cache
def driver() -> Driver | None:
    """The driver entry points, or None where ``libcuda`` (or one of them) cannot be loaded."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        memcpy, memcpy2d, error_name = lib.cuMemcpyAsync, lib.cuMemcpy2DAsync_v2, lib.cuGetErrorName
    except (OSError, AttributeError):
        return None
    memcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    memcpy.restype = ctypes.c_int
    memcpy2d.argtypes = [ctypes.POINTER(CUDA_MEMCPY2D), ctypes.c_void_p]
    memcpy2d.restype = ctypes.c_int
    error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    error_name.restype = ctypes.c_int
    return Driver(memcpy, memcpy2d, error_name)


def describe(drv: Driver, code: int) -> str:
    name = ctypes.c_char_p()
    if drv.error_name(code, ctypes.byref(name)) == 0 and name.value:
        return f"{name.value.decode()} ({code})"
    return f"CUDA error {code}"


def copy_2d(s: int, d: int, w: int, h: int, sp: int, dp: int) -> CUDA_MEMCPY2D:
    """The descriptor of one 2-D copy between unified (device) addresses."""
    p = CUDA_MEMCPY2D()
    p.srcMemoryType = p.dstMemoryType = CU_MEMORYTYPE_UNIFIED
    p.srcDevice, p.srcPitch, p.dstDevice, p.dstPitch = s, sp, d, dp
    p.WidthInBytes, p.Height = w, h
    return p


def run_plan(drv: Driver, plan: CopyPlan, src: int, dst: int, stream: int, what: str) -> None:
    """Enqueue ``plan`` from device address ``src`` to ``dst`` on ``stream`` (a ``CUstream`` handle); returns at
    once (the caller synchronizes). The calling thread's current context must be the reader's device."""
    for s, d, w, h, sp, dp in plan.copies.tolist():
        if h == 1:
            _check(drv, drv.memcpy(dst + d, src + s, w, stream), what)
            continue
        code = drv.memcpy2d(ctypes.byref(copy_2d(src + s, dst + d, w, h, sp, dp)), stream)
        if code == CUDA_ERROR_INVALID_VALUE:
            warnings.warn(
                f"{what}: the driver refused a 2-D copy ({h} rows of {w} bytes, pitches {sp}/{dp}); "
                "copying its rows one by one instead",
                RuntimeWarning,
                stacklevel=2,
            )
            for r in range(h):
                _check(drv, drv.memcpy(dst + d + r * dp, src + s + r * sp, w, stream), what)
            continue
        _check(drv, code, what)


def _check(drv: Driver, code: int, what: str) -> None:
    if code != 0:
        raise TransportError(f"{what}: CUDA copy failed with {describe(drv, code)}")

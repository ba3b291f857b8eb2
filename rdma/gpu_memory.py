"""The hook for registering GPU memory with the NIC through dma-buf (issue 14 part 2).

**Off by default, and untested**: no one has run it on a machine with both a CUDA GPU and
an RDMA NIC. Until someone has, KV leaves a GPU through the pinned host staging buffers
(``services/engine/staging.py``), which the transport registers as ordinary host memory.

Turned on with ``gpu_memory="dmabuf"`` on :class:`~rdma.verbs.VerbsTransport` (or
``KVMESH_RDMA_GPU_MEMORY=dmabuf``), a transport refuses to start, with the reason, unless
all of these hold (:func:`unavailable_reason` checks them in this order):

1. its verbs layer can register a dma-buf by file descriptor: a method
   ``reg_dmabuf_mr(pd, fd, offset, length, iova)`` (``ibv_reg_dmabuf_mr``). The shipped
   pyverbs layer has none: rdma-core's ``pyverbs.mr.DmaBufMR`` only registers dma-bufs
   that pyverbs allocates itself through DRM (``pyverbs.dmabuf.DmaBuf``), not the fd
   of a CUDA allocation, and pyverbs exposes no raw PD to call libibverbs with;
2. the CUDA driver library (``libcuda.so.1``) loads and has
   ``cuMemGetHandleForAddressRange`` (a driver for CUDA 11.7 or later);
3. the device reports ``CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`` (NVIDIA's open kernel
   modules; the NIC's driver must import dma-bufs too, which only the registration
   itself can tell).

:func:`register_gpu_memory` then exports the page-aligned range holding the allocation
as a dma-buf fd and registers ``[addr, addr + length)`` on a protection domain, with the
device address as the IOVA, so peers address it like host memory. This module never
imports torch (the transfer engine does not depend on it): it takes addresses.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

MODES = ("off", "dmabuf")
ENV = "KVMESH_RDMA_GPU_MEMORY"
CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1
CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class GpuMemoryUnavailable(RuntimeError):
    """GPU memory registration was asked for where it cannot work; says why."""


def gpu_memory_mode(value: str | None = None) -> str:
    """``value``, else ``$KVMESH_RDMA_GPU_MEMORY``, else ``off``; one of :data:`MODES`."""
    mode = (value if value is not None else os.environ.get(ENV, "")).strip().lower() or "off"
    if mode not in MODES:
        raise ValueError(f"gpu_memory (or {ENV}) must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def load_libcuda() -> Any | None:
    """The CUDA driver library, or None where it does not load."""
    for name in ("libcuda.so.1", ctypes.util.find_library("cuda")):
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _cuda_check(lib: Any, rc: int, what: str) -> None:
    if rc != 0:
        raise GpuMemoryUnavailable(f"{what} failed with CUDA error {rc}")


def unavailable_reason(
    mode: str, layer: Any, device_index: int = 0, libcuda: Any = "probe"
) -> str | None:
    """None when ``mode`` is ``dmabuf`` and everything it needs is there, else what is
    missing (see the module's docstring). ``libcuda`` overrides the probe (tests)."""
    if mode == "off":
        return (
            f"GPU memory registration is off (the default; untested): KV leaves the GPU "
            f"through pinned host staging. Set gpu_memory='dmabuf' ({ENV}=dmabuf) to try it"
        )
    if not callable(getattr(layer, "reg_dmabuf_mr", None)):
        return (
            f"the verbs layer {type(layer).__name__} cannot register a dma-buf by fd "
            "(no reg_dmabuf_mr): pyverbs' DmaBufMR registers only dma-bufs pyverbs "
            "allocates itself, not a CUDA allocation's"
        )
    lib = load_libcuda() if libcuda == "probe" else libcuda
    if lib is None:
        return "the CUDA driver library (libcuda.so.1) does not load: no NVIDIA driver here"
    if not hasattr(lib, "cuMemGetHandleForAddressRange"):
        return (
            "the CUDA driver has no cuMemGetHandleForAddressRange "
            "(dma-buf export needs a driver for CUDA 11.7 or later)"
        )
    try:
        _cuda_check(lib, lib.cuInit(0), "cuInit")
        dev, supported = ctypes.c_int(0), ctypes.c_int(0)
        _cuda_check(lib, lib.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
        _cuda_check(
            lib,
            lib.cuDeviceGetAttribute(
                ctypes.byref(supported), CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev
            ),
            "cuDeviceGetAttribute(DMA_BUF_SUPPORTED)",
        )
    except GpuMemoryUnavailable as e:
        return f"CUDA device {device_index}: {e}"
    if not supported.value:
        return (
            f"CUDA device {device_index} does not support dma-buf export "
            "(CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0: NVIDIA's open kernel modules needed)"
        )
    return None


def aligned_range(addr: int, length: int, page: int = PAGE) -> tuple[int, int, int]:
    """(start, size, offset): the whole pages holding ``[addr, addr + length)``, and
    ``addr``'s offset in them (what the dma-buf is exported for and registered at)."""
    if length <= 0:
        raise ValueError(f"length must be positive, got {length}")
    start = addr - addr % page
    end = -(-(addr + length) // page) * page
    return start, end - start, addr - start


def register_gpu_memory(
    layer: Any,
    pd: Any,
    addr: int,
    length: int,
    mode: str = "off",
    device_index: int = 0,
    libcuda: Any = "probe",
) -> Any:
    """A memory region of ``[addr, addr + length)`` in CUDA device memory on ``pd``
    (IOVA = ``addr``), registered through a dma-buf; :class:`GpuMemoryUnavailable` with
    the reason where that cannot work (``mode`` off included). Untested on hardware."""
    lib = load_libcuda() if libcuda == "probe" else libcuda
    why = unavailable_reason(mode, layer, device_index, lib)
    if why is not None:
        raise GpuMemoryUnavailable(why)
    assert lib is not None
    start, size, offset = aligned_range(addr, length)
    fd = ctypes.c_int(-1)
    _cuda_check(
        lib,
        lib.cuMemGetHandleForAddressRange(
            ctypes.byref(fd),
            ctypes.c_uint64(start),
            ctypes.c_size_t(size),
            CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            ctypes.c_ulonglong(0),
        ),
        f"cuMemGetHandleForAddressRange({start:#x}, {size})",
    )
    try:  # the registration holds its own reference to the dma-buf
        return layer.reg_dmabuf_mr(pd, fd.value, offset, length, addr)
    finally:
        os.close(fd.value)

"""The dma-buf hook for GPU memory in the verbs transport (rdma/gpu_memory.py, issue 14
part 2): off by default, refused with the reason wherever it cannot work (here: no GPU,
no NIC; the shipped pyverbs layer cannot register a CUDA dma-buf), and, through a fake
CUDA driver and a fake verbs layer, the range it exports and registers."""

from __future__ import annotations

import asyncio
import ctypes
import os

import pytest

from kvmesh.rdma import gpu_memory as gm
from kvmesh.rdma.gpu_memory import (
    GpuMemoryUnavailable,
    aligned_range,
    gpu_memory_mode,
    register_gpu_memory,
    unavailable_reason,
)
from kvmesh.rdma.transport import RegionTable
from kvmesh.rdma.verbs import VerbsTransport
from tests.test_verbs import SECRET, FakeFabric, FakeVerbs


class DmabufVerbs(FakeVerbs):
    """A verbs layer that can register a dma-buf by fd (the hook's contract)."""

    def __init__(self, *a):
        super().__init__(*a)
        self.dmabuf_mrs: list[tuple] = []

    def reg_dmabuf_mr(self, pd, fd, offset, length, iova):
        os.fstat(fd)  # the fd is open while it registers
        self.dmabuf_mrs.append((pd, offset, length, iova))
        return ("mr", pd, iova)


class FakeCuda:
    """The four libcuda entry points the hook calls, with their ctypes out-parameters."""

    def __init__(self, supported: int = 1, init_rc: int = 0):
        self.supported, self.init_rc = supported, init_rc
        self.exported: list[tuple[int, int]] = []
        self.fds: list[int] = []

    def cuInit(self, flags):
        return self.init_rc

    def cuDeviceGet(self, dev, index):
        ctypes.cast(dev, ctypes.POINTER(ctypes.c_int))[0] = index
        return 0

    def cuDeviceGetAttribute(self, out, attr, dev):
        assert attr == gm.CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED
        ctypes.cast(out, ctypes.POINTER(ctypes.c_int))[0] = self.supported
        return 0

    def cuMemGetHandleForAddressRange(self, out, start, size, kind, flags):
        assert kind == gm.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
        fd = os.open(os.devnull, os.O_RDONLY)
        self.fds.append(fd)
        self.exported.append((start.value, size.value))
        ctypes.cast(out, ctypes.POINTER(ctypes.c_int))[0] = fd
        return 0


def _layer(cls=FakeVerbs):
    return cls(FakeFabric(), [("d0", 0), ("d1", 0)])


def test_off_by_default_and_a_bad_mode_names_the_choices(monkeypatch):
    monkeypatch.delenv(gm.ENV, raising=False)
    assert gpu_memory_mode() == "off"
    monkeypatch.setenv(gm.ENV, "DMABUF")
    assert gpu_memory_mode() == "dmabuf"
    with pytest.raises(ValueError, match="one of off, dmabuf, got 'nvlink'"):
        gpu_memory_mode("nvlink")
    why = unavailable_reason("off", _layer())
    assert "off (the default; untested)" in why and "KVMESH_RDMA_GPU_MEMORY=dmabuf" in why
    with pytest.raises(GpuMemoryUnavailable, match="is off"):
        register_gpu_memory(_layer(DmabufVerbs), None, 1 << 20, 4096, "off", libcuda=FakeCuda())


def test_refused_clearly_where_it_cannot_work():
    # the shipped layers cannot register a dma-buf by fd
    assert "cannot register a dma-buf by fd" in unavailable_reason("dmabuf", _layer())
    dl = _layer(DmabufVerbs)
    assert "libcuda.so.1" in unavailable_reason("dmabuf", dl, libcuda=None)
    assert "CUDA 11.7" in unavailable_reason("dmabuf", dl, libcuda=object())
    assert "cuInit failed with CUDA error 100" in unavailable_reason(
        "dmabuf", dl, libcuda=FakeCuda(init_rc=100)
    )
    assert "does not support dma-buf" in unavailable_reason(
        "dmabuf", dl, libcuda=FakeCuda(supported=0)
    )
    assert unavailable_reason("dmabuf", dl, libcuda=FakeCuda()) is None


def test_this_machine_refuses_with_a_reason():
    """No GPU and no dma-buf-capable layer here: a reason, never a crash."""
    why = unavailable_reason("dmabuf", _layer(DmabufVerbs))
    if gm.load_libcuda() is None:
        assert "does not load" in why
    else:  # a driver without a usable device still gives a reason
        assert why is None or "CUDA" in why


def test_the_transport_refuses_to_start_with_it_unavailable_and_is_off_otherwise(monkeypatch):
    monkeypatch.delenv(gm.ENV, raising=False)
    assert VerbsTransport(SECRET, layer=_layer()).gpu_memory == "off"
    with pytest.raises(GpuMemoryUnavailable, match="gpu_memory='dmabuf': the verbs layer"):
        VerbsTransport(SECRET, layer=_layer(), gpu_memory="dmabuf")
    monkeypatch.setenv(gm.ENV, "dmabuf")
    with pytest.raises(GpuMemoryUnavailable, match="cannot register a dma-buf"):
        VerbsTransport(SECRET, layer=_layer())


def test_aligned_range():
    assert aligned_range(8192 + 100, 50, page=4096) == (8192, 4096, 100)
    assert aligned_range(4096, 8192, page=4096) == (4096, 8192, 0)
    assert aligned_range(4000, 200, page=4096) == (0, 8192, 4000)
    with pytest.raises(ValueError, match="positive"):
        aligned_range(0, 0)


def test_registration_exports_the_pages_and_registers_on_every_nic(monkeypatch):
    cuda = FakeCuda()
    monkeypatch.setattr(gm, "load_libcuda", lambda: cuda)
    layer = _layer(DmabufVerbs)
    tr = VerbsTransport(SECRET, layer=layer, gpu_memory="dmabuf")

    async def go():
        await tr.start(RegionTable(), lambda payload: None)
        try:
            mrs = tr.register_gpu_memory(0x7F00_0000_0000 + 300, 10_000)
            for fd in cuda.fds:  # closed once registered (the MR holds its own reference)
                with pytest.raises(OSError):
                    os.fstat(fd)
            return mrs
        finally:
            await tr.close()

    mrs = asyncio.run(go())
    page = gm.PAGE
    start = (0x7F00_0000_0000 + 300) // page * page
    assert len(mrs) == 2 and len(cuda.exported) == 2  # one per NIC
    assert cuda.exported[0] == (start, -(-(0x7F00_0000_0000 + 10_300) // page) * page - start)
    offset = 0x7F00_0000_0000 + 300 - start
    assert [m[1:] for m in layer.dmabuf_mrs] == [(offset, 10_000, 0x7F00_0000_0000 + 300)] * 2

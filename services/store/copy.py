"""Memory copies behind the store client's bytes API (``put``/``get`` copy a value
between the caller's bytes and a segment or staging buffer).

Every copy is one ``memcpy`` that releases the GIL (``np.copyto``, ``ctypes.memmove``),
so the transfer engine's socket threads keep moving the bytes of other values while a
value is copied. ``get`` must hand back an immutable ``bytes``, so a large value is
copied straight into a fresh, not yet shared ``bytes`` object (as C extensions fill one)
rather than into a buffer that is then copied again. Batches of values of
``PARALLEL_MIN`` bytes or more are split over this thread and one helper thread.

Single values used to be copied by torch's intra-op threads above ``PARALLEL_MIN``.
On a host whose cores are busy (a model node computing, or a shared machine) that was
the slowest part of a remote put or get: 4 MiB took 0.7 ms into a staging buffer
against 0.36 ms for one memcpy, and 7.8 ms into a fresh ``bytes`` against 0.19 ms
(2 cores, load average 6), because the copy waited for torch's pool threads.
"""

from __future__ import annotations

import ctypes
import platform
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvmesh.rdma.wire import usable_cpus

PARALLEL_MIN = 1 << 20

_CPYTHON = platform.python_implementation() == "CPython"
if _CPYTHON:
    _new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
    _new_bytes.restype = ctypes.py_object
    _new_bytes.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
    _BYTES_DATA = bytes.__basicsize__ - 1  # offsetof(PyBytesObject, ob_sval)
FILLABLE_BYTES = _CPYTHON  # a fresh bytes can be filled in place (fresh_bytes_target)


def _address(buf) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


def copy_into(dst: memoryview, src) -> None:
    """``dst[:] = src`` (equal lengths; ``dst`` writable, ``src`` any buffer)."""
    n = len(dst)
    if n < PARALLEL_MIN:
        dst[:] = src
        return
    if len(src) != n:
        raise ValueError(f"copy_into: {len(src)} bytes into {n}")
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _helper() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(1, thread_name_prefix="kvmesh-store-copy")
        return _pool


def _copy_all(pairs) -> None:
    for dst, src in pairs:
        if len(dst) != len(src):  # np.copyto would broadcast a short source
            raise ValueError(f"copy: {len(src)} bytes into {len(dst)}")
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def _two_threads(items: list, sizes: list[int], fn) -> bool:
    """Runs ``fn`` over the first half of ``items`` (by bytes) on the helper thread and
    over the rest on this one; False (nothing run) when that is not worth it."""
    total = sum(sizes)
    if len(items) < 2 or total < PARALLEL_MIN or usable_cpus() < 2:
        return False
    half, cut = 0, 0
    while cut < len(items) - 1 and half + sizes[cut] <= total // 2:
        half += sizes[cut]
        cut += 1
    cut = max(cut, 1)
    done = _helper().submit(fn, items[:cut])
    try:
        fn(items[cut:])
    finally:
        done.result()
    return True


def copy_many(pairs: list[tuple[memoryview, memoryview]]) -> None:
    """``dst[:] = src`` for each pair (a batch put's values into their slots). A batch
    of ``PARALLEL_MIN`` bytes or more is split in two halves by bytes, one copied on a
    helper thread (numpy releases the GIL while it copies)."""
    if not _two_threads(pairs, [len(d) for d, _ in pairs], _copy_all):
        for dst, src in pairs:
            copy_into(dst, src)


def fresh_bytes(src: memoryview) -> bytes:
    """``bytes(src)``; a large value is copied with the GIL released."""
    n = len(src)
    if n < PARALLEL_MIN or not _CPYTHON:
        return src.tobytes()
    out = _new_bytes(None, n)  # uninitialised and referenced only here until returned
    ctypes.memmove(id(out) + _BYTES_DATA, _address(src), n)
    return out


def fresh_bytes_target(n: int) -> tuple[bytes, ctypes.Array]:
    """A fresh ``bytes`` of ``n`` uninitialised bytes and a writable ctypes view of its
    contents, for a transfer to land a value straight in the object ``get`` returns (only
    where ``FILLABLE_BYTES``). The caller must fill it completely, and must not hand it
    out until it has."""
    out = _new_bytes(None, n)
    return out, (ctypes.c_char * n).from_address(id(out) + _BYTES_DATA)


def _memmove_all(jobs) -> None:
    for dst, src, n in jobs:
        ctypes.memmove(dst, src, n)  # a foreign call: the GIL is released


def fresh_bytes_many(srcs: list[memoryview]) -> list[bytes]:
    """``[bytes(s) for s in srcs]`` (a batch get's values); a batch of ``PARALLEL_MIN``
    bytes or more is filled by two threads, half of the bytes each."""
    sizes = [len(s) for s in srcs]
    if not _CPYTHON or len(srcs) < 2 or sum(sizes) < PARALLEL_MIN:
        return [fresh_bytes(s) for s in srcs]
    outs = [_new_bytes(None, n) for n in sizes]
    jobs = [(id(o) + _BYTES_DATA, _address(s), n) for o, s, n in zip(outs, srcs, sizes)]
    if not _two_threads(jobs, sizes, _memmove_all):
        _memmove_all(jobs)
    return outs

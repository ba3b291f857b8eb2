# Compiled-only declarations for rolling.py (see policy.pxd).
cimport cython

from kvmesh.services.conductor cimport _sorted


cdef class RollingWindow:
    cdef public object _items
    cdef public list _sorted
    cdef public Py_ssize_t _nans
    cdef public Py_ssize_t _maxlen

    @cython.locals(kept=list)
    cpdef refill(self, object items)
    @cython.locals(s=list)
    cpdef append(self, object x)
    cpdef list sorted(self)
    cpdef list tail(self, Py_ssize_t k)
    @cython.locals(s=list, n=Py_ssize_t)
    cpdef object median(self)

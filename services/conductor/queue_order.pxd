# Compiled-only declarations for queue_order.py (see policy.pxd).
cimport cython

from kvmesh.services.conductor cimport _sorted


cdef class QueueOrder:
    cdef public list keys
    cdef public dict _key_of
    cdef public dict _dirty
    cdef public object _version
    cdef public object _of

    cpdef moved(self, object state)
    @cython.locals(dirty=dict, keys=list, key_of=dict, old=tuple, new=tuple, i=Py_ssize_t)
    cpdef sync(self, object nodes)
    @cython.locals(out=list)
    cpdef list least(self, object nodes, Py_ssize_t k, object skip)

# Compiled-only declarations for index.py (see policy.pxd).
cimport cython

from kvmesh.services.conductor cimport _blocktable, _prefetch


cdef class Lookup:
    cdef public dict per_node
    cdef public long store_prefix
    cdef public long store_dram_prefix


@cython.locals(holders=object, n=Py_ssize_t)
cdef Py_ssize_t _run(dict pool, list hashes, Py_ssize_t i, object node) except -1


cdef class CacheIndex:
    cdef public dict _pool
    cdef public dict _by_node
    cdef public dict _names
    cdef public dict _store
    cdef public dict _ssd
    cdef public object _table

    @cython.locals(out=Lookup, n=Py_ssize_t, k=Py_ssize_t, dram=Py_ssize_t,
                   store=dict, ssd=dict, per_node=dict)
    cpdef Lookup lookup(self, list hashes)

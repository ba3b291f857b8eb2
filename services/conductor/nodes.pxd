# Compiled-only declarations for nodes.py (see policy.pxd).
cimport cython

from kvmesh.services.conductor cimport _sorted

from kvmesh.services.conductor.estimator cimport DecodeModel, MeasuredRate, PrefillModel
from kvmesh.services.conductor.queue_order cimport QueueOrder


cdef class PrefillNodeState:
    cdef public tuple _orders
    cdef public object node_id
    cdef public long block_size
    cdef public long block_nbytes
    cdef public long layer_nbytes
    cdef public PrefillModel model
    cdef public double bandwidth
    cdef public object store_fetch
    cdef public dict queue
    cdef public double _queue_ms
    cdef public double head_since
    cdef public MeasuredRate rate
    cdef public double lag_ms
    cdef public long foreign
    cdef public double foreign_ms

    @cython.locals(order=QueueOrder)
    cpdef _set_queue_ms(self, double ms)
    cpdef enqueue(self, object rid, double ms, double now=*)
    @cython.locals(queue=dict, left=double, head=object)
    cpdef dequeue(self, object rid, double now=*)
    @cython.locals(f=double, head=double, since=double, late=double, done=double,
                   served=double, foreign=double, queue=dict)
    cpdef tuple wait(self, double now)


cdef class DecodeNodeState:
    cdef public object node_id
    cdef public long block_size
    cdef public long kv_blocks_total
    cdef public long kv_blocks_free
    cdef public DecodeModel model
    cdef public PrefillModel prefill_model
    cdef public double bandwidth
    cdef public list ends
    cdef public list joins
    cdef public dict join_of
    cdef public dict work
    cdef public long kv_tokens
    cdef public long reserved_blocks
    cdef public set unreported
    cdef public dict reserve_seq
    cdef public long reports_seen
    cdef public double local_queue_ms
    cdef public dict local_booked
    cdef public long foreign
    cdef public long foreign_kv
    cdef public MeasuredRate prefill_rate
    cdef public dict prompts
    cdef public dict waiting
    cdef public long waiting_blocks

    cpdef admit(self, object rid, double end, long kv, long blocks, double join=*)
    @cython.locals(end=double, kv=long, blocks=long)
    cpdef finish(self, object rid)
    cpdef book_local(self, object rid, double ms)
    cpdef unbook_local(self, object rid)
    cpdef joined(self, object rid, double t)
    cpdef prompt_held(self, object rid, object hashes)
    @cython.locals(best=Py_ssize_t, lo=Py_ssize_t, hi=Py_ssize_t, mid=Py_ssize_t)
    cpdef Py_ssize_t held_prefix(self, object hashes, Py_ssize_t most)


@cython.locals(i=Py_ssize_t)
cdef _remove(list xs, double x)

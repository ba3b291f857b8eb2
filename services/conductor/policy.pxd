# Compiled-only declarations for policy.py, in Cython's "pure Python mode": policy.py
# stays plain, importable Python (what runs where nothing was compiled), and this file
# types its hot state and functions when setup.py compiles it. Types only: every
# computation is policy.py's own, in the same order (decisions stay bit-identical).
cimport cython

from kvmesh.services.conductor cimport _sorted

from kvmesh.services.conductor.estimator cimport (
    DecodeModel,
    ErrorTail,
    ErrorTracker,
    MeasuredRate,
    PrefillModel,
)
from kvmesh.services.conductor.index cimport CacheIndex, Lookup
from kvmesh.services.conductor.queue_order cimport QueueOrder
from kvmesh.services.conductor.rolling cimport RollingWindow


cdef class Request:
    cdef public object request_id
    cdef public long n_tokens
    cdef public object hashes
    cdef public long max_tokens
    cdef public double ttft_slo_ms
    cdef public double tbt_slo_ms
    cdef public double ttft_spent_ms


cdef class Candidate:
    cdef public str route
    cdef public object node
    cdef public double ttft_ms
    cdef public double queue_ms
    cdef public double prefill_ms
    cdef public double fetch_ms
    cdef public double handoff_ms
    cdef public long cached_blocks
    cdef public long fetch_blocks
    cdef public double work_ms
    cdef public double speed


cdef class Decision:
    cdef public bint accepted
    cdef public object route
    cdef public object prefill_node
    cdef public object decode_node
    cdef public object estimate
    cdef public double tbt_ms
    cdef public list candidates
    cdef public object reason
    cdef public object message
    cdef public double retry_after_ms

    cpdef tuple booked(self)


cdef class _Misses:
    cdef public str reason
    cdef public object least_tbt


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
    cdef public double local_queue_ms
    cdef public long foreign
    cdef public long foreign_kv
    cdef public MeasuredRate prefill_rate

    cpdef admit(self, object rid, double end, long kv, long blocks, double join=*)
    @cython.locals(end=double, kv=long, blocks=long)
    cpdef finish(self, object rid)
    cpdef joined(self, object rid, double t)


@cython.locals(i=Py_ssize_t)
cdef _remove(list xs, double x)


@cython.locals(bs=long, a=double, b=double, k2=double, fetch_blocks=long, fetch_ms=double,
               top=long, k=long, on_ssd=long, new=long, cached=long, new2=long,
               cached2=long, saved=double, held=long, prefill_ms=double, new_blocks=long,
               bw=double, over=double, handoff_ms=double, work=double, queue=double,
               f=double, c=Candidate)
cdef Candidate _disagg_candidate(PrefillNodeState p, long n, long usable, long local,
                                 long store_prefix, bint use_store, double now,
                                 object dram_prefix, double overhead_ms,
                                 double ssd_bytes_per_ms)


@cython.locals(n=Py_ssize_t, i=Py_ssize_t, j=Py_ssize_t, t=double, c=Candidate,
               prev=Candidate)
cdef _sort_by_ttft(list cands)


@cython.locals(best_tbt=double, d=DecodeNodeState, ends=list, joins=list,
               now_batch=Py_ssize_t, batch=Py_ssize_t, kv=double, a_=double, b_=double,
               k_=double, tbt=double, last=double, first=double)
cdef object _decode_scan(object options, long need_blocks, double at, long n,
                         double tbt_limit, bint predict, _Misses misses)


cdef class Scheduler:
    cdef dict __dict__  # (a test may hang its own attributes on the scheduler)
    cdef public object cfg
    cdef public CacheIndex index
    cdef public object clock
    cdef public object rng
    cdef public object prefill
    cdef public QueueOrder _queue_order
    cdef public dict decode
    cdef public ErrorTracker ttft_error
    cdef public dict overhead_ms
    cdef public dict _residuals
    cdef public double _output_share
    cdef public dict error_tail

    @cython.locals(now=double, n=long, bs=long, usable=long, look=Lookup, cands=list,
                   fast=list)
    cpdef Decision decide(self, Request r, object store_prefix=*)
    @cython.locals(look=Lookup)
    cpdef _lookup(self, object hashes, object store_prefix)
    @cython.locals(pick=list, order=QueueOrder, k=Py_ssize_t)
    cpdef list _prefill_nodes(self, dict per_node)
    @cython.locals(per_node=dict, use_store=bint, store_prefix=long, overhead=double,
                   ssd_rate=double, cands=list, p=PrefillNodeState)
    cpdef list _prefill_candidates(self, long n, long usable, Lookup look, bint store_given,
                                   double now)
    @cython.locals(out=list, colocate=bint, d=DecodeNodeState)
    cpdef list _decode_node_candidates(self, long n, long usable, dict per_node)
    @cython.locals(ttft_limit=double, tail=dict, misses=_Misses, c=Candidate,
                   et=ErrorTail, d=DecodeNodeState, tbt=double)
    cpdef Decision _admit(self, Request r, list cands, long need_blocks, double now)
    @cython.locals(tbt_limit=double)
    cpdef _decode_choice(self, Request r, Candidate c, long need_blocks, double now,
                         _Misses misses)
    @cython.locals(now=double, c=Candidate, dn=DecodeNodeState, p=PrefillNodeState,
                   expected=double, join=double)
    cpdef commit(self, Request r, Decision d)
    @cython.locals(now=double, c=Candidate, dn=DecodeNodeState, p=PrefillNodeState,
                   transfer=double, window=RollingWindow, et=ErrorTail)
    cpdef prefill_done(self, Request r, Decision d, long new, long cached, object ms=*,
                       object ttft_ms=*, object node_ms=*, object node_queue_ms=*)
    @cython.locals(dn=DecodeNodeState, share=double)
    cpdef request_done(self, Request r, Decision d, object output_tokens=*)

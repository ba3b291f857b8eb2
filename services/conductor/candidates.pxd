# Compiled-only declarations for candidates.py (see policy.pxd).
cimport cython

from kvmesh.services.conductor cimport _sorted

from kvmesh.services.conductor.nodes cimport DecodeNodeState, PrefillNodeState


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
    cdef public double kv_wait_ms

    cpdef tuple booked(self)


cdef class Misses:
    cdef public str reason
    cdef public object least_tbt
    cdef public bint kv_short


@cython.locals(bs=long, a=double, b=double, k2=double, fetch_blocks=long, fetch_ms=double,
               top=long, k=long, on_ssd=long, new=long, cached=long, new2=long,
               cached2=long, saved=double, held=long, prefill_ms=double, new_blocks=long,
               bw=double, over=double, handoff_ms=double, work=double, queue=double,
               f=double, c=Candidate)
cdef Candidate disagg_candidate(PrefillNodeState p, long n, long usable, long local,
                                long store_prefix, bint use_store, double now,
                                object dram_prefix, double overhead_ms,
                                double ssd_bytes_per_ms)


@cython.locals(n=Py_ssize_t, i=Py_ssize_t, j=Py_ssize_t, t=double, c=Candidate,
               prev=Candidate)
cdef sort_by_ttft(list cands)


@cython.locals(best_tbt=double, d=DecodeNodeState, ends=list, joins=list,
               now_batch=Py_ssize_t, batch=Py_ssize_t, kv=double, a_=double, b_=double,
               k_=double, tbt=double, last=double, first=double, room=long)
cdef object decode_scan(object options, long need_blocks, double at, long n,
                        double tbt_limit, bint predict, Misses misses, object hashes)

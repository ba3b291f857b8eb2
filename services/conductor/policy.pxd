# Compiled-only declarations for policy.py, in Cython's "pure Python mode": policy.py
# stays plain, importable Python (what runs where nothing was compiled), and this file
# types its hot state and functions when setup.py compiles it. Types only: every
# computation is policy.py's own, in the same order (decisions stay bit-identical).
cimport cython

# candidates.py's and nodes.py's types by their module's name: a name cimported alone
# would hide policy.py's import of it, which re-exports it (compiled, no such attribute)
from kvmesh.services.conductor cimport candidates, nodes

from kvmesh.services.conductor.estimator cimport ErrorTail, ErrorTracker
from kvmesh.services.conductor.index cimport CacheIndex, Lookup
from kvmesh.services.conductor.queue_order cimport QueueOrder
from kvmesh.services.conductor.rolling cimport RollingWindow


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
    cpdef candidates.Decision decide(self, candidates.Request r, object store_prefix=*)
    @cython.locals(look=Lookup)
    cpdef _lookup(self, object hashes, object store_prefix)
    @cython.locals(pick=list, order=QueueOrder, k=Py_ssize_t)
    cpdef list _prefill_nodes(self, dict per_node)
    @cython.locals(per_node=dict, use_store=bint, store_prefix=long, overhead=double,
                   ssd_rate=double, cands=list, p=nodes.PrefillNodeState)
    cpdef list _prefill_candidates(self, long n, long usable, Lookup look, bint store_given,
                                   double now)
    @cython.locals(out=list, colocate=bint, d=nodes.DecodeNodeState)
    cpdef list _decode_node_candidates(self, long n, long usable, dict per_node)
    @cython.locals(ttft_limit=double, tail=dict, misses=candidates.Misses,
                   c=candidates.Candidate, et=ErrorTail, f=double, d=nodes.DecodeNodeState,
                   tbt=double)
    cpdef candidates.Decision _admit(self, candidates.Request r, list cands,
                                     long need_blocks, double now)
    @cython.locals(tbt_limit=double)
    cpdef _decode_choice(self, candidates.Request r, candidates.Candidate c,
                         long need_blocks, double now, candidates.Misses misses)
    @cython.locals(now=double, c=candidates.Candidate, dn=nodes.DecodeNodeState,
                   expected=double, join=double, blocks=long)
    cpdef commit(self, candidates.Request r, candidates.Decision d)
    @cython.locals(now=double, c=candidates.Candidate, dn=nodes.DecodeNodeState,
                   p=nodes.PrefillNodeState, transfer=double, window=RollingWindow,
                   et=ErrorTail)
    cpdef prefill_done(self, candidates.Request r, candidates.Decision d, long new,
                       long cached, object ms=*, object ttft_ms=*, object node_ms=*,
                       object node_queue_ms=*)
    @cython.locals(dn=nodes.DecodeNodeState, share=double)
    cpdef request_done(self, candidates.Request r, candidates.Decision d,
                       object output_tokens=*)

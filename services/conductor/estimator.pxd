# Compiled-only declarations for estimator.py (see policy.pxd).
cimport cython


cdef class _Regression:
    cdef dict __dict__  # (an instance may replace a method: tests stub ``fit``)
    cdef public list coef
    cdef public Py_ssize_t _window
    cdef public Py_ssize_t _nf
    cdef public object _xraw
    cdef public object _yraw
    cdef public object _xbuf
    cdef public object _ybuf
    cdef public Py_ssize_t _head
    cdef public Py_ssize_t _rows
    cdef public object _errors
    cdef public long _refit_every
    cdef public long _pending
    cdef public long observations
    cdef public list _amax
    cdef public object _amax_obs
    cdef public long _scaled_to


cdef class PrefillModel(_Regression):
    pass


cdef class DecodeModel(_Regression):
    pass


cdef class ErrorTracker:
    cdef public object _e


cdef class MeasuredRate:
    cdef public double lo
    cdef public double hi
    cdef public long recent
    cdef public long warmup
    cdef public long least
    cdef public long observations
    cdef public object _seen
    cdef public double _factor
    cdef public object _coef
    cdef public object _ratios
    cdef public long _fresh

    cpdef double factor(self, object model) except? -1.0


cdef class ErrorTail:
    cdef public double quantile
    cdef public long least
    cdef public double lo
    cdef public double hi
    cdef public object _ratios
    cdef public double value

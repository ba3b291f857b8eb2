# Compiled-only declarations for estimator.py (see policy.pxd).
cimport cython

from kvmesh.services.conductor.normal_fit cimport normal_nnls
from kvmesh.services.conductor.rolling cimport RollingWindow


cdef class _Regression:
    cdef dict __dict__  # (an instance may replace a method: tests stub ``fit``)
    cdef public list coef
    cdef public Py_ssize_t _window
    cdef public Py_ssize_t _nf
    cdef public object _xraw
    cdef public object _yraw
    cdef public object _xbuf
    cdef public object _ybuf
    cdef double[::1] _xr
    cdef double[::1] _yr
    cdef public Py_ssize_t _head
    cdef public Py_ssize_t _rows
    cdef public object _errors
    cdef public long _refit_every
    cdef public long _pending
    cdef public long observations
    cdef public list _amax
    cdef public object _amax_obs
    cdef public long _scaled_to

    cpdef tuple _features(self, object x, object y)
    @cython.locals(c=list)
    cpdef object _predict(self, tuple f)
    # (the rings typed as memory: no conversion call per number written or read)
    @cython.locals(i=Py_ssize_t, w=Py_ssize_t, j=Py_ssize_t, f=tuple, xr=double[::1],
                   yr=double[::1])
    cpdef add(self, tuple args, object ms, bint track_error=*)
    @cython.locals(obs=long, rows=Py_ssize_t, w=Py_ssize_t, gone=long, amax=list,
                   xr=double[::1], stride=Py_ssize_t, o=long, j=Py_ssize_t, f=Py_ssize_t,
                   v=double)
    cpdef list _scales(self, object xt)


cdef class PrefillModel(_Regression):
    cpdef tuple _features(self, object new, object cached)
    cpdef observe(self, object new, object cached, object ms)


cdef class DecodeModel(_Regression):
    cpdef tuple _features(self, object batch, object kv_tokens)
    cpdef observe(self, object batch, object kv_tokens, object ms)


cdef class ErrorTracker:
    cdef public object _e

    cpdef add(self, object estimated, object actual)


cdef class MeasuredRate:
    cdef public double lo
    cdef public double hi
    cdef public long recent
    cdef public long warmup
    cdef public long least
    cdef public long observations
    cdef public Py_ssize_t _window
    cdef public object _rows
    cdef public object _ratio
    cdef public object _sorted
    cdef double[::1] _rv
    cdef double[::1] _qv
    cdef double[::1] _sv
    cdef public Py_ssize_t _head
    cdef public Py_ssize_t _count
    cdef public double _factor
    cdef public object _coef
    cdef public long _fresh

    @cython.locals(h=Py_ssize_t, rows=double[::1])
    cpdef observe(self, object new, object cached, object extra_ms, object actual_ms)
    cpdef double factor(self, _Regression model) except? -1.0
    @cython.locals(w=Py_ssize_t, count=Py_ssize_t, fresh=Py_ssize_t, rows=double[::1],
                   ratio=double[::1], lo=double, hi=double, full=bint, todo=Py_ssize_t,
                   s=Py_ssize_t, three=bint, a=double, b=double, k=double, n=double,
                   c=double, x=double, ms=double, pred=double, r=double, f=double,
                   few=long, last=Py_ssize_t, y=double, z=double, m=double)
    cdef double _refactor(self, _Regression model, list coef) except? -1.0


@cython.locals(i=Py_ssize_t, j=Py_ssize_t, v=double)
cdef double _median_of(double[::1] ring, Py_ssize_t count, double[::1] out)


cdef class ErrorTail:
    cdef public double quantile
    cdef public long least
    cdef public long least_sized
    cdef public double lo
    cdef public double hi
    cdef public double mid_share
    cdef public double near_share
    cdef public RollingWindow _ratios
    cdef public RollingWindow _mid
    cdef public RollingWindow _near
    cdef public double value
    cdef public double mid_value
    cdef public double near_value
    cdef public double _mid_tail
    cdef public double _near_tail
    cdef public double horizon_ms
    cdef public long _window
    cdef public object _log
    cdef public double _next_expiry
    cdef public double idle_share
    cdef public RollingWindow _idle
    cdef public double idle_value

    @cython.locals(r=list, last=Py_ssize_t, i=Py_ssize_t, q=double)
    cdef double _tail(self, RollingWindow ratios) except? -1.0
    @cython.locals(ratios=RollingWindow, mid=RollingWindow, near=RollingWindow, ratio=double,
                   sz=double, to_mid=bint, to_near=bint, v=double, idle=bint)
    cpdef add(self, object estimated, object actual, double limit=*, object size=*,
              double now=*, double wait=*)
    @cython.locals(cut=double, w=Py_ssize_t, v=double, mt=double, nt=double)
    cpdef expire(self, double now)
    @cython.locals(f=double, v=double)
    cpdef double factor(self, double estimate, double limit, double wait=*)

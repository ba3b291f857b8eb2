# Typed inline versions of _sorted.py's functions, for the compiled modules that cimport
# this file (the name resolves to these where compiled, to bisect's where not).
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE


cdef inline Py_ssize_t bisect_right(list xs, double x) except -1:
    cdef Py_ssize_t lo = 0, hi = PyList_GET_SIZE(xs), mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if x < <double><object>PyList_GET_ITEM(xs, mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


cdef inline Py_ssize_t bisect_left(list xs, double x) except -1:
    cdef Py_ssize_t lo = 0, hi = PyList_GET_SIZE(xs), mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if <double><object>PyList_GET_ITEM(xs, mid) < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


cdef inline int insort(list xs, object x) except -1:
    xs.insert(bisect_right(xs, x), x)  # (the object itself, as bisect.insort)
    return 0

# Typed inline versions of _sorted.py's functions, for the compiled modules that cimport
# this file (the name resolves to these where compiled, to bisect's where not).
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.tuple cimport PyTuple_GET_ITEM


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


# the least-queued order's keys: (queue ms, node id) tuples, compared as tuples are
cdef inline bint _key_lt(tuple v, tuple w) except -1:
    cdef object a = <object>PyTuple_GET_ITEM(v, 0), b = <object>PyTuple_GET_ITEM(w, 0)
    if a is b or <double>a == <double>b:  # (tuple comparison: identity, then ==)
        a, b = <object>PyTuple_GET_ITEM(v, 1), <object>PyTuple_GET_ITEM(w, 1)
        if a is b or a == b:
            return False
        return a < b
    return <double>a < <double>b


cdef inline Py_ssize_t bisect_left_key(list keys, tuple key) except -1:
    cdef Py_ssize_t lo = 0, hi = PyList_GET_SIZE(keys), mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if _key_lt(<tuple>PyList_GET_ITEM(keys, mid), key):
            lo = mid + 1
        else:
            hi = mid
    return lo


cdef inline int insort_key(list keys, tuple key) except -1:
    cdef Py_ssize_t lo = 0, hi = PyList_GET_SIZE(keys), mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if _key_lt(key, <tuple>PyList_GET_ITEM(keys, mid)):
            hi = mid
        else:
            lo = mid + 1
    keys.insert(lo, key)
    return 0

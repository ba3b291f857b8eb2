# Prefetch hints for the compiled cache index (_prefetch.h); _prefetch.py is the plain
# Python stand-in (nothing to do).
cdef extern from "_prefetch.h":
    int prefetch "kvmesh_prefetch"(object d, object keys)

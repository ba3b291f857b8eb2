# The compiled cache index's block table (_blocktable.h); _blocktable.py is the plain
# Python stand-in (no table: the dicts answer).
cdef extern from "_blocktable.h":
    object new_table "kvmesh_kvt_new"()
    int set_holder "kvmesh_kvt_set_holder"(object t, object key, object holder) except -1
    int set_store "kvmesh_kvt_set_store"(object t, object key, long store, long ssd) except -1
    int clear_store "kvmesh_kvt_clear_store"(object t) except -1
    object lookup "kvmesh_kvt_lookup"(object t, object keys, object per_node)

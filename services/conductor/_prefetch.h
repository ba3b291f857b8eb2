/* Prefetch hints for the cache index's lookups (index.py, through _prefetch.pxd).
 *
 * A lookup follows a request's block hashes through dicts of 10^6 entries, one probe
 * after another; each probe is a cache and TLB miss, and each waits for the one before.
 * kvmesh_prefetch() first asks for the hash-table slots of all the hashes at once, then
 * for the entries those slots point to, so that the misses overlap; the lookup itself
 * then runs as before. It reads CPython 3.11's dict layout (Include/internal/
 * pycore_dict.h) only to compute addresses for __builtin_prefetch, which never faults
 * and never changes a result: elsewhere it does nothing. */
#ifndef KVMESH_PREFETCH_H
#define KVMESH_PREFETCH_H

#include <Python.h>
#include <stdint.h>

#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000 && \
    (defined(__GNUC__) || defined(__clang__)) && !defined(Py_LIMITED_API)

typedef struct {  /* CPython 3.11's struct _dictkeysobject, up to its indices */
    Py_ssize_t dk_refcnt;
    uint8_t dk_log2_size;
    uint8_t dk_log2_index_bytes;
    uint8_t dk_kind;
    uint32_t dk_version;
    Py_ssize_t dk_usable;
    Py_ssize_t dk_nentries;
    char dk_indices[];
} kvmesh_dictkeys;

#define KVMESH_PREFETCH_MAX 64

static inline int kvmesh_prefetch(PyObject *d, PyObject *keys) {
    PyDictObject *mp = (PyDictObject *)d;
    kvmesh_dictkeys *dk;
    Py_ssize_t n, i, ix;
    Py_hash_t hs[KVMESH_PREFETCH_MAX];
    size_t mask, slot, width;
    char *entries;
    size_t esize;
    int log2;
    if (!PyDict_CheckExact(d) || !PyList_CheckExact(keys) || mp->ma_values != NULL)
        return 0;
    dk = (kvmesh_dictkeys *)mp->ma_keys;
    log2 = dk->dk_log2_size;
    mask = ((size_t)1 << log2) - 1;
    width = (size_t)1 << (dk->dk_log2_index_bytes - log2);  /* bytes per index */
    n = PyList_GET_SIZE(keys);
    if (n > KVMESH_PREFETCH_MAX)
        n = KVMESH_PREFETCH_MAX;
    for (i = 0; i < n; i++) {  /* the slots, all at once */
        PyObject *k = PyList_GET_ITEM(keys, i);
        hs[i] = PyBytes_CheckExact(k) ? PyObject_Hash(k) : -1;  /* (bytes: never fails) */
        if (hs[i] != -1)
            __builtin_prefetch(dk->dk_indices + ((size_t)hs[i] & mask) * width);
    }
    entries = dk->dk_indices + ((size_t)1 << dk->dk_log2_index_bytes);
    esize = dk->dk_kind == 0 ? 3 * sizeof(void *) : 2 * sizeof(void *);
    for (i = 0; i < n; i++) {  /* then the entries they point to */
        if (hs[i] == -1)
            continue;
        slot = (size_t)hs[i] & mask;
        if (log2 < 8)
            ix = ((int8_t *)dk->dk_indices)[slot];
        else if (log2 < 16)
            ix = ((int16_t *)dk->dk_indices)[slot];
        else if (log2 >= 32)
            ix = (Py_ssize_t)((int64_t *)dk->dk_indices)[slot];
        else
            ix = ((int32_t *)dk->dk_indices)[slot];
        if (ix >= 0 && ix < dk->dk_nentries)
            __builtin_prefetch(entries + (size_t)ix * esize);
    }
    return 0;
}

#else

static inline int kvmesh_prefetch(PyObject *d, PyObject *keys) {
    (void)d;
    (void)keys;
    return 0;
}

#endif
#endif

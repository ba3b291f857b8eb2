/* The compiled cache index's block table (index.py, through _blocktable.pxd).
 *
 * The index keeps its dicts (hash -> pool holder(s); hash -> store replicas; hash -> SSD
 * replicas) as the truth. Compiled, it also keeps this mirror of all three: one open
 * addressing table (linear probing) of 32-byte slots keyed by the block hash, in memory
 * mapped with MADV_HUGEPAGE. A lookup then costs one cache miss per block (the slot
 * holds the holder and both replica counts), its misses overlapped by prefetching a
 * request's slots at once, and few TLB misses, instead of two dict probes per block
 * (index slot, entry) in each of two dicts of 10^6 entries.
 *
 * The table holds a reference to each key (exact bytes only: any other key marks the
 * table broken, and lookups go back to the dicts) and to each holder (the same str or
 * set object the pool dict holds). Lookups run no Python code while they read it.
 *
 * A write answers 1 once the table is broken (a key that is not bytes, out of memory):
 * the index then drops it, which frees its memory and references, and says so. */
#ifndef KVMESH_BLOCKTABLE_H
#define KVMESH_BLOCKTABLE_H

#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

typedef struct {
    Py_hash_t hash;
    PyObject *key;    /* NULL: an empty slot */
    PyObject *holder; /* the pool dict's value (str or set); NULL: in no node's pool */
    int32_t store;    /* replicas in the store, any tier (the store dict's value, or 0) */
    int32_t ssd;      /* replicas on an SSD tier (the ssd dict's value, or 0) */
} kvmesh_kvt_slot;

typedef struct {
    kvmesh_kvt_slot *slots;
    void *base; /* the mapping (slots is its 2 MiB aligned part) */
    size_t map_bytes;
    size_t mask; /* capacity - 1 */
    size_t used;
    Py_ssize_t n_ssd; /* keys with SSD replicas (the ssd dict's length) */
    int broken;       /* a key that is not bytes, a count past 2^31: the dicts answer */
} kvmesh_kvt;

#define KVMESH_KVT_NAME "kvmesh.blocktable"
#define KVMESH_KVT_HUGE ((size_t)2 << 20)
#define KVMESH_KVT_CHUNK 64

static kvmesh_kvt_slot *kvmesh_kvt_alloc(size_t cap, void **base, size_t *map_bytes) {
    size_t bytes = cap * sizeof(kvmesh_kvt_slot);
    size_t total = bytes >= KVMESH_KVT_HUGE ? bytes + KVMESH_KVT_HUGE : bytes;
    char *p = (char *)mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                           -1, 0);
    if (p == (char *)MAP_FAILED)
        return NULL;
    *base = p;
    *map_bytes = total;
    if (bytes >= KVMESH_KVT_HUGE) { /* aligned to a huge page, and asked for them */
        p = (char *)(((uintptr_t)p + KVMESH_KVT_HUGE - 1) & ~(uintptr_t)(KVMESH_KVT_HUGE - 1));
#ifdef MADV_HUGEPAGE
        madvise(p, bytes, MADV_HUGEPAGE);
#endif
    }
    return (kvmesh_kvt_slot *)p; /* zeroed: every slot empty */
}

static void kvmesh_kvt_capsule_free(PyObject *cap) {
    kvmesh_kvt *t = (kvmesh_kvt *)PyCapsule_GetPointer(cap, KVMESH_KVT_NAME);
    size_t i;
    if (t == NULL)
        return;
    for (i = 0; i <= t->mask; i++) {
        if (t->slots[i].key != NULL) {
            Py_DECREF(t->slots[i].key);
            Py_XDECREF(t->slots[i].holder);
        }
    }
    munmap(t->base, t->map_bytes);
    PyMem_Free(t);
}

/* A new, empty table (a capsule). */
static PyObject *kvmesh_kvt_new(void) {
    kvmesh_kvt *t = (kvmesh_kvt *)PyMem_Calloc(1, sizeof(kvmesh_kvt));
    PyObject *cap;
    if (t == NULL)
        return PyErr_NoMemory();
    t->mask = 1023;
    t->slots = kvmesh_kvt_alloc(t->mask + 1, &t->base, &t->map_bytes);
    if (t->slots == NULL) {
        PyMem_Free(t);
        return PyErr_NoMemory();
    }
    cap = PyCapsule_New(t, KVMESH_KVT_NAME, kvmesh_kvt_capsule_free);
    if (cap == NULL) {
        munmap(t->base, t->map_bytes);
        PyMem_Free(t);
    }
    return cap;
}

static inline kvmesh_kvt *kvmesh_kvt_get(PyObject *cap) {
    return (kvmesh_kvt *)PyCapsule_GetPointer(cap, KVMESH_KVT_NAME);
}

static inline int kvmesh_kvt_eq(PyObject *a, PyObject *b) { /* both exact bytes */
    Py_ssize_t n;
    if (a == b)
        return 1;
    n = PyBytes_GET_SIZE(a);
    return n == PyBytes_GET_SIZE(b) && memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), n) == 0;
}

/* The slot of ``key``, or the empty slot where it would go. */
static inline kvmesh_kvt_slot *kvmesh_kvt_find(kvmesh_kvt *t, PyObject *key, Py_hash_t h) {
    size_t i = (size_t)h & t->mask;
    for (;;) {
        kvmesh_kvt_slot *s = &t->slots[i];
        if (s->key == NULL || (s->hash == h && kvmesh_kvt_eq(s->key, key)))
            return s;
        i = (i + 1) & t->mask;
    }
}

/* Moves every slot that ``keep`` accepts into a new mapping of ``cap`` slots; the
 * others lose their references. */
static int kvmesh_kvt_rebuild(kvmesh_kvt *t, size_t cap, int drop_store) {
    void *base;
    size_t map_bytes, i, j, mask = cap - 1;
    kvmesh_kvt_slot *ns = kvmesh_kvt_alloc(cap, &base, &map_bytes), *old = t->slots;
    size_t old_cap = t->mask + 1;
    void *old_base = t->base;
    size_t old_bytes = t->map_bytes;
    if (ns == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->used = 0;
    for (i = 0; i < old_cap; i++) {
        kvmesh_kvt_slot s = old[i];
        if (s.key == NULL)
            continue;
        if (drop_store) {
            s.store = s.ssd = 0;
            if (s.holder == NULL) {
                Py_DECREF(s.key);
                continue;
            }
        }
        j = (size_t)s.hash & mask;
        while (ns[j].key != NULL)
            j = (j + 1) & mask;
        ns[j] = s;
        t->used++;
    }
    if (drop_store)
        t->n_ssd = 0;
    t->slots = ns;
    t->mask = mask;
    t->base = base;
    t->map_bytes = map_bytes;
    munmap(old_base, old_bytes);
    return 0;
}

/* Empties slot ``s`` (backward shift: the slots after it that belong before it move). */
static void kvmesh_kvt_delete(kvmesh_kvt *t, kvmesh_kvt_slot *s) {
    size_t mask = t->mask, i = (size_t)(s - t->slots), j = i, home;
    PyObject *key = s->key, *holder = s->holder;
    for (;;) {
        j = (j + 1) & mask;
        if (t->slots[j].key == NULL)
            break;
        home = (size_t)t->slots[j].hash & mask;
        /* slot j may move to the hole at i unless its home lies cyclically in (i, j] */
        if (i <= j ? (home <= i || home > j) : (home <= i && home > j)) {
            t->slots[i] = t->slots[j];
            i = j;
        }
    }
    memset(&t->slots[i], 0, sizeof(kvmesh_kvt_slot));
    t->used--;
    Py_DECREF(key);
    Py_XDECREF(holder);
}

/* The slot for ``key``, added if missing (NULL without an exception where the table
 * is or becomes broken, out of memory included: the dicts answer then). */
static kvmesh_kvt_slot *kvmesh_kvt_slot_of(kvmesh_kvt *t, PyObject *key, int add) {
    Py_hash_t h;
    kvmesh_kvt_slot *s;
    if (t->broken)
        return NULL;
    if (!PyBytes_CheckExact(key)) {
        t->broken = 1;
        return NULL;
    }
    h = PyObject_Hash(key);
    if (h == -1)
        return NULL;
    s = kvmesh_kvt_find(t, key, h);
    if (s->key == NULL && add) {
        if ((t->used + 1) * 2 > t->mask + 1) {
            if (kvmesh_kvt_rebuild(t, (t->mask + 1) * 2, 0) < 0) {
                /* out of memory: the dicts (written first) answer from now on */
                t->broken = 1;
                PyErr_Clear();
                return NULL;
            }
            s = kvmesh_kvt_find(t, key, h);
        }
        Py_INCREF(key);
        s->key = key;
        s->hash = h;
        s->holder = NULL;
        s->store = s->ssd = 0;
        t->used++;
    }
    return s;
}

/* ``key``'s pool holder is now ``holder`` (the pool dict's value; None: no holder).
 * 0, or 1 where the table is broken (the dicts must answer: drop it). */
static int kvmesh_kvt_set_holder(PyObject *cap, PyObject *key, PyObject *holder) {
    kvmesh_kvt *t = kvmesh_kvt_get(cap);
    kvmesh_kvt_slot *s;
    PyObject *old;
    if (t == NULL)
        return -1;
    if (holder == Py_None)
        holder = NULL;
    s = kvmesh_kvt_slot_of(t, key, holder != NULL);
    if (s == NULL)
        return PyErr_Occurred() ? -1 : 1;
    if (s->key == NULL)
        return 0; /* (no holder for a key the table does not have) */
    old = s->holder;
    Py_XINCREF(holder);
    s->holder = holder;
    if (holder == NULL && s->store == 0 && s->ssd == 0)
        kvmesh_kvt_delete(t, s); /* (s->holder is NULL: nothing released twice) */
    Py_XDECREF(old);
    return 0;
}

/* ``key`` now has ``store`` replicas in the store and ``ssd`` on an SSD tier (the
 * dicts' values, 0 where absent). 0, or 1 where the table is broken. */
static int kvmesh_kvt_set_store(PyObject *cap, PyObject *key, long store, long ssd) {
    kvmesh_kvt *t = kvmesh_kvt_get(cap);
    kvmesh_kvt_slot *s;
    if (t == NULL)
        return -1;
    if (store < 0 || ssd < 0 || store > INT32_MAX || ssd > INT32_MAX) {
        t->broken = 1; /* (never: the dicts hold counts from 1 up) */
        return 1;
    }
    s = kvmesh_kvt_slot_of(t, key, store != 0 || ssd != 0);
    if (s == NULL)
        return PyErr_Occurred() ? -1 : 1;
    if (s->key == NULL)
        return 0;
    t->n_ssd += (ssd != 0) - (s->ssd != 0);
    s->store = (int32_t)store;
    s->ssd = (int32_t)ssd;
    if (s->holder == NULL && store == 0 && ssd == 0)
        kvmesh_kvt_delete(t, s);
    return 0;
}

/* The store forgot everything (``store_reset``): every count to 0. 0, or 1 where the
 * table is broken. */
static int kvmesh_kvt_clear_store(PyObject *cap) {
    kvmesh_kvt *t = kvmesh_kvt_get(cap);
    if (t == NULL)
        return -1;
    if (t->broken)
        return 1;
    if (kvmesh_kvt_rebuild(t, t->mask + 1, 1) < 0) {
        /* out of memory: the dicts (emptied first) answer from now on */
        t->broken = 1;
        PyErr_Clear();
        return 1;
    }
    return 0;
}

/* ``CacheIndex.lookup`` from the table: fills ``per_node`` where the first block has
 * one holder (a str) and answers ``(store_prefix, store_dram_prefix, holders)``, where
 * ``holders`` is the first block's set of holders when it has several (the caller
 * follows them) and None otherwise; None where the dicts must answer (a broken table,
 * keys that are not a list of bytes). */
static PyObject *kvmesh_kvt_lookup(PyObject *cap, PyObject *keys, PyObject *per_node) {
    kvmesh_kvt *t = kvmesh_kvt_get(cap);
    Py_ssize_t n, base, i, m, run = -1, k = 0, dram = 0;
    int pool_open = 1, store_open = 1, ssd_any;
    PyObject *node = NULL, *many = Py_None, *holder;
    Py_hash_t hs[KVMESH_KVT_CHUNK];
    kvmesh_kvt_slot *found[KVMESH_KVT_CHUNK];
    if (t == NULL)
        return NULL;
    if (t->broken || !PyList_CheckExact(keys) || !PyDict_CheckExact(per_node))
        Py_RETURN_NONE;
    n = PyList_GET_SIZE(keys);
    ssd_any = t->n_ssd != 0;
    for (base = 0; base < n && (pool_open || store_open); base += KVMESH_KVT_CHUNK) {
        m = n - base < KVMESH_KVT_CHUNK ? n - base : KVMESH_KVT_CHUNK;
        for (i = 0; i < m; i++) /* the keys' own objects (their cached hash) first */
            __builtin_prefetch(PyList_GET_ITEM(keys, base + i));
        for (i = 0; i < m; i++) { /* then the slots, all asked for at once */
            PyObject *key = PyList_GET_ITEM(keys, base + i);
            if (!PyBytes_CheckExact(key))
                Py_RETURN_NONE; /* (nothing written to per_node yet: see below) */
            hs[i] = PyObject_Hash(key); /* (bytes: never fails) */
            __builtin_prefetch(&t->slots[(size_t)hs[i] & t->mask]);
        }
        for (i = 0; i < m; i++) {
            kvmesh_kvt_slot *s =
                kvmesh_kvt_find(t, PyList_GET_ITEM(keys, base + i), hs[i]);
            found[i] = s->key != NULL ? s : NULL;
        }
        for (i = 0; i < m; i++) {
            Py_ssize_t at = base + i;
            kvmesh_kvt_slot *s = found[i];
            holder = s != NULL ? s->holder : NULL;
            if (pool_open) {
                if (at == 0) {
                    if (holder == NULL)
                        pool_open = 0;
                    else if (PyUnicode_CheckExact(holder))
                        node = holder, run = 1;
                    else { /* several holders: the caller follows them */
                        many = holder;
                        pool_open = 0;
                    }
                } else {
                    int same = holder == node;
                    if (!same && holder != NULL) {
                        if (PyUnicode_CheckExact(holder))
                            same = PyUnicode_Compare(holder, node) == 0;
                        else {
                            same = PySet_Contains(holder, node);
                            if (same < 0)
                                return NULL;
                        }
                    }
                    if (same)
                        run = at + 1;
                    else
                        pool_open = 0;
                }
            }
            if (store_open) {
                if (s == NULL || s->store == 0)
                    store_open = 0;
                else {
                    k = at + 1;
                    if (dram == k - 1 && (!ssd_any || s->store > s->ssd))
                        dram = k;
                }
            }
        }
    }
    if (node != NULL) {
        PyObject *v = PyLong_FromSsize_t(run);
        if (v == NULL || PyDict_SetItem(per_node, node, v) < 0) {
            Py_XDECREF(v);
            return NULL;
        }
        Py_DECREF(v);
    }
    return Py_BuildValue("nnO", k, dram, many);
}

#endif

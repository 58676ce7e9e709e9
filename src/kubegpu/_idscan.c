/*
 * kubegpu._idscan: which of a resource's device IDs a GetPreferredAllocation request offers,
 * read from the request's bytes without making a Python object per offered ID.
 *
 * Why C: a kubelet offers every free ID of a resource in each call (3,072 at 64 GPUs x 48
 * replicas). In Python, knowing which are present costs an object, a hash and a set probe
 * per ID (~56 ns each, kubegpu.plugin.wire's pure-Python reader); here it is one hash of
 * the ID's bytes and one probe of a table built once per device list (~10 ns). The module
 * is optional: where it was not built (no C compiler at install), kubegpu.plugin.wire
 * reads the same bytes in Python to the same answer (tests/unit/test_idscan.py checks both
 * agree on random and hostile input).
 *
 * The table's keys are IDs as a repeated string field carries them on the wire: a length
 * byte (< 0x80, a one-byte varint) then the UTF-8 bytes; `kubegpu.topology.encoded_ids`
 * makes them. Its values are the spec's own ID strings, handed back in a set.
 *
 * IdTable.read(data, start, end) walks data[start:end] as field-1 entries (tag 0x0a, a
 * one-byte length, that many bytes). It returns None at the first thing that is not such
 * an entry holding a key, or at a key seen twice: the caller then reads the request the
 * general way, which judges (and logs) those cases. Else (offered, lacking, ids): when
 * more than half of the keys were offered, lacking is True and ids are the keys' values
 * not offered (an idle node's request lacks few); else ids are the values offered.
 *
 * Lookups only ever walk chains of the table's own keys, laid out once at half load or
 * less, so no request can make one slower than the longest of those.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define FIELD_TAG 0x0a  /* ContainerPreferredAllocationRequest.available_deviceIDs (api.proto) */

typedef struct {
    PyObject_HEAD
    Py_ssize_t count;            /* keys */
    size_t mask;                 /* slots - 1; slots are a power of two >= 2 * count */
    int32_t *slots;              /* key index, or -1 for an empty slot */
    const unsigned char **key;   /* each key's bytes, in `arena` */
    uint8_t *length;             /* each key's length */
    uint32_t *seen;              /* the call (`call`) that last saw each key */
    uint32_t call;
    unsigned char *arena;
    PyObject *values;            /* tuple of str, one per key */
} IdTable;

static inline uint64_t word(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, sizeof v); /* an unaligned load where the CPU allows it */
    return v;
}

/* A hash of whole 8-byte words. The products are independent of each other, so the CPU
   overlaps them; the last word overlaps the one before it instead of a byte loop. */
static inline uint64_t hash_bytes(const unsigned char *p, size_t n) {
    uint64_t h = n * 0x9E3779B97F4A7C15ULL;
    if (n < 8) {
        uint64_t tail = 0;
        memcpy(&tail, p, n);
        h += (tail ^ 0x8EBC6AF09C88C6E3ULL) * 0x589965CC75374CC3ULL;
    } else {
        const unsigned char *last = p + n - 8;
        uint64_t k = 0xE7037ED1A0B428DBULL;
        for (; p < last; p += 8, k += 2)
            h += (word(p) ^ 0xA0761D6478BD642FULL) * k;
        h += (word(last) ^ 0x8EBC6AF09C88C6E3ULL) * 0x589965CC75374CC3ULL;
    }
    h ^= h >> 32;
    h *= 0xBF58476D1CE4E5B9ULL;
    h ^= h >> 29;
    return h;
}

/* Equal bytes, compared a word at a time (a call to memcmp costs more than the compare). */
static inline int same_bytes(const unsigned char *a, const unsigned char *b, size_t n) {
    if (n < 8)
        return memcmp(a, b, n) == 0;
    uint64_t diff = word(a + n - 8) ^ word(b + n - 8);
    for (size_t i = 0; i + 8 <= n; i += 8)
        diff |= word(a + i) ^ word(b + i);
    return diff == 0;
}

/* The index of the key equal to p[0:n], or -1. */
static inline int32_t find(const IdTable *t, const unsigned char *p, size_t n) {
    for (size_t s = hash_bytes(p, n) & t->mask;; s = (s + 1) & t->mask) {
        int32_t i = t->slots[s];
        if (i < 0 || (t->length[i] == n && same_bytes(t->key[i], p, n)))
            return i;
    }
}

static void IdTable_dealloc(IdTable *self) {
    PyMem_Free(self->slots);
    PyMem_Free(self->key);
    PyMem_Free(self->length);
    PyMem_Free(self->seen);
    PyMem_Free(self->arena);
    Py_XDECREF(self->values);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *IdTable_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"keys", "values", NULL};
    PyObject *keys, *values;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!:IdTable", names, &PyTuple_Type, &keys,
                                     &PyTuple_Type, &values))
        return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(keys);
    if (PyTuple_GET_SIZE(values) != count) {
        PyErr_Format(PyExc_ValueError, "IdTable: %zd keys but %zd values; give one value per key",
                     count, PyTuple_GET_SIZE(values));
        return NULL;
    }
    if (count > INT32_MAX / 4) {
        PyErr_Format(PyExc_ValueError, "IdTable: %zd keys is more than a table holds", count);
        return NULL;
    }
    size_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *k = PyTuple_GET_ITEM(keys, i), *v = PyTuple_GET_ITEM(values, i);
        /* Exact str values: adding them to a set runs no Python code (see read). */
        if (!PyBytes_Check(k) || PyBytes_GET_SIZE(k) < 1 || PyBytes_GET_SIZE(k) > 0x80 ||
            !PyUnicode_CheckExact(v)) {
            PyErr_Format(PyExc_TypeError,
                         "IdTable: entry %zd must be bytes of 1 to 128 and a str (an ID's "
                         "length byte and UTF-8, and the ID)", i);
            return NULL;
        }
        total += (size_t)PyBytes_GET_SIZE(k);
    }
    IdTable *self = (IdTable *)type->tp_alloc(type, 0); /* zeroed: dealloc frees NULLs */
    if (self == NULL)
        return NULL;
    size_t slots = 16;
    while (slots < 2 * (size_t)count)
        slots <<= 1;
    self->count = count;
    self->mask = slots - 1;
    self->slots = PyMem_Malloc(slots * sizeof *self->slots);
    self->key = PyMem_Malloc(((size_t)count + 1) * sizeof *self->key);
    self->length = PyMem_Malloc((size_t)count + 1);
    self->seen = PyMem_Calloc((size_t)count + 1, sizeof *self->seen);
    self->arena = PyMem_Malloc(total + 1);
    Py_INCREF(values);
    self->values = values;
    if (!self->slots || !self->key || !self->length || !self->seen || !self->arena) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    memset(self->slots, 0xff, slots * sizeof *self->slots);
    unsigned char *at = self->arena;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *k = PyTuple_GET_ITEM(keys, i);
        size_t n = (size_t)PyBytes_GET_SIZE(k);
        memcpy(at, PyBytes_AS_STRING(k), n);
        size_t s = hash_bytes(at, n) & self->mask;
        for (; self->slots[s] >= 0; s = (s + 1) & self->mask) {
            int32_t j = self->slots[s];
            if (self->length[j] == n && same_bytes(self->key[j], at, n)) {
                PyErr_Format(PyExc_ValueError, "IdTable: key %zd repeats key %d; keys must "
                             "be distinct", i, (int)j);
                Py_DECREF(self);
                return NULL;
            }
        }
        self->key[i] = at;
        self->length[i] = (uint8_t)n;
        self->slots[s] = (int32_t)i;
        at += n;
    }
    return (PyObject *)self;
}

static PyObject *IdTable_read(IdTable *self, PyObject *args) {
    Py_buffer buffer;
    Py_ssize_t start, end;
    if (!PyArg_ParseTuple(args, "y*nn:read", &buffer, &start, &end))
        return NULL;
    PyObject *result = Py_None;
    const unsigned char *data = buffer.buf;
    if (start < 0 || start > end || end > buffer.len)
        goto done;
    /* A fresh mark per call instead of clearing `seen`; clear it once per 2**32 calls. */
    if (++self->call == 0) {
        memset(self->seen, 0, (size_t)self->count * sizeof *self->seen);
        self->call = 1;
    }
    const uint32_t call = self->call;
    Py_ssize_t offered = 0;
    for (Py_ssize_t pos = start; pos < end;) {
        if (data[pos] != FIELD_TAG || end - pos < 2)
            goto done;
        size_t n = (size_t)data[pos + 1] + 1; /* the key: the length byte and the bytes */
        if (n > 0x80 || (Py_ssize_t)n > end - pos - 1)
            goto done; /* a longer varint, or past the end */
        int32_t i = find(self, data + pos + 1, n);
        if (i < 0 || self->seen[i] == call)
            goto done; /* not the spec's, or offered twice */
        self->seen[i] = call;
        offered++;
        pos += 1 + (Py_ssize_t)n;
    }
    const int lacking = 2 * offered > self->count;
    PyObject *ids = PySet_New(NULL);
    if (ids == NULL) {
        result = NULL;
        goto done;
    }
    for (Py_ssize_t i = 0; i < self->count; i++) {
        if ((self->seen[i] == call) != lacking &&
            PySet_Add(ids, PyTuple_GET_ITEM(self->values, i)) < 0) {
            Py_DECREF(ids);
            result = NULL;
            goto done;
        }
    }
    result = Py_BuildValue("(nON)", offered, lacking ? Py_True : Py_False, ids);
    PyBuffer_Release(&buffer);
    return result;
done:
    PyBuffer_Release(&buffer);
    return Py_XNewRef(result);
}

static PyMethodDef IdTable_methods[] = {
    {"read", (PyCFunction)IdTable_read, METH_VARARGS,
     "read(data, start, end) -> (offered, lacking, ids) or None; see the module's comment."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject IdTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kubegpu._idscan.IdTable",
    .tp_doc = "IdTable(keys, values): a resource's IDs in wire form, and their strings.",
    .tp_basicsize = sizeof(IdTable),
    .tp_dealloc = (destructor)IdTable_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_methods = IdTable_methods,
    .tp_new = IdTable_new,
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "kubegpu._idscan",
    .m_doc = "Which device IDs a GetPreferredAllocation request offers, read from its bytes.",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__idscan(void) {
    if (PyType_Ready(&IdTableType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&IdTableType);
    if (PyModule_AddObject(m, "IdTable", (PyObject *)&IdTableType) < 0) {
        Py_DECREF(&IdTableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

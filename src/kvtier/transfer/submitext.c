/* A CPython extension with one function: the CPU engine's submit call (native_worker.py).
 *
 * Through ctypes a submit of one 64 KiB block cost about 4.6 µs on the 2-core machine of
 * docs/bench/transfer.md, more than the copy: converting the ids with numpy, copying them
 * into a staging buffer and converting ten ctypes arguments took 2.4 µs of it. Here the ids
 * are read straight from the caller's list, tuple or integer array, and the arguments arrive
 * as Python objects (METH_FASTCALL), so the submitting thread keeps ahead of the copy thread.
 *
 * The engine's own submit function comes as an address, so this module links against nothing
 * but Python; it is built only where Python's headers are installed (native.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "kvtier.h"

typedef int (*submit_ids_fn)(void *engine, const kvt_submit_ctx *x, int64_t id, int lane,
                             uint64_t seq, const int64_t *blocks, size_t nblocks,
                             const int64_t *slots, size_t nslots, size_t skip);

/* submit()'s results besides a block count; Python turns each into its error or fallback. */
#define STOPPED (-1)    /* the engine is stopping or out of memory: nothing queued */
#define REFUSED (-2)    /* the engine's planner refused the arguments: nothing queued */
#define UNREADABLE (-3) /* ids this module does not read: nothing queued */

#define ON_STACK 64

typedef struct {
    int64_t *v;
    Py_ssize_t n;
    int64_t stack[ON_STACK];
} ids_t;

static int64_t *room(ids_t *ids, Py_ssize_t n) {
    ids->n = n;
    ids->v = n <= ON_STACK ? ids->stack : PyMem_Malloc((size_t)n * sizeof(int64_t));
    return ids->v;
}

static void release(ids_t *ids) {
    if (ids->v && ids->v != ids->stack)
        PyMem_Free(ids->v);
    ids->v = NULL;
}

/* A list or tuple of exact ints that fit int64 (bools and numpy scalars are left to numpy). */
static int read_sequence(PyObject *o, ids_t *ids) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
    PyObject **items = PySequence_Fast_ITEMS(o);
    int64_t *v = room(ids, n);
    if (!v) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int overflow = 0;
        if (!PyLong_CheckExact(items[i]))
            return 1;
        v[i] = PyLong_AsLongLongAndOverflow(items[i], &overflow);
        if (overflow)
            return 1;
    }
    return 0;
}

/* Integers read at `p`, which need not be aligned: numpy exports views at any byte offset (a
 * uint8 array's `[1:].view(np.int64)`), where a load through a cast pointer is undefined.
 * A memcpy of constant size compiles to the same single load (gcc and clang at -O2). */
#define LOADER(name, type)                                                                      \
    static inline int64_t name(const char *p) {                                                 \
        type v;                                                                                 \
        memcpy(&v, p, sizeof v);                                                                \
        return (int64_t)v;                                                                      \
    }
LOADER(load_i16, int16_t)
LOADER(load_u16, uint16_t)
LOADER(load_i32, int32_t)
LOADER(load_u32, uint32_t)
LOADER(load_i64, int64_t)

/* A 1-D C-contiguous buffer of native 1, 2, 4 or 8-byte integers (numpy arrays, torch CPU
 * tensors through numpy, array.array, memoryview), at any alignment. */
static int read_buffer(PyObject *o, ids_t *ids) {
    Py_buffer b;
    if (PyObject_GetBuffer(o, &b, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        return 1;
    }
    int rc = 1;
    const char *f = b.format ? b.format : "B";
    /* Native byte order only ('<' or '>' where it is the machine's); the rest goes to numpy. */
    if (*f == '@' || *f == '=' || *f == (PY_LITTLE_ENDIAN ? '<' : '>'))
        f++;
    char k = f[0];
    int ok_format = k != '\0' && f[1] == '\0' && strchr("bBhHiIlLqQnN", k) != NULL;
    if (ok_format && b.ndim == 1 && (b.itemsize == 1 || b.itemsize == 2 || b.itemsize == 4 ||
                                     b.itemsize == 8)) {
        int is_signed = k >= 'a' && k <= 'z';
        Py_ssize_t n = b.shape[0];
        int64_t *v = room(ids, n);
        if (!v) {
            PyErr_NoMemory();
            rc = -1;
        } else {
            rc = 0;
            for (Py_ssize_t i = 0; i < n && rc == 0; i++) {
                const char *p = (const char *)b.buf + i * b.itemsize;
                switch (b.itemsize) {
                case 1:
                    v[i] = is_signed ? *(const int8_t *)p : *(const uint8_t *)p;
                    break;
                case 2:
                    v[i] = is_signed ? load_i16(p) : load_u16(p);
                    break;
                case 4:
                    v[i] = is_signed ? load_i32(p) : load_u32(p);
                    break;
                default:
                    v[i] = load_i64(p);
                    if (!is_signed && v[i] < 0)
                        rc = 1; /* above INT64_MAX: numpy's path reports it */
                }
            }
        }
    }
    PyBuffer_Release(&b);
    return rc;
}

/* 0: read; 1: not readable here (no error set); -1: a Python error is set. */
static int read_ids(PyObject *o, ids_t *ids) {
    ids->v = NULL;
    if (PyList_CheckExact(o) || PyTuple_CheckExact(o))
        return read_sequence(o, ids);
    if (PyObject_CheckBuffer(o) && !PyBytes_Check(o)) /* numpy reads bytes as one string */
        return read_buffer(o, ids);
    return 1;
}

PyDoc_STRVAR(submit_doc,
             "submit(fn, engine, ctx, job_id, lane, seq, device_blocks, slots, skip) -> int\n\n"
             "Call the engine's submit function at address `fn`. Returns the number of device "
             "blocks queued, or -1 (engine stopping or out of memory), -2 (arguments refused) "
             "or -3 (ids or skip not readable here); nothing is queued unless it returns a "
             "count.");

static PyObject *submit(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 9) {
        PyErr_Format(PyExc_TypeError, "submit() takes 9 arguments (%zd given)", nargs);
        return NULL;
    }
    submit_ids_fn fn = (submit_ids_fn)PyLong_AsVoidPtr(args[0]);
    void *engine = PyLong_AsVoidPtr(args[1]);
    const kvt_submit_ctx *ctx = PyLong_AsVoidPtr(args[2]);
    long long job_id = PyLong_AsLongLong(args[3]);
    int lane = (int)PyLong_AsLong(args[4]);
    unsigned long long seq = PyLong_AsUnsignedLongLong(args[5]);
    if (PyErr_Occurred())
        return NULL;
    if (!fn || !engine || !ctx) {
        PyErr_SetString(PyExc_ValueError, "submit() needs the engine's function, engine and context");
        return NULL;
    }
    if (!PyLong_CheckExact(args[8]))
        return PyLong_FromLong(UNREADABLE);
    int overflow = 0;
    long long skip = PyLong_AsLongLongAndOverflow(args[8], &overflow);
    if (overflow || skip < 0)
        return PyLong_FromLong(UNREADABLE);

    ids_t blocks, slots;
    slots.v = NULL;
    int rc = read_ids(args[6], &blocks);
    if (rc == 0)
        rc = read_ids(args[7], &slots);
    long result;
    if (rc < 0)
        result = 0; /* the error is set */
    else if (rc > 0)
        result = UNREADABLE;
    else {
        int got = fn(engine, ctx, job_id, lane, seq, blocks.v, (size_t)blocks.n, slots.v,
                     (size_t)slots.n, (size_t)skip);
        result = got == 0 ? (long)blocks.n : got > 0 ? REFUSED : STOPPED;
    }
    release(&blocks);
    release(&slots);
    return rc < 0 ? NULL : PyLong_FromLong(result);
}

static PyMethodDef methods[] = {
    {"submit", (PyCFunction)(void (*)(void))submit, METH_FASTCALL, submit_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_kvtier_submit", "kvtier's compiled submit call (submitext.c).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kvtier_submit(void) { return PyModule_Create(&module_def); }

/* Direct calls of two CUDA driver entry points, by address: a prepared
   cuLaunchKernel (Launch), a launch from packed parameters (launch_packed) and
   a prepared cuStreamWriteValue32 (Writer); and the backend's hot methods
   (HotLaunch, HotRecord, HotPoll, HotNotify: ``Kernels.launch``,
   ``StreamTable.record_marker``, ``StreamTable.poll_marker`` and
   ``StreamTable.notify_submitted`` for their common case).

   Invariants:
   - This module knows no CUDA header and links no CUDA library. It calls
     the entry points whose addresses the caller obtained from the driver
     (cuGetProcAddress), with the driver's own prototypes, written out below.
   - A prepared call holds plain values only (handles and addresses as
     integers); the caller keeps what they point to alive, and never calls a
     prepared call after its function was unloaded or its stream destroyed.
   - Each call releases the GIL around the driver call, as cuda.bindings does,
     and returns the driver's CUresult as an int; nothing here raises for a
     driver error.
   - The pure-Python path (cuda.bindings' own wrappers) is the reference; the
     backend falls back to it when this module is missing or turned off.
   - A hot method makes its Python method's steps, in its order, for the
     common case only. Anything else (another type, a mode, a first use, a
     destroyed stream, several devices) calls the Python method, before any
     step has had an effect; a driver error goes to the same Python error
     path (``_launch_failed``, ``ContextState.fail``).
   - Attributes are read as getattr reads them; a slot through the
     per-type cache of _fastattr.h. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "../../_core/_fastattr.h"

/* CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, gridDimY,
   gridDimZ, blockDimX, blockDimY, blockDimZ, unsigned int sharedMemBytes,
   CUstream hStream, void **kernelParams, void **extra) */
typedef int (*launch_fn)(void *, unsigned int, unsigned int, unsigned int, unsigned int,
                         unsigned int, unsigned int, unsigned int, void *, void **, void **);

/* CUresult cuStreamWriteValue32(CUstream stream, CUdeviceptr addr,
   cuuint32_t value, unsigned int flags), and cuStreamWaitValue32, whose
   prototype is the same (its flags 0: CU_STREAM_WAIT_VALUE_GEQ) */
typedef int (*write32_fn)(void *, unsigned long long, uint32_t, unsigned int);

static int as_ptr(PyObject *obj, void **out, const char *what) {
    unsigned long long v = u64_of(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "%s: expected an address (an int from 0 to 2**64-1), got %R",
                     what, obj);
        return -1;
    }
    *out = (void *)(uintptr_t)v;
    return 0;
}

static int as_u32(PyObject *obj, unsigned int *out, const char *what) {
    unsigned long v = PyLong_AsUnsignedLong(obj);
    if ((v == (unsigned long)-1 && PyErr_Occurred()) || v > 0xFFFFFFFFUL) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: expected an int from 0 to 2**32-1, got %R", what, obj);
        return -1;
    }
    *out = (unsigned int)v;
    return 0;
}

/* ------------------------------------------------------------------ Launch */

typedef struct {
    PyObject_HEAD
    launch_fn fn;
    void *function;
    unsigned int dims[7]; /* grid x y z, block x y z, shared memory bytes */
    void *stream;
    void **params;
} LaunchObject;

static PyObject *Launch_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static const char *names[] = {"entry", "function", "gx", "gy", "gz", "bx", "by", "bz",
                                  "shared_mem", "stream", "params"};
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "Launch: takes no keyword arguments");
        return NULL;
    }
    if (PyTuple_GET_SIZE(args) != 11) {
        PyErr_Format(PyExc_TypeError, "Launch: expected 11 arguments (%s, %s, grid, block, %s, %s, %s), got %zd",
                     names[0], names[1], names[8], names[9], names[10], PyTuple_GET_SIZE(args));
        return NULL;
    }
    void *entry, *function, *stream, *params;
    unsigned int dims[7];
    if (as_ptr(PyTuple_GET_ITEM(args, 0), &entry, names[0]) < 0 ||
        as_ptr(PyTuple_GET_ITEM(args, 1), &function, names[1]) < 0 ||
        as_ptr(PyTuple_GET_ITEM(args, 9), &stream, names[9]) < 0 ||
        as_ptr(PyTuple_GET_ITEM(args, 10), &params, names[10]) < 0)
        return NULL;
    for (int i = 0; i < 7; i++) {
        if (as_u32(PyTuple_GET_ITEM(args, 2 + i), &dims[i], names[2 + i]) < 0)
            return NULL;
    }
    if (entry == NULL) {
        PyErr_SetString(PyExc_ValueError, "Launch: entry: expected the address of cuLaunchKernel, got 0");
        return NULL;
    }
    LaunchObject *self = (LaunchObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->fn = (launch_fn)entry;
    self->function = function;
    memcpy(self->dims, dims, sizeof dims);
    self->stream = stream;
    self->params = (void **)params;
    return (PyObject *)self;
}

static PyObject *Launch_call(PyObject *op, PyObject *args, PyObject *kwargs) {
    LaunchObject *self = (LaunchObject *)op;
    if (PyTuple_GET_SIZE(args) || (kwargs != NULL && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "Launch(): takes no arguments");
        return NULL;
    }
    int err;
    unsigned int *d = self->dims;
    Py_BEGIN_ALLOW_THREADS
    err = self->fn(self->function, d[0], d[1], d[2], d[3], d[4], d[5], d[6], self->stream, self->params, NULL);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(err);
}

static PyTypeObject LaunchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "trio_cuda._backends.cuda._direct.Launch",
    .tp_basicsize = sizeof(LaunchObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Launch(entry, function, gx, gy, gz, bx, by, bz, shared_mem, stream, params): "
              "a prepared cuLaunchKernel; calling it launches and returns the CUresult.",
    .tp_new = Launch_new,
    .tp_call = Launch_call,
};

/* ------------------------------------------------------------------ Writer */

typedef struct {
    PyObject_HEAD
    write32_fn fn;
    void *stream;
    unsigned long long addr;
} WriterObject;

static PyObject *Writer_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    void *entry, *stream, *addr;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "Writer: takes no keyword arguments");
        return NULL;
    }
    if (PyTuple_GET_SIZE(args) != 3) {
        PyErr_Format(PyExc_TypeError, "Writer: expected 3 arguments (entry, stream, addr), got %zd",
                     PyTuple_GET_SIZE(args));
        return NULL;
    }
    if (as_ptr(PyTuple_GET_ITEM(args, 0), &entry, "entry") < 0 ||
        as_ptr(PyTuple_GET_ITEM(args, 1), &stream, "stream") < 0 ||
        as_ptr(PyTuple_GET_ITEM(args, 2), &addr, "addr") < 0)
        return NULL;
    if (entry == NULL) {
        PyErr_SetString(PyExc_ValueError, "Writer: entry: expected the address of cuStreamWriteValue32, got 0");
        return NULL;
    }
    WriterObject *self = (WriterObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->fn = (write32_fn)entry;
    self->stream = stream;
    self->addr = (unsigned long long)(uintptr_t)addr;
    return (PyObject *)self;
}

static PyObject *Writer_call(PyObject *op, PyObject *args, PyObject *kwargs) {
    WriterObject *self = (WriterObject *)op;
    if (PyTuple_GET_SIZE(args) != 1 || (kwargs != NULL && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "Writer(value): takes one argument");
        return NULL;
    }
    /* the value is taken modulo 2**32, as the stream's 32-bit flag wraps */
    unsigned long long v = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(args, 0));
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = self->fn(self->stream, self->addr, (uint32_t)v, 0);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(err);
}

static PyTypeObject WriterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "trio_cuda._backends.cuda._direct.Writer",
    .tp_basicsize = sizeof(WriterObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Writer(entry, stream, addr): a prepared cuStreamWriteValue32 of one flag; "
              "calling it with a value enqueues the write and returns the CUresult.",
    .tp_new = Writer_new,
    .tp_call = Writer_call,
};

/* ------------------------------------------------------------------ packed launch */

/* launch_packed(entry, function, gx, gy, gz, bx, by, bz, shared_mem, stream,
   arena, offsets): cuLaunchKernel with the parameters read from ``arena`` (a
   bytes object: the launch's packed parameters) at ``offsets`` (a bytes
   object of native uint32 offsets, one per parameter). The void** array
   lives on the C stack for the call (the driver copies the parameters before
   it returns), so a launch enqueued once needs no memory of its own. */
#define STACK_SLOTS 64

/* cuLaunchKernel through ``fn`` with parameter i at ``arena`` (bytes) +
   ``offsets`` (bytes, native uint32 each)[i]; *err the CUresult. -1 (error
   set) for offsets that are not whole or point past the arena. */
static int packed_call(launch_fn fn, void *function, const unsigned int *d, void *stream, PyObject *arena,
                       PyObject *offsets, int *err) {
    Py_ssize_t size = PyBytes_GET_SIZE(arena), nb = PyBytes_GET_SIZE(offsets);
    if (nb % 4) {
        PyErr_Format(PyExc_ValueError, "launch_packed: offsets: expected a multiple of 4 bytes, got %zd", nb);
        return -1;
    }
    Py_ssize_t n = nb / 4;
    char *base = PyBytes_AS_STRING(arena);
    const char *raw = PyBytes_AS_STRING(offsets);
    void *stack[STACK_SLOTS];
    void **argv = n <= STACK_SLOTS ? stack : PyMem_Malloc(sizeof(void *) * (size_t)n);
    if (argv == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t off;
        memcpy(&off, raw + 4 * i, 4);
        if ((Py_ssize_t)off >= size) {
            if (argv != stack)
                PyMem_Free(argv);
            PyErr_Format(PyExc_ValueError,
                         "launch_packed: offsets: parameter %zd at offset %u is past the arena (%zd bytes)",
                         i, (unsigned int)off, size);
            return -1;
        }
        argv[i] = base + off;
    }
    int e;
    Py_BEGIN_ALLOW_THREADS
    e = fn(function, d[0], d[1], d[2], d[3], d[4], d[5], d[6], stream, n ? argv : NULL, NULL);
    Py_END_ALLOW_THREADS
    if (argv != stack)
        PyMem_Free(argv);
    *err = e;
    return 0;
}

static PyObject *launch_packed(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    static const char *names[] = {"entry", "function", "gx", "gy", "gz", "bx", "by", "bz",
                                  "shared_mem", "stream"};
    if (nargs != 12) {
        PyErr_Format(PyExc_TypeError, "launch_packed: expected 12 arguments, got %zd", nargs);
        return NULL;
    }
    void *entry, *function, *stream;
    unsigned int d[7];
    if (as_ptr(args[0], &entry, names[0]) < 0 || as_ptr(args[1], &function, names[1]) < 0 ||
        as_ptr(args[9], &stream, names[9]) < 0)
        return NULL;
    for (int i = 0; i < 7; i++) {
        if (as_u32(args[2 + i], &d[i], names[2 + i]) < 0)
            return NULL;
    }
    PyObject *arena = args[10], *offsets = args[11];
    if (!PyBytes_CheckExact(arena) || !PyBytes_CheckExact(offsets)) {
        PyErr_Format(PyExc_TypeError, "launch_packed: arena, offsets: expected bytes, got %s and %s",
                     Py_TYPE(arena)->tp_name, Py_TYPE(offsets)->tp_name);
        return NULL;
    }
    if (entry == NULL) {
        PyErr_SetString(PyExc_ValueError, "launch_packed: entry: expected the address of cuLaunchKernel, got 0");
        return NULL;
    }
    int err;
    if (packed_call((launch_fn)entry, function, d, stream, arena, offsets, &err) < 0)
        return NULL;
    return PyLong_FromLong(err);
}
/* ------------------------------------------------------------------ hot methods */

static PyObject *n_owner, *n_destroyed, *n_multi_device, *n_capturing, *n_marker_mode, *n_record_events,
    *n_write, *n_seq, *n_watched, *n_new_head, *n_eager, *n_state, *n_fail, *n_write_call, *n_stream, *n_mv,
    *n_slot, *n_sticky, *n_cache, *n_key, *n_config, *n_plan, *n_kernel, *n_cluster, *n_cooperative, *n_pdl,
    *n_shared_mem, *n_dyn_smem, *n_unloaded, *n_packed, *n_arena, *n_size, *n_addr, *n_handle, *n_grid,
    *n_block, *n_enqueued, *n_launch_failed, *n_event, *n_wake_ev;

static int intern_names(void) {
    struct {
        PyObject **at;
        const char *s;
    } names[] = {{&n_owner, "owner"}, {&n_destroyed, "destroyed"}, {&n_multi_device, "multi_device"},
                 {&n_capturing, "capturing"}, {&n_marker_mode, "marker_mode"},
                 {&n_record_events, "record_events"}, {&n_write, "write"}, {&n_seq, "seq"},
                 {&n_watched, "watched"}, {&n_new_head, "new_head"}, {&n_eager, "eager"}, {&n_state, "_state"},
                 {&n_fail, "fail"}, {&n_write_call, "cuStreamWriteValue32"}, {&n_stream, "stream"},
                 {&n_mv, "mv"}, {&n_slot, "slot"}, {&n_sticky, "sticky"}, {&n_cache, "cache"}, {&n_key, "key"},
                 {&n_config, "config"}, {&n_plan, "plan"}, {&n_kernel, "kernel"}, {&n_cluster, "cluster"},
                 {&n_cooperative, "cooperative"}, {&n_pdl, "pdl"}, {&n_shared_mem, "shared_mem"},
                 {&n_dyn_smem, "dyn_smem"}, {&n_unloaded, "unloaded"}, {&n_packed, "packed"},
                 {&n_arena, "arena"}, {&n_size, "size"}, {&n_addr, "addr"}, {&n_handle, "handle"},
                 {&n_grid, "grid"}, {&n_block, "block"}, {&n_enqueued, "enqueued"},
                 {&n_launch_failed, "_launch_failed"}, {&n_event, "event"}, {&n_wake_ev, "wake_ev"}};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if ((*names[i].at = PyUnicode_InternFromString(names[i].s)) == NULL)
            return -1;
    return 0;
}

/* The start of each hot type's constructor: no keywords, and the names
   interned. 0, or -1 (error set). */
static int hot_start(PyObject *kwargs, const char *what) {
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_Format(PyExc_TypeError, "%s: takes no keyword arguments", what);
        return -1;
    }
    return n_owner == NULL ? intern_names() : 0;
}

/* 1: attribute ``name`` of ``obj`` is ``value``; 0: it is not (or it is
   missing: the Python method decides); -1: an error other than a missing
   attribute. */
static int attr_is(PyObject *obj, PyObject *name, PyObject *value) {
    PyObject *v = fast_getattr(obj, name);
    if (v == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    Py_DECREF(v);
    return v == value;
}

/* Whether the process uses several devices (``primary.multi_device``): 1,
   0, or -1 (error set). Any value but False counts as yes. */
static int several_devices(PyObject *primary) {
    if (PyModule_CheckExact(primary)) { /* (a module's attribute is its dict's entry, where it has one) */
        PyObject *v = PyDict_GetItemWithError(PyModule_GetDict(primary), n_multi_device); /* (borrowed) */
        if (v != NULL) return v != Py_False;
        if (PyErr_Occurred()) return -1;
    }
    int no = attr_is(primary, n_multi_device, Py_False);
    return no < 0 ? -1 : !no;
}

/* ``state.fail(err, call)``: raises (NULL); should it return, its result. */
static PyObject *fail(PyObject *state_owner, int err, PyObject *call) {
    PyObject *state = fast_getattr(state_owner, n_state);
    if (state == NULL)
        return NULL;
    PyObject *code = PyLong_FromLong(err);
    PyObject *r = code ? PyObject_CallMethodObjArgs(state, n_fail, code, call, NULL) : NULL;
    Py_XDECREF(code);
    Py_DECREF(state);
    return r;
}

/* --- HotRecord: StreamTable.record_marker, eager mode, a flag write */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    void *entry; /* (HotLaunch's) */
    PyObject *table, *fallback, *stream_type, *marker_type, *primary;
    PyObject *d_stream, *d_seq, *d_event; /* the marker type's slot descriptors */
} HotRecordObject;

static int slot_descr(PyObject *type, PyObject *name, PyObject **out) {
    PyObject *d = PyObject_GetAttr(type, name);
    if (d == NULL)
        return -1;
    if (Py_TYPE(d) != &PyMemberDescr_Type) {
        PyErr_Format(PyExc_TypeError, "%R.%U: expected a slot, got %.100s", type, name, Py_TYPE(d)->tp_name);
        Py_DECREF(d);
        return -1;
    }
    *out = d;
    return 0;
}

static PyObject *HotRecord_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames);

static PyObject *HotRecord_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *table, *fallback, *stream_type, *marker_type, *primary;
    if (hot_start(kwargs, "HotRecord") < 0)
        return NULL;
    if (!PyArg_ParseTuple(args, "OOO!O!O:HotRecord", &table, &fallback, &PyType_Type, &stream_type, &PyType_Type,
                          &marker_type, &primary))
        return NULL;
    HotRecordObject *self = (HotRecordObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->table = Py_NewRef(table);
    self->fallback = Py_NewRef(fallback);
    self->stream_type = Py_NewRef(stream_type);
    self->marker_type = Py_NewRef(marker_type);
    self->primary = Py_NewRef(primary);
    self->vectorcall = HotRecord_vectorcall;
    if (slot_descr(marker_type, n_stream, &self->d_stream) < 0 || slot_descr(marker_type, n_seq, &self->d_seq) < 0 ||
        slot_descr(marker_type, n_event, &self->d_event) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

/* The hot types share their head; their object fields come last,
   one after another, from ``first`` on. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    void *entry;
    PyObject *first;
} HotHead;

static Py_ssize_t hot_refs(PyObject *op) {
    return (Py_TYPE(op)->tp_basicsize - (Py_ssize_t)offsetof(HotHead, first)) / (Py_ssize_t)sizeof(PyObject *);
}

static int Hot_traverse(PyObject *op, visitproc visit, void *arg) {
    PyObject **f = &((HotHead *)op)->first;
    for (Py_ssize_t i = 0, n = hot_refs(op); i < n; i++)
        Py_VISIT(f[i]);
    return 0;
}

static int Hot_clear(PyObject *op) {
    PyObject **f = &((HotHead *)op)->first;
    for (Py_ssize_t i = 0, n = hot_refs(op); i < n; i++)
        Py_CLEAR(f[i]);
    return 0;
}

static void Hot_dealloc(PyObject *op) {
    PyObject_GC_UnTrack(op);
    Py_TYPE(op)->tp_clear(op);
    Py_TYPE(op)->tp_free(op);
}

/* Whether ``s`` takes the eager flag write here: 1 yes (its Writer in
   *writer, borrowed), 0 no, -1 error. */
static int record_here(HotRecordObject *self, PyObject *s, WriterObject **writer) {
    if (Py_TYPE(s) != (PyTypeObject *)self->stream_type)
        return 0;
    int ok = attr_is(s, n_owner, self->table);
    if (ok <= 0)
        return ok;
    if ((ok = attr_is(s, n_destroyed, Py_False)) <= 0)
        return ok;
    int many = several_devices(self->primary);
    if (many)
        return many < 0 ? -1 : 0;
    PyObject *cap = fast_getattr(self->table, n_capturing);
    if (cap == NULL)
        return -1;
    Py_DECREF(cap);
    if (cap == s)
        return 0; /* (the Python method refuses it) */
    if ((ok = attr_is(self->table, n_record_events, Py_False)) <= 0)
        return ok;
    PyObject *mode = fast_getattr(self->table, n_marker_mode);
    if (mode == NULL)
        return -1;
    ok = PyUnicode_CheckExact(mode) && PyUnicode_Compare(mode, n_eager) == 0;
    Py_DECREF(mode);
    if (!ok)
        return 0;
    PyObject *w = fast_getattr(s, n_write);
    if (w == NULL)
        return -1;
    Py_DECREF(w); /* (the stream keeps it) */
    if (Py_TYPE(w) != &WriterType)
        return 0;
    *writer = (WriterObject *)w;
    return 1;
}

static PyObject *HotRecord_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    HotRecordObject *self = (HotRecordObject *)op;
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL)
        return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    PyObject *s = args[0];
    WriterObject *w = NULL;
    int here = record_here(self, s, &w);
    if (here < 0)
        return NULL;
    if (!here)
        return PyObject_CallOneArg(self->fallback, s);
    Py_INCREF(w);
    PyObject *seq = NULL, *one = NULL, *marker = NULL, *ret = NULL;
    PyObject *old = fast_getattr(s, n_seq);
    if (old == NULL || (one = PyLong_FromLong(1)) == NULL || (seq = PyNumber_Add(old, one)) == NULL)
        goto out;
    unsigned long long v = PyLong_AsUnsignedLongLongMask(seq);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        goto out;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = w->fn(w->stream, w->addr, (uint32_t)v, 0);
    Py_END_ALLOW_THREADS
    if (err) {
        PyObject *r = fail(self->table, err, n_write_call);
        if (r == NULL)
            goto out;
        Py_DECREF(r);
    }
    if (PyObject_SetAttr(s, n_seq, seq) < 0)
        goto out;
    PyObject *watched = fast_getattr(s, n_watched);
    int yes = watched ? PyObject_IsTrue(watched) : -1;
    Py_XDECREF(watched);
    if (yes < 0 || (!yes && PyObject_SetAttr(self->table, n_new_head, Py_True) < 0))
        goto out;
    PyTypeObject *mt = (PyTypeObject *)self->marker_type;
    if ((marker = mt->tp_alloc(mt, 0)) == NULL)
        goto out;
    if (Py_TYPE(self->d_stream)->tp_descr_set(self->d_stream, marker, s) < 0 ||
        Py_TYPE(self->d_seq)->tp_descr_set(self->d_seq, marker, seq) < 0 ||
        Py_TYPE(self->d_event)->tp_descr_set(self->d_event, marker, Py_None) < 0)
        goto out;
    ret = Py_NewRef(marker);
out:
    Py_DECREF(w);
    Py_XDECREF(old);
    Py_XDECREF(one);
    Py_XDECREF(seq);
    Py_XDECREF(marker);
    return ret;
}

static PyTypeObject HotRecordType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "trio_cuda._backends.cuda._direct.HotRecord",
    .tp_basicsize = sizeof(HotRecordObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "HotRecord(table, fallback, stream_type, marker_type, primary): the stream table's "
              "record_marker for a stream of its own in eager mode (one direct flag write); "
              "anything else calls fallback, the Python method.",
    .tp_new = HotRecord_new,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(HotRecordObject, vectorcall),
    .tp_traverse = Hot_traverse,
    .tp_clear = Hot_clear,
    .tp_dealloc = Hot_dealloc,
};

/* --- HotPoll: StreamTable.poll_marker, a read of the marker's flag */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    void *entry; /* (HotLaunch's) */
    PyObject *table, *fallback, *stream_type, *marker_type, *done, *pending;
} HotPollObject;

static PyObject *HotPoll_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames);

static PyObject *HotPoll_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *table, *fallback, *stream_type, *marker_type, *done, *pending;
    if (hot_start(kwargs, "HotPoll") < 0)
        return NULL;
    if (!PyArg_ParseTuple(args, "OOO!O!OO:HotPoll", &table, &fallback, &PyType_Type, &stream_type, &PyType_Type,
                          &marker_type, &done, &pending))
        return NULL;
    HotPollObject *self = (HotPollObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->table = Py_NewRef(table);
    self->fallback = Py_NewRef(fallback);
    self->stream_type = Py_NewRef(stream_type);
    self->marker_type = Py_NewRef(marker_type);
    self->done = Py_NewRef(done);
    self->pending = Py_NewRef(pending);
    self->vectorcall = HotPoll_vectorcall;
    return (PyObject *)self;
}

/* The flag's value: ``stream.mv[stream.slot]`` read through the buffer
   protocol (a released view raises as in Python). 1 read, 0 not here, -1. */
static int read_flag(PyObject *stream, uint32_t *out) {
    PyObject *mv = fast_getattr(stream, n_mv);
    if (mv == NULL)
        return -1;
    PyObject *slot = fast_getattr(stream, n_slot);
    if (slot == NULL) {
        Py_DECREF(mv);
        return -1;
    }
    Py_ssize_t i = PyLong_Check(slot) ? PyLong_AsSsize_t(slot) : -1;
    Py_DECREF(slot);
    if (i < 0) {
        Py_DECREF(mv);
        PyErr_Clear();
        return 0;
    }
    Py_buffer view;
    int rc = PyObject_GetBuffer(mv, &view, PyBUF_FORMAT | PyBUF_ND);
    Py_DECREF(mv);
    if (rc < 0)
        return -1;
    rc = 0;
    if (view.itemsize == 4 && view.ndim == 1 && view.format != NULL && strcmp(view.format, "I") == 0 &&
        i < view.shape[0]) {
        *out = ((volatile uint32_t *)view.buf)[i];
        rc = 1;
    }
    PyBuffer_Release(&view);
    return rc;
}

static PyObject *HotPoll_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    HotPollObject *self = (HotPollObject *)op;
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL || Py_TYPE(args[0]) != (PyTypeObject *)self->marker_type)
        return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    PyObject *marker = args[0];
    PyObject *s = fast_getattr(marker, n_stream);
    if (s == NULL)
        return NULL;
    if (Py_TYPE(s) != (PyTypeObject *)self->stream_type) {
        Py_DECREF(s);
        return PyObject_CallOneArg(self->fallback, marker);
    }
    uint32_t flag = 0;
    int rc = read_flag(s, &flag);
    Py_DECREF(s);
    if (rc <= 0)
        return rc < 0 ? NULL : PyObject_CallOneArg(self->fallback, marker);
    PyObject *seq = fast_getattr(marker, n_seq);
    if (seq == NULL)
        return NULL;
    unsigned long long v = PyLong_Check(seq) ? PyLong_AsUnsignedLongLongMask(seq) : (unsigned long long)-1;
    int bad = !PyLong_Check(seq) || (v == (unsigned long long)-1 && PyErr_Occurred());
    Py_DECREF(seq);
    if (bad) {
        PyErr_Clear();
        return PyObject_CallOneArg(self->fallback, marker);
    }
    if ((uint32_t)(flag - (uint32_t)v) < 0x80000000u)
        return Py_NewRef(self->done);
    /* pending, unless the context broke: the Python method says which */
    PyObject *state = fast_getattr(self->table, n_state);
    PyObject *sticky = state ? fast_getattr(state, n_sticky) : NULL;
    Py_XDECREF(state);
    if (sticky == NULL)
        return NULL;
    Py_DECREF(sticky);
    if (sticky != Py_None)
        return PyObject_CallOneArg(self->fallback, marker);
    return Py_NewRef(self->pending);
}

static PyTypeObject HotPollType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "trio_cuda._backends.cuda._direct.HotPoll",
    .tp_basicsize = sizeof(HotPollObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "HotPoll(table, fallback, stream_type, marker_type, done, pending): the stream table's "
              "poll_marker for a plain marker (a read of its stream's flag); anything else calls "
              "fallback, the Python method.",
    .tp_new = HotPoll_new,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(HotPollObject, vectorcall),
    .tp_traverse = Hot_traverse,
    .tp_clear = Hot_clear,
    .tp_dealloc = Hot_dealloc,
};

/* --- HotNotify: StreamTable.notify_submitted, where no marker is new */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    void *entry; /* (unused: the shared head) */
    PyObject *table, *fallback;
} HotNotifyObject;

static PyObject *HotNotify_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    HotNotifyObject *self = (HotNotifyObject *)op;
    if (PyVectorcall_NARGS(nargsf) == 0 && kwnames == NULL) {
        /* the Python method's tests: no new head, or no waiter parked to wake */
        int idle = attr_is(self->table, n_new_head, Py_False);
        if (idle == 0)
            idle = attr_is(self->table, n_wake_ev, Py_None);
        if (idle < 0)
            return NULL;
        if (idle)
            Py_RETURN_NONE;
    }
    return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
}

static PyObject *HotNotify_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *table, *fallback;
    if (hot_start(kwargs, "HotNotify") < 0)
        return NULL;
    if (!PyArg_ParseTuple(args, "OO:HotNotify", &table, &fallback))
        return NULL;
    HotNotifyObject *self = (HotNotifyObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->table = Py_NewRef(table);
    self->fallback = Py_NewRef(fallback);
    self->vectorcall = HotNotify_vectorcall;
    return (PyObject *)self;
}

static PyTypeObject HotNotifyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "trio_cuda._backends.cuda._direct.HotNotify",
    .tp_basicsize = sizeof(HotNotifyObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "HotNotify(table, fallback): the stream table's notify_submitted, which returns at once "
              "where table.new_head is False or table.wake_ev is None (nobody parked to wake); anything else "
              "calls fallback, the Python method.",
    .tp_new = HotNotify_new,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(HotNotifyObject, vectorcall),
    .tp_traverse = Hot_traverse,
    .tp_clear = Hot_clear,
    .tp_dealloc = Hot_dealloc,
};

/* --- HotLaunch: Kernels.launch, a prepared launch or a plain first enqueue */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    launch_fn entry;
    PyObject *kernels, *fallback, *table, *stream_type, *function_type, *primary;
    /* the last first enqueue that took every check (see launch_first): its
       function, configuration, plan, kernel, stream and packed offsets, and
       what the checks gave (a FirstMemo's bytes); NULL until then */
    PyObject *m_function, *m_config, *m_plan, *m_kernel, *m_stream, *m_packed, *m_data;
} HotLaunchObject;

/* What launch_first's checks give for a function, configuration, plan,
   kernel and stream: the dimensions and shared memory, the function's
   address, the stream's handle, and the arena's least size. */
typedef struct {
    unsigned int d[7];
    unsigned long long addr, handle;
    Py_ssize_t need;
} FirstMemo;

static PyObject *HotLaunch_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames);

static PyObject *HotLaunch_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *kernels, *fallback, *table, *stream_type, *function_type, *primary, *entry_obj;
    if (hot_start(kwargs, "HotLaunch") < 0)
        return NULL;
    if (!PyArg_ParseTuple(args, "OOOO!O!OO:HotLaunch", &kernels, &fallback, &table, &PyType_Type, &stream_type,
                          &PyType_Type, &function_type, &primary, &entry_obj))
        return NULL;
    void *entry;
    if (as_ptr(entry_obj, &entry, "entry") < 0)
        return NULL;
    if (entry == NULL) {
        PyErr_SetString(PyExc_ValueError, "HotLaunch: entry: expected the address of cuLaunchKernel, got 0");
        return NULL;
    }
    HotLaunchObject *self = (HotLaunchObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->kernels = Py_NewRef(kernels);
    self->fallback = Py_NewRef(fallback);
    self->table = Py_NewRef(table);
    self->stream_type = Py_NewRef(stream_type);
    self->function_type = Py_NewRef(function_type);
    self->primary = Py_NewRef(primary);
    self->entry = (launch_fn)entry;
    self->vectorcall = HotLaunch_vectorcall;
    return (PyObject *)self;
}

/* Three ints of tuple ``t`` into d[0..2]: 1, or 0 (not so; no error set). */
static int dims3(PyObject *t, unsigned int *d) {
    if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != 3)
        return 0;
    for (int i = 0; i < 3; i++) {
        PyObject *v = PyTuple_GET_ITEM(t, i);
        if (!PyLong_CheckExact(v))
            return 0;
        unsigned long x = PyLong_AsUnsignedLong(v);
        if ((x == (unsigned long)-1 && PyErr_Occurred()) || x > 0xFFFFFFFFUL) {
            PyErr_Clear();
            return 0;
        }
        d[i] = (unsigned int)x;
    }
    return 1;
}

/* An attribute that must be an exact int from 0 to 2**64-1: 1, 0 (not so;
   no error set), -1. */
static int attr_u64(PyObject *obj, PyObject *name, unsigned long long *out) {
    PyObject *v = fast_getattr(obj, name);
    if (v == NULL)
        return -1;
    int ok = PyLong_CheckExact(v);
    if (ok) {
        *out = u64_of(v);
        if (*out == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            ok = 0;
        }
    }
    Py_DECREF(v);
    return ok;
}

/* The first enqueue of a plain launch (``Kernels._launch_first``) through
   ``launch_packed``: 1 launched (*err its CUresult), 0 declined before any
   effect (the Python method decides), -1 error. The checks' results are kept
   for the last function, configuration, plan, kernel and stream that took
   them all (identities: configurations are interned, a kernel's plan is
   its own); a launch of those same objects reads again only what can change
   since: whether the function was unloaded, the function's packed offsets
   and dynamic shared memory, the process's devices, and its own arena. The
   caller has read that the stream is not destroyed. */
static int launch_first(HotLaunchObject *self, PyObject *s, PyObject *function, PyObject *launch, int *err) {
    int rc = 0;
    PyObject *config = NULL, *plan = NULL, *kernel = NULL, *kplan = NULL, *v = NULL, *packed = NULL,
             *arena = NULL, *size = NULL;
    FirstMemo m;
    unsigned long long dyn;
#define TAKE(var, obj, name)                              \
    do {                                                  \
        if ((var = fast_getattr(obj, name)) == NULL) { \
            rc = -1;                                      \
            goto done;                                    \
        }                                                 \
    } while (0)
#define NO_UNLESS(cond)     \
    do {                    \
        int c_ = (cond);    \
        if (c_ <= 0) {      \
            rc = c_;        \
            goto done;      \
        }                   \
    } while (0)
    NO_UNLESS(Py_TYPE(function) == (PyTypeObject *)self->function_type);
    TAKE(config, launch, n_config);
    TAKE(plan, launch, n_plan);
    TAKE(kernel, launch, n_kernel);
    int known = self->m_data != NULL && self->m_function == function && self->m_config == config &&
                self->m_plan == plan && self->m_kernel == kernel && self->m_stream == s;
    if (known) { /* what can have changed since the checks */
        memcpy(&m, PyBytes_AS_STRING(self->m_data), sizeof m);
        NO_UNLESS(attr_is(function, n_unloaded, Py_False));
        TAKE(packed, function, n_packed);
        NO_UNLESS(packed == self->m_packed);
        NO_UNLESS(attr_u64(function, n_dyn_smem, &dyn));
        NO_UNLESS(m.d[6] <= dyn);
    } else {
        NO_UNLESS(attr_is(function, n_owner, self->kernels));
        NO_UNLESS(attr_is(function, n_unloaded, Py_False));
        NO_UNLESS(attr_is(config, n_cluster, Py_None));
        NO_UNLESS(attr_is(config, n_cooperative, Py_False));
        NO_UNLESS(attr_is(config, n_pdl, Py_False));
        TAKE(v, config, n_grid);
        NO_UNLESS(dims3(v, m.d));
        Py_CLEAR(v);
        TAKE(v, config, n_block);
        NO_UNLESS(dims3(v, m.d + 3));
        Py_CLEAR(v);
        unsigned long long smem;
        NO_UNLESS(attr_u64(config, n_shared_mem, &smem));
        NO_UNLESS(attr_u64(function, n_dyn_smem, &dyn));
        NO_UNLESS(smem <= dyn && smem <= 0xFFFFFFFFULL);
        m.d[6] = (unsigned int)smem;
        TAKE(kplan, kernel, n_plan);
        NO_UNLESS(plan == kplan);
        NO_UNLESS(Py_TYPE(s) == (PyTypeObject *)self->stream_type);
        NO_UNLESS(attr_is(s, n_owner, self->table));
        TAKE(packed, function, n_packed);
        NO_UNLESS(PyBytes_CheckExact(packed)); /* (None: not decided yet; False: the wrapper) */
        TAKE(size, plan, n_size);
        NO_UNLESS(PyLong_CheckExact(size));
        m.need = PyLong_AsSsize_t(size);
        if (m.need == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            goto done;
        }
        NO_UNLESS(attr_u64(function, n_addr, &m.addr));
        NO_UNLESS(attr_u64(s, n_handle, &m.handle));
    }
    int many = several_devices(self->primary);
    NO_UNLESS(many < 0 ? -1 : !many);
    TAKE(arena, launch, n_arena);
    NO_UNLESS(PyBytes_CheckExact(arena));
    NO_UNLESS(PyBytes_GET_SIZE(arena) >= m.need);
    if (!known) { /* kept for the next launch of these (an error here only forgets) */
        PyObject *data = PyBytes_FromStringAndSize((const char *)&m, sizeof m);
        if (data == NULL) {
            rc = -1;
            goto done;
        }
        Py_XSETREF(self->m_data, data);
        Py_XSETREF(self->m_function, Py_NewRef(function));
        Py_XSETREF(self->m_config, Py_NewRef(config));
        Py_XSETREF(self->m_plan, Py_NewRef(plan));
        Py_XSETREF(self->m_kernel, Py_NewRef(kernel));
        Py_XSETREF(self->m_stream, Py_NewRef(s));
        Py_XSETREF(self->m_packed, Py_NewRef(packed));
    }
    /* every check passed: the steps with effects */
    if (fast_setattr(launch, n_enqueued, Py_True) < 0) {
        rc = -1;
        goto done;
    }
    rc = packed_call(self->entry, (void *)(uintptr_t)m.addr, m.d, (void *)(uintptr_t)m.handle, arena, packed, err) <
                 0
             ? -1
             : 1;
done:
#undef TAKE
#undef NO_UNLESS
    Py_XDECREF(config);
    Py_XDECREF(plan);
    Py_XDECREF(kernel);
    Py_XDECREF(kplan);
    Py_XDECREF(v);
    Py_XDECREF(packed);
    Py_XDECREF(arena);
    Py_XDECREF(size);
    return rc;
}

static PyObject *HotLaunch_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    HotLaunchObject *self = (HotLaunchObject *)op;
    if (PyVectorcall_NARGS(nargsf) != 3 || kwnames != NULL || Py_TYPE(args[0]) != (PyTypeObject *)self->stream_type)
        return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    PyObject *s = args[0], *function = args[1], *launch = args[2];
    PyObject *cache = fast_getattr(launch, n_cache), *key = NULL, *result = NULL, *hit = NULL;
    if (cache == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return NULL;
        PyErr_Clear();
        return PyObject_Vectorcall(self->fallback, args, nargsf, NULL);
    }
    if (cache != Py_None) { /* (None: nothing kept for it yet) */
        if (!PyDict_CheckExact(cache) || (key = fast_getattr(s, n_key)) == NULL) {
            if (PyErr_Occurred()) {
                Py_DECREF(cache);
                return NULL;
            }
            goto python;
        }
        hit = PyDict_GetItemWithError(cache, key); /* (borrowed) */
        if (hit == NULL && PyErr_Occurred())
            goto out;
    }
    int live = attr_is(s, n_destroyed, Py_False);
    if (live < 0)
        goto out;
    int err = 0;
    if (hit == NULL || !PyTuple_CheckExact(hit) || PyTuple_GET_SIZE(hit) < 3 || PyTuple_GET_ITEM(hit, 0) != function ||
        !live) {
        if (hit != NULL && (!PyTuple_CheckExact(hit) || PyTuple_GET_SIZE(hit) < 3))
            goto python;
        int fresh = live ? attr_is(launch, n_enqueued, Py_False) : 0;
        if (fresh < 0)
            goto out;
        if (!fresh)
            goto python; /* (a launch enqueued again: stable memory of its own; a destroyed stream: in Python) */
        int rc = launch_first(self, s, function, launch, &err);
        if (rc < 0)
            goto out;
        if (rc == 0)
            goto python;
    } else {
        int many = several_devices(self->primary);
        if (many)
            goto out_or_python;
        PyObject *how = PyTuple_GET_ITEM(hit, 1), *call = PyTuple_GET_ITEM(hit, 2);
        if (!PyLong_CheckExact(how) || PyLong_AsLong(how) != 0 || Py_TYPE(call) != &LaunchType) {
            PyErr_Clear();
            goto python;
        }
        LaunchObject *l = (LaunchObject *)call;
        unsigned int *dm = l->dims;
        Py_INCREF(call);
        Py_BEGIN_ALLOW_THREADS
        err = l->fn(l->function, dm[0], dm[1], dm[2], dm[3], dm[4], dm[5], dm[6], l->stream, l->params, NULL);
        Py_END_ALLOW_THREADS
        Py_DECREF(call);
    }
    if (err) {
        PyObject *code = PyLong_FromLong(err);
        PyObject *r = code ? PyObject_CallMethodObjArgs(self->kernels, n_launch_failed, code, launch, NULL) : NULL;
        Py_XDECREF(code);
        if (r == NULL)
            goto out;
        Py_DECREF(r);
    }
    result = Py_NewRef(Py_None);
    goto out;
out_or_python:
    if (PyErr_Occurred())
        goto out;
python:
    result = PyObject_Vectorcall(self->fallback, args, nargsf, NULL);
out:
    Py_DECREF(cache);
    Py_XDECREF(key);
    return result;
}

static PyTypeObject HotLaunchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "trio_cuda._backends.cuda._direct.HotLaunch",
    .tp_basicsize = sizeof(HotLaunchObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "HotLaunch(kernels, fallback, table, stream_type, function_type, primary, entry): "
              "Kernels.launch for a launch prepared on its stream, or a plain launch's first enqueue "
              "from its packed parameters; anything else calls fallback, the Python method.",
    .tp_new = HotLaunch_new,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(HotLaunchObject, vectorcall),
    .tp_traverse = Hot_traverse,
    .tp_clear = Hot_clear,
    .tp_dealloc = Hot_dealloc,
};

/* ------------------------------------------------------------------ module */

static PyMethodDef direct_methods[] = {
    {"launch_packed", (PyCFunction)(void (*)(void))launch_packed, METH_FASTCALL,
     "launch_packed(entry, function, gx, gy, gz, bx, by, bz, shared_mem, stream, arena, offsets): "
     "call cuLaunchKernel once with the parameters packed in arena at offsets; returns the CUresult."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef direct_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "trio_cuda._backends.cuda._direct",
    .m_doc = "Direct calls of cuLaunchKernel and cuStreamWriteValue32 by address, and the backend's "
             "hot methods made of them (see _direct.c).",
    .m_size = -1,
    .m_methods = direct_methods,
};

PyMODINIT_FUNC PyInit__direct(void) {
    if (PyType_Ready(&LaunchType) < 0 || PyType_Ready(&WriterType) < 0 || PyType_Ready(&HotRecordType) < 0 ||
        PyType_Ready(&HotPollType) < 0 || PyType_Ready(&HotLaunchType) < 0 || PyType_Ready(&HotNotifyType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&direct_module);
    if (m == NULL)
        return NULL;
    PyTypeObject *types[] = {&LaunchType, &WriterType, &HotRecordType, &HotPollType, &HotLaunchType, &HotNotifyType};
    const char *names[] = {"Launch", "Writer", "HotRecord", "HotPoll", "HotLaunch", "HotNotify"};
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}

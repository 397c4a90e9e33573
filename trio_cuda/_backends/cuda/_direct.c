/* Direct calls of two CUDA driver entry points, by address: a prepared
   cuLaunchKernel (Launch), a launch from packed parameters (launch_packed) and
   a prepared cuStreamWriteValue32 (Writer).

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
     backend falls back to it when this module is missing or turned off. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

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
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
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
    Py_ssize_t size = PyBytes_GET_SIZE(arena), nb = PyBytes_GET_SIZE(offsets);
    if (nb % 4) {
        PyErr_Format(PyExc_ValueError, "launch_packed: offsets: expected a multiple of 4 bytes, got %zd", nb);
        return NULL;
    }
    Py_ssize_t n = nb / 4;
    char *base = PyBytes_AS_STRING(arena);
    const char *raw = PyBytes_AS_STRING(offsets);
    void *stack[STACK_SLOTS];
    void **argv = n <= STACK_SLOTS ? stack : PyMem_Malloc(sizeof(void *) * (size_t)n);
    if (argv == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t off;
        memcpy(&off, raw + 4 * i, 4);
        if ((Py_ssize_t)off >= size) {
            if (argv != stack)
                PyMem_Free(argv);
            PyErr_Format(PyExc_ValueError,
                         "launch_packed: offsets: parameter %zd at offset %u is past the arena (%zd bytes)",
                         i, (unsigned int)off, size);
            return NULL;
        }
        argv[i] = base + off;
    }
    int err;
    launch_fn fn = (launch_fn)entry;
    Py_BEGIN_ALLOW_THREADS
    err = fn(function, d[0], d[1], d[2], d[3], d[4], d[5], d[6], stream, n ? argv : NULL, NULL);
    Py_END_ALLOW_THREADS
    if (argv != stack)
        PyMem_Free(argv);
    return PyLong_FromLong(err);
}

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
    .m_doc = "Direct calls of cuLaunchKernel and cuStreamWriteValue32 by address (see _direct.c).",
    .m_size = -1,
    .m_methods = direct_methods,
};

PyMODINIT_FUNC PyInit__direct(void) {
    if (PyType_Ready(&LaunchType) < 0 || PyType_Ready(&WriterType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&direct_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&LaunchType);
    if (PyModule_AddObject(m, "Launch", (PyObject *)&LaunchType) < 0) {
        Py_DECREF(&LaunchType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&WriterType);
    if (PyModule_AddObject(m, "Writer", (PyObject *)&WriterType) < 0) {
        Py_DECREF(&WriterType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

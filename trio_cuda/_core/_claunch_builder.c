/* The launch builder's fields and hot methods, compiled: the base class of
   trio_cuda.LaunchBuilder (see _claunch.c for the invariants). */

#include "_claunch.h"

static PyObject *g_base;           /* the base type, once made */
static PyObject *g_reference;      /* the reference class (_PyBuilder) */
static PyObject *g_pointer_slot, *g_scalar_kinds, *g_config_cache, *g_own_layouts;
static PyObject *g_cached_config, *g_plan_for, *g_views;
static PyTypeObject *g_views_type; /* LazyViews */

enum { REF_GRID, REF_BLOCK, REF_SHARED, REF_CLUSTER, REF_COOPERATIVE, REF_PDL, REF_ARG, REF_FINALIZE, REF_N };
static const char *const ref_names[REF_N] = {"grid", "block", "shared_mem", "cluster",
                                             "cooperative", "pdl", "arg", "finalize_unchecked"};
static PyObject *g_ref[REF_N];
static PyObject *s_params, *s_access, *s_plan;

/* ------------------------------------------------------------------ Builder */

typedef struct {
    PyObject_HEAD
    PyObject *kernel, *grid, *block, *shared, *cluster, *cooperative, *pdl;
    PyObject *values, *accesses, *outputs, *layout, *arena;
} Builder;

#define N_FIELDS 12

static PyObject **fields(Builder *self) { return &self->kernel; }

static PyMemberDef builder_members[] = {
    {"_kernel", T_OBJECT_EX, offsetof(Builder, kernel), 0, NULL},
    {"_grid", T_OBJECT_EX, offsetof(Builder, grid), 0, NULL},
    {"_block", T_OBJECT_EX, offsetof(Builder, block), 0, NULL},
    {"_shared", T_OBJECT_EX, offsetof(Builder, shared), 0, NULL},
    {"_cluster", T_OBJECT_EX, offsetof(Builder, cluster), 0, NULL},
    {"_cooperative", T_OBJECT_EX, offsetof(Builder, cooperative), 0, NULL},
    {"_pdl", T_OBJECT_EX, offsetof(Builder, pdl), 0, NULL},
    {"_values", T_OBJECT_EX, offsetof(Builder, values), 0, NULL},
    {"_accesses", T_OBJECT_EX, offsetof(Builder, accesses), 0, NULL},
    {"_outputs", T_OBJECT_EX, offsetof(Builder, outputs), 0, NULL},
    {"_layout", T_OBJECT_EX, offsetof(Builder, layout), 0, NULL},
    {"_arena", T_OBJECT_EX, offsetof(Builder, arena), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static int builder_traverse(Builder *self, visitproc visit, void *arg) {
    PyObject **f = fields(self);
    for (int i = 0; i < N_FIELDS; i++) Py_VISIT(f[i]);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int builder_clear(Builder *self) {
    PyObject **f = fields(self);
    for (int i = 0; i < N_FIELDS; i++) Py_CLEAR(f[i]);
    return 0;
}

static void builder_dealloc(Builder *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    builder_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* Whether the fields are what the fast paths read (a user may have set or
   deleted them; the reference then decides what happens). */
static int fields_ok(Builder *self) {
    PyObject **f = fields(self);
    for (int i = 0; i < N_FIELDS; i++)
        if (f[i] == NULL) return 0;
    return PyList_CheckExact(self->values) && PyList_CheckExact(self->accesses) &&
           PyList_CheckExact(self->outputs) && PyList_CheckExact(self->layout) &&
           PyByteArray_CheckExact(self->arena);
}

/* The reference method ``which`` called with the same arguments. */
static PyObject *delegate(int which, PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                          PyObject *kwnames) {
    Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    PyObject *small[8];
    PyObject **vec = small;
    if (total + 1 > 8) {
        vec = PyMem_Malloc((size_t)(total + 1) * sizeof(PyObject *));
        if (vec == NULL) return PyErr_NoMemory();
    }
    vec[0] = self;
    for (Py_ssize_t i = 0; i < total; i++) vec[i + 1] = args[i];
    PyObject *out = PyObject_Vectorcall(g_ref[which], vec, (size_t)(nargs + 1), kwnames);
    if (vec != small) PyMem_Free(vec);
    return out;
}

static PyObject *self_ref(Builder *self) {
    Py_INCREF(self);
    return (PyObject *)self;
}

static PyObject *tuple_of(PyObject *const *args, Py_ssize_t n) {
    PyObject *t = PyTuple_New(n);
    if (t == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_INCREF(args[i]);
        PyTuple_SET_ITEM(t, i, args[i]);
    }
    return t;
}

/* grid(*dims), block(*dims), cluster(*dims): the dims tuple is stored */
static PyObject *set_dims(Builder *self, PyObject **slot, int which, PyObject *const *args,
                          Py_ssize_t nargs, PyObject *kwnames) {
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames)) return delegate(which, (PyObject *)self, args, nargs, kwnames);
    PyObject *dims = tuple_of(args, nargs);
    if (dims == NULL) return NULL;
    Py_XSETREF(*slot, dims);
    return self_ref(self);
}

static PyObject *b_grid(Builder *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return set_dims(self, &self->grid, REF_GRID, args, nargs, kwnames);
}

static PyObject *b_block(Builder *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return set_dims(self, &self->block, REF_BLOCK, args, nargs, kwnames);
}

static PyObject *b_cluster(Builder *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return set_dims(self, &self->cluster, REF_CLUSTER, args, nargs, kwnames);
}

static PyObject *b_shared_mem(Builder *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (nargs != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames)))
        return delegate(REF_SHARED, (PyObject *)self, args, nargs, kwnames);
    Py_INCREF(args[0]);
    Py_XSETREF(self->shared, args[0]);
    return self_ref(self);
}

/* cooperative(enabled=True), pdl(enabled=True) */
static PyObject *set_flag(Builder *self, PyObject **slot, int which, PyObject *const *args, Py_ssize_t nargs,
                          PyObject *kwnames) {
    if (nargs > 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames)))
        return delegate(which, (PyObject *)self, args, nargs, kwnames);
    PyObject *value = nargs ? args[0] : Py_True;
    Py_INCREF(value);
    Py_XSETREF(*slot, value);
    return self_ref(self);
}

static PyObject *b_cooperative(Builder *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return set_flag(self, &self->cooperative, REF_COOPERATIVE, args, nargs, kwnames);
}

static PyObject *b_pdl(Builder *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return set_flag(self, &self->pdl, REF_PDL, args, nargs, kwnames);
}

/* Append ``lead`` zero bytes and ``n`` bytes of ``data`` to the arena. */
static int arena_append(PyObject *arena, Py_ssize_t lead, const void *data, Py_ssize_t n) {
    Py_ssize_t at = PyByteArray_GET_SIZE(arena);
    if (PyByteArray_Resize(arena, at + lead + n) < 0) return -1;
    char *buf = PyByteArray_AS_STRING(arena);
    memset(buf + at, 0, (size_t)lead);
    memcpy(buf + at + lead, data, (size_t)n);
    return 0;
}


/* arg(array) with the access the kernel declares: 1 done, 0 take the
   reference path (nothing changed), -1 error. */
static int arg_array(Builder *self, PyObject *value) {
    int rc = 0;
    PyObject *alloc = NULL, *flag = NULL, *table = NULL, *params = NULL, *declared = NULL, *ptr = NULL,
             *offset = NULL, *entry = NULL;
    PyObject *mode;
    Py_ssize_t index = PyList_GET_SIZE(self->values);
    FAIL_IF_NULL(alloc = read_slot(value, &g_slot[A_ALLOC]));
    FAIL_IF_NULL(flag = read_slot(value, &g_slot[A_CLOSED]));
    DECLINE_IF(flag != Py_False);
    Py_CLEAR(flag);
    FAIL_IF_NULL(flag = read_slot(alloc, &g_slot[L_STATE]));
    DECLINE_IF(flag == g_freed);
    Py_CLEAR(flag);
    FAIL_IF_NULL(table = read_slot(alloc, &g_slot[L_TABLE]));
    FAIL_IF_NULL(flag = read_slot(table, &g_slot[T_CLOSED]));
    DECLINE_IF(flag != Py_False);
    Py_CLEAR(flag);
    FAIL_IF_NULL(params = PyObject_GetAttr(self->kernel, s_params));
    DECLINE_IF(!PyTuple_CheckExact(params) && !PyList_CheckExact(params));
    mode = g_write;
    if (index < PySequence_Fast_GET_SIZE(params)) {
        FAIL_IF_NULL(declared = PyObject_GetAttr(PySequence_Fast_GET_ITEM(params, index), s_access));
        if (declared != Py_None) mode = declared;
    }
    if (mode == g_write) {
        FAIL_IF_NULL(flag = read_slot(value, &g_slot[A_READONLY]));
        DECLINE_IF(flag != Py_False);
        Py_CLEAR(flag);
    }
    unsigned long long base, off;
    FAIL_IF_NULL(ptr = read_slot(alloc, &g_slot[L_PTR]));
    FAIL_IF_NULL(offset = read_slot(value, &g_slot[A_OFFSET]));
    DECLINE_IF(!as_u64(ptr, &base) || !as_u64(offset, &off) || base + off < base);
    uint64_t address = (uint64_t)(base + off);
    FAIL_IF_NULL(entry = PyTuple_Pack(2, value, mode));
    Py_ssize_t at = PyByteArray_GET_SIZE(self->arena);
    if (arena_append(self->arena, (-at) & 7, &address, 8) < 0 || PyList_Append(self->layout, g_pointer_slot) < 0 ||
        PyList_Append(self->accesses, entry) < 0 || (mode == g_write && PyList_Append(self->outputs, value) < 0) ||
        PyList_Append(self->values, value) < 0) {
        rc = -1;
        goto done;
    }
    rc = 1;
done:
    Py_XDECREF(alloc);
    Py_XDECREF(flag);
    Py_XDECREF(table);
    Py_XDECREF(params);
    Py_XDECREF(declared);
    Py_XDECREF(ptr);
    Py_XDECREF(offset);
    Py_XDECREF(entry);
    return rc;
}

/* arg(scalar) of a kind the reference has cached ((size, align), packer):
   1 done, 0 reference path (nothing changed), -1 error (the packer's, as
   the reference would raise it). */
static int arg_scalar(Builder *self, PyObject *value, PyObject *kind) {
    if (!PyTuple_CheckExact(kind) || PyTuple_GET_SIZE(kind) != 2) return 0;
    PyObject *slot = PyTuple_GET_ITEM(kind, 0);
    if (!PyTuple_CheckExact(slot) || PyTuple_GET_SIZE(slot) != 2 || !PyLong_CheckExact(PyTuple_GET_ITEM(slot, 1)))
        return 0;
    long align = PyLong_AsLong(PyTuple_GET_ITEM(slot, 1));
    if (align <= 0 || (align & (align - 1))) {
        PyErr_Clear();
        return 0;
    }
    Py_INCREF(kind); /* the packer may run anything: keep what is used */
    PyObject *raw = PyObject_CallOneArg(PyTuple_GET_ITEM(kind, 1), value);
    int rc = -1;
    if (raw == NULL) goto out;
    if (!PyBytes_CheckExact(raw)) {
        rc = 0;
        goto out;
    }
    Py_ssize_t at = PyByteArray_GET_SIZE(self->arena);
    if (arena_append(self->arena, (-at) & (align - 1), PyBytes_AS_STRING(raw), PyBytes_GET_SIZE(raw)) < 0 ||
        PyList_Append(self->layout, slot) < 0 || PyList_Append(self->values, value) < 0)
        goto out;
    rc = 1;
out:
    Py_XDECREF(raw);
    Py_DECREF(kind);
    return rc;
}

static PyObject *b_arg(Builder *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (nargs != 1 || !fields_ok(self)) goto slow;
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames)) {
        /* arg(value, access=None) is arg(value); any other keyword goes to the reference */
        if (PyTuple_GET_SIZE(kwnames) != 1 || args[1] != Py_None) goto slow;
        PyObject *key = PyTuple_GET_ITEM(kwnames, 0);
        if (!PyUnicode_CheckExact(key) || PyUnicode_CompareWithASCIIString(key, "access") != 0) goto slow;
    }
    PyObject *value = args[0];
    int rc;
    if (Py_TYPE(value) == g_array_type) {
        rc = arg_array(self, value);
    } else {
        PyObject *kind = PyDict_GetItemWithError(g_scalar_kinds, (PyObject *)Py_TYPE(value));
        if (kind == NULL) {
            if (PyErr_Occurred()) return NULL;
            goto slow;
        }
        rc = arg_scalar(self, value, kind);
    }
    if (rc < 0) return NULL;
    if (rc > 0) return self_ref(self);
slow:
    return delegate(REF_ARG, (PyObject *)self, args, nargs, kwnames);
}

/* ------------------------------------------------------------------ LazyViews */

/* The argument views of a finalized builder, made on first use: calls the
   reference's ``_views(values, accesses)``. */
typedef struct {
    PyObject_HEAD
    PyObject *values, *accesses;
} LazyViews;

static int views_traverse(LazyViews *self, visitproc visit, void *arg) {
    Py_VISIT(self->values);
    Py_VISIT(self->accesses);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int views_clear(LazyViews *self) {
    Py_CLEAR(self->values);
    Py_CLEAR(self->accesses);
    return 0;
}

static void views_dealloc(LazyViews *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    views_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *views_call(LazyViews *self, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs != NULL && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "the argument views take no arguments");
        return NULL;
    }
    return PyObject_CallFunctionObjArgs(g_views, self->values, self->accesses, NULL);
}

static PyType_Slot views_slots[] = {
    {Py_tp_dealloc, views_dealloc}, {Py_tp_traverse, views_traverse}, {Py_tp_clear, views_clear},
    {Py_tp_call, views_call},       {Py_tp_doc, "A finalized builder's argument views, made when called."},
    {0, NULL},
};

static PyType_Spec views_spec = {
    "trio_cuda._core._claunch.LazyViews", sizeof(LazyViews), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_DISALLOW_INSTANTIATION, views_slots,
};

/* ------------------------------------------------------------------ finalize */

static int exact_int_1tuple(PyObject *t) {
    return PyTuple_CheckExact(t) && PyTuple_GET_SIZE(t) == 1 && PyLong_CheckExact(PyTuple_GET_ITEM(t, 0));
}

/* The launch configuration: the cache entry the reference's ``_config``
   finds in the common case, else ``cached_config(...)``. New reference. */
static PyObject *config_of(Builder *self) {
    if (exact_int_1tuple(self->grid) && exact_int_1tuple(self->block) && PyLong_CheckExact(self->shared) &&
        self->cluster == Py_None && self->cooperative == Py_False && self->pdl == Py_False) {
        PyObject *key = PyTuple_Pack(6, self->grid, self->block, self->shared, Py_None, Py_False, Py_False);
        if (key == NULL) return NULL;
        PyObject *config = PyDict_GetItemWithError(g_config_cache, key);
        Py_DECREF(key);
        if (config != NULL) {
            Py_INCREF(config);
            return config;
        }
        if (PyErr_Occurred()) return NULL;
    }
    PyObject *args[6] = {self->grid, self->block, self->shared, self->cluster, self->cooperative, self->pdl};
    return PyObject_Vectorcall(g_cached_config, args, 6, NULL);
}

/* The parameter plan of the layout ``key``: the kernel's own when it is
   known to match (the reference's cache), else ``_plan_for``. */
static PyObject *plan_of(Builder *self, PyObject *key) {
    PyObject *own = PyObject_GetAttr(self->kernel, s_plan);
    if (own == NULL) return NULL;
    PyObject *id = PyLong_FromVoidPtr(own);
    if (id == NULL) {
        Py_DECREF(own);
        return NULL;
    }
    PyObject *entry = PyDict_GetItemWithError(g_own_layouts, id);
    Py_DECREF(id);
    if (entry != NULL && PyTuple_CheckExact(entry) && PyTuple_GET_SIZE(entry) == 2 &&
        PyTuple_GET_ITEM(entry, 0) == own) {
        Py_INCREF(entry);
        int same = PyObject_RichCompareBool(key, PyTuple_GET_ITEM(entry, 1), Py_EQ);
        Py_DECREF(entry);
        if (same < 0) {
            Py_DECREF(own);
            return NULL;
        }
        if (same) return own;
    }
    Py_DECREF(own);
    if (PyErr_Occurred()) return NULL;
    PyObject *args[2] = {self->kernel, key};
    return PyObject_Vectorcall(g_plan_for, args, 2, NULL);
}

/* 1 if two array arguments are views of one allocation, 0 if not, -1
   error, 2 if an entry is not an (array, access) pair of a DeviceArray
   (fields set by hand: the reference decides). */
static int shares_allocation(PyObject *accesses) {
    Py_ssize_t n = PyTuple_GET_SIZE(accesses);
    if (n < 2) return 0;
    PyObject *small[16];
    PyObject **allocs = small;
    if (n > 16) {
        allocs = PyMem_Malloc((size_t)n * sizeof(PyObject *));
        if (allocs == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    Py_ssize_t got = 0;
    int rc = 0;
    for (; got < n; got++) {
        PyObject *entry = PyTuple_GET_ITEM(accesses, got);
        if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 2 ||
            Py_TYPE(PyTuple_GET_ITEM(entry, 0)) != g_array_type) {
            rc = 2;
            break;
        }
        allocs[got] = read_slot(PyTuple_GET_ITEM(entry, 0), &g_slot[A_ALLOC]);
        if (allocs[got] == NULL) {
            rc = -1;
            break;
        }
    }
    for (Py_ssize_t i = 0; rc == 0 && i < got; i++)
        for (Py_ssize_t j = i + 1; j < got; j++)
            if (allocs[i] == allocs[j]) {
                rc = 1;
                break;
            }
    for (Py_ssize_t i = 0; i < got; i++) Py_DECREF(allocs[i]);
    if (allocs != small) PyMem_Free(allocs);
    return rc;
}

static PyObject *b_finalize(Builder *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (nargs || (kwnames != NULL && PyTuple_GET_SIZE(kwnames)) || !fields_ok(self))
        return delegate(REF_FINALIZE, (PyObject *)self, args, nargs, kwnames);
    PyObject *config = NULL, *key = NULL, *plan = NULL, *accesses = NULL, *merged = NULL, *arena = NULL,
             *values = NULL, *views = NULL, *prepared = NULL, *output = NULL, *launch = NULL;
    if ((config = config_of(self)) == NULL) goto done;
    if ((key = PyList_AsTuple(self->layout)) == NULL) goto done;
    if ((plan = plan_of(self, key)) == NULL) goto done;
    if ((accesses = PyList_AsTuple(self->accesses)) == NULL) goto done;
    int shared = shares_allocation(accesses);
    if (shared < 0) goto done;
    if (shared == 2) {
        launch = delegate(REF_FINALIZE, (PyObject *)self, args, nargs, kwnames);
        goto done;
    }
    if (shared) {
        if ((merged = PyObject_CallOneArg(g_merge, accesses)) == NULL) goto done;
    } else {
        Py_INCREF(accesses);
        merged = accesses;
    }
    if ((arena = PyBytes_FromStringAndSize(PyByteArray_AS_STRING(self->arena), PyByteArray_GET_SIZE(self->arena))) ==
        NULL)
        goto done;
    if ((values = PyList_AsTuple(self->values)) == NULL) goto done;
    LazyViews *lazy = PyObject_GC_New(LazyViews, g_views_type);
    if (lazy == NULL) goto done; /* (it holds its heap type, as every instance does) */
    Py_INCREF(values);
    Py_INCREF(accesses);
    lazy->values = values;
    lazy->accesses = accesses;
    PyObject_GC_Track(lazy);
    views = (PyObject *)lazy;
    {
        PyObject *fields[9] = {self->kernel, config, plan, arena, views, PyTuple_New(0), Py_None, Py_None, Py_False};
        if (fields[5] == NULL) goto done;
        prepared = new_instance(g_prepared_type, g_prepared_off, fields, 9);
        Py_DECREF(fields[5]);
        if (prepared == NULL) goto done;
    }
    Py_ssize_t n_out = PyList_GET_SIZE(self->outputs);
    if (n_out == 0) {
        output = Py_None;
        Py_INCREF(output);
    } else if (n_out == 1) {
        output = PyList_GET_ITEM(self->outputs, 0);
        Py_INCREF(output);
    } else if ((output = PyList_AsTuple(self->outputs)) == NULL) {
        goto done;
    }
    {
        PyObject *fields[5] = {prepared, merged, Py_None, output, Py_False};
        launch = new_instance(g_launch_type, g_launch_off, fields, 5);
    }
done:
    Py_XDECREF(config);
    Py_XDECREF(key);
    Py_XDECREF(plan);
    Py_XDECREF(accesses);
    Py_XDECREF(merged);
    Py_XDECREF(arena);
    Py_XDECREF(values);
    Py_XDECREF(views);
    Py_XDECREF(prepared);
    Py_XDECREF(output);
    return launch;
}

/* ------------------------------------------------------------------ _create */

static PyObject *b_create(PyObject *cls, PyObject *kernel) {
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, (PyTypeObject *)g_base)) {
        PyErr_SetString(PyExc_TypeError, "_create: cls must be a subclass of the builder base");
        return NULL;
    }
    PyTypeObject *tp = (PyTypeObject *)cls;
    Builder *self = (Builder *)tp->tp_alloc(tp, 0);
    if (self == NULL) return NULL;
    Py_INCREF(kernel);
    self->kernel = kernel;
    self->grid = PyLong_FromLong(1);
    self->block = PyLong_FromLong(1);
    self->shared = PyLong_FromLong(0);
    Py_INCREF(Py_None);
    self->cluster = Py_None;
    Py_INCREF(Py_False);
    self->cooperative = Py_False;
    Py_INCREF(Py_False);
    self->pdl = Py_False;
    self->values = PyList_New(0);
    self->accesses = PyList_New(0);
    self->outputs = PyList_New(0);
    self->layout = PyList_New(0);
    self->arena = PyByteArray_FromStringAndSize(NULL, 0);
    PyObject **f = fields(self);
    for (int i = 0; i < N_FIELDS; i++)
        if (f[i] == NULL) {
            Py_DECREF(self);
            return NULL;
        }
    return (PyObject *)self;
}

/* ------------------------------------------------------------------ make_base */

int builder_init(void) {
    const char *names[] = {"params", "access", "_plan"};
    PyObject **slots[] = {&s_params, &s_access, &s_plan};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        *slots[i] = PyUnicode_InternFromString(names[i]);
        if (*slots[i] == NULL) return -1;
    }
    g_views_type = (PyTypeObject *)PyType_FromSpec(&views_spec);
    return g_views_type == NULL ? -1 : 0;
}

static PyMethodDef builder_methods[] = {
    {"_create", (PyCFunction)(void (*)(void))b_create, METH_O | METH_CLASS, NULL},
    {"grid", (PyCFunction)(void (*)(void))b_grid, METH_FASTCALL | METH_KEYWORDS, NULL},
    {"block", (PyCFunction)(void (*)(void))b_block, METH_FASTCALL | METH_KEYWORDS, NULL},
    {"shared_mem", (PyCFunction)(void (*)(void))b_shared_mem, METH_FASTCALL | METH_KEYWORDS, NULL},
    {"cluster", (PyCFunction)(void (*)(void))b_cluster, METH_FASTCALL | METH_KEYWORDS, NULL},
    {"cooperative", (PyCFunction)(void (*)(void))b_cooperative, METH_FASTCALL | METH_KEYWORDS, NULL},
    {"pdl", (PyCFunction)(void (*)(void))b_pdl, METH_FASTCALL | METH_KEYWORDS, NULL},
    {"arg", (PyCFunction)(void (*)(void))b_arg, METH_FASTCALL | METH_KEYWORDS, NULL},
    {"finalize_unchecked", (PyCFunction)(void (*)(void))b_finalize, METH_FASTCALL | METH_KEYWORDS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot builder_slots[] = {
    {Py_tp_dealloc, builder_dealloc},
    {Py_tp_traverse, builder_traverse},
    {Py_tp_clear, builder_clear},
    {Py_tp_methods, builder_methods},
    {Py_tp_members, builder_members},
    {Py_tp_doc, "The launch builder's fields and hot methods, compiled (see trio_cuda.LaunchBuilder)."},
    {0, NULL},
};

static PyType_Spec builder_spec = {
    "trio_cuda._core._builder._BuilderCore", sizeof(Builder), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    builder_slots,
};

PyObject *make_base(PyObject *module, PyObject *args) {
    PyObject *reference, *env, *docs;
    if (!PyArg_ParseTuple(args, "OO!O!:make_base", &reference, &PyDict_Type, &env, &PyDict_Type, &docs)) return NULL;
    if (!g_configured || g_base != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "make_base: called once per process, after configure()");
        return NULL;
    }
    if (take(env, "POINTER_SLOT", &g_pointer_slot) < 0 || take(env, "SCALAR_KINDS", &g_scalar_kinds) < 0 ||
        take(env, "CONFIG_CACHE", &g_config_cache) < 0 || take(env, "OWN_LAYOUTS", &g_own_layouts) < 0 ||
        take(env, "cached_config", &g_cached_config) < 0 || take(env, "plan_for", &g_plan_for) < 0 ||
        take(env, "views", &g_views) < 0)
        return NULL;
    if (!PyDict_CheckExact(g_scalar_kinds) || !PyDict_CheckExact(g_config_cache) || !PyDict_CheckExact(g_own_layouts)) {
        PyErr_SetString(PyExc_TypeError, "make_base: the caches must be dicts");
        return NULL;
    }
    for (int i = 0; i < REF_N; i++) {
        g_ref[i] = PyObject_GetAttrString(reference, ref_names[i]);
        if (g_ref[i] == NULL) return NULL;
    }
    /* each method's doc: the reference's, with its text signature */
    for (PyMethodDef *m = builder_methods; m->ml_name != NULL; m++) {
        PyObject *doc = PyDict_GetItemString(docs, m->ml_name);
        if (doc == NULL) continue;
        const char *text = PyUnicode_AsUTF8(doc);
        if (text == NULL) return NULL;
        char *copy = PyMem_RawMalloc(strlen(text) + 1); /* held for the life of the type */
        if (copy == NULL) return PyErr_NoMemory();
        strcpy(copy, text);
        m->ml_doc = copy;
    }
    Py_INCREF(reference);
    g_reference = reference;
    g_base = PyType_FromSpec(&builder_spec);
    if (g_base == NULL) return NULL;
    Py_INCREF(g_base);
    return g_base;
}


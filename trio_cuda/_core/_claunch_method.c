/* Kernel.launch, compiled (part of trio_cuda._core._claunch).

   launch_method(reference, Kernel, config_module) makes the descriptor that
   stands for the reference ``Kernel.launch`` (trio_cuda/_core/_kernel.py) in
   the class. Read on the class it is the reference function itself (its
   documentation, signature and pickling are the reference's). A call
   ``kernel.launch(...)`` calls it without binding it (a method descriptor);
   read on a kernel otherwise (a call with ``*args``, ``**kwargs``), it is
   that method bound to the kernel (``BoundLaunch``), whose call takes the
   arguments' tuple and keywords' dict as given, keeping that tuple for the
   launch rather than making one.

   A call does what the reference does for the common case: keywords among
   grid, block and shared_mem (cluster, cooperative and pdl only at their
   defaults), an exact int grid, a configuration already in the config
   module's ``_SIMPLE_CONFIGS`` (what ``cached_config`` returns then), and a
   fast path making the launch:
   - a SIMT kernel: exact ints for block and shared_mem (None: 0), and the
     kernel's typed fast path (``kernel._fast``);
   - a tile kernel: no block or shared_mem (its configuration is grid x 1,
     as the tile support makes it), and the fast paths of its recent
     recipes, in their order (``kernel.tile._fast``, kept by the tile
     support: trio_cuda/_tile/launching.py).
   Every other call, and one whose fast paths decline, is the reference's
   call, from the start: so its errors, its checked paths and its tile
   support are the reference's own. */

#include "_claunch.h"

typedef struct {
    PyObject_HEAD
    PyObject *reference;
    vectorcallfunc vectorcall;
} LaunchMethod;

static PyTypeObject *t_method, *t_kernel;
static SlotRef r_tile, r_fast;
static PyObject *g_config_globals, *n_simple, *n_grid, *n_block, *n_shared_mem, *n_cluster, *n_cooperative, *n_pdl,
    *n_fast, *g_zero, *g_one;

/* ``made``'s fast paths tried in turn on the arguments after the kernel:
   ``argt`` where it is their tuple, else ``args[1:nargs]``. The launch (a new
   reference), None where each declined, NULL on an error. */
static PyObject *try_fast(PyObject *const *fasts, Py_ssize_t n, PyObject *argt, PyObject *const *args,
                          Py_ssize_t nargs, PyObject *config) {
    if (argt != NULL) {
        Py_INCREF(argt);
    } else {
        if ((argt = PyTuple_New(nargs - 1)) == NULL) return NULL;
        for (Py_ssize_t i = 1; i < nargs; i++) {
            Py_INCREF(args[i]);
            PyTuple_SET_ITEM(argt, i - 1, args[i]);
        }
    }
    PyObject *made = Py_NewRef(Py_None);
    PyObject *fargs[2] = {argt, config};
    for (Py_ssize_t i = 0; i < n && made == Py_None; i++) {
        Py_DECREF(made);
        made = PyObject_Vectorcall(fasts[i], fargs, 2, NULL);
        if (made == NULL) break; /* (the fast path raised, as in the reference) */
    }
    Py_DECREF(argt);
    return made;
}

/* The geometry keywords of a call. */
typedef struct {
    PyObject *grid, *block, *smem;
} Geometry;

/* Keyword ``name`` = ``value`` taken into ``g``: 1, or 0 where the common
   call does not take it (a keyword not interned too: the reference parses it). */
static int take_keyword(Geometry *g, PyObject *name, PyObject *value) {
    if (name == n_grid)
        g->grid = value;
    else if (name == n_block)
        g->block = value;
    else if (name == n_shared_mem)
        g->smem = value;
    else if (name == n_cluster || name == n_cooperative)
        return value == Py_None || (name == n_cooperative && value == Py_False);
    else
        return name == n_pdl && value == Py_False;
    return 1;
}

/* The configurations found last, by their three ints: ``_SIMPLE_CONFIGS``'
   entries as the dict gave them (a value: an entry stays right after the
   dict dropped it, being equal to what ``cached_config`` makes again). */
#define RECENT 4
static struct {
    long grid, block, smem;
    PyObject *config;
} recent[RECENT];
static int recent_next;

/* ``_SIMPLE_CONFIGS[(grid, block, smem)]`` (borrowed; NULL where it has
   none, or on an error, set). The three are exact ints. */
static PyObject *found_config(PyObject *grid, PyObject *block, PyObject *smem) {
    int o1, o2, o3;
    long gx = PyLong_AsLongAndOverflow(grid, &o1), bx = PyLong_AsLongAndOverflow(block, &o2),
         sx = PyLong_AsLongAndOverflow(smem, &o3);
    int small = !(o1 | o2 | o3);
    if (small)
        for (int i = 0; i < RECENT; i++)
            if (recent[i].config != NULL && recent[i].grid == gx && recent[i].block == bx && recent[i].smem == sx)
                return recent[i].config;
    PyObject *configs = PyDict_GetItemWithError(g_config_globals, n_simple); /* (borrowed) */
    if (configs == NULL || !PyDict_CheckExact(configs)) return NULL;
    PyObject *key = PyTuple_Pack(3, grid, block, smem);
    if (key == NULL) return NULL;
    PyObject *config = PyDict_GetItemWithError(configs, key); /* (borrowed) */
    Py_DECREF(key);
    if (config != NULL && small) {
        int i = recent_next;
        recent_next = (i + 1) % RECENT;
        Py_XSETREF(recent[i].config, Py_NewRef(config));
        recent[i].grid = gx;
        recent[i].block = bx;
        recent[i].smem = sx;
    }
    return config;
}

/* The common call of ``kernel`` with the arguments after it (``argt`` or
   ``args[1:nargs]``, see try_fast): the launch (a new reference), None where
   the reference makes this call, NULL on an error. */
static PyObject *common_call(PyObject *kernel, PyObject *argt, PyObject *const *args, Py_ssize_t nargs, Geometry g) {
    if (Py_TYPE(kernel) != t_kernel || g.grid == NULL || !PyLong_CheckExact(g.grid)) Py_RETURN_NONE;
    PyObject *tile = read_slot(kernel, &r_tile);
    if (tile == NULL) return NULL;
    PyObject *fasts = NULL, *made = NULL, *block = g.block, *smem = g.smem;
    int is_tile = tile != Py_None;
    if (is_tile) { /* block, shared memory and the rest are compiled in: none given */
        if (block != Py_None || smem != Py_None) {
            Py_DECREF(tile);
            Py_RETURN_NONE;
        }
        block = g_one;
        smem = g_zero;
        fasts = fast_getattr(tile, n_fast);
    } else {
        if (smem == Py_None) smem = g_zero;
        if (!PyLong_CheckExact(block) || !PyLong_CheckExact(smem)) {
            Py_DECREF(tile);
            Py_RETURN_NONE;
        }
        fasts = read_slot(kernel, &r_fast);
    }
    Py_DECREF(tile);
    if (fasts == NULL) return NULL;
    PyObject *config = found_config(g.grid, block, smem); /* (borrowed) */
    if (PyErr_Occurred()) {
        Py_DECREF(fasts);
        return NULL;
    }
    if (config == NULL) { /* (the reference makes it, and caches it) */
        Py_DECREF(fasts);
        Py_RETURN_NONE;
    }
    Py_INCREF(config);
    if (is_tile && PyTuple_CheckExact(fasts))
        made = try_fast(((PyTupleObject *)fasts)->ob_item, PyTuple_GET_SIZE(fasts), argt, args, nargs, config);
    else if (!is_tile && fasts != Py_None)
        made = try_fast(&fasts, 1, argt, args, nargs, config);
    else
        made = Py_NewRef(Py_None);
    Py_DECREF(config);
    Py_DECREF(fasts);
    return made;
}

static PyObject *method_call(LaunchMethod *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1) goto reference;
    Geometry g = {NULL, Py_None, Py_None};
    Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t i = 0; i < nk; i++)
        if (!take_keyword(&g, PyTuple_GET_ITEM(kwnames, i), args[nargs + i])) goto reference;
    PyObject *made = common_call(args[0], NULL, args, nargs, g);
    if (made != Py_None) return made; /* (the launch, or NULL: a fast path raised) */
    Py_DECREF(made);
reference:
    return PyObject_Vectorcall(self->reference, args, nargsf, kwnames);
}

/* ``kernel.launch`` read as an attribute (a call with ``*args`` or
   ``**kwargs`` reads it so): the method bound to the kernel, called with the
   arguments' tuple and keywords' dict as they are given, so that the common
   call's launch keeps that tuple. It shows itself as the bound reference
   (``__wrapped__``, its documentation, signature, name and pickling). */
typedef struct {
    PyObject_HEAD
    LaunchMethod *method;
    PyObject *kernel;
} BoundLaunch;

static PyTypeObject *t_bound;

static PyObject *bound_call(BoundLaunch *self, PyObject *args, PyObject *kwargs) {
    Geometry g = {NULL, Py_None, Py_None};
    PyObject *name, *value, *made, *all;
    Py_ssize_t pos = 0, n = PyTuple_GET_SIZE(args);
    if (!PyTuple_CheckExact(args) || (kwargs != NULL && !PyDict_CheckExact(kwargs))) goto reference;
    while (kwargs != NULL && PyDict_Next(kwargs, &pos, &name, &value))
        if (!take_keyword(&g, name, value)) goto reference;
    made = common_call(self->kernel, args, NULL, n + 1, g);
    if (made != Py_None) return made;
    Py_DECREF(made);
reference:
    if ((all = PyTuple_New(n + 1)) == NULL) return NULL;
    Py_INCREF(self->kernel);
    PyTuple_SET_ITEM(all, 0, self->kernel);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_INCREF(PyTuple_GET_ITEM(args, i));
        PyTuple_SET_ITEM(all, i + 1, PyTuple_GET_ITEM(args, i));
    }
    made = PyObject_Call(self->method->reference, all, kwargs);
    Py_DECREF(all);
    return made;
}

static PyObject *bound_wrapped(BoundLaunch *self, void *closure) {
    return PyMethod_New(self->method->reference, self->kernel);
}

static PyObject *bound_doc(BoundLaunch *self, void *closure) {
    return PyObject_GetAttrString(self->method->reference, "__doc__");
}

static PyObject *bound_getattr(BoundLaunch *self, PyObject *name) {
    /* __name__, __qualname__, __module__...: the reference's */
    PyObject *v = PyObject_GenericGetAttr((PyObject *)self, name);
    if (v != NULL || !PyErr_ExceptionMatches(PyExc_AttributeError)) return v;
    PyErr_Clear();
    return PyObject_GetAttr(self->method->reference, name);
}

static PyObject *bound_reduce(BoundLaunch *self, PyObject *unused) {
    /* as a bound method pickles: getattr(kernel, name) */
    PyObject *get = PyDict_GetItemString(PyEval_GetBuiltins(), "getattr"); /* (borrowed) */
    PyObject *fname = PyObject_GetAttrString(self->method->reference, "__name__");
    if (get == NULL || fname == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "builtins.getattr is missing");
        Py_XDECREF(fname);
        return NULL;
    }
    PyObject *out = Py_BuildValue("O(OO)", get, self->kernel, fname);
    Py_DECREF(fname);
    return out;
}

static PyObject *bound_repr(BoundLaunch *self) {
    PyObject *qual = PyObject_GetAttrString(self->method->reference, "__qualname__");
    if (qual == NULL) return NULL;
    PyObject *out = PyUnicode_FromFormat("<bound method %S of %R>", qual, self->kernel);
    Py_DECREF(qual);
    return out;
}

static PyObject *bound_richcompare(PyObject *a, PyObject *b, int op) {
    /* as bound methods compare: the same function bound to the same object */
    if ((op != Py_EQ && op != Py_NE) || Py_TYPE(b) != t_bound) Py_RETURN_NOTIMPLEMENTED;
    BoundLaunch *x = (BoundLaunch *)a, *y = (BoundLaunch *)b;
    int same = x->method == y->method && x->kernel == y->kernel;
    return PyBool_FromLong(op == Py_EQ ? same : !same);
}

static Py_hash_t bound_hash(BoundLaunch *self) {
    Py_hash_t h = (Py_hash_t)(((uintptr_t)self->kernel >> 4) ^ ((uintptr_t)self->method >> 4));
    return h == -1 ? -2 : h;
}

static int bound_traverse(BoundLaunch *self, visitproc visit, void *arg) {
    Py_VISIT(self->method);
    Py_VISIT(self->kernel);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int bound_clear(BoundLaunch *self) {
    Py_CLEAR(self->method);
    Py_CLEAR(self->kernel);
    return 0;
}

static void bound_dealloc(BoundLaunch *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    bound_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyMemberDef bound_members[] = {
    {"__self__", T_OBJECT, offsetof(BoundLaunch, kernel), READONLY, "the kernel"},
    {"__func__", T_OBJECT, offsetof(BoundLaunch, method), READONLY, "the method"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef bound_getset[] = {
    {"__doc__", (getter)bound_doc, NULL, NULL, NULL},
    {"__wrapped__", (getter)bound_wrapped, NULL, "the reference bound to the kernel", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef bound_methods[] = {
    {"__reduce__", (PyCFunction)bound_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot bound_slots[] = {
    {Py_tp_dealloc, bound_dealloc},   {Py_tp_traverse, bound_traverse},
    {Py_tp_clear, bound_clear},       {Py_tp_call, bound_call},
    {Py_tp_getattro, bound_getattr},  {Py_tp_members, bound_members},
    {Py_tp_getset, bound_getset},     {Py_tp_methods, bound_methods},
    {Py_tp_repr, bound_repr},         {Py_tp_richcompare, bound_richcompare},
    {Py_tp_hash, bound_hash},         {0, NULL},
};

static PyType_Spec bound_spec = {
    "trio_cuda._core._claunch.BoundLaunch",
    sizeof(BoundLaunch),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    bound_slots,
};

static PyObject *method_get(LaunchMethod *self, PyObject *obj, PyObject *type) {
    if (obj == NULL || obj == Py_None) {
        Py_INCREF(self->reference);
        return self->reference;
    }
    BoundLaunch *bound = PyObject_GC_New(BoundLaunch, t_bound);
    if (bound == NULL) return NULL;
    Py_INCREF(self);
    Py_INCREF(obj);
    bound->method = self;
    bound->kernel = obj;
    PyObject_GC_Track(bound);
    return (PyObject *)bound;
}

static PyObject *method_call_tuple(LaunchMethod *self, PyObject *args, PyObject *kwargs) {
    return PyVectorcall_Call((PyObject *)self, args, kwargs);
}

static PyObject *method_getattr(LaunchMethod *self, PyObject *name) {
    /* __doc__, __name__, __qualname__, __module__... are the reference's */
    PyObject *v = PyObject_GenericGetAttr((PyObject *)self, name);
    if (v != NULL || !PyErr_ExceptionMatches(PyExc_AttributeError)) return v;
    PyErr_Clear();
    return PyObject_GetAttr(self->reference, name);
}

static PyObject *method_doc(LaunchMethod *self, void *closure) {
    return PyObject_GetAttrString(self->reference, "__doc__");
}

static int method_traverse(LaunchMethod *self, visitproc visit, void *arg) {
    Py_VISIT(self->reference);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int method_clear(LaunchMethod *self) {
    Py_CLEAR(self->reference);
    return 0;
}

static void method_dealloc(LaunchMethod *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    method_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyMemberDef method_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(LaunchMethod, vectorcall), READONLY, NULL},
    {"__wrapped__", T_OBJECT_EX, offsetof(LaunchMethod, reference), READONLY, "the reference Kernel.launch"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef method_getset[] = {
    {"__doc__", (getter)method_doc, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot method_slots[] = {
    {Py_tp_dealloc, method_dealloc},
    {Py_tp_traverse, method_traverse},
    {Py_tp_clear, method_clear},
    {Py_tp_call, method_call_tuple},
    {Py_tp_descr_get, method_get},
    {Py_tp_getattro, method_getattr},
    {Py_tp_members, method_members},
    {Py_tp_getset, method_getset},
    {0, NULL},
};

static PyType_Spec method_spec = {
    "trio_cuda._core._claunch.LaunchMethod",
    sizeof(LaunchMethod),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_HAVE_VECTORCALL |
        Py_TPFLAGS_METHOD_DESCRIPTOR,
    method_slots,
};

/* launch_method(reference, Kernel, config_module): once per process. */
PyObject *launch_method(PyObject *module, PyObject *args) {
    PyObject *reference, *kernel_type, *config_module;
    if (!PyArg_ParseTuple(args, "OO!O!:launch_method", &reference, &PyType_Type, &kernel_type, &PyModule_Type,
                          &config_module))
        return NULL;
    if (!g_configured || t_method != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "launch_method: once per process, after configure()");
        return NULL;
    }
    if (!PyCallable_Check(reference)) {
        PyErr_SetString(PyExc_TypeError, "launch_method: reference must be callable");
        return NULL;
    }
    if (make_slot_ref(kernel_type, "tile", &r_tile) < 0 || make_slot_ref(kernel_type, "_fast", &r_fast) < 0)
        return NULL;
    if (intern(&n_simple, "_SIMPLE_CONFIGS") < 0 || intern(&n_grid, "grid") < 0 || intern(&n_block, "block") < 0 ||
        intern(&n_shared_mem, "shared_mem") < 0 || intern(&n_cluster, "cluster") < 0 ||
        intern(&n_cooperative, "cooperative") < 0 || intern(&n_pdl, "pdl") < 0)
        return NULL;
    if ((g_zero = PyLong_FromLong(0)) == NULL || (g_one = PyLong_FromLong(1)) == NULL ||
        intern(&n_fast, "_fast") < 0)
        return NULL;
    if ((g_config_globals = PyModule_GetDict(config_module)) == NULL) return NULL;
    Py_INCREF(g_config_globals);
    Py_INCREF(kernel_type);
    t_kernel = (PyTypeObject *)kernel_type;
    if ((t_method = (PyTypeObject *)PyType_FromSpec(&method_spec)) == NULL ||
        (t_bound = (PyTypeObject *)PyType_FromSpec(&bound_spec)) == NULL)
        return NULL;
    LaunchMethod *self = PyObject_GC_New(LaunchMethod, t_method);
    if (self == NULL) return NULL;
    Py_INCREF(reference);
    self->reference = reference;
    self->vectorcall = (vectorcallfunc)method_call;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

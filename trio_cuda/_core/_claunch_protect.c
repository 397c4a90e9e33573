/* ResourceScope.submit without a frame of its own, and the KI protection of
   the Python it calls (part of trio_cuda._core._claunch).

   Trio decides where a Ctrl-C may land by walking the Python frames from the
   one running: code marked with ``enable_ki_protection`` defers it to the
   next checkpoint. Compiled code has no frame and runs no bytecode, so a
   Ctrl-C can only land in Python code that it calls. ``ResourceScope.submit``
   was a protected Python frame around the compiled steps (``submit_whole``)
   for that reason alone.

   submit_method(reference, protected_call, scope_module) makes the
   descriptor that stands for ``ResourceScope.submit`` in the class: a call
   ``scope.submit(op)`` or ``scope.submit(op, stream=s)`` runs
   ``submit_whole`` with no frame, while the scope module holds the compiled
   ``submit_whole`` (tests turn it off); anything else (other arguments, a
   bound method read as an attribute and called later, the pure path) calls
   the reference, the protected Python method, which raises its errors.

   Invariants:
   - While a frameless call runs (``g_frameless``), the compiled steps call
     Python through pcall, pmethod and pgetattr, which go through
     ``protected_call`` (``_scope._protected_call``, a protected Python
     function that calls what it is given): every Python frame they start
     has a protected frame under it, as under the reference's frame. Builtin
     functions, and the types that a backend declared to protect their own
     Python (``trust``: the cuda backend's hot methods, whose Python
     fallbacks are marked protected), are called directly.
   - Outside a frameless call the helpers are the plain calls: the compiled
     steps run under the caller's frame, as before.
   - The counter is per process, under the GIL: another thread that runs
     while a frameless call has released the GIL (the driver call) only
     routes its own Python through the trampoline too, which protects it
     the more. */

#include "_claunch.h"

int g_frameless;
static PyObject *g_protect, *g_getattr, *g_trusted;

/* Whether fn protects its own Python (called directly while frameless). */
static int self_protecting(PyObject *fn) {
    PyTypeObject *tp = Py_TYPE(fn);
    if (tp == &PyFunction_Type || tp == &PyMethod_Type) return 0; /* (the common Python callables) */
    if (g_trusted != NULL)
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(g_trusted); i++)
            if ((PyObject *)tp == PyTuple_GET_ITEM(g_trusted, i)) return 1;
    return PyCFunction_Check(fn);
}

static PyObject *through_trampoline(PyObject *fn, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *small[8], **argv = small;
    if (nargs + 1 > 8 && (argv = PyMem_Malloc((size_t)(nargs + 1) * sizeof(PyObject *))) == NULL)
        return PyErr_NoMemory();
    argv[0] = fn;
    if (nargs) memcpy(argv + 1, args, (size_t)nargs * sizeof(PyObject *));
    PyObject *r = PyObject_Vectorcall(g_protect, argv, (size_t)nargs + 1, NULL);
    if (argv != small) PyMem_Free(argv);
    return r;
}

PyObject *pcall(PyObject *fn, PyObject *const *args, Py_ssize_t nargs) {
    if (!g_frameless || g_protect == NULL || self_protecting(fn)) return PyObject_Vectorcall(fn, args, (size_t)nargs, NULL);
    return through_trampoline(fn, args, nargs);
}

PyObject *pmethod(PyObject *obj, PyObject *name, PyObject *const *args, Py_ssize_t nargs) {
    if (!g_frameless || g_protect == NULL) {
        PyObject *small[8], **argv = small;
        if (nargs + 1 > 8 && (argv = PyMem_Malloc((size_t)(nargs + 1) * sizeof(PyObject *))) == NULL)
            return PyErr_NoMemory();
        argv[0] = obj;
        if (nargs) memcpy(argv + 1, args, (size_t)nargs * sizeof(PyObject *));
        PyObject *r = PyObject_VectorcallMethod(name, argv, (size_t)(nargs + 1), NULL);
        if (argv != small) PyMem_Free(argv);
        return r;
    }
    PyObject *m = PyObject_GetAttr(obj, name); /* (a method: no Python of ours runs to find it) */
    if (m == NULL) return NULL;
    PyObject *r = pcall(m, args, nargs);
    Py_DECREF(m);
    return r;
}

PyObject *pmethod_memo(PyObject *obj, PyObject *name, PyObject *const *args, Py_ssize_t nargs, AttrMemo *memo) {
    if (!g_frameless || g_protect == NULL) return pmethod(obj, name, args, nargs);
    PyObject *m = memo_getattr(obj, name, memo);
    if (m == NULL) return NULL;
    PyObject *r = pcall(m, args, nargs);
    Py_DECREF(m);
    return r;
}

PyObject *memo_getattr(PyObject *obj, PyObject *name, AttrMemo *m) {
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030D0000 && !defined(Py_GIL_DISABLED)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    PyTypeObject *tp = Py_TYPE(obj);
    if (tp->tp_getattro != PyObject_GenericGetAttr || !(tp->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) ||
        tp->tp_dictoffset == 0)
        return PyObject_GetAttr(obj, name);
    PyObject **dp = _PyObject_GetDictPtr(obj); /* (a managed dict is made once, here) */
    PyObject *dict = dp != NULL ? *dp : NULL;
    if (dict == NULL || !PyDict_CheckExact(dict)) return PyObject_GetAttr(obj, name);
    uint64_t version = ((PyDictObject *)dict)->ma_version_tag;
    if (version != 0 && m->type == tp && m->type_version == tp->tp_version_tag && m->dict == dict &&
        m->dict_version == version)
        return Py_NewRef(m->value);
    m->type = NULL;
    /* the instance's dict decides unless the type has a data descriptor of that name */
    PyObject *d = _PyType_Lookup(tp, name); /* (borrowed) */
    if ((d != NULL && Py_TYPE(d)->tp_descr_set != NULL) || !(tp->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG))
        return PyObject_GetAttr(obj, name);
    PyObject *v = PyDict_GetItemWithError(dict, name); /* (borrowed) */
    if (v == NULL) return PyErr_Occurred() ? NULL : PyObject_GetAttr(obj, name);
    m->type = tp;
    m->type_version = tp->tp_version_tag;
    m->dict = dict;
    m->dict_version = ((PyDictObject *)dict)->ma_version_tag;
    m->value = v;
    return Py_NewRef(v);
#pragma GCC diagnostic pop
#else
    (void)m;
    return PyObject_GetAttr(obj, name);
#endif
}

PyObject *pgetattr(PyObject *obj, PyObject *name) {
    /* (an attribute may be a Python property, or a class's __getattr__) */
    if (!g_frameless || g_protect == NULL) return PyObject_GetAttr(obj, name);
    PyTypeObject *tp = Py_TYPE(obj);
    if (tp->tp_getattro == PyObject_GenericGetAttr) { /* the generic way: Python only through a descriptor */
        PyObject *d = _PyType_Lookup(tp, name); /* (borrowed) */
        if (d == NULL || PyFunction_Check(d) || PyCFunction_Check(d) || Py_IS_TYPE(d, &PyMethodDescr_Type) ||
            Py_IS_TYPE(d, &PyMemberDescr_Type))
            return PyObject_GetAttr(obj, name);
    }
    PyObject *argv[2] = {obj, name};
    return through_trampoline(g_getattr, argv, 2);
}

/* trust(types): the types whose instances protect their own Python. */
PyObject *trust(PyObject *module, PyObject *types) {
    if (!PyTuple_CheckExact(types)) {
        PyErr_Format(PyExc_TypeError, "trust: expected a tuple of types, got %.100s", Py_TYPE(types)->tp_name);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(types); i++)
        if (!PyType_Check(PyTuple_GET_ITEM(types, i))) {
            PyErr_Format(PyExc_TypeError, "trust: types[%zd]: expected a type, got %.100s", i,
                         Py_TYPE(PyTuple_GET_ITEM(types, i))->tp_name);
            return NULL;
        }
    PyObject *all = g_trusted == NULL ? Py_NewRef(types) : PySequence_Concat(g_trusted, types);
    if (all == NULL) return NULL;
    Py_XSETREF(g_trusted, all);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ the descriptor */

typedef struct {
    PyObject_HEAD
    PyObject *reference; /* the protected Python ResourceScope.submit */
    vectorcallfunc vectorcall;
} SubmitMethod;

static PyTypeObject *t_submit_method;
static PyObject *g_scope_dict, *n_submit_whole, *n_stream;
static GlobalMemo m_whole;

/* scope.submit(op[, stream=s]): args[0] the scope. */
static PyObject *submit_call(SubmitMethod *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *stream = Py_None;
    if (nargs != 2) goto reference;
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames)) {
        if (PyTuple_GET_SIZE(kwnames) != 1) goto reference;
        PyObject *k = PyTuple_GET_ITEM(kwnames, 0);
        if (k != n_stream && !(PyUnicode_CheckExact(k) && PyUnicode_Compare(k, n_stream) == 0)) goto reference;
        stream = args[2];
    }
    PyObject *whole = global_of(g_scope_dict, n_submit_whole, &m_whole);
    if (whole == NULL) {
        if (PyErr_Occurred()) return NULL;
        goto reference;
    }
    if (!PyCFunction_Check(whole) || PyCFunction_GET_FUNCTION(whole) != (PyCFunction)(void (*)(void))submit_whole)
        goto reference;
    {
        PyObject *argv[3] = {args[0], args[1], stream};
        g_frameless++;
        PyObject *fut = submit_whole(NULL, argv, 3);
        g_frameless--;
        return fut;
    }
reference:
    return PyObject_Vectorcall(self->reference, args, nargsf, kwnames);
}

static PyObject *submit_get(SubmitMethod *self, PyObject *obj, PyObject *type) {
    /* read on the class: the reference; on a scope, this method bound to it (its
       call is submit_call's, with the scope first) */
    if (obj == NULL || obj == Py_None) return Py_NewRef(self->reference);
    return PyMethod_New((PyObject *)self, obj);
}

static PyObject *submit_call_tuple(SubmitMethod *self, PyObject *args, PyObject *kwargs) {
    return PyVectorcall_Call((PyObject *)self, args, kwargs);
}

static PyObject *submit_getattr(SubmitMethod *self, PyObject *name) {
    /* __doc__, __name__, __qualname__, __module__, __wrapped__...: the reference's */
    PyObject *v = PyObject_GenericGetAttr((PyObject *)self, name);
    if (v != NULL || !PyErr_ExceptionMatches(PyExc_AttributeError)) return v;
    PyErr_Clear();
    return PyObject_GetAttr(self->reference, name);
}

static PyObject *submit_doc(SubmitMethod *self, void *closure) {
    return PyObject_GetAttrString(self->reference, "__doc__");
}

static int submit_traverse(SubmitMethod *self, visitproc visit, void *arg) {
    Py_VISIT(self->reference);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int submit_clear(SubmitMethod *self) {
    Py_CLEAR(self->reference);
    return 0;
}

static void submit_dealloc(SubmitMethod *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    submit_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyMemberDef submit_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(SubmitMethod, vectorcall), READONLY, NULL},
    {"__wrapped__", T_OBJECT_EX, offsetof(SubmitMethod, reference), READONLY, "the reference ResourceScope.submit"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef submit_getset[] = {
    {"__doc__", (getter)submit_doc, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot submit_slots[] = {
    {Py_tp_dealloc, submit_dealloc}, {Py_tp_traverse, submit_traverse}, {Py_tp_clear, submit_clear},
    {Py_tp_call, submit_call_tuple}, {Py_tp_descr_get, submit_get},     {Py_tp_getattro, submit_getattr},
    {Py_tp_members, submit_members}, {Py_tp_getset, submit_getset},     {0, NULL},
};

static PyType_Spec submit_spec = {
    "trio_cuda._core._claunch.SubmitMethod",
    sizeof(SubmitMethod),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_HAVE_VECTORCALL |
        Py_TPFLAGS_METHOD_DESCRIPTOR,
    submit_slots,
};

/* submit_method(reference, protected_call, scope_module): once per process. */
PyObject *submit_method(PyObject *module, PyObject *args) {
    PyObject *reference, *protect, *scope_module;
    if (!PyArg_ParseTuple(args, "OOO!:submit_method", &reference, &protect, &PyModule_Type, &scope_module))
        return NULL;
    if (t_submit_method != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "submit_method: once per process");
        return NULL;
    }
    if (!PyCallable_Check(reference) || !PyCallable_Check(protect)) {
        PyErr_SetString(PyExc_TypeError, "submit_method: reference and protected_call must be callable");
        return NULL;
    }
    PyObject *builtins = PyEval_GetBuiltins(); /* (borrowed) */
    PyObject *get = builtins ? PyDict_GetItemString(builtins, "getattr") : NULL;
    if (get == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "submit_method: builtins.getattr is missing");
        return NULL;
    }
    if ((n_submit_whole = PyUnicode_InternFromString("submit_whole")) == NULL ||
        (n_stream = PyUnicode_InternFromString("stream")) == NULL)
        return NULL;
    if ((t_submit_method = (PyTypeObject *)PyType_FromSpec(&submit_spec)) == NULL) return NULL;
    g_scope_dict = Py_NewRef(PyModule_GetDict(scope_module));
    g_protect = Py_NewRef(protect);
    g_getattr = Py_NewRef(get);
    SubmitMethod *self = PyObject_GC_New(SubmitMethod, t_submit_method);
    if (self == NULL) return NULL;
    self->reference = Py_NewRef(reference);
    self->vectorcall = (vectorcallfunc)submit_call;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

/* The hot paths of a kernel launch, compiled, where this module was built at
   install: making it (the launch builder's methods, the base class of
   trio_cuda.LaunchBuilder: _claunch_builder.c; a kernel's typed-launch fast
   path: _claunch_typed.c), and the common cases of taking its leases and of
   retiring it (_claunch_leases.c); submitting it (_claunch_submit.c);
   retiring what completed, per stream (_claunch_scan.c); Kernel.launch
   itself (_claunch_method.c).

   Invariants:
   - The pure-Python code is the reference, and every path here does what it
     does, or hands the case to it before changing anything:
     - the builder base keeps the fields of the reference builder
       (trio_cuda/_core/_builder.py, ``_PyBuilder``) under the same names
       (its members), so every reference method runs unchanged on it; its
       methods do the common cases (a positional call, an array or a scalar
       of a known kind, the cached geometry and plan) and hand every other
       case, errors included, to the reference method;
     - a typed launcher (``typed``) does what the kernel's generated fast
       path (trio_cuda/_core/_kernel.py, ``_compile_fast_py``) does: it
       returns the launch the checked path would build, or None, and then
       the checked path runs (and raises the precise error);
     - ``take_whole`` and ``retire_done`` return False where the Python
       path must decide (see _claunch_leases.c);
     - ``submit_launch`` makes the steps of ``_submit_launch``, calling the
       Python code that one calls wherever a step is not the common case,
       and ``submit_whole`` those of ``ResourceScope.submit``, which
       ``submit_method`` calls without a frame, its calls into Python
       KI-protected (see _claunch_submit.c, _claunch_protect.c); ``scan`` makes the steps of
       ``Completion.scan``, each retirement and host step through the
       Python methods (see _claunch_scan.c); ``launch_method`` calls the
       typed fast path for the common call and the reference
       ``Kernel.launch`` for every other (see _claunch_method.c).
   - What is made is what the reference makes: the same bytes, layout,
     accesses, outputs, configuration, plan and objects (a PreparedLaunch
     and a KernelLaunch, their slots stored where their descriptors keep
     them); the lease tables and counters the reference leaves.
   - Slots are read and stored at the offsets their member descriptors give,
     for objects of the exact classes configured; anything else goes through
     getattr or to the reference.
   - No path calls back into Python code except the reference's own
     functions (and a scalar's packer; ``submit_launch`` and ``scan``: the
     policy, the driver and the Python steps of the reference); the lease paths call
     none but a traced scope's record of a retirement and, to order leases
     of other streams in the way, the completion's flush and the driver's
     poll and wait (as the reference does). Their callers are KI-protected
     Python functions.
   - configure() is called once, by _compiled.py, with the types and
     constants the paths read; make_base() once, by _builder.py;
     configure_leases(), configure_order() and configure_retire() once, by
     _submit.py (the first two) and _completion.py; configure_submit() once, by _scope.py;
     configure_scan() once, by _completion.py; launch_method() once, by
     _kernel.py. What they are given is held for the life of the
     process.
   - Nothing here imports CUDA; this module belongs to the CUDA-free core. */

#include "_claunch.h"

/* ------------------------------------------------------------------ state */

int g_configured;
SlotRef g_slot[N_SLOTREFS];
PyTypeObject *g_array_type, *g_prepared_type, *g_launch_type, *g_modes_type;
PyObject *g_freed, *g_live, *g_write, *g_merge;
Py_ssize_t g_prepared_off[9];
Py_ssize_t g_launch_off[5];

int make_slot_ref(PyObject *type, const char *name, SlotRef *out) {
    PyObject *d = PyObject_GetAttrString(type, name);
    if (d == NULL) return -1;
    int ok = Py_IS_TYPE(d, &PyMemberDescr_Type) && ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX &&
             PyType_IsSubtype((PyTypeObject *)type, PyDescr_TYPE(d));
    if (ok) out->offset = ((PyMemberDescrObject *)d)->d_member->offset;
    Py_DECREF(d);
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "configure: %s.%s is not a slot", ((PyTypeObject *)type)->tp_name, name);
        return -1;
    }
    out->name = PyUnicode_InternFromString(name);
    if (out->name == NULL) return -1;
    Py_INCREF(type);
    out->type = (PyTypeObject *)type;
    return 0;
}

/* An instance of a slots class (as object.__new__ makes it), its fields
   stored where their member descriptors keep them (as object.__setattr__
   would store them: the class's own __setattr__ is not called); steals
   nothing. */
PyObject *new_instance(PyTypeObject *tp, const Py_ssize_t *offsets, PyObject *const *values, int n) {
    PyObject *obj = tp->tp_alloc(tp, 0);
    if (obj == NULL) return NULL;
    for (int i = 0; i < n; i++) {
        Py_INCREF(values[i]);
        *(PyObject **)((char *)obj + offsets[i]) = values[i];
    }
    return obj;
}

int take(PyObject *env, const char *name, PyObject **out) {
    PyObject *v = PyDict_GetItemString(env, name);
    if (v == NULL) {
        PyErr_Format(PyExc_KeyError, "the environment given lacks %s", name);
        return -1;
    }
    Py_INCREF(v);
    *out = v;
    return 0;
}

static int take_type(PyObject *env, const char *name, PyTypeObject **out) {
    PyObject *v;
    if (take(env, name, &v) < 0) return -1;
    if (!PyType_Check(v)) {
        Py_DECREF(v);
        PyErr_Format(PyExc_TypeError, "the environment's %s must be a type", name);
        return -1;
    }
    *out = (PyTypeObject *)v;
    return 0;
}

/* Where each named slot of ``tp`` is stored (its member descriptor's offset). */
static int take_offsets(PyTypeObject *tp, const char *const *names, Py_ssize_t *out, int n) {
    for (int i = 0; i < n; i++) {
        SlotRef ref;
        if (make_slot_ref((PyObject *)tp, names[i], &ref) < 0) return -1;
        out[i] = ref.offset;
    }
    return 0;
}

static PyObject *configure(PyObject *module, PyObject *env) {
    if (!PyDict_Check(env)) {
        PyErr_SetString(PyExc_TypeError, "configure: expected a dict");
        return NULL;
    }
    if (g_configured) {
        PyErr_SetString(PyExc_RuntimeError, "configure: called once per process");
        return NULL;
    }
#if !PY_LITTLE_ENDIAN
    PyErr_SetString(PyExc_RuntimeError, "configure: the paths pack little-endian arguments (a big-endian host)");
    return NULL;
#endif
    static const char *const prepared_names[9] = {"kernel", "config", "plan", "arena", "args",
                                                  "values", "cache", "ready", "enqueued"};
    static const char *const launch_names[5] = {"prepared", "_acc", "_lease_plan", "_output", "_lease_simple"};
    PyTypeObject *alloc_type, *table_type;
    if (take_type(env, "DeviceArray", &g_array_type) < 0 || take_type(env, "Allocation", &alloc_type) < 0 ||
        take_type(env, "MemoryTable", &table_type) < 0)
        return NULL;
    static const struct {
        int which, owner;
        const char *name;
    } refs[N_SLOTREFS] = {{A_ALLOC, 0, "_alloc"},   {A_CLOSED, 0, "_closed"}, {A_READONLY, 0, "_readonly"},
                          {A_OFFSET, 0, "_offset"}, {A_DTYPE, 0, "_dtype"},   {A_SHAPE, 0, "_shape"},
                          {A_WHOLE, 0, "_whole"},   {A_ORDER, 0, "_order"},  {L_BORROWED, 1, "borrowed"},
                          {L_STATE, 1, "state"},    {L_TABLE, 1, "table"},    {L_PTR, 1, "ptr"},
                          {L_SCOPE, 1, "scope"},    {T_CLOSED, 2, "closed"}};
    PyTypeObject *owners[3] = {g_array_type, alloc_type, table_type};
    for (int i = 0; i < N_SLOTREFS; i++)
        if (make_slot_ref((PyObject *)owners[refs[i].owner], refs[i].name, &g_slot[refs[i].which]) < 0) return NULL;
    if (take(env, "FREED", &g_freed) < 0 || take(env, "LIVE", &g_live) < 0 || take(env, "WRITE", &g_write) < 0 ||
        take(env, "merge_accesses", &g_merge) < 0 || take_type(env, "PreparedLaunch", &g_prepared_type) < 0 ||
        take_type(env, "KernelLaunch", &g_launch_type) < 0 || take_type(env, "ArrayModes", &g_modes_type) < 0)
        return NULL;
    if (take_offsets(g_prepared_type, prepared_names, g_prepared_off, 9) < 0 ||
        take_offsets(g_launch_type, launch_names, g_launch_off, 5) < 0)
        return NULL;
    if (builder_init() < 0 || typed_init() < 0) return NULL;
    g_configured = 1;
    Py_RETURN_NONE;
}

/* fast_getattr, fast_setattr and class_holds as tests call them (_fastattr.h). */
static PyObject *fast_getattr_py(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyUnicode_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "fast_getattr(obj, name: str)");
        return NULL;
    }
    PyObject *name = Py_NewRef(args[1]);
    PyUnicode_InternInPlace(&name);
    PyObject *v = fast_getattr(args[0], name);
    Py_DECREF(name);
    return v;
}

static PyObject *fast_setattr_py(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyUnicode_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "fast_setattr(obj, name: str, value)");
        return NULL;
    }
    PyObject *name = Py_NewRef(args[1]);
    PyUnicode_InternInPlace(&name);
    int rc = fast_setattr(args[0], name, args[2]);
    Py_DECREF(name);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *class_holds_py(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyType_Check(args[0]) || !PyUnicode_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "class_holds(cls: type, name: str, value)");
        return NULL;
    }
    PyObject *name = Py_NewRef(args[1]);
    PyUnicode_InternInPlace(&name);
    int yes = class_holds((PyTypeObject *)args[0], name, args[2]);
    Py_DECREF(name);
    return PyBool_FromLong(yes);
}

static PyMethodDef module_methods[] = {
    {"fast_getattr", (PyCFunction)(void (*)(void))fast_getattr_py, METH_FASTCALL,
     "fast_getattr(obj, name) -> getattr(obj, name), a slot read through the per-type table (for tests)."},
    {"fast_setattr", (PyCFunction)(void (*)(void))fast_setattr_py, METH_FASTCALL,
     "fast_setattr(obj, name, value): setattr(obj, name, value), a slot store through the per-type table (for "
     "tests)."},
    {"class_holds", (PyCFunction)(void (*)(void))class_holds_py, METH_FASTCALL,
     "class_holds(cls, name, value) -> whether cls's attribute name is value (for tests)."},
    {"configure", configure, METH_O, "configure(env): the types and constants the paths read (once per process)."},
    {"make_base", make_base, METH_VARARGS,
     "make_base(reference, env, docs) -> the builder base type (once per process)."},
    {"configure_leases", configure_leases, METH_VARARGS,
     "configure_leases(Submission, Allocation): the slots take_whole reads (once per process)."},
    {"take_whole", (PyCFunction)(void (*)(void))take_whole, METH_FASTCALL,
     "take_whole(scope, stream, sub, accesses, allocs) -> bool: a simple launch's leases, where nothing is in "
     "the way."},
    {"configure_order", configure_order, METH_O,
     "configure_order(env): the states and names take_whole's ordering of conflicts compares with (once per "
     "process)."},
    {"configure_retire", configure_retire, METH_VARARGS,
     "configure_retire(Completion, Stream, DONE): the slots retire_done reads (once per process)."},
    {"retire_done", (PyCFunction)(void (*)(void))retire_done, METH_FASTCALL,
     "retire_done(completion, sub) -> bool: a completed submission retired, where nothing but bookkeeping is left."},
    {"configure_submit", configure_submit, METH_O,
     "configure_submit(env): the types, slots and modules submit_launch reads (once per process)."},
    {"future_of", future_of, METH_O, "future_of(sub) -> DeviceFuture: DeviceFuture._create(sub)."},
    {"submit_launch", (PyCFunction)(void (*)(void))submit_launch, METH_FASTCALL,
     "submit_launch(scope, op, stream) -> Submission: ResourceScope._submit_launch."},
    {"submit_method", submit_method, METH_VARARGS,
     "submit_method(reference, protected_call, scope_module) -> the descriptor that stands for "
     "ResourceScope.submit: the compiled steps without a frame (once per process)."},
    {"trust", trust, METH_O,
     "trust(types): callables of these types protect their own Python from Ctrl-C (a backend's hot methods)."},
    {"submit_whole", (PyCFunction)(void (*)(void))submit_whole, METH_FASTCALL,
     "submit_whole(scope, op, stream) -> DeviceFuture: ResourceScope.submit's steps after its frame."},
    {"enqueue_unsafe", (PyCFunction)(void (*)(void))enqueue_unsafe, METH_FASTCALL,
     "enqueue_unsafe(op, stream) -> output: unsafe.async_on, compiled for a lone kernel launch."},
    {"configure_scan", configure_scan, METH_O,
     "configure_scan(env): the types, slots and module scan reads (once per process)."},
    {"scan", scan, METH_O, "scan(completion) -> bool: Completion.scan (True when a host step ran)."},
    {"prepare", (PyCFunction)(void (*)(void))prepare, METH_FASTCALL,
     "prepare(completion, sub): before an awaiting task's first checkpoint, a lone waiter's marker recorded."},
    {"begin", (PyCFunction)(void (*)(void))begin, METH_FASTCALL,
     "begin(scope, op, stream) -> Submission | None: ResourceScope.run's steps up to its first checkpoint."},
    {"configure_trace", configure_trace, METH_O,
     "configure_trace(env): the types, slots and functions the trace's compiled records read (once per process)."},
    {"trace_await", (PyCFunction)(void (*)(void))trace_await, METH_FASTCALL,
     "trace_await(completion, sub, t0): Completion.trace_await, compiled for a plain tracer."},
    {"configure_step", configure_step, METH_VARARGS,
     "configure_step(trap, Value, CHECK): what Trio's checkpoint yields and gets back (once per process)."},
    {"step", (PyCFunction)(void (*)(void))make_step, METH_FASTCALL,
     "step(completion, sub) -> awaitable: Trio's checkpoint, then look(completion, sub) (CHECK: a cancellation "
     "may be due)."},
    {"look", (PyCFunction)(void (*)(void))look, METH_FASTCALL,
     "look(completion, sub) -> output, SETTLED or AGAIN: an awaiting task's look at its own submission."},
    {"launch_method", launch_method, METH_VARARGS,
     "launch_method(reference, Kernel, config_module) -> the descriptor standing for Kernel.launch (once per "
     "process)."},
    {"typed", make_typed, METH_VARARGS,
     "typed(kernel, plan, size, entries, tile=False) -> a typed launch's fast path, fast(args, config)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_claunch", "The hot paths of making a launch, compiled.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__claunch(void) {
    PyObject *module = PyModule_Create(&module_def);
    if (module != NULL && add_trace_lock(module) < 0) Py_CLEAR(module);
    return module;
}

/* A launch's leases, compiled: the common cases of taking them
   (_submit.take_launch_leases) and of releasing them when the work is done
   (_completion.Completion.retire); see _claunch.c for the invariants.

   take_whole(scope, stream, sub, accesses, allocs) records the leases of a
   launch whose lease plan is simple (whole allocations, each once) when
   every array is a live, usable array of ``scope`` whose allocation has no
   range index; leases of other streams in its way are ordered first, as
   the Python fast path orders them (device-side waits: order_in_way in
   _claunch_order.c, which calls the completion's flush and the driver).
   It returns True, or raises the Python path's error. Otherwise it returns
   False having changed nothing, and the Python path decides (refuses the
   conflict, or takes the general path).
   It records what the Python path records: each allocation's ``active``
   count, and ``sub`` as its only writer (a write: the tables cleared first)
   or as one more reader; ``sub.leases`` is the plan's tuple.

   retire_done(completion, sub) retires a submission whose marker completed
   when nothing but the bookkeeping is left to do: no error, no finishers,
   nobody parked on it, and no allocation it leases to free now
   (each is this scope's own memory, and still held, or still has handles);
   it returns True. Otherwise it changes nothing and returns False, and
   ``Completion.retire`` runs. It does what that method does in that case:
   each lease released, the submission's references dropped, and it settled
   as done with the counters moved; in a traced scope it is recorded first
   (``completion.trace_retire``, the one call into Python, compiled where
   _claunch_trace.c's retire_record takes it).

   Neither runs Python code but the trace's record and, for take_whole with
   leases in its way, the calls the Python fast path makes to order them
   (the completion's flush, the driver's poll and wait). Without those each
   is atomic with respect to other threads; their callers are KI-protected. */

#include "_claunch.h"

static SlotRef s_sub_stream, s_sub_leases, s_arr_extent, s_alloc_scope, s_alloc_index, s_alloc_active,
    s_alloc_writers, s_alloc_readers, s_alloc_table, s_alloc_handles;
static SlotRef s_sub_unknown, s_sub_error, s_sub_finishers, s_sub_waiter, s_sub_owners, s_sub_op, s_sub_state;
static SlotRef s_c_tracer, s_c_memory, s_c_in_flight, s_c_completed, s_st_in_flight, s_st_completed;
static PyObject *g_done, *s_trace_retire;
static int g_retire_ready;
static int g_leases_ready;

/* 1 if a key of the dict ``table`` (submissions) is on another stream
   than ``stream``, 0 if none, -1 error. */
static int other_stream(PyObject *table, PyObject *stream) {
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    if (PyDict_GET_SIZE(table) == 0) return 0; /* (an emptied table keeps its size: no walk through it) */
    while (PyDict_Next(table, &pos, &key, &value)) {
        PyObject *s = read_slot(key, &s_sub_stream);
        if (s == NULL) return -1;
        int other = s != stream;
        Py_DECREF(s);
        if (other) return 1;
    }
    return 0;
}


PyObject *take_whole(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "take_whole(scope, stream, sub, accesses, allocs)");
        return NULL;
    }
    Accesses acc;
    if (!PyTuple_CheckExact(args[3]) || !accesses_of(args[3], NULL, &acc)) Py_RETURN_FALSE;
    int rc = take_whole_c(args[0], args[1], args[2], &acc, args[4]);
    if (rc < 0) return NULL;
    return PyBool_FromLong(rc);
}

/* take_whole for ``acc``: 1 taken, 0 declined (nothing changed), -1 error. */
int take_whole_c(PyObject *scope, PyObject *stream, PyObject *sub, const Accesses *acc, PyObject *allocs) {
    if (!g_leases_ready) {
        PyErr_SetString(PyExc_RuntimeError, "take_whole: configure_leases() first");
        return -1;
    }
    if (!PyTuple_CheckExact(allocs)) return 0;
    Py_ssize_t pos = 0;
    PyObject *arr, *access;
    int any_in_way = 0;
    /* 1. every array usable (reads only); whether another stream's lease is in the way */
    while (accesses_next(acc, &pos, &arr, &access)) {
        int rc = 1;
        PyObject *flag = NULL, *alloc = NULL, *v = NULL, *ext = NULL;
        DECLINE_IF(Py_TYPE(arr) != g_array_type);
        if ((flag = read_slot(arr, &g_slot[A_CLOSED])) == NULL) goto fail;
        DECLINE_IF(flag != Py_False);
        if ((alloc = read_slot(arr, &g_slot[A_ALLOC])) == NULL) goto fail;
        DECLINE_IF(Py_TYPE(alloc) != s_alloc_scope.type);
        if ((v = read_slot(alloc, &g_slot[L_STATE])) == NULL) goto fail;
        DECLINE_IF(v != g_live);
        Py_CLEAR(v);
        if ((v = read_slot(alloc, &s_alloc_scope)) == NULL) goto fail;
        DECLINE_IF(v != scope);
        Py_CLEAR(v);
        if ((v = read_slot(alloc, &s_alloc_index)) == NULL) goto fail;
        DECLINE_IF(v != Py_None);
        Py_CLEAR(v);
        if (access == g_write) {
            Py_CLEAR(flag);
            if ((flag = read_slot(arr, &g_slot[A_READONLY])) == NULL) goto fail;
            DECLINE_IF(flag != Py_False);
        }
        if ((ext = read_slot(arr, &s_arr_extent)) == NULL) goto fail;
        DECLINE_IF(!PyTuple_CheckExact(ext));
        if (PyTuple_GET_SIZE(ext)) { /* (an empty extent touches nothing: no conflict) */
            if ((v = read_slot(alloc, &s_alloc_writers)) == NULL) goto fail;
            DECLINE_IF(!PyDict_CheckExact(v));
            int in_way = other_stream(v, stream);
            if (in_way < 0) goto fail;
            any_in_way |= in_way;
            Py_CLEAR(v);
            if (access == g_write) {
                if ((v = read_slot(alloc, &s_alloc_readers)) == NULL) goto fail;
                DECLINE_IF(!PyDict_CheckExact(v));
                in_way = other_stream(v, stream);
                if (in_way < 0) goto fail;
                any_in_way |= in_way;
            }
        }
    done:
        Py_XDECREF(flag);
        Py_XDECREF(alloc);
        Py_XDECREF(v);
        Py_XDECREF(ext);
        if (rc == 0) return 0;
        continue;
    fail:
        Py_XDECREF(flag);
        Py_XDECREF(alloc);
        Py_XDECREF(v);
        Py_XDECREF(ext);
        return -1;
    }
    /* 2. leases of other streams in the way: ordered (device-side waits), or the Python path decides */
    if (any_in_way) {
        int ordered = order_in_way(scope, stream, sub, acc);
        if (ordered <= 0) return ordered;
    }
    /* 3. record them (each allocation once: the plan is simple) */
    for (pos = 0; accesses_next(acc, &pos, &arr, &access);) {
        PyObject *alloc = read_slot(arr, &g_slot[A_ALLOC]);
        PyObject *ext = alloc ? read_slot(arr, &s_arr_extent) : NULL;
        PyObject *writers = ext ? read_slot(alloc, &s_alloc_writers) : NULL;
        PyObject *readers = writers ? read_slot(alloc, &s_alloc_readers) : NULL;
        int rc = -1;
        if (readers != NULL) {
            if (bump(alloc, &s_alloc_active, 1) == 0) {
                if (access == g_write) {
                    if (PyDict_GET_SIZE(writers)) PyDict_Clear(writers);
                    if (PyDict_GET_SIZE(readers)) PyDict_Clear(readers);
                    rc = PyDict_SetItem(writers, sub, ext);
                } else {
                    rc = PyDict_SetItem(readers, sub, ext);
                }
            }
        }
        Py_XDECREF(alloc);
        Py_XDECREF(ext);
        Py_XDECREF(writers);
        Py_XDECREF(readers);
        if (rc < 0) return -1; /* (memory exhausted part-way: the caller's error path retires what it has) */
    }
    Py_INCREF(allocs);
    if (store_slot(sub, &s_sub_leases, allocs) < 0) return -1;
    return 1;
}

/* configure_leases(Submission, Allocation): the slots take_whole uses. */
PyObject *configure_leases(PyObject *module, PyObject *args) {
    PyObject *sub_type, *alloc_type;
    if (!PyArg_ParseTuple(args, "O!O!:configure_leases", &PyType_Type, &sub_type, &PyType_Type, &alloc_type))
        return NULL;
    if (!g_configured || g_leases_ready) {
        PyErr_SetString(PyExc_RuntimeError, "configure_leases: once per process, after configure()");
        return NULL;
    }
    struct {
        PyObject *type;
        const char *name;
        SlotRef *ref;
    } refs[] = {{sub_type, "stream", &s_sub_stream},       {sub_type, "leases", &s_sub_leases},
                {sub_type, "unknown", &s_sub_unknown},     {sub_type, "error", &s_sub_error},
                {sub_type, "finishers", &s_sub_finishers}, {sub_type, "waiter", &s_sub_waiter},
                {sub_type, "owners", &s_sub_owners},       {sub_type, "op", &s_sub_op},
                {sub_type, "state", &s_sub_state},
                {(PyObject *)g_array_type, "_extent", &s_arr_extent},
                {alloc_type, "scope", &s_alloc_scope},     {alloc_type, "index", &s_alloc_index},
                {alloc_type, "active", &s_alloc_active},   {alloc_type, "writers", &s_alloc_writers},
                {alloc_type, "readers", &s_alloc_readers}, {alloc_type, "table", &s_alloc_table},
                {alloc_type, "handles", &s_alloc_handles}};
    for (size_t i = 0; i < sizeof(refs) / sizeof(refs[0]); i++)
        if (make_slot_ref(refs[i].type, refs[i].name, refs[i].ref) < 0) return NULL;
    g_leases_ready = 1;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ retire */

/* 1 if slot ``ref`` of ``obj`` holds None, 0 if not, -1 error. */
static int is_none(PyObject *obj, SlotRef *ref) {
    PyObject *v = read_slot(obj, ref);
    if (v == NULL) return -1;
    int none = v == Py_None;
    Py_DECREF(v);
    return none;
}

/* Whether retiring frees nothing, for one leased allocation: 1 yes, 0 no
   (the Python path must run), -1 error. */
static int release_is_plain(PyObject *alloc, PyObject *memory) {
    if (Py_TYPE(alloc) != s_alloc_table.type) return 0;
    PyObject *table = read_slot(alloc, &s_alloc_table);
    if (table == NULL) return -1;
    int own = table == memory;
    Py_DECREF(table);
    if (!own) return 0;
    PyObject *active = read_slot(alloc, &s_alloc_active);
    if (active == NULL) return -1;
    long n = PyLong_CheckExact(active) ? PyLong_AsLong(active) : 0;
    Py_DECREF(active);
    if (n == -1 && PyErr_Occurred()) return -1;
    if (n > 1) return 1; /* still held after this one */
    if (n < 1) return 0; /* (a count out of step: the Python path says what happens) */
    PyObject *handles = read_slot(alloc, &s_alloc_handles);
    if (handles == NULL) return -1;
    long h = PyLong_CheckExact(handles) ? PyLong_AsLong(handles) : 0;
    Py_DECREF(handles);
    if (h == -1 && PyErr_Occurred()) return -1;
    if (h > 0) return 1; /* a handle keeps it */
    PyObject *state = read_slot(alloc, &g_slot[L_STATE]);
    if (state == NULL) return -1;
    int live = state == g_live;
    Py_DECREF(state);
    return live ? 0 : 1; /* live and unheld: it is freed now, by the Python path */
}

static int drop_key(PyObject *alloc, SlotRef *ref, PyObject *sub) {
    PyObject *table = read_slot(alloc, ref);
    if (table == NULL) return -1;
    int rc = 0;
    if (PyDict_CheckExact(table) && PyDict_GET_SIZE(table)) { /* (one lookup: popped, or not there) */
#if PY_VERSION_HEX >= 0x030D0000
        rc = PyDict_Pop(table, sub, NULL) < 0 ? -1 : 0;
#else
        PyObject *was = _PyDict_Pop(table, sub, Py_None);
        rc = was == NULL ? -1 : 0;
        Py_XDECREF(was);
#endif
    }
    Py_DECREF(table);
    return rc;
}

PyObject *retire_done(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "retire_done(completion, sub)");
        return NULL;
    }
    if (!g_retire_ready) {
        PyErr_SetString(PyExc_RuntimeError, "retire_done: configure_retire() first");
        return NULL;
    }
    PyObject *completion = args[0], *sub = args[1];
    if (Py_TYPE(sub) != s_sub_leases.type || Py_TYPE(completion) != s_c_memory.type) Py_RETURN_FALSE;
    SlotRef *nones[] = {&s_sub_unknown, &s_sub_error, &s_sub_finishers, &s_sub_waiter};
    for (size_t i = 0; i < sizeof(nones) / sizeof(nones[0]); i++) {
        int none = is_none(sub, nones[i]);
        if (none < 0) return NULL;
        if (!none) Py_RETURN_FALSE;
    }
    int untraced = is_none(completion, &s_c_tracer);
    if (untraced < 0) return NULL;
    PyObject *leases = read_slot(sub, &s_sub_leases);
    if (leases == NULL) return NULL;
    PyObject *memory = read_slot(completion, &s_c_memory);
    PyObject *stream = memory ? read_slot(sub, &s_sub_stream) : NULL;
    PyObject *result = NULL;
    if (stream == NULL) goto out;
    if (!PyTuple_CheckExact(leases)) { /* (the general path's dict: Python) */
        result = Py_False;
        goto out;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(leases);
    for (Py_ssize_t i = 0; i < n; i++) {
        int plain = release_is_plain(PyTuple_GET_ITEM(leases, i), memory);
        if (plain < 0) goto out;
        if (!plain) {
            result = Py_False;
            goto out;
        }
    }
    if (!untraced) { /* recorded first, as there (an error here changes nothing) */
        int recorded = retire_record(completion, sub);
        if (recorded < 0) goto out;
        PyObject *r = recorded ? Py_NewRef(Py_None) : PyObject_CallMethodOneArg(completion, s_trace_retire, sub);
        if (r == NULL) goto out;
        Py_DECREF(r);
    }
    /* nothing to free, nothing to run: release the leases, drop the
       references, settle it (as Completion.retire and settle do) */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *alloc = PyTuple_GET_ITEM(leases, i);
        if (bump(alloc, &s_alloc_active, -1) < 0 || drop_key(alloc, &s_alloc_writers, sub) < 0 ||
            drop_key(alloc, &s_alloc_readers, sub) < 0)
            goto out;
    }
    Py_INCREF(Py_None);
    Py_INCREF(Py_None);
    Py_INCREF(Py_None);
    PyObject *empty = PyTuple_New(0);
    Py_INCREF(g_done);
    if (empty == NULL || store_slot(sub, &s_sub_owners, Py_None) < 0 ||
        store_slot(sub, &s_sub_finishers, Py_None) < 0 || store_slot(sub, &s_sub_leases, empty) < 0 ||
        store_slot(sub, &s_sub_op, Py_None) < 0 || store_slot(sub, &s_sub_state, g_done) < 0 ||
        bump(completion, &s_c_in_flight, -1) < 0 || bump(completion, &s_c_completed, 1) < 0 ||
        bump(stream, &s_st_in_flight, -1) < 0 || bump(stream, &s_st_completed, 1) < 0)
        goto out;
    result = Py_True;
out:
    Py_DECREF(leases);
    Py_XDECREF(memory);
    Py_XDECREF(stream);
    if (result == NULL) return NULL;
    Py_INCREF(result);
    return result;
}

/* configure_retire(Completion, Stream, DONE): after configure_leases(). */
PyObject *configure_retire(PyObject *module, PyObject *args) {
    PyObject *completion_type, *stream_type, *done;
    if (!PyArg_ParseTuple(args, "O!O!O:configure_retire", &PyType_Type, &completion_type, &PyType_Type, &stream_type,
                          &done))
        return NULL;
    if (!g_leases_ready || g_retire_ready) {
        PyErr_SetString(PyExc_RuntimeError, "configure_retire: once per process, after configure_leases()");
        return NULL;
    }
    struct {
        PyObject *type;
        const char *name;
        SlotRef *ref;
    } refs[] = {{completion_type, "tracer", &s_c_tracer},       {completion_type, "memory", &s_c_memory},
                {completion_type, "in_flight", &s_c_in_flight}, {completion_type, "completed", &s_c_completed},
                {stream_type, "_in_flight", &s_st_in_flight},   {stream_type, "_completed", &s_st_completed}};
    for (size_t i = 0; i < sizeof(refs) / sizeof(refs[0]); i++)
        if (make_slot_ref(refs[i].type, refs[i].name, refs[i].ref) < 0) return NULL;
    if ((s_trace_retire = PyUnicode_InternFromString("trace_retire")) == NULL) return NULL;
    Py_INCREF(done);
    g_done = done;
    g_retire_ready = 1;
    Py_RETURN_NONE;
}

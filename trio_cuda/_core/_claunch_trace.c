/* A lifetime trace's records on the awaited path, compiled (part of
   trio_cuda._core._claunch).

   trace_record(...) makes ``Tracer.emit``'s steps (trio_cuda/_core/_trace.py)
   for a tracer of that exact class without NVTX ranges: under the tracer's
   lock, the event tuple (perf_counter() first) is appended to the ring, or
   overwrites its oldest slot once the ring holds ``limit`` events, and
   ``recorded`` moves. Nothing else runs between taking and releasing the
   lock but C code (perf_counter, the tuple, the list), so the record is
   atomic with respect to KeyboardInterrupt, as emit's is; the lock is
   released on every path. An event whose arguments hold nothing the
   garbage collector tracks is left untracked (as the collector would
   untrack it at its first pass), so a long trace does not make the
   collections longer.

   Three records use it, each where its Python function is the one the
   class or module holds now (else that function runs, as before):
   - trace_await(completion, sub, t0): ``Completion.trace_await``;
   - the retirement record of ``retire_done`` (retire_record):
     ``Completion.trace_retire`` for work without an error;
   - the submission record of ``submit_launch`` (submit_record):
     ``_trace.trace_submit`` for an untimed launch on its lease plan's fast
     path whose plan's lease record is cached.
   Where a record declines (0) nothing has changed, and the caller runs the
   Python function. */

#include "_claunch.h"

static PyTypeObject *t_tracer, *t_completion_tr;
static PyObject *g_perf_counter, *g_await_fn, *g_retire_fn, *g_submit_fn, *g_in_flight_tr, *g_ctx;
static PyObject *n_acquire, *n_release, *n_task, *n_name, *n_trace_await, *n_trace_retire, *n_last_command;
static PyObject *u_await, *u_retire, *u_submit, *u_waiter, *u_handoff, *u_exit, *u_ok, *u_error, *u_left;
static PyObject *k_task, *k_t0, *k_outcome, *k_leases, *k_enqueue, *k_cmd, *k_marks, *k_trace_leases;
static SlotRef r_lock, r_ring, r_recorded, r_limit, r_nvtx, r_c_tracer, r_c_trace_id, r_c_handoff, r_c_exiting,
    r_s_stream, r_s_id, r_s_error, r_s_state, r_s_leases, r_st_index, r_sc_trace_id, r_sc_trace_cmds, r_sc_driver,
    r_k_name;

static int tracer_plain(PyObject *tr);

/* The last lock recorded under and its bound acquire and release (held:
   the lock cannot be freed and another object take its address while its
   methods are kept). */
static PyObject *c_lock, *c_acquire, *c_release;

/* ``lock.acquire()`` (release: ``lock.release()``) through the kept bound
   method where ``lock`` is the last one: a new reference, or NULL. */
static PyObject *lock_call(PyObject *lock, int release) {
    if (lock != c_lock) {
        PyObject *acquire = PyObject_GetAttr(lock, n_acquire);
        PyObject *rel = acquire ? PyObject_GetAttr(lock, n_release) : NULL;
        if (rel == NULL) {
            Py_XDECREF(acquire);
            return NULL;
        }
        Py_XSETREF(c_acquire, acquire);
        Py_XSETREF(c_release, rel);
        Py_XSETREF(c_lock, Py_NewRef(lock));
    }
    return PyObject_CallNoArgs(release ? c_release : c_acquire);
}

/* 1 recorded; 0 declined (nothing changed: call emit); -1 error. */
int trace_record(PyObject *tr, PyObject *cat, PyObject *name, PyObject *sid, PyObject *stream, PyObject *sub,
                 PyObject *alloc, PyObject *args) {
    int plain = tracer_plain(tr);
    if (plain <= 0) return plain;
    PyObject *lock = read_slot(tr, &r_lock);
    if (lock == NULL) return -1;
    PyObject *r = lock_call(lock, 0);
    if (r == NULL) {
        Py_DECREF(lock);
        return -1;
    }
    Py_DECREF(r);
    int rc = -1;
    PyObject *t = NULL, *ev = NULL, *ring = NULL, *recorded = NULL, *limit = NULL;
    if ((t = PyObject_CallNoArgs(g_perf_counter)) == NULL ||
        (ev = PyTuple_Pack(8, t, cat, name, sid, stream, sub, alloc, args)) == NULL ||
        (ring = read_slot(tr, &r_ring)) == NULL || (recorded = read_slot(tr, &r_recorded)) == NULL ||
        (limit = read_slot(tr, &r_limit)) == NULL)
        goto release;
    if (args == Py_None || !PyObject_GC_IsTracked(args)) /* (atomic: nothing a cycle could go through) */
        PyObject_GC_UnTrack(ev);
    Py_ssize_t n = PyLong_AsSsize_t(recorded), lim = PyLong_AsSsize_t(limit);
    if ((n == -1 || lim == -1) && PyErr_Occurred()) goto release;
    if (!PyList_CheckExact(ring) || lim <= 0) {
        PyErr_SetString(PyExc_TypeError, "trace_record: a tracer's ring is a list and its limit positive");
        goto release;
    }
    PyObject *more = PyLong_FromSsize_t(n + 1);
    if (more == NULL) goto release;
    if (n < lim) {
        if (PyList_Append(ring, ev) < 0) {
            Py_DECREF(more);
            goto release;
        }
    } else {
        if (PyList_GET_SIZE(ring) != lim) {
            Py_DECREF(more);
            PyErr_SetString(PyExc_RuntimeError, "trace_record: the ring is not full at its limit");
            goto release;
        }
        PyObject *old = PyList_GET_ITEM(ring, n % lim);
        PyList_SET_ITEM(ring, n % lim, Py_NewRef(ev));
        Py_XDECREF(old);
    }
    if (store_slot(tr, &r_recorded, more) < 0) goto release;
    rc = 1;
release:;
    PyObject *exc = rc < 0 ? take_raised() : NULL;
    r = lock_call(lock, 1);
    if (r == NULL) {
        Py_XDECREF(exc); /* (the release's error wins) */
        rc = -1;
    } else {
        Py_DECREF(r);
        if (exc != NULL) {
            PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
            Py_DECREF(exc);
        }
    }
    Py_DECREF(lock);
    Py_XDECREF(t);
    Py_XDECREF(ev);
    Py_XDECREF(ring);
    Py_XDECREF(recorded);
    Py_XDECREF(limit);
    return rc;
}

/* Whether trace_record records for ``tr`` (a Tracer without NVTX): 1, 0, -1. */
static int tracer_plain(PyObject *tr) {
    if (t_tracer == NULL || Py_TYPE(tr) != t_tracer) return 0;
    PyObject *nvtx = read_slot(tr, &r_nvtx);
    if (nvtx == NULL) return -1;
    Py_DECREF(nvtx);
    return nvtx == Py_None;
}


/* The calling Trio task (a new reference), or NULL with no error set where it cannot be read. */
static PyObject *running_task(void) {
    PyObject *task = g_ctx != NULL && g_ctx != Py_None ? PyObject_GetAttr(g_ctx, n_task) : NULL;
    if (task == NULL) PyErr_Clear();
    return task;
}

/* record(tr, cat, name, <sid slot of owner>, sub's stream index, sub's id, args) */
static int record_sub(PyObject *tr, PyObject *cat, PyObject *name, PyObject *sid, PyObject *sub, PyObject *args) {
    PyObject *stream = read_slot(sub, &r_s_stream);
    PyObject *index = stream ? read_slot(stream, &r_st_index) : NULL;
    PyObject *id = index ? read_slot(sub, &r_s_id) : NULL;
    int rc = id ? trace_record(tr, cat, name, sid, index, id, Py_None, args) : -1;
    Py_XDECREF(stream);
    Py_XDECREF(index);
    Py_XDECREF(id);
    return rc;
}

/* trace_await(completion, sub, t0): Completion.trace_await(sub, t0). */
PyObject *trace_await(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "trace_await(completion, sub, t0)");
        return NULL;
    }
    PyObject *c = args[0], *sub = args[1], *t0 = args[2];
    int rc = 0;
    PyObject *tr = NULL, *task = NULL, *name = NULL, *state = NULL, *error = NULL, *d = NULL, *sid = NULL;
    if (t_tracer == NULL || Py_TYPE(c) != t_completion_tr) goto done;
    if ((rc = class_holds(t_completion_tr, n_trace_await, g_await_fn)) <= 0) goto done;
    FAIL_IF_NULL(tr = read_slot(c, &r_c_tracer));
    if (tr == Py_None) {
        rc = 1;
        goto done;
    }
    if ((rc = tracer_plain(tr)) <= 0) goto done;
    rc = 0;
    DECLINE_IF((task = running_task()) == NULL);
    FAIL_IF_NULL(name = fast_getattr(task, n_name));
    FAIL_IF_NULL(state = read_slot(sub, &r_s_state));
    FAIL_IF_NULL(error = read_slot(sub, &r_s_error));
    PyObject *outcome = state == g_in_flight_tr ? u_left : error == Py_None ? u_ok : u_error;
    FAIL_IF_NULL(d = PyDict_New());
    if (PyDict_SetItem(d, k_task, name) < 0 || PyDict_SetItem(d, k_t0, t0) < 0 ||
        PyDict_SetItem(d, k_outcome, outcome) < 0) {
        rc = -1;
        goto done;
    }
    FAIL_IF_NULL(sid = read_slot(c, &r_c_trace_id));
    rc = record_sub(tr, u_await, u_await, sid, sub, d);
done:
    Py_XDECREF(tr);
    Py_XDECREF(task);
    Py_XDECREF(name);
    Py_XDECREF(state);
    Py_XDECREF(error);
    Py_XDECREF(d);
    Py_XDECREF(sid);
    if (rc < 0) return NULL;
    if (rc == 0) return PyObject_CallMethodObjArgs(c, n_trace_await, sub, t0, NULL);
    Py_RETURN_NONE;
}

/* Completion.trace_retire(sub) for work without an error: 1 recorded, 0 declined, -1 error. */
int retire_record(PyObject *c, PyObject *sub) {
    if (t_tracer == NULL || Py_TYPE(c) != t_completion_tr) return 0;
    int rc = class_holds(t_completion_tr, n_trace_retire, g_retire_fn);
    if (rc <= 0) return rc;
    rc = 0;
    PyObject *tr = NULL, *task = NULL, *error = NULL, *v = NULL, *sid = NULL;
    FAIL_IF_NULL(error = read_slot(sub, &r_s_error));
    DECLINE_IF(error != Py_None);
    FAIL_IF_NULL(tr = read_slot(c, &r_c_tracer));
    DECLINE_IF(tr == Py_None);
    if ((rc = tracer_plain(tr)) <= 0) goto done;
    rc = 0;
    DECLINE_IF((task = running_task()) == NULL);
    FAIL_IF_NULL(v = read_slot(c, &r_c_handoff));
    PyObject *who = u_handoff;
    if (v != task) {
        Py_CLEAR(v);
        FAIL_IF_NULL(v = read_slot(c, &r_c_exiting));
        int exiting = PyObject_IsTrue(v);
        if (exiting < 0) {
            rc = -1;
            goto done;
        }
        who = exiting ? u_exit : u_waiter;
    }
    FAIL_IF_NULL(sid = read_slot(c, &r_c_trace_id));
    rc = record_sub(tr, u_retire, who, sid, sub, Py_None);
done:
    Py_XDECREF(tr);
    Py_XDECREF(task);
    Py_XDECREF(error);
    Py_XDECREF(v);
    Py_XDECREF(sid);
    return rc;
}

/* _trace.trace_submit(scope, tr, sub, op, mark), where ``fn`` is the
   function the scope module holds now, for an untimed launch (``mark`` None)
   on its plan's fast path with the plan's lease record cached: 1 recorded,
   0 declined, -1 error. */
int submit_record(PyObject *fn, PyObject *scope, PyObject *tr, PyObject *sub, PyObject *op, PyObject *mark) {
    if (t_tracer == NULL || fn != g_submit_fn || mark != Py_None || Py_TYPE(op) != g_launch_type) return 0;
    int rc = tracer_plain(tr);
    if (rc <= 0) return rc;
    rc = 0;
    PyObject *leases = NULL, *record = NULL, *cmds = NULL, *cmd = NULL, *d = NULL, *sid = NULL, *name = NULL;
    PyObject *plan = *(PyObject **)((char *)op + g_launch_off[2]);
    PyObject *prepared = *(PyObject **)((char *)op + g_launch_off[0]);
    DECLINE_IF(plan == NULL || !PyTuple_CheckExact(plan));
    DECLINE_IF(prepared == NULL || Py_TYPE(prepared) != g_prepared_type);
    FAIL_IF_NULL(leases = read_slot(sub, &r_s_leases));
    DECLINE_IF(leases != plan);
    PyObject *cache = *(PyObject **)((char *)prepared + g_prepared_off[6]);
    PyObject *kernel = *(PyObject **)((char *)prepared + g_prepared_off[0]);
    DECLINE_IF(cache == NULL || !PyDict_CheckExact(cache) || kernel == NULL);
    record = PyDict_GetItemWithError(cache, k_trace_leases); /* (borrowed) */
    if (record == NULL && PyErr_Occurred()) {
        rc = -1;
        goto done;
    }
    DECLINE_IF(record == NULL);
    Py_INCREF(record);
    FAIL_IF_NULL(name = read_slot(kernel, &r_k_name));
    FAIL_IF_NULL(cmds = read_slot(scope, &r_sc_trace_cmds));
    int yes = PyObject_IsTrue(cmds);
    if (yes < 0) {
        rc = -1;
        goto done;
    }
    if (yes) {
        PyObject *driver = read_slot(scope, &r_sc_driver);
        FAIL_IF_NULL(driver);
        cmd = pmethod(driver, n_last_command, NULL, 0);
        Py_DECREF(driver);
        FAIL_IF_NULL(cmd);
    } else {
        cmd = Py_NewRef(Py_None);
    }
    FAIL_IF_NULL(d = PyDict_New());
    if (PyDict_SetItem(d, k_leases, record) < 0 || PyDict_SetItem(d, k_enqueue, name) < 0 ||
        PyDict_SetItem(d, k_cmd, cmd) < 0 || PyDict_SetItem(d, k_marks, Py_None) < 0) {
        rc = -1;
        goto done;
    }
    /* (its one container is the plan's cached record, which holds nothing of the trace: no cycle can
       go through it, so the collector need not visit it; an insertion would track it again) */
    PyObject_GC_UnTrack(d);
    FAIL_IF_NULL(sid = read_slot(scope, &r_sc_trace_id));
    rc = record_sub(tr, u_submit, name, sid, sub, d);
done:
    Py_XDECREF(leases);
    Py_XDECREF(record);
    Py_XDECREF(cmds);
    Py_XDECREF(cmd);
    Py_XDECREF(d);
    Py_XDECREF(sid);
    Py_XDECREF(name);
    return rc;
}

/* configure_trace(env): once per process, after configure(). */
PyObject *configure_trace(PyObject *module, PyObject *env) {
    if (!PyDict_Check(env)) {
        PyErr_SetString(PyExc_TypeError, "configure_trace: expected a dict");
        return NULL;
    }
    if (!g_configured || t_tracer != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "configure_trace: once per process, after configure()");
        return NULL;
    }
    PyObject *tracer_type, *completion_type, *sub_type, *stream_type, *scope_type, *kernel_type;
    if (take(env, "Tracer", &tracer_type) < 0 || take(env, "Completion", &completion_type) < 0 ||
        take(env, "Submission", &sub_type) < 0 || take(env, "Stream", &stream_type) < 0 ||
        take(env, "ResourceScope", &scope_type) < 0 || take(env, "Kernel", &kernel_type) < 0 ||
        take(env, "perf_counter", &g_perf_counter) < 0 || take(env, "trace_await", &g_await_fn) < 0 ||
        take(env, "trace_retire", &g_retire_fn) < 0 || take(env, "trace_submit", &g_submit_fn) < 0 ||
        take(env, "IN_FLIGHT", &g_in_flight_tr) < 0 || take(env, "RUN_CONTEXT", &g_ctx) < 0)
        return NULL;
    if (!PyType_Check(tracer_type) || !PyType_Check(completion_type)) {
        PyErr_SetString(PyExc_TypeError, "configure_trace: Tracer and Completion must be types");
        return NULL;
    }
    struct {
        PyObject *type;
        const char *name;
        SlotRef *ref;
    } refs[] = {{tracer_type, "lock", &r_lock},           {tracer_type, "ring", &r_ring},
                {tracer_type, "recorded", &r_recorded},   {tracer_type, "limit", &r_limit},
                {tracer_type, "nvtx", &r_nvtx},           {completion_type, "tracer", &r_c_tracer},
                {completion_type, "trace_id", &r_c_trace_id}, {completion_type, "handoff_task", &r_c_handoff},
                {completion_type, "exiting", &r_c_exiting}, {sub_type, "stream", &r_s_stream},
                {sub_type, "id", &r_s_id},                {sub_type, "error", &r_s_error},
                {sub_type, "state", &r_s_state},          {sub_type, "leases", &r_s_leases},
                {stream_type, "index", &r_st_index},      {scope_type, "_trace_id", &r_sc_trace_id},
                {scope_type, "_trace_cmds", &r_sc_trace_cmds}, {scope_type, "_driver", &r_sc_driver},
                {kernel_type, "name", &r_k_name}};
    for (size_t i = 0; i < sizeof(refs) / sizeof(refs[0]); i++)
        if (make_slot_ref(refs[i].type, refs[i].name, refs[i].ref) < 0) return NULL;
    if (intern(&n_acquire, "acquire") < 0 || intern(&n_release, "release") < 0 || intern(&n_task, "task") < 0 ||
        intern(&n_name, "name") < 0 || intern(&n_trace_await, "trace_await") < 0 ||
        intern(&n_trace_retire, "trace_retire") < 0 || intern(&n_last_command, "last_command") < 0 ||
        intern(&u_await, "await") < 0 || intern(&u_retire, "retire") < 0 || intern(&u_submit, "submit") < 0 ||
        intern(&u_waiter, "waiter") < 0 || intern(&u_handoff, "handoff") < 0 || intern(&u_exit, "exit") < 0 ||
        intern(&u_ok, "ok") < 0 || intern(&u_error, "error") < 0 || intern(&u_left, "left") < 0 ||
        intern(&k_task, "task") < 0 || intern(&k_t0, "t0") < 0 || intern(&k_outcome, "outcome") < 0 ||
        intern(&k_leases, "leases") < 0 || intern(&k_enqueue, "enqueue") < 0 || intern(&k_cmd, "cmd") < 0 ||
        intern(&k_marks, "marks") < 0 || intern(&k_trace_leases, "trace_leases") < 0)
        return NULL;
    t_completion_tr = (PyTypeObject *)completion_type;
    t_tracer = (PyTypeObject *)tracer_type; /* (last: the records are on from here) */
    Py_RETURN_NONE;
}

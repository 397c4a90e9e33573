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
   collections longer. The lock is taken in C where it is a TraceLock (the
   tracers' own, below), else through its acquire and release methods; the
   time is read by clock_gettime where that is perf_counter's clock (checked
   once, at configure_trace).

   Three records use it, each where its Python function is the one the
   class or module holds now (else that function runs, as before):
   - trace_await(completion, sub, t0): ``Completion.trace_await``;
   - the retirement record of ``retire_done`` (retire_record):
     ``Completion.trace_retire`` for work without an error;
   - the submission record of ``submit_launch`` (submit_record):
     ``_trace.trace_submit`` for an untimed launch on its lease plan's fast
     path whose plan's lease record is cached; without command ids (a GPU's
     host-observed times) its args are made once per launch and shared.
   Where a record declines (0) nothing has changed, and the caller runs the
   Python function. */

#include "_claunch.h"

#include <math.h>
#ifndef _WIN32
#include <time.h>
#endif

static PyTypeObject *t_tracer, *t_completion_tr;
static PyObject *g_perf_counter, *g_await_fn, *g_retire_fn, *g_submit_fn, *g_in_flight_tr, *g_ctx;
static PyObject *n_acquire, *n_release, *n_task, *n___dict__, *n_name, *n_trace_await, *n_trace_retire, *n_last_command;
static PyObject *u_await, *u_retire, *u_submit, *u_waiter, *u_handoff, *u_exit, *u_ok, *u_error, *u_left;
static PyObject *k_task, *k_t0, *k_outcome, *k_leases, *k_enqueue, *k_cmd, *k_marks, *k_trace_leases, *k_trace_submit;
static SlotRef r_lock, r_ring, r_recorded, r_limit, r_nvtx, r_c_tracer, r_c_trace_id, r_c_handoff, r_c_exiting,
    r_s_stream, r_s_id, r_s_error, r_s_state, r_s_leases, r_st_index, r_sc_trace_id, r_sc_trace_cmds, r_sc_driver,
    r_k_name;

static int tracer_plain(PyObject *tr);

/* ---- TraceLock: the tracers' lock where the compiled paths are in use.

   threading.RLock's semantics (acquire(blocking=True, timeout=-1),
   release(), the context manager, _is_owned()) with one difference that
   matters: a record takes and releases it in C, with no call. The owner and
   the count are read and written only with the GIL held; the OS lock is
   free exactly while the count is 0. An acquire that has to wait releases
   the GIL, and an interrupted wait runs the signal handlers (Ctrl-C raises
   there, as RLock's acquire does). */
typedef struct {
    PyObject_HEAD PyThread_type_lock mutex;
    unsigned long owner;
    unsigned long count;
} TraceLock;

static PyTypeObject *t_tracelock;

static int64_t mono_us(void) {
#ifdef _WIN32
    return (int64_t)GetTickCount64() * 1000;
#else
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
#endif
}

/* 1 acquired; 0 not (``timeout_us`` 0: do not wait; > 0: waited that long); -1 error (interrupted). */
static int tl_acquire(TraceLock *self, int64_t timeout_us) {
    unsigned long me = PyThread_get_thread_ident();
    if (self->count > 0 && self->owner == me) {
        if (self->count == ULONG_MAX) {
            PyErr_SetString(PyExc_OverflowError, "TraceLock: the count of acquisitions overflowed");
            return -1;
        }
        self->count++;
        return 1;
    }
    PyLockStatus r = PyThread_acquire_lock_timed(self->mutex, 0, 0);
    if (r == PY_LOCK_FAILURE && timeout_us != 0) {
        int64_t deadline = timeout_us > 0 ? mono_us() + timeout_us : 0, wait = timeout_us;
        for (;;) {
            Py_BEGIN_ALLOW_THREADS
            r = PyThread_acquire_lock_timed(self->mutex, wait, 1);
            Py_END_ALLOW_THREADS
            if (r != PY_LOCK_INTR) break;
            if (Py_MakePendingCalls() < 0) return -1;
            if (timeout_us > 0) {
                wait = deadline - mono_us();
                if (wait <= 0) {
                    r = PyThread_acquire_lock_timed(self->mutex, 0, 0);
                    break;
                }
            }
        }
    }
    if (r != PY_LOCK_ACQUIRED) return 0;
    self->owner = me;
    self->count = 1;
    return 1;
}

/* 0 released; -1 (RuntimeError) where the calling thread does not hold it. */
static int tl_release(TraceLock *self) {
    if (self->count == 0 || self->owner != PyThread_get_thread_ident()) {
        PyErr_SetString(PyExc_RuntimeError, "cannot release un-acquired lock");
        return -1;
    }
    if (--self->count == 0) {
        self->owner = 0;
        PyThread_release_lock(self->mutex);
    }
    return 0;
}

static PyObject *tl_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "TraceLock() takes no arguments");
        return NULL;
    }
    TraceLock *self = (TraceLock *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->mutex = PyThread_allocate_lock();
    if (self->mutex == NULL) {
        Py_DECREF(self);
        PyErr_SetString(PyExc_MemoryError, "TraceLock: no OS lock could be allocated");
        return NULL;
    }
    return (PyObject *)self;
}

static void tl_dealloc(TraceLock *self) {
    PyTypeObject *type = Py_TYPE(self);
    if (self->mutex != NULL) {
        if (self->count > 0) PyThread_release_lock(self->mutex);
        PyThread_free_lock(self->mutex);
    }
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

static PyObject *tl_acquire_py(TraceLock *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"blocking", "timeout", NULL};
    int blocking = 1;
    double timeout = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|pd:acquire", kwlist, &blocking, &timeout)) return NULL;
    if (isnan(timeout)) {
        PyErr_SetString(PyExc_ValueError, "timeout: expected a number of seconds >= 0 or -1, got nan");
        return NULL;
    }
    if (isinf(timeout) || fabs(timeout) > (double)INT64_MAX / 1e9) { /* (RLock's order: the value's own first) */
        PyErr_SetString(PyExc_OverflowError, "timeout value is too large");
        return NULL;
    }
    if (!blocking && timeout != -1) {
        PyErr_SetString(PyExc_ValueError, "can't specify a timeout for a non-blocking call");
        return NULL;
    }
    if (timeout < 0 && timeout != -1) {
        PyObject *given = PyFloat_FromDouble(timeout);
        if (given != NULL) {
            PyErr_Format(PyExc_ValueError, "timeout: expected a number of seconds >= 0 or -1, got %R", given);
            Py_DECREF(given);
        }
        return NULL;
    }
    if (timeout > (double)PY_TIMEOUT_MAX / 1e6) {
        PyErr_SetString(PyExc_OverflowError, "timeout value is too large");
        return NULL;
    }
    /* (a positive timeout shorter than a microsecond still waits one) */
    int64_t us = !blocking ? 0 : timeout < 0 ? -1 : timeout > 0 && timeout < 1e-6 ? 1 : (int64_t)(timeout * 1e6);
    int got = tl_acquire(self, us);
    if (got < 0) return NULL;
    return PyBool_FromLong(got);
}

static PyObject *tl_enter(TraceLock *self, PyObject *unused) {
    if (tl_acquire(self, -1) < 0) return NULL;
    Py_RETURN_TRUE;
}

static PyObject *tl_release_py(TraceLock *self, PyObject *unused) {
    if (tl_release(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *tl_exit(TraceLock *self, PyObject *const *args, Py_ssize_t nargs) {
    if (tl_release(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *tl_is_owned(TraceLock *self, PyObject *unused) {
    return PyBool_FromLong(self->count > 0 && self->owner == PyThread_get_thread_ident());
}

static PyObject *tl_repr(TraceLock *self) {
    return PyUnicode_FromFormat("<%s %s object owner=%lu count=%lu at %p>", self->count ? "locked" : "unlocked",
                                Py_TYPE(self)->tp_name, self->owner, self->count, self);
}

static PyMethodDef tl_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))tl_acquire_py, METH_VARARGS | METH_KEYWORDS,
     "acquire(blocking=True, timeout=-1) -> bool, as threading.RLock's."},
    {"release", (PyCFunction)tl_release_py, METH_NOARGS, "release(), as threading.RLock's."},
    {"__enter__", (PyCFunction)tl_enter, METH_NOARGS, "acquire()"},
    {"__exit__", (PyCFunction)(void (*)(void))tl_exit, METH_FASTCALL, "release()"},
    {"_is_owned", (PyCFunction)tl_is_owned, METH_NOARGS, "whether the calling thread holds it"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot tl_slots[] = {
    {Py_tp_new, tl_new},         {Py_tp_dealloc, tl_dealloc}, {Py_tp_methods, tl_methods},
    {Py_tp_repr, tl_repr},       {Py_tp_doc, "A reentrant lock that the trace's compiled records take in C."},
    {0, NULL},
};

static PyType_Spec tl_spec = {"trio_cuda._core._claunch.TraceLock", sizeof(TraceLock), 0, Py_TPFLAGS_DEFAULT,
                              tl_slots};

/* Adds TraceLock to the module (at import): 0, or -1 with an error set. */
int add_trace_lock(PyObject *module) {
    if (t_tracelock == NULL && (t_tracelock = (PyTypeObject *)PyType_FromSpec(&tl_spec)) == NULL) return -1;
    Py_INCREF(t_tracelock);
    if (PyModule_AddObject(module, "TraceLock", (PyObject *)t_tracelock) < 0) {
        Py_DECREF(t_tracelock);
        return -1;
    }
    return 0;
}

/* ---- the event's time: perf_counter()'s, read by clock_gettime where
   that is the same clock (checked at configure_trace), else by the call. */
static int g_clock_direct;

static PyObject *perf_now(void) {
#ifndef _WIN32
    if (g_clock_direct) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        int64_t ns = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
        /* (as CPython turns its nanoseconds into seconds) */
        return PyFloat_FromDouble(ns % 1000000000 == 0 ? (double)(ns / 1000000000) : (double)ns / 1e9);
    }
#endif
    return PyObject_CallNoArgs(g_perf_counter);
}

/* Whether clock_gettime(CLOCK_MONOTONIC) reads perf_counter()'s clock: three
   reads in turn, C, Python, C, must be in order, five times out of five. */
static int clock_check(void) {
#ifdef _WIN32
    return 0;
#else
    g_clock_direct = 1;
    int ok = 1;
    for (int i = 0; i < 5 && ok; i++) {
        PyObject *a = perf_now(), *b = a ? PyObject_CallNoArgs(g_perf_counter) : NULL, *c = b ? perf_now() : NULL;
        if (c == NULL) {
            ok = -1;
        } else {
            double x = PyFloat_AsDouble(a), y = PyFloat_AsDouble(b), z = PyFloat_AsDouble(c);
            if (PyErr_Occurred()) ok = -1;
            else ok = PyFloat_CheckExact(b) && x <= y && y <= z;
        }
        Py_XDECREF(a);
        Py_XDECREF(b);
        Py_XDECREF(c);
    }
    g_clock_direct = ok == 1;
    return ok < 0 ? -1 : 0;
#endif
}

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
    int direct = Py_TYPE(lock) == t_tracelock; /* (else through its bound methods) */
    PyObject *r = direct ? (tl_acquire((TraceLock *)lock, -1) < 0 ? NULL : Py_NewRef(Py_None)) : lock_call(lock, 0);
    if (r == NULL) {
        Py_DECREF(lock);
        return -1;
    }
    Py_DECREF(r);
    int rc = -1;
    PyObject *t = NULL, *ev = NULL, *ring = NULL, *recorded = NULL, *limit = NULL;
    if ((t = perf_now()) == NULL ||
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
    r = direct ? (tl_release((TraceLock *)lock) < 0 ? NULL : Py_NewRef(Py_None)) : lock_call(lock, 1);
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


/* Trio's run context is a threading.local: the last thread that read it
   (its thread state's id, which is never reused) and that thread's dict of
   it, read through ``__dict__`` and checked against the attribute once. */
static uint64_t c_ctx_thread;
static PyObject *c_ctx_dict;

/* The calling Trio task (a new reference), or NULL with no error set where it cannot be read. */
static PyObject *running_task(void) {
    if (g_ctx == NULL || g_ctx == Py_None) return NULL;
    uint64_t me = PyThreadState_GetID(PyThreadState_Get());
    if (c_ctx_dict == NULL || c_ctx_thread != me) {
        Py_CLEAR(c_ctx_dict);
        PyObject *task = PyObject_GetAttr(g_ctx, n_task);
        PyObject *d = task ? PyObject_GetAttr(g_ctx, n___dict__) : NULL;
        if (d != NULL && PyDict_CheckExact(d) && PyDict_GetItemWithError(d, n_task) == task) {
            c_ctx_dict = Py_NewRef(d);
            c_ctx_thread = me;
        }
        Py_XDECREF(d);
        if (task == NULL || PyErr_Occurred()) {
            PyErr_Clear();
            Py_CLEAR(task);
        }
        return task;
    }
    PyObject *task = PyDict_GetItemWithError(c_ctx_dict, n_task); /* (borrowed) */
    if (task == NULL) {
        PyErr_Clear();
        return NULL;
    }
    return Py_NewRef(task);
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
    /* Without a command id the args are the same for every submission of this launch: they are
       made once and kept in its cache as (name, record, args), and the events share them
       (``Trace.events`` gives each event its own copy). */
    PyObject *kept = yes ? NULL : PyDict_GetItemWithError(cache, k_trace_submit); /* (borrowed) */
    if (kept == NULL && PyErr_Occurred()) {
        rc = -1;
        goto done;
    }
    if (kept != NULL && PyTuple_CheckExact(kept) && PyTuple_GET_SIZE(kept) == 3 &&
        PyTuple_GET_ITEM(kept, 0) == name && PyTuple_GET_ITEM(kept, 1) == record &&
        PyDict_CheckExact(PyTuple_GET_ITEM(kept, 2))) {
        d = Py_NewRef(PyTuple_GET_ITEM(kept, 2));
    } else {
        FAIL_IF_NULL(d = PyDict_New());
        if (PyDict_SetItem(d, k_leases, record) < 0 || PyDict_SetItem(d, k_enqueue, name) < 0 ||
            PyDict_SetItem(d, k_cmd, cmd) < 0 || PyDict_SetItem(d, k_marks, Py_None) < 0) {
            rc = -1;
            goto done;
        }
        /* (its one container is the plan's cached record, which holds nothing of the trace: no cycle can
           go through it, so the collector need not visit it; an insertion would track it again) */
        PyObject_GC_UnTrack(d);
        if (!yes) {
            PyObject *entry = PyTuple_Pack(3, name, record, d);
            FAIL_IF_NULL(entry);
            int bad = PyDict_SetItem(cache, k_trace_submit, entry);
            Py_DECREF(entry);
            if (bad < 0) {
                rc = -1;
                goto done;
            }
        }
    }
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
        intern(&n___dict__, "__dict__") < 0 ||
        intern(&n_name, "name") < 0 || intern(&n_trace_await, "trace_await") < 0 ||
        intern(&n_trace_retire, "trace_retire") < 0 || intern(&n_last_command, "last_command") < 0 ||
        intern(&u_await, "await") < 0 || intern(&u_retire, "retire") < 0 || intern(&u_submit, "submit") < 0 ||
        intern(&u_waiter, "waiter") < 0 || intern(&u_handoff, "handoff") < 0 || intern(&u_exit, "exit") < 0 ||
        intern(&u_ok, "ok") < 0 || intern(&u_error, "error") < 0 || intern(&u_left, "left") < 0 ||
        intern(&k_task, "task") < 0 || intern(&k_t0, "t0") < 0 || intern(&k_outcome, "outcome") < 0 ||
        intern(&k_leases, "leases") < 0 || intern(&k_enqueue, "enqueue") < 0 || intern(&k_cmd, "cmd") < 0 ||
        intern(&k_marks, "marks") < 0 || intern(&k_trace_leases, "trace_leases") < 0 ||
        intern(&k_trace_submit, "trace_submit") < 0)
        return NULL;
    if (clock_check() < 0) return NULL;
    t_completion_tr = (PyTypeObject *)completion_type;
    t_tracer = (PyTypeObject *)tracer_type; /* (last: the records are on from here) */
    Py_RETURN_NONE;
}

/* Retiring what completed (part of trio_cuda._core._claunch).

   scan(completion) does what Completion.scan (trio_cuda/_core/_completion.py)
   does, in its order:
   - the unmarked submissions get their markers, as ``flush_all`` gives
     them (``completion.flush(s)`` for each stream of ``unflushed`` that has
     unmarked work: it does nothing for the others);
   - dropped DLPack capsules release their exports (``sweep_dropped()``,
     when the _completion module's ``UNCONSUMED`` is not empty), and the
     memory table's collected handles are released (``release_pending()``,
     when ``gc_releases`` is set);
   - per stream, in order, the head of its pending queue is polled (a burst
     sharing one marker is polled once; a poll that raises an Exception is
     an unknown completion, as there), and while it completed it is taken
     off: a host step runs (``completion.run_host_step``), a submission is
     retired: by the _completion module's ``retire_done`` where its marker
     is done and that one is set, else by ``completion.retire``.
   Those steps are the Python methods themselves, looked up on every call, so
   what runs is what the class and the module hold now. It returns True when
   a host step ran. Its caller, Completion.scan, is KI-protected.

   prepare(completion, sub) and look(completion, sub) are what an awaiting
   task does before and after its first checkpoint, as Completion.observe
   does them (see them below); a stream's marker is recorded with
   Completion.flush's steps (flush_stream). begin(scope, op, stream) is
   ResourceScope.run's start for a lone launch, up to that checkpoint. */

#include "_claunch.h"

static int g_scan_ready;
static PyTypeObject *t_completion, *t_host_step;
static SlotRef r_unflushed, r_memory, r_gc_releases, r_driver, r_streams, r_pending, r_unmarked, r_sub_marker,
    r_poll_state, r_sub_state, r_host_steps, r_completed, r_by_waiters;
static PyObject *g_pending_state, *g_done_state, *g_unknown_state, *g_pending_poll, *g_poll_type,
    *g_completion_globals;
static PyObject *g_in_flight_state, *g_again, *g_settled, *n_scan_streams, *n_scan, *n_flush;
static SlotRef r_sub_error, r_sub_output, r_sub_stream;
static PyObject *g_run_context, *n_runner, *n_runq;
static PyObject *g_flush_fn, *n_handle, *n_record_marker, *n_quarantine_submission, *n_extend;
static PyObject *n_flush_all, *n_unconsumed, *n_sweep, *n_release_pending, *n_poll_marker, *n_popleft,
    *n_run_host_step, *n_retire_done, *n_retire;

static int truthy_slot(PyObject *obj, SlotRef *ref) {
    PyObject *v = read_slot(obj, ref);
    if (v == NULL) return -1;
    int yes = PyObject_IsTrue(v);
    Py_DECREF(v);
    return yes;
}

/* What polling ``marker`` established (a new reference): the driver's Poll,
   or Poll(UNKNOWN, exc) where the driver raised an Exception. */
static PyObject *poll(PyObject *poll_marker, PyObject *marker) {
    PyObject *p = PyObject_CallOneArg(poll_marker, marker);
    if (p != NULL || !PyErr_ExceptionMatches(PyExc_Exception)) return p;
    PyObject *value = take_raised();
    p = PyObject_CallFunctionObjArgs(g_poll_type, g_unknown_state, value, NULL);
    Py_DECREF(value);
    return p;
}

/* ``completion.flush_all()``: a marker after each stream's unmarked
   submissions (``completion.flush(s)``, called for the streams that have
   some: it does nothing for the others). 0, or -1 (error set). */
/* ``completion.flush(s)``: the steps of Completion.flush where the class
   holds that function still (else the method): the stream's unmarked
   submissions get one marker (``driver.record_marker(s.handle)``) and join
   its pending queue; an exception recording it quarantines each
   (``quarantine_submission``), and a BaseException is raised on. 0, or -1
   (error set). Also _claunch_order.c's (the method, until configure_scan). */
int flush_stream(PyObject *completion, PyObject *s) {
    if (!g_scan_ready || !class_holds(Py_TYPE(completion), n_flush, g_flush_fn)) {
        PyObject *r = g_scan_ready ? pmethod(completion, n_flush, &s, 1)
                                   : PyObject_CallMethod(completion, "flush", "O", s);
        Py_XDECREF(r);
        return r ? 0 : -1;
    }
    PyObject *subs = read_slot(s, &r_unmarked);
    if (subs == NULL) return -1;
    int rc = -1, some = PyObject_IsTrue(subs);
    PyObject *fresh = NULL, *driver = NULL, *handle = NULL, *marker = NULL, *pending = NULL;
    if (some <= 0) {
        rc = some;
        goto done;
    }
    if ((fresh = PyList_New(0)) == NULL || store_slot(s, &r_unmarked, fresh) < 0) {
        fresh = NULL; /* (stolen) */
        goto done;
    }
    fresh = NULL;
    if ((driver = read_slot(completion, &r_driver)) == NULL || (handle = fast_getattr(s, n_handle)) == NULL)
        goto done;
    marker = pmethod(driver, n_record_marker, &handle, 1);
    if (marker == NULL) { /* quarantined; a BaseException is raised on */
        int base = !PyErr_ExceptionMatches(PyExc_Exception);
        PyObject *exc = take_raised();
        PyObject *it = PyObject_GetIter(subs), *sub;
        while (it != NULL && (sub = PyIter_Next(it)) != NULL) {
            PyObject *r = pmethod(completion, n_quarantine_submission, (PyObject *[]){sub, exc}, 2);
            Py_DECREF(sub);
            if (r == NULL) break;
            Py_DECREF(r);
        }
        Py_XDECREF(it);
        if (base && !PyErr_Occurred()) {
            PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        }
        Py_DECREF(exc);
        rc = PyErr_Occurred() ? -1 : 0;
        goto done;
    }
    PyObject *it = PyObject_GetIter(subs), *sub;
    while (it != NULL && (sub = PyIter_Next(it)) != NULL) {
        int bad = store_slot(sub, &r_sub_marker, Py_NewRef(marker)) < 0;
        Py_DECREF(sub);
        if (bad) break;
    }
    Py_XDECREF(it);
    if (it == NULL || PyErr_Occurred() || (pending = read_slot(s, &r_pending)) == NULL) goto done;
    PyObject *r = PyObject_CallMethodOneArg(pending, n_extend, subs);
    Py_XDECREF(r);
    rc = r ? 0 : -1;
done:
    Py_DECREF(subs);
    Py_XDECREF(driver);
    Py_XDECREF(handle);
    Py_XDECREF(marker);
    Py_XDECREF(pending);
    return rc;
}

static int flush_all(PyObject *completion) {
    PyObject *streams = read_slot(completion, &r_unflushed);
    if (streams == NULL) return -1;
    int rc = -1;
    if (!PyList_CheckExact(streams)) { /* (not the list it keeps: the method decides) */
        PyObject *r = PyObject_CallMethodNoArgs(completion, n_flush_all);
        Py_XDECREF(r);
        rc = r ? 0 : -1;
        goto done;
    }
    if (PyList_GET_SIZE(streams) == 0) {
        rc = 0;
        goto done;
    }
    PyObject *fresh = PyList_New(0);
    if (fresh == NULL || store_slot(completion, &r_unflushed, fresh) < 0) goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(streams); i++) {
        PyObject *s = PyList_GET_ITEM(streams, i);
        PyObject *unmarked = read_slot(s, &r_unmarked);
        if (unmarked == NULL) goto done;
        int some = PyObject_IsTrue(unmarked);
        Py_DECREF(unmarked);
        if (some < 0) goto done;
        if (some && flush_stream(completion, s) < 0) goto done;
    }
    rc = 0;
done:
    Py_DECREF(streams);
    return rc;
}

/* One stream's completed prefix: 1 if a host step ran, 0 if not, -1 error. */
static int scan_stream(PyObject *completion, PyObject *stream, PyObject *poll_marker, PyObject *known,
                       PyObject *known_poll) {
    PyObject *pending = read_slot(stream, &r_pending);
    if (pending == NULL) return -1;
    int progressed = 0;
    /* as the Python loop starts: no marker polled, nothing completed */
    PyObject *last_ref = Py_NewRef(Py_None), *p = Py_NewRef(g_pending_poll);
    for (;;) {
        Py_ssize_t n = PyObject_Length(pending);
        if (n < 0) goto fail;
        if (n == 0) break;
        PyObject *head = PySequence_GetItem(pending, 0);
        if (head == NULL) goto fail;
        PyObject *marker = read_slot(head, &r_sub_marker);
        if (marker == NULL) {
            Py_DECREF(head);
            goto fail;
        }
        if (marker != last_ref) { /* a burst shares one marker: poll it once */
            Py_XDECREF(p);
            /* (a marker the caller saw done is done: completion is for good) */
            p = marker == known ? Py_NewRef(known_poll) : poll(poll_marker, marker);
            Py_SETREF(last_ref, Py_NewRef(marker));
            if (p == NULL) {
                Py_DECREF(marker);
                Py_DECREF(head);
                goto fail;
            }
        }
        Py_DECREF(marker);
        PyObject *state = read_slot(p, &r_poll_state);
        if (state == NULL) {
            Py_DECREF(head);
            goto fail;
        }
        Py_DECREF(state); /* (p holds it) */
        if (state == g_pending_state) {
            Py_DECREF(head);
            break;
        }
        PyObject *r = PyObject_CallMethodNoArgs(pending, n_popleft);
        if (r == NULL) {
            Py_DECREF(head);
            goto fail;
        }
        Py_DECREF(r);
        if (Py_TYPE(head) == t_host_step) {
            progressed = 1;
            r = PyObject_CallMethodObjArgs(completion, n_run_host_step, head, p, NULL);
        } else {
            int retired = 0;
            if (state == g_done_state) {
                PyObject *rd = PyDict_GetItemWithError(g_completion_globals, n_retire_done); /* (borrowed) */
                if (rd == NULL && PyErr_Occurred()) {
                    Py_DECREF(head);
                    goto fail;
                }
                if (rd != NULL && rd != Py_None) {
                    Py_INCREF(rd);
                    PyObject *argv[2] = {completion, head};
                    PyObject *took = PyObject_Vectorcall(rd, argv, 2, NULL);
                    Py_DECREF(rd);
                    retired = took ? PyObject_IsTrue(took) : -1;
                    Py_XDECREF(took);
                    if (retired < 0) {
                        Py_DECREF(head);
                        goto fail;
                    }
                }
            }
            r = retired ? Py_NewRef(Py_None) : PyObject_CallMethodObjArgs(completion, n_retire, head, p, NULL);
        }
        Py_DECREF(head);
        if (r == NULL) goto fail;
        Py_DECREF(r);
    }
    Py_XDECREF(p);
    Py_XDECREF(last_ref);
    Py_DECREF(pending);
    return progressed;
fail:
    Py_XDECREF(p);
    Py_XDECREF(last_ref);
    Py_DECREF(pending);
    return -1;
}

static PyObject *scan_known(PyObject *completion, PyObject *known, PyObject *known_poll);

PyObject *scan(PyObject *module, PyObject *completion) { return scan_known(completion, NULL, NULL); }

/* The scan, where ``known`` (or NULL) is a marker the caller polled and
   found done (``known_poll``): it is not polled again. */
static PyObject *scan_known(PyObject *completion, PyObject *known, PyObject *known_poll) {
    if (!g_scan_ready) {
        PyErr_SetString(PyExc_RuntimeError, "scan: configure_scan() first");
        return NULL;
    }
    if (Py_TYPE(completion) != t_completion) {
        PyErr_Format(PyExc_TypeError, "scan: expected a Completion, got %.100s", Py_TYPE(completion)->tp_name);
        return NULL;
    }
    PyObject *r = NULL, *memory = NULL, *driver = NULL, *poll_marker = NULL, *streams = NULL, *result = NULL;
    if (flush_all(completion) < 0) return NULL;
    int yes;
    PyObject *unconsumed = PyDict_GetItemWithError(g_completion_globals, n_unconsumed); /* (borrowed) */
    if (unconsumed == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "scan: UNCONSUMED is gone");
        return NULL;
    }
    if ((yes = PyObject_IsTrue(unconsumed)) < 0) return NULL;
    if (yes) {
        PyObject *sweep = PyDict_GetItemWithError(g_completion_globals, n_sweep);
        if (sweep == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "scan: sweep_dropped is gone");
            return NULL;
        }
        Py_INCREF(sweep);
        r = PyObject_CallNoArgs(sweep);
        Py_DECREF(sweep);
        if (r == NULL) return NULL;
        Py_CLEAR(r);
    }
    if ((memory = read_slot(completion, &r_memory)) == NULL) goto out;
    if ((yes = truthy_slot(memory, &r_gc_releases)) < 0) goto out;
    if (yes && (r = PyObject_CallMethodNoArgs(memory, n_release_pending)) == NULL) goto out;
    Py_CLEAR(r);
    if ((driver = read_slot(completion, &r_driver)) == NULL) goto out;
    if ((poll_marker = PyObject_GetAttr(driver, n_poll_marker)) == NULL) goto out;
    if ((streams = read_slot(completion, &r_streams)) == NULL) goto out;
    PyObject *it = PyObject_GetIter(streams);
    if (it == NULL) goto out;
    int progressed = 0;
    PyObject *stream;
    while ((stream = PyIter_Next(it)) != NULL) {
        int rc = scan_stream(completion, stream, poll_marker, known, known_poll);
        Py_DECREF(stream);
        if (rc < 0) break;
        progressed |= rc;
    }
    Py_DECREF(it);
    if (!PyErr_Occurred()) result = PyBool_FromLong(progressed);
out:
    Py_XDECREF(memory);
    Py_XDECREF(driver);
    Py_XDECREF(poll_marker);
    Py_XDECREF(streams);
    return result;
}

/* prepare(completion, sub): before an awaiting task's first checkpoint, as
   ``Completion.observe`` begins: a lone waiter (its marker not recorded, no
   host closure due, no other Trio task runnable) records its stream's
   marker now (``completion.flush``), so it queues right behind the work.
   Whether another task is runnable is read from Trio's run queue, as
   ``_trio_internals.others_runnable`` reads it (where that cannot be read:
   yes). */
PyObject *prepare(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !g_scan_ready) {
        PyErr_SetString(PyExc_TypeError, "prepare(completion, sub), after configure_scan()");
        return NULL;
    }
    PyObject *completion = args[0], *sub = args[1];
    PyObject *marker = read_slot(sub, &r_sub_marker);
    if (marker == NULL) return NULL;
    Py_DECREF(marker);
    if (marker != Py_None) Py_RETURN_NONE;
    int yes = truthy_slot(completion, &r_host_steps);
    if (yes) return yes < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *runner = PyObject_GetAttr(g_run_context, n_runner);
    PyObject *runq = runner ? fast_getattr(runner, n_runq) : NULL;
    Py_XDECREF(runner);
    if (runq == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
        PyErr_Clear(); /* (another Trio layout: assume busy) */
        Py_RETURN_NONE;
    }
    yes = PyObject_IsTrue(runq);
    Py_DECREF(runq);
    if (yes) return yes < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *stream = read_slot(sub, &r_sub_stream);
    if (stream == NULL) return NULL;
    int rc = flush_stream(completion, stream);
    Py_DECREF(stream);
    return rc < 0 ? NULL : Py_NewRef(Py_None);
}

/* What awaiting ``sub``, settled, gives (a new reference), where
   ``outcome`` would give it as it is: no error, and an output that is None
   or a DeviceArray; else SETTLED (``outcome`` raises or resolves it). */
static PyObject *settled(PyObject *sub) {
    PyObject *error = read_slot(sub, &r_sub_error);
    if (error == NULL) return NULL;
    Py_DECREF(error);
    if (error != Py_None) return Py_NewRef(g_settled);
    PyObject *out = read_slot(sub, &r_sub_output);
    if (out == NULL || out == Py_None || Py_TYPE(out) == g_array_type) return out;
    Py_DECREF(out);
    return Py_NewRef(g_settled);
}

/* look(completion, sub): one look of an awaiting task at its own
   submission, as ``Completion.observe`` looks after a checkpoint; once it
   settled, what awaiting it gives (see ``settled``). While it is in flight, with no host closure due and its
   marker recorded, the marker is polled; once that completed, the scan
   runs (the _completion module's ``scan_streams``, else
   ``completion.scan()``) until it reports no host step, and what it
   retired counts as retired by waiters (a marker seen done is not polled
   again). AGAIN: the caller waits on (``observe``). Its caller is
   KI-protected. */
PyObject *look(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "look(completion, sub)");
        return NULL;
    }
    if (!g_scan_ready) {
        PyErr_SetString(PyExc_RuntimeError, "look: configure_scan() first");
        return NULL;
    }
    PyObject *completion = args[0], *sub = args[1];
    if (Py_TYPE(completion) != t_completion) {
        PyErr_Format(PyExc_TypeError, "look: expected a Completion, got %.100s", Py_TYPE(completion)->tp_name);
        return NULL;
    }
    PyObject *state = read_slot(sub, &r_sub_state);
    if (state == NULL) return NULL;
    Py_DECREF(state);
    if (state != g_in_flight_state) return settled(sub);
    int yes = truthy_slot(completion, &r_host_steps);
    if (yes < 0) return NULL;
    if (yes) return Py_NewRef(g_again); /* (a host closure is due: only the handoff runs them) */
    PyObject *marker = read_slot(sub, &r_sub_marker);
    if (marker == NULL) return NULL;
    PyObject *driver = NULL, *poll_marker = NULL, *p = NULL, *done = NULL, *now = NULL, *result = NULL;
    if (marker == Py_None) { /* one marker per stream for this look, as observe records them */
        Py_DECREF(marker);
        if (flush_all(completion) < 0) return NULL;
        if ((state = read_slot(sub, &r_sub_state)) == NULL) return NULL;
        Py_DECREF(state);
        if (state != g_in_flight_state) return settled(sub); /* (recording it quarantined it) */
        if ((marker = read_slot(sub, &r_sub_marker)) == NULL) return NULL;
        if (marker == Py_None) {
            result = Py_NewRef(g_again);
            goto out;
        }
    }
    if ((driver = read_slot(completion, &r_driver)) == NULL ||
        (poll_marker = PyObject_GetAttr(driver, n_poll_marker)) == NULL || (p = poll(poll_marker, marker)) == NULL)
        goto out;
    if ((state = read_slot(p, &r_poll_state)) == NULL) goto out;
    Py_DECREF(state);
    if (state == g_pending_state) {
        result = Py_NewRef(g_again);
        goto out;
    }
    if ((done = read_slot(completion, &r_completed)) == NULL) goto out;
    for (;;) {
        PyObject *fn = PyDict_GetItemWithError(g_completion_globals, n_scan_streams); /* (borrowed) */
        if (fn == NULL && PyErr_Occurred()) goto out;
        PyObject *r;
        if (fn != NULL && PyCFunction_Check(fn) && PyCFunction_GET_FUNCTION(fn) == (PyCFunction)scan)
            /* (this module's: a marker seen done is not polled again; any other state is) */
            r = scan_known(completion, state == g_done_state ? marker : NULL, p);
        else if (fn != NULL && fn != Py_None)
            r = PyObject_CallOneArg(fn, completion);
        else
            r = PyObject_CallMethodNoArgs(completion, n_scan);
        if (r == NULL) goto out;
        int again = PyObject_IsTrue(r);
        Py_DECREF(r);
        if (again < 0) goto out;
        if (!again) break;
    }
    if ((now = read_slot(completion, &r_completed)) == NULL) goto out;
    PyObject *retired = PyNumber_Subtract(now, done);
    if (retired == NULL) goto out;
    PyObject *before = read_slot(completion, &r_by_waiters);
    PyObject *after = before ? PyNumber_Add(before, retired) : NULL;
    Py_XDECREF(before);
    Py_DECREF(retired);
    if (after == NULL || store_slot(completion, &r_by_waiters, after) < 0) goto out;
    if ((state = read_slot(sub, &r_sub_state)) == NULL) goto out;
    Py_DECREF(state);
    result = state != g_in_flight_state ? settled(sub) : Py_NewRef(g_again);
out:
    Py_DECREF(marker);
    Py_XDECREF(driver);
    Py_XDECREF(poll_marker);
    Py_XDECREF(p);
    Py_XDECREF(done);
    Py_XDECREF(now);
    return result;
}

/* configure_scan(env): once per process, after configure(). */
PyObject *configure_scan(PyObject *module, PyObject *env) {
    if (!PyDict_Check(env)) {
        PyErr_SetString(PyExc_TypeError, "configure_scan: expected a dict");
        return NULL;
    }
    if (!g_configured || g_scan_ready) {
        PyErr_SetString(PyExc_RuntimeError, "configure_scan: once per process, after configure()");
        return NULL;
    }
    PyObject *mod, *stream_type, *sub_type, *table_type;
    if (take(env, "Completion", (PyObject **)&t_completion) < 0 || take(env, "HostStep", (PyObject **)&t_host_step) < 0 ||
        take(env, "Stream", &stream_type) < 0 || take(env, "Submission", &sub_type) < 0 ||
        take(env, "MemoryTable", &table_type) < 0 || take(env, "Poll", &g_poll_type) < 0 ||
        take(env, "PENDING", &g_pending_state) < 0 || take(env, "DONE", &g_done_state) < 0 ||
        take(env, "UNKNOWN", &g_unknown_state) < 0 || take(env, "IN_FLIGHT", &g_in_flight_state) < 0 ||
        take(env, "AGAIN", &g_again) < 0 || take(env, "SETTLED", &g_settled) < 0 ||
        take(env, "RUN_CONTEXT", &g_run_context) < 0 || take(env, "PENDING_POLL", &g_pending_poll) < 0 || take(env, "completion_module", &mod) < 0 ||
        take(env, "flush", &g_flush_fn) < 0)
        return NULL;
    if (!PyType_Check(t_completion) || !PyType_Check(t_host_step) || !PyType_Check(g_poll_type)) {
        PyErr_SetString(PyExc_TypeError, "configure_scan: Completion, HostStep and Poll must be types");
        return NULL;
    }
    if ((g_completion_globals = PyModule_GetDict(mod)) == NULL) return NULL;
    Py_INCREF(g_completion_globals);
    PyObject *tp_c = (PyObject *)t_completion;
    struct {
        PyObject *type;
        const char *name;
        SlotRef *ref;
    } refs[] = {{tp_c, "unflushed", &r_unflushed},          {tp_c, "memory", &r_memory},
                {tp_c, "driver", &r_driver},                {tp_c, "streams", &r_streams},
                {table_type, "gc_releases", &r_gc_releases}, {stream_type, "_pending", &r_pending},
                {sub_type, "marker", &r_sub_marker},         {g_poll_type, "state", &r_poll_state},
                {stream_type, "_unmarked", &r_unmarked},     {sub_type, "state", &r_sub_state},
                {tp_c, "host_steps", &r_host_steps},         {tp_c, "completed", &r_completed},
                {tp_c, "by_waiters", &r_by_waiters},         {sub_type, "error", &r_sub_error},
                {sub_type, "output", &r_sub_output},         {sub_type, "stream", &r_sub_stream}};
    for (size_t i = 0; i < sizeof(refs) / sizeof(refs[0]); i++)
        if (make_slot_ref(refs[i].type, refs[i].name, refs[i].ref) < 0) return NULL;
    if (intern(&n_flush_all, "flush_all") < 0 || intern(&n_unconsumed, "UNCONSUMED") < 0 ||
        intern(&n_sweep, "sweep_dropped") < 0 || intern(&n_release_pending, "release_pending") < 0 ||
        intern(&n_poll_marker, "poll_marker") < 0 || intern(&n_popleft, "popleft") < 0 ||
        intern(&n_run_host_step, "run_host_step") < 0 || intern(&n_retire_done, "retire_done") < 0 ||
        intern(&n_retire, "retire") < 0 || intern(&n_scan_streams, "scan_streams") < 0 ||
        intern(&n_scan, "scan") < 0 || intern(&n_flush, "flush") < 0 || intern(&n_runner, "runner") < 0 ||
        intern(&n_runq, "runq") < 0 || intern(&n_handle, "handle") < 0 ||
        intern(&n_record_marker, "record_marker") < 0 ||
        intern(&n_quarantine_submission, "quarantine_submission") < 0 || intern(&n_extend, "extend") < 0)
        return NULL;
    g_scan_ready = 1;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ begin */

static PyObject *g_scope_globals, *n_b_task, *n_b_left, *n_b_submit_launch, *n_b_prepare, *n_b_look;

static int begin_names(void) {
    return intern(&n_b_task, "task") < 0 || intern(&n_b_left, "left") < 0 ||
                   intern(&n_b_submit_launch, "submit_launch") < 0 || intern(&n_b_prepare, "prepare") < 0 ||
                   intern(&n_b_look, "look") < 0
               ? -1
               : 0;
}

/* Whether the scope module's global ``name`` is this module's function ``fn``. */
static int is_ours(PyObject *name, PyCFunction fn) {
    PyObject *f = PyDict_GetItemWithError(g_scope_globals, name); /* (borrowed) */
    return f != NULL && PyCFunction_Check(f) && PyCFunction_GET_FUNCTION(f) == fn;
}

/* The slots may_begin reads, found on first use from the objects' types
   (read_slot falls back to getattr for any other type; a field that is
   not a slot is always read through getattr). */
enum {
    B_FUNCTIONS, B_KERNELS, B_EXTENSIONS, B_CLOSING, B_ENQUEUING, B_THREAD, B_COMPLETION, /* the scope's */
    B_LOAD_IN_THREAD, B_TILE, B_EXPORTS_RELEASING,                                        /* others' */
    B_CANCEL_STATUS, B_RUNNER, B_CANCEL_POINTS, B_EFFECTIVELY_CANCELLED, B_MAIN_TASK, B_KI_PENDING, /* Trio's */
    N_B
};
static SlotRef b_ref[N_B];
static int b_made[N_B];

/* Slot ``i`` (named ``name``) of ``obj``, a new reference; NULL (error set). */
static PyObject *b_read(PyObject *obj, int i, const char *name) {
    if (!b_made[i]) {
        if (make_slot_ref((PyObject *)Py_TYPE(obj), name, &b_ref[i]) < 0) {
            PyErr_Clear();
            b_ref[i].type = NULL; /* (not a slot: getattr) */
            if ((b_ref[i].name = PyUnicode_InternFromString(name)) == NULL) return NULL;
        }
        b_made[i] = 1;
    }
    return read_slot(obj, &b_ref[i]);
}

/* Slot ``i`` of ``obj``, truthy: 1, 0, or -1 (error set). */
static int b_true(PyObject *obj, int i, const char *name) {
    PyObject *v = b_read(obj, i, name);
    if (v == NULL) return -1;
    int yes = PyObject_IsTrue(v);
    Py_DECREF(v);
    return yes;
}

/* In cancel_point and may_begin: decline where ``cond`` is nonzero (or -1). */
#define NO_IF(cond)                 \
    do {                            \
        int x_ = (cond);            \
        if (x_ != 0) goto declined; \
    } while (0)

/* Trio's cancel point at the calling task, past its schedule point (what
   ``trio.lowlevel.checkpoint`` does after its yield, and
   ``checkpoint_if_cancelled``): 1 where no cancellation is due (the task's
   count of cancel points moved, as Trio moves it); 0 where one is due, or
   Trio's state could not be read (nothing changed, no error set: Trio's own
   function decides); -1 (error set) where the count could not be moved. */
int cancel_point(void) {
    int rc = 0;
    PyObject *v = NULL, *task = NULL, *runner = NULL;
    if (n_b_task == NULL && begin_names() < 0) goto declined;
    NO_IF(g_run_context == NULL || g_run_context == Py_None);
    NO_IF((task = PyObject_GetAttr(g_run_context, n_b_task)) == NULL);
    NO_IF((v = b_read(task, B_CANCEL_STATUS, "_cancel_status")) == NULL);
    NO_IF(b_true(v, B_EFFECTIVELY_CANCELLED, "effectively_cancelled"));
    Py_CLEAR(v);
    NO_IF((runner = b_read(task, B_RUNNER, "_runner")) == NULL || (v = b_read(runner, B_MAIN_TASK, "main_task")) == NULL);
    if (v == task) NO_IF(b_true(runner, B_KI_PENDING, "ki_pending"));
    Py_CLEAR(v);
    NO_IF((v = b_read(task, B_CANCEL_POINTS, "_cancel_points")) == NULL || !PyLong_CheckExact(v));
    PyObject *one = PyLong_FromLong(1);
    PyObject *more = one ? PyNumber_Add(v, one) : NULL;
    Py_XDECREF(one);
    rc = more == NULL || store_slot(task, &b_ref[B_CANCEL_POINTS], more) < 0 ? -1 : 1;
    goto done;
declined:
    PyErr_Clear();
done:
    Py_XDECREF(v);
    Py_XDECREF(task);
    Py_XDECREF(runner);
    return rc;
}

/* Every check ``run`` makes before it submits a lone launch, and Trio's
   ``checkpoint_if_cancelled``: 1 where all pass (*completion: the scope's
   Completion, a new reference; the task's count of cancel points moved, as
   Trio moves it), 0 where run's Python code decides (nothing changed; an
   error on the way counts as that), -1 (error set) where the count could
   not be moved. */
static int may_begin(PyObject *scope, PyObject *op, PyObject **completion) {
    int rc = 0;
    PyObject *v = NULL, *kernel, *c = NULL;
    if (g_scope_globals == NULL) {
        PyObject *name = PyUnicode_FromString("trio_cuda._core._scope");
        PyObject *m = name ? PyImport_GetModule(name) : NULL;
        Py_XDECREF(name);
        if (m == NULL) goto declined;
        g_scope_globals = Py_NewRef(PyModule_GetDict(m));
        Py_DECREF(m);
    }
    NO_IF(!is_ours(n_b_submit_launch, (PyCFunction)submit_launch) || !is_ours(n_b_prepare, (PyCFunction)prepare) ||
          !is_ours(n_b_look, (PyCFunction)look));
    PyObject *prepared = *(PyObject **)((char *)op + g_launch_off[0]);
    NO_IF(prepared == NULL || Py_TYPE(prepared) != g_prepared_type);
    kernel = *(PyObject **)((char *)prepared + g_prepared_off[0]);
    NO_IF(kernel == NULL);
    NO_IF((v = b_read(scope, B_FUNCTIONS, "_functions")) == NULL);
    int known = PyDict_CheckExact(v) ? PyDict_Contains(v, kernel) : -1;
    Py_CLEAR(v);
    NO_IF(known < 0);
    if (!known) { /* (run loads it first where the scope loads in a thread, or a tile kernel) */
        NO_IF((v = b_read(scope, B_KERNELS, "_kernels")) == NULL);
        NO_IF(b_true(v, B_LOAD_IN_THREAD, "load_in_thread"));
        Py_CLEAR(v);
        NO_IF((v = b_read(kernel, B_TILE, "tile")) == NULL || v != Py_None);
        Py_CLEAR(v);
    }
    NO_IF((v = b_read(scope, B_EXTENSIONS, "_extensions")) == NULL);
    NO_IF(b_true(v, B_EXPORTS_RELEASING, "exports_releasing"));
    Py_CLEAR(v);
    NO_IF(b_true(scope, B_CLOSING, "_closing") || b_true(scope, B_ENQUEUING, "_enqueuing"));
    NO_IF((v = b_read(scope, B_THREAD, "_thread")) == NULL || !PyLong_CheckExact(v) ||
          PyLong_AsUnsignedLong(v) != PyThread_get_thread_ident());
    Py_CLEAR(v);
    NO_IF((c = b_read(scope, B_COMPLETION, "_completion")) == NULL || Py_TYPE(c) != t_completion);
    /* trio.lowlevel.checkpoint_if_cancelled, where it would not checkpoint */
    int point = cancel_point();
    if (point < 0) {
        rc = -1;
        goto done;
    }
    NO_IF(!point);
    *completion = Py_NewRef(c);
    rc = 1;
    goto done;
declined:
    PyErr_Clear();
done:
    Py_XDECREF(v);
    Py_XDECREF(c);
    return rc;
}

#undef NO_IF

/* begin(scope, op, stream): what ``ResourceScope.run`` does for a lone
   launch up to its first checkpoint, where every check it makes first
   passes (see may_begin): the submission (``submit_launch``) and an
   awaiting task's first step (``prepare``; should that raise,
   ``completion.left(sub, exc)`` first, as run does). The Submission, or
   None: run's Python code decides (a cancellation due included: it raises
   it). Its caller is KI-protected. */
PyObject *begin(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "begin(scope, op, stream)");
        return NULL;
    }
    if (!g_scan_ready || !g_configured || Py_TYPE(args[1]) != g_launch_type) Py_RETURN_NONE;
    if (n_b_look == NULL && begin_names() < 0) return NULL;
    PyObject *c = NULL;
    int may = may_begin(args[0], args[1], &c);
    if (may <= 0) return may < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *sub = submit_launch(module, args, 3);
    if (sub == NULL) {
        Py_DECREF(c);
        return NULL;
    }
    PyObject *pa[2] = {c, sub};
    PyObject *r = prepare(module, pa, 2);
    if (r == NULL) {
        PyObject *exc = take_raised();
        PyObject *left = PyObject_CallMethodObjArgs(c, n_b_left, sub, exc, NULL);
        if (left == NULL) { /* (the new error, with the first as its context) */
            PyObject *later = take_raised();
            PyException_SetContext(later, exc); /* (steals exc) */
            PyErr_SetObject((PyObject *)Py_TYPE(later), later);
            Py_DECREF(later);
        } else {
            Py_DECREF(left);
            PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
            Py_DECREF(exc);
        }
        Py_DECREF(sub);
        Py_DECREF(c);
        return NULL;
    }
    Py_DECREF(r);
    Py_DECREF(c);
    return sub;
}

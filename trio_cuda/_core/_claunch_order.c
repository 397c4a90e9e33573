/* Cross-stream conflicts of a launch's leases, ordered in C (part of
   trio_cuda._core._claunch): the step of ``take_whole`` that
   ``_submit._order_conflicts`` and ``_conflict`` make in Python.

   order_in_way(scope, stream, sub, acc) is called by take_whole for a
   simple lease plan (whole allocations, each once) whose arrays it found
   usable, where some lease of another stream is in the way (a writer of an
   allocation the launch touches, or a reader of one it writes). It returns
   1 once the device-side waits are issued (the caller then records the
   leases), 0 where the Python path must decide, -1 with an error set.

   Invariants:
   - It does what the Python fast path does, in its order: the leases in the
     way are collected access by access (writers, then readers of a write);
     each in turn is skipped once it is already waited for or no longer in
     flight; an unmarked one has its stream's marker recorded
     (``completion.flush``, in C where _claunch_scan.c makes its steps), a marked one is polled and skipped once
     complete; the waits are issued in the order they were first found
     (``driver.wait_marker``), and ``sub.dirty`` is set after the last.
   - It declines (0) before anything changes wherever the Python path would
     leave the fast path: ``conflicts`` other than "order", a traced scope,
     exported or quarantined work in the way, or work of another scope.
     Where a completion cannot be established on the way (a marker that
     could not be recorded, work quarantined by that, a poll that says
     unknown) it raises the Python path's error, made by the same function
     (``_submit._unknown``), with nothing enqueued. Nothing else changes
     before the waits are issued.
   - The Python code it calls is the completion's ``flush`` and the
     driver's ``poll_marker`` and ``wait_marker``; an error out of them is
     raised as it is, as from the Python path. */

#include "_claunch.h"

static int g_order_ready;
static PyObject *g_in_flight_state, *g_exported, *g_quarantined, *g_pending, *g_unknown, *g_order, *g_unknown_fn;
static PyObject *n_conflicts, *n_tracer, *n_driver, *n_completion, *n_handle, *n_state, *n_scope, *n_marker,
    *n_stream, *n_dirty, *n_poll, *n_wait, *n_alloc, *n_extent, *n_writers, *n_readers;

/* Append to ``out`` an (arr, key) pair for each key of the dict ``table``
   on another stream than ``stream``: 0, or -1. */
static int collect(PyObject *table, PyObject *stream, PyObject *arr, PyObject *out) {
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    if (!PyDict_CheckExact(table) || PyDict_GET_SIZE(table) == 0) return 0;
    while (PyDict_Next(table, &pos, &key, &value)) {
        PyObject *s = fast_getattr(key, n_stream);
        if (s == NULL) return -1;
        int other = s != stream;
        Py_DECREF(s);
        if (other) {
            PyObject *pair = PyTuple_Pack(2, arr, key);
            int rc = pair ? PyList_Append(out, pair) : -1;
            Py_XDECREF(pair);
            if (rc < 0) return -1;
        }
    }
    return 0;
}

/* The leases in the way, in the Python path's order: a new list of
   (the launch's array, the submission holding the lease), or NULL. */
static PyObject *in_way(PyObject *stream, const Accesses *acc) {
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    Py_ssize_t pos = 0;
    PyObject *arr, *access;
    while (accesses_next(acc, &pos, &arr, &access)) {
        PyObject *alloc = fast_getattr(arr, n_alloc);
        PyObject *ext = alloc ? fast_getattr(arr, n_extent) : NULL;
        PyObject *table = NULL;
        int rc = -1;
        if (ext == NULL) goto next;
        if (!PyTuple_CheckExact(ext) || PyTuple_GET_SIZE(ext) == 0) { /* (touches nothing) */
            rc = 0;
            goto next;
        }
        if ((table = fast_getattr(alloc, n_writers)) == NULL || collect(table, stream, arr, out) < 0) goto next;
        Py_CLEAR(table);
        if (access == g_write && ((table = fast_getattr(alloc, n_readers)) == NULL || collect(table, stream, arr, out) < 0))
            goto next;
        rc = 0;
    next:
        Py_XDECREF(alloc);
        Py_XDECREF(ext);
        Py_XDECREF(table);
        if (rc < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

/* 1 if ``obj`` is one of the list's items (identity), else 0. */
static int holds(PyObject *list, PyObject *obj) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++)
        if (PyList_GET_ITEM(list, i) == obj) return 1;
    return 0;
}

/* Raise what ``_submit._unknown`` makes for ``arr`` and ``other`` (the
   Python path's error where completion of work in the way cannot be
   established): -1. */
static int raise_unknown(PyObject *sub, PyObject *arr, PyObject *other) {
    static const char *path[] = {"op", "prepared", "kernel", "name"};
    PyObject *what = sub, *exc;
    Py_INCREF(what);
    for (size_t i = 0; i < sizeof(path) / sizeof(path[0]) && what != NULL; i++) {
        PyObject *next = PyObject_GetAttrString(what, path[i]);
        Py_DECREF(what);
        what = next;
    }
    if (what == NULL) return -1;
    PyObject *argv[3] = {what, arr, other};
    exc = pcall(g_unknown_fn, argv, 3);
    Py_DECREF(what);
    if (exc == NULL) return -1;
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
    return -1;
}

int order_in_way(PyObject *scope, PyObject *stream, PyObject *sub, const Accesses *acc) {
    if (!g_order_ready) return 0;
    int rc = 0;
    PyObject *v = NULL, *found = NULL, *waits = NULL, *driver = NULL, *completion = NULL, *marker = NULL;
    PyObject *other = NULL, *r = NULL;
    /* 1. what makes the Python path leave its fast path, before anything changes */
    FAIL_IF_NULL(v = fast_getattr(scope, n_conflicts));
    if (v != g_order) {
        int eq = PyUnicode_Check(v) ? PyUnicode_Compare(v, g_order) : 1;
        if (eq == -1 && PyErr_Occurred()) {
            rc = -1;
            goto done;
        }
        DECLINE_IF(eq != 0);
    }
    Py_CLEAR(v);
    FAIL_IF_NULL(v = fast_getattr(scope, n_tracer));
    DECLINE_IF(v != Py_None);
    Py_CLEAR(v);
    FAIL_IF_NULL(found = in_way(stream, acc));
    Py_ssize_t n = PyList_GET_SIZE(found);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *c = PyTuple_GET_ITEM(PyList_GET_ITEM(found, i), 1);
        FAIL_IF_NULL(v = fast_getattr(c, n_state));
        DECLINE_IF(v == g_exported || v == g_quarantined);
        Py_CLEAR(v);
        FAIL_IF_NULL(v = fast_getattr(c, n_scope));
        DECLINE_IF(v != scope);
        Py_CLEAR(v);
    }
    /* 2. each in turn: skipped, marked (its stream flushed) or polled */
    FAIL_IF_NULL(waits = PyList_New(0));
    FAIL_IF_NULL(driver = fast_getattr(scope, n_driver));
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *arr = PyTuple_GET_ITEM(PyList_GET_ITEM(found, i), 0);
        PyObject *c = PyTuple_GET_ITEM(PyList_GET_ITEM(found, i), 1);
        FAIL_IF_NULL(v = fast_getattr(c, n_state));
        if (v == g_quarantined) { /* (an earlier flush failed) */
            rc = raise_unknown(sub, arr, c);
            goto done;
        }
        int skip = v != g_in_flight_state || holds(waits, c);
        Py_CLEAR(v);
        if (skip) continue;
        FAIL_IF_NULL(marker = fast_getattr(c, n_marker));
        if (marker == Py_None) {
            if (completion == NULL) FAIL_IF_NULL(completion = fast_getattr(scope, n_completion));
            FAIL_IF_NULL(other = fast_getattr(c, n_stream));
            if (flush_stream(completion, other) < 0) { /* (_claunch_scan.c: Completion.flush's steps) */
                rc = -1;
                goto done;
            }
            Py_CLEAR(other);
            Py_CLEAR(marker);
            FAIL_IF_NULL(marker = fast_getattr(c, n_marker));
            if (marker == Py_None) { /* recording it failed: quarantined */
                rc = raise_unknown(sub, arr, c);
                goto done;
            }
        } else {
            FAIL_IF_NULL(r = pmethod(driver, n_poll, &marker, 1));
            FAIL_IF_NULL(v = fast_getattr(r, n_state));
            Py_CLEAR(r);
            if (v == g_unknown) { /* (not quarantined yet, but it will be) */
                rc = raise_unknown(sub, arr, c);
                goto done;
            }
            int pending = v == g_pending;
            Py_CLEAR(v);
            if (!pending) { /* completed: it is retired soon */
                Py_CLEAR(marker);
                continue;
            }
        }
        Py_CLEAR(marker);
        if (PyList_Append(waits, c) < 0) {
            rc = -1;
            goto done;
        }
    }
    /* 3. the waits, in the order found */
    n = PyList_GET_SIZE(waits);
    if (n) {
        FAIL_IF_NULL(v = fast_getattr(stream, n_handle));
        for (Py_ssize_t i = 0; i < n; i++) {
            FAIL_IF_NULL(marker = fast_getattr(PyList_GET_ITEM(waits, i), n_marker));
            FAIL_IF_NULL(r = pmethod(driver, n_wait, (PyObject *[]){v, marker}, 2));
            Py_CLEAR(r);
            Py_CLEAR(marker);
        }
        if (fast_setattr(sub, n_dirty, Py_True) < 0) {
            rc = -1;
            goto done;
        }
    }
    rc = 1;
done:
    Py_XDECREF(v);
    Py_XDECREF(found);
    Py_XDECREF(waits);
    Py_XDECREF(driver);
    Py_XDECREF(completion);
    Py_XDECREF(marker);
    Py_XDECREF(other);
    Py_XDECREF(r);
    return rc;
}

/* configure_order({...}): the states and names order_in_way compares with
   (once per process, by _submit.py). */
PyObject *configure_order(PyObject *module, PyObject *env) {
    if (!PyDict_Check(env)) {
        PyErr_SetString(PyExc_TypeError, "configure_order: expected a dict");
        return NULL;
    }
    if (!g_configured || g_order_ready) {
        PyErr_SetString(PyExc_RuntimeError, "configure_order: once per process, after configure()");
        return NULL;
    }
    if (take(env, "IN_FLIGHT", &g_in_flight_state) < 0 || take(env, "EXPORTED", &g_exported) < 0 ||
        take(env, "QUARANTINED", &g_quarantined) < 0 || take(env, "PENDING", &g_pending) < 0 ||
        take(env, "UNKNOWN", &g_unknown) < 0 || take(env, "_unknown", &g_unknown_fn) < 0)
        return NULL;
    struct {
        PyObject **out;
        const char *name;
    } names[] = {{&g_order, "order"},       {&n_conflicts, "_conflicts"}, {&n_tracer, "_tracer"},
                 {&n_driver, "_driver"},    {&n_completion, "_completion"}, {&n_handle, "handle"},
                 {&n_state, "state"},       {&n_scope, "scope"},        {&n_marker, "marker"},
                 {&n_stream, "stream"},     {&n_dirty, "dirty"},
                 {&n_poll, "poll_marker"},  {&n_wait, "wait_marker"},   {&n_alloc, "_alloc"},
                 {&n_extent, "_extent"},    {&n_writers, "writers"},    {&n_readers, "readers"}};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (intern(names[i].out, names[i].name) < 0) return NULL;
    g_order_ready = 1;
    Py_RETURN_NONE;
}

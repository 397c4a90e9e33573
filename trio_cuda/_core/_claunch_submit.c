/* A lone kernel launch submitted (part of trio_cuda._core._claunch).

   submit_launch(scope, op, stream) does what ResourceScope._submit_launch
   (trio_cuda/_core/_scope.py) does for an untraced scope, step for step and
   in its order:
   1. the stream: ``stream`` itself when it is one of the scope's, else the
      policy's choice (``policy.choose``; the least-loaded stream, compiled,
      where the default policies would find it), else ``scope._pick`` (which raises
      the reference's errors);
   2. the loaded function: the launch's ``ready`` pair when it is this
      scope's; for a fresh launch of the shape its kernel was last checked
      in (a SIMT kernel, or a tile specialisation whose check does not run
      per launch), the loaded function, kept as ``ready`` (what
      ``KernelTable.function_for`` does then); else that method;
   3. the next id, and the Submission, made as its __init__ makes it;
   4. the leases, as ``take_launch_leases`` takes them: ``take_whole`` (the
      _submit module's, where its fast path is on), else
      ``take_launch_leases_rest``; or the _scope module's
      ``take_launch_leases`` itself, where it was replaced (a test's);
   5. ``driver.launch``; if it raises, the submission keeps the error,
      counts as observed and is finished behind a marker
      (``completion.finish(sub, None)``), and the error is raised;
   6. what ``Completion.launched`` does: the submission in flight, the
      counters, the unmarked list, a marker where markers are not batched
      (``completion.flush``), and ``driver.notify_submitted()``.
   In a traced scope, the device's time mark is taken before the launch
   where the trace takes them, an error is recorded (``trace_error``), and
   the launch is recorded (``trace_submit``; compiled by submit_record in
   _claunch_trace.c where it can be) before its marker and the driver's
   notice (``Completion.submitted``'s steps). The Python code called here (the policy, the
   function table, the general lease path, the driver, the trace) runs under
   the caller's KI protection, or, in a frameless ``submit``, through the
   protected trampoline (pcall, pmethod, pgetattr: _claunch_protect.c). */

#include "_claunch.h"

static int g_submit_ready;
static PyTypeObject *t_scope, *t_stream, *t_sub, *t_future;
static Py_ssize_t future_sub_off; /* DeviceFuture's _sub */
static SlotRef r_sc_functions, r_sc_kernels, r_sc_next_id, r_sc_driver, r_sc_completion, r_sc_policy,
    r_sc_streams, r_sc_tracer, r_sc_trace_timing, r_sc_closing, r_sc_thread;
static SlotRef r_st_scope, r_st_handle, r_st_in_flight, r_st_unmarked;
static SlotRef r_c_in_flight, r_c_unflushed, r_c_batch, r_c_driver;
static SlotRef r_sub_error, r_sub_observed, r_sub_dirty, r_sub_output, r_sub_state;
static GlobalMemo m_tll, m_fast, m_take_whole, m_submit_launch; /* (global_of: these sites' names) */
static SlotRef r_kt_last, r_kt_functions, r_kt_ready, r_kt_hot, r_k_tile;
enum { N_SUB = 15 };
static const char *const sub_names[N_SUB] = {"scope",  "stream", "id",       "op",       "state",
                                             "marker", "owners", "finishers", "leases",  "error",
                                             "observed", "output", "waiter",  "dirty",   "unknown"};
static Py_ssize_t sub_off[N_SUB];
static PyObject *g_enqueuing, *g_in_flight, *g_empty, *g_tll, *g_scope_globals, *g_submit_globals;
static PyObject *n_submit_launch, *n_py_submit_launch, *n_py_submit, *n_submit, *n_set, *n_watch;
static SlotRef r_sc_enqueuing, r_c_idle;
static PyObject *n_accesses, *n_tll, *n_fast, *n_take_whole, *n_rest, *n_pick, *n_check_choice, *n_choose, *n_function_for, *n_launch,
    *n_finish, *n_flush, *n_notify, *n_per_launch, *n_check_open, *n_async_on, *g_enqueue_py, *n_trace_error, *n_trace_submit, *n_timing_mark;

static PyTypeObject *t_follow, *t_least;
static PyObject *g_follow_choose, *g_least_choose;
static SlotRef r_al_writers;

/* The in-flight count of stream ``s`` into *out: 1, or 0 (not an exact int; no error set). */
static int load_of(PyObject *s, long *out) {
    PyObject *v = read_slot(s, &r_st_in_flight);
    if (v == NULL) {
        PyErr_Clear();
        return 0;
    }
    int ok = PyLong_CheckExact(v);
    *out = ok ? PyLong_AsLong(v) : 0;
    Py_DECREF(v);
    if (ok && *out == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        ok = 0;
    }
    return ok;
}

/* The default policies' choice where it is the least-loaded stream, while
   their classes hold their own ``choose``: ``LeastLoaded``'s always, and
   ``FollowWriter``'s for a kernel launch none of whose allocations has a
   writer in flight (as its loop finds none). The stream (a new reference),
   or NULL with no error set: the policy's method chooses. Read only. */
static PyObject *least_loaded_choice(PyObject *policy, PyObject *streams, PyObject *op) {
    PyTypeObject *tp = Py_TYPE(policy);
    PyObject *own = tp == t_follow ? g_follow_choose : tp == t_least ? g_least_choose : NULL;
    if (own == NULL) return NULL;
    if (!class_holds(tp, n_choose, own)) return NULL;
    if (tp == t_follow) {
        Accesses acc;
        if (Py_TYPE(op) != g_launch_type || !launch_accesses(op, &acc)) return NULL;
        Py_ssize_t pos = 0;
        PyObject *arr, *access;
        while (accesses_next(&acc, &pos, &arr, &access)) {
            if (Py_TYPE(arr) != g_array_type) return NULL;
            PyObject *alloc = read_slot(arr, &g_slot[A_ALLOC]);
            PyObject *writers = alloc ? read_slot(alloc, &r_al_writers) : NULL;
            Py_XDECREF(alloc);
            int some = writers ? PyObject_IsTrue(writers) : -1;
            Py_XDECREF(writers);
            if (some != 0) {
                PyErr_Clear();
                return NULL;
            }
        }
    }
    if (!PyTuple_CheckExact(streams) && !PyList_CheckExact(streams)) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(streams);
    if (n == 0) return NULL;
    PyObject **items = PySequence_Fast_ITEMS(streams);
    PyObject *best = items[0];
    long load, k;
    if (Py_TYPE(best) != t_stream || !load_of(best, &load)) return NULL;
    for (Py_ssize_t i = 0; load && i < n; i++) { /* (as _least_loaded: the lowest index on ties) */
        if (Py_TYPE(items[i]) != t_stream || !load_of(items[i], &k)) return NULL;
        if (k < load) {
            best = items[i];
            load = k;
        }
    }
    return Py_NewRef(best);
}

/* The stream ``op`` goes to (a new reference), as ``_pick`` chooses it. */
static PyObject *pick(PyObject *scope, PyObject *op, PyObject *stream) {
    if (Py_TYPE(stream) == t_stream) {
        PyObject *owner = read_slot(stream, &r_st_scope);
        if (owner == NULL) return NULL;
        Py_DECREF(owner);
        if (owner == scope) {
            Py_INCREF(stream);
            return stream;
        }
    }
    if (stream != Py_None) return pmethod(scope, n_pick, (PyObject *[]){op, stream}, 2);
    PyObject *policy = read_slot(scope, &r_sc_policy);
    PyObject *streams = policy ? read_slot(scope, &r_sc_streams) : NULL;
    PyObject *chosen = streams ? least_loaded_choice(policy, streams, op) : NULL;
    if (chosen == NULL && streams != NULL) chosen = pmethod(policy, n_choose, (PyObject *[]){streams, op}, 2);
    Py_XDECREF(policy);
    Py_XDECREF(streams);
    if (chosen == NULL) return NULL;
    if (Py_TYPE(chosen) == t_stream) {
        PyObject *owner = read_slot(chosen, &r_st_scope);
        if (owner == NULL) {
            Py_DECREF(chosen);
            return NULL;
        }
        Py_DECREF(owner);
        if (owner == scope) return chosen;
    }
    PyObject *checked = pmethod(scope, n_check_choice, &chosen, 1); /* (raises the reason) */
    Py_DECREF(chosen);
    return checked;
}

/* A fresh SIMT launch of the shape its kernel was last checked in, whose
   kernel is loaded: its function (a new reference), kept on the launch as
   ``KernelTable.function_for`` keeps it; NULL, with no error set and
   nothing changed, where that method must decide; NULL, error set, on an
   error. */
static PyObject *last_checked(PyObject *kernels, PyObject *prepared) {
    PyObject *kernel = *(PyObject **)((char *)prepared + g_prepared_off[0]);
    PyObject *config = *(PyObject **)((char *)prepared + g_prepared_off[1]);
    PyObject *plan = *(PyObject **)((char *)prepared + g_prepared_off[2]);
    if (kernel == NULL || config == NULL || plan == NULL || Py_TYPE(kernels) != r_kt_last.type ||
        Py_TYPE(kernel) != r_k_tile.type)
        return NULL;
    PyObject *tile = read_slot(kernel, &r_k_tile);
    if (tile == NULL) return NULL;
    if (tile != Py_None) { /* (a tile launch with lists has them prepared by its check: per launch) */
        PyObject *per_launch = pgetattr(tile, n_per_launch);
        Py_DECREF(tile);
        int yes = per_launch ? PyObject_IsTrue(per_launch) : -1;
        Py_XDECREF(per_launch);
        if (yes) return NULL; /* (-1: the error is set) */
    } else {
        Py_DECREF(tile);
    }
    PyObject *hot = read_slot(kernels, &r_kt_hot);
    if (hot == NULL) return NULL;
    if (PyTuple_CheckExact(hot) && PyTuple_GET_SIZE(hot) == 4 && PyTuple_GET_ITEM(hot, 0) == kernel &&
        PyTuple_GET_ITEM(hot, 1) == config && PyTuple_GET_ITEM(hot, 2) == plan) {
        /* what the lookups below gave last, for this same shape (any change to the tables resets it) */
        PyObject *ready = PyTuple_GET_ITEM(hot, 3);
        PyObject *fn = Py_NewRef(PyTuple_GET_ITEM(ready, 1));
        PyObject **at = (PyObject **)((char *)prepared + g_prepared_off[7]);
        PyObject *old = *at;
        *at = Py_NewRef(ready);
        Py_XDECREF(old);
        Py_DECREF(hot);
        return fn;
    }
    Py_DECREF(hot);
    PyObject *table = read_slot(kernels, &r_kt_last);
    if (table == NULL) return NULL;
    PyObject *functions = read_slot(kernels, &r_kt_functions);
    if (functions == NULL) {
        Py_DECREF(table);
        return NULL;
    }
    PyObject *fn = NULL, *pairs = NULL;
    if (PyDict_CheckExact(table) && PyDict_CheckExact(functions)) {
        PyObject *last = PyDict_GetItemWithError(table, kernel); /* (borrowed) */
        if (last != NULL && PyTuple_CheckExact(last) && PyTuple_GET_SIZE(last) == 2 &&
            PyTuple_GET_ITEM(last, 0) == config && PyTuple_GET_ITEM(last, 1) == plan &&
            (pairs = read_slot(kernels, &r_kt_ready)) != NULL && PyDict_CheckExact(pairs)) {
            fn = PyDict_GetItemWithError(functions, kernel); /* (borrowed) */
            /* the kernel's shared (functions, fn) pair, as function_for keeps it */
            PyObject *ready = fn ? PyDict_GetItemWithError(pairs, kernel) : NULL; /* (borrowed) */
            if (ready != NULL && PyTuple_CheckExact(ready) && PyTuple_GET_SIZE(ready) == 2 &&
                PyTuple_GET_ITEM(ready, 0) == functions && PyTuple_GET_ITEM(ready, 1) == fn) {
                Py_INCREF(ready);
            } else if (fn != NULL && !PyErr_Occurred()) {
                ready = PyTuple_Pack(2, functions, fn);
                if (ready != NULL && PyDict_SetItem(pairs, kernel, ready) < 0) Py_CLEAR(ready);
            } else {
                ready = NULL;
            }
            if (ready == NULL) {
                fn = NULL;
            } else {
                PyObject **at = (PyObject **)((char *)prepared + g_prepared_off[7]);
                PyObject *old = *at;
                *at = ready;
                Py_XDECREF(old);
                Py_INCREF(fn);
                PyObject *memo = PyTuple_Pack(4, kernel, config, plan, ready);
                if (memo == NULL || store_slot(kernels, &r_kt_hot, memo) < 0) { /* (store_slot takes it) */
                    Py_CLEAR(fn);
                }
            }
        }
    }
    Py_DECREF(table);
    Py_DECREF(functions);
    Py_XDECREF(pairs);
    return fn;
}

/* The loaded function ``prepared`` launches (a new reference). */
static PyObject *function_for(PyObject *scope, PyObject *prepared) {
    PyObject *functions = read_slot(scope, &r_sc_functions);
    if (functions == NULL) return NULL;
    PyObject *kernels = NULL, *fn = NULL;
    if (Py_TYPE(prepared) == g_prepared_type) {
        PyObject *ready = *(PyObject **)((char *)prepared + g_prepared_off[7]);
        if (ready != NULL && PyTuple_CheckExact(ready) && PyTuple_GET_SIZE(ready) == 2 &&
            PyTuple_GET_ITEM(ready, 0) == functions) {
            fn = PyTuple_GET_ITEM(ready, 1);
            Py_INCREF(fn);
            goto done;
        }
    }
    if ((kernels = read_slot(scope, &r_sc_kernels)) == NULL) goto done;
    if (Py_TYPE(prepared) == g_prepared_type) {
        fn = last_checked(kernels, prepared);
        if (fn != NULL || PyErr_Occurred()) goto done;
    }
    fn = pmethod(kernels, n_function_for, &prepared, 1);
done:
    Py_DECREF(functions);
    Py_XDECREF(kernels);
    return fn;
}

/* Step 4: 0, or -1 (error set). */
static int take_leases(PyObject *scope, PyObject *s, PyObject *sub, PyObject *op) {
    PyObject *tll = global_of(g_scope_globals, n_tll, &m_tll); /* (borrowed) */
    if (tll == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "submit_launch: take_launch_leases is gone");
        return -1;
    }
    Py_INCREF(tll);
    int rc = -1;
    PyObject *plan = NULL, *r = NULL;
    if (tll == g_tll) { /* (what it does, without its frame; a patched one runs itself) */
        PyObject *fast = global_of(g_submit_globals, n_fast, &m_fast);
        if (fast == NULL && PyErr_Occurred()) goto done;
        plan = *(PyObject **)((char *)op + g_launch_off[2]); /* (op is of the exact type) */
        Py_XINCREF(plan);
        PyObject *simple = *(PyObject **)((char *)op + g_launch_off[4]);
        if (fast == Py_True && plan != NULL && PyTuple_CheckExact(plan) && simple != NULL) {
            PyObject *allocs = plan;
            PyObject *tw = global_of(g_submit_globals, n_take_whole, &m_take_whole);
            if (tw == NULL && PyErr_Occurred()) goto done;
            if (simple == Py_True && tw != NULL && tw != Py_None) {
                Accesses acc;
                int yes;
                if (PyCFunction_Check(tw) && PyCFunction_GET_FUNCTION(tw) == (PyCFunction)(void (*)(void))take_whole &&
                    launch_accesses(op, &acc)) {
                    yes = take_whole_c(scope, s, sub, &acc, allocs); /* (what it does, without the call) */
                } else { /* (a patched one, or accesses of another form: given the pairs, as Python would) */
                    PyObject *accesses = pgetattr(op, n_accesses);
                    if (accesses == NULL) goto done;
                    Py_INCREF(tw);
                    PyObject *argv[5] = {scope, s, sub, accesses, allocs};
                    PyObject *took = pcall(tw, argv, 5);
                    Py_DECREF(tw);
                    Py_DECREF(accesses);
                    yes = took ? PyObject_IsTrue(took) : -1;
                    Py_XDECREF(took);
                }
                if (yes < 0) goto done;
                if (yes) {
                    rc = 0;
                    goto done;
                }
            }
            PyObject *rest = PyDict_GetItemWithError(g_submit_globals, n_rest);
            if (rest == NULL) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "submit_launch: take_launch_leases_rest is gone");
                goto done;
            }
            Py_INCREF(rest);
            PyObject *argv[6] = {scope, s, sub, op, allocs, simple};
            r = pcall(rest, argv, 6);
            Py_DECREF(rest);
            if (r != NULL) rc = 0;
            goto done;
        }
    }
    PyObject *argv[4] = {scope, s, sub, op};
    r = pcall(tll, argv, 4);
    if (r != NULL) rc = 0;
done:
    Py_DECREF(tll);
    Py_XDECREF(plan);
    Py_XDECREF(r);
    return rc;
}

/* The error now set, raised with ``value`` (stolen) as its context. */
static void chain(PyObject *value) {
    PyObject *t2, *v2, *tb2;
    PyErr_Fetch(&t2, &v2, &tb2);
    PyErr_NormalizeException(&t2, &v2, &tb2);
    if (tb2 != NULL) PyException_SetTraceback(v2, tb2);
    PyException_SetContext(v2, value);
    PyErr_Restore(t2, v2, tb2);
}

/* Step 5's error path: keep the driver's error on the submission, finish it
   behind a marker, record it where the scope is traced (``trace_error``),
   and raise the error (or what those raised, with the error as its
   context). */
static void launch_failed(PyObject *scope, PyObject *sub) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL) PyException_SetTraceback(value, tb);
    Py_INCREF(value);
    Py_INCREF(Py_True);
    PyObject *completion = read_slot(scope, &r_sc_completion);
    PyObject *r = NULL, *tracer = NULL;
    if (store_slot(sub, &r_sub_error, value) == 0 && store_slot(sub, &r_sub_observed, Py_True) == 0 &&
        completion != NULL)
        r = pmethod(completion, n_finish, (PyObject *[]){sub, Py_None}, 2);
    Py_XDECREF(completion);
    if (r != NULL) {
        Py_CLEAR(r);
        if ((tracer = read_slot(scope, &r_sc_tracer)) != NULL) {
            if (tracer == Py_None) {
                r = Py_NewRef(Py_None);
            } else {
                PyObject *fn = PyDict_GetItemWithError(g_scope_globals, n_trace_error); /* (borrowed) */
                if (fn != NULL) {
                    PyObject *argv[4] = {scope, tracer, sub, value};
                    Py_INCREF(fn);
                    r = pcall(fn, argv, 4);
                    Py_DECREF(fn);
                } else if (!PyErr_Occurred()) {
                    PyErr_SetString(PyExc_RuntimeError, "submit_launch: trace_error is gone");
                }
            }
            Py_DECREF(tracer);
        }
    }
    if (r != NULL) {
        Py_DECREF(r);
        PyErr_Restore(type, value, tb);
        return;
    }
    Py_XDECREF(type);
    Py_XDECREF(tb);
    chain(value);
}

/* Step 6 (``traced``: without the marker and the driver's notice, which
   come once the launch was recorded): 0, or -1 (error set). */
static int submitted(PyObject *completion, PyObject *s);

static int launched(PyObject *scope, PyObject *s, PyObject *sub, PyObject *op, int traced) {
    PyObject *output = *(PyObject **)((char *)op + g_launch_off[3]);
    if (output == NULL) {
        PyErr_SetString(PyExc_AttributeError, "_output");
        return -1;
    }
    Py_INCREF(Py_True);
    Py_INCREF(output);
    Py_INCREF(g_in_flight);
    if (store_slot(sub, &r_sub_dirty, Py_True) < 0 || store_slot(sub, &r_sub_output, output) < 0 ||
        store_slot(sub, &r_sub_state, g_in_flight) < 0)
        return -1;
    PyObject *completion = read_slot(scope, &r_sc_completion);
    if (completion == NULL) return -1;
    int rc = -1;
    PyObject *unmarked = NULL, *unflushed = NULL;
    if (bump(s, &r_st_in_flight, 1) < 0 || bump(completion, &r_c_in_flight, 1) < 0) goto done;
    if ((unmarked = read_slot(s, &r_st_unmarked)) == NULL) goto done;
    if (!PyList_Check(unmarked)) {
        PyErr_Format(PyExc_TypeError, "stream._unmarked: expected a list, got %.100s", Py_TYPE(unmarked)->tp_name);
        goto done;
    }
    if (PyList_GET_SIZE(unmarked) == 0) {
        if ((unflushed = read_slot(completion, &r_c_unflushed)) == NULL) goto done;
        if (!PyList_Check(unflushed)) {
            PyErr_SetString(PyExc_TypeError, "completion.unflushed: expected a list");
            goto done;
        }
        if (PyList_Append(unflushed, s) < 0) goto done;
    }
    if (PyList_Append(unmarked, sub) < 0) goto done;
    rc = traced ? 0 : submitted(completion, s);
done:
    Py_DECREF(completion);
    Py_XDECREF(unmarked);
    Py_XDECREF(unflushed);
    return rc;
}

/* ``Completion.submitted(s)``'s steps: the marker (unless batched), and the driver told. */
static int submitted(PyObject *completion, PyObject *s) {
    int rc = -1;
    PyObject *batch = NULL, *driver = NULL, *r = NULL;
    if ((batch = read_slot(completion, &r_c_batch)) == NULL) goto done;
    int batched = PyObject_IsTrue(batch);
    if (batched < 0) goto done;
    if (!batched) {
        if ((r = pmethod(completion, n_flush, &s, 1)) == NULL) goto done;
        Py_CLEAR(r);
    }
    if ((driver = read_slot(completion, &r_c_driver)) == NULL) goto done;
    static AttrMemo notify_memo;
    if ((r = pmethod_memo(driver, n_notify, NULL, 0, &notify_memo)) == NULL) goto done;
    rc = 0;
done:
    Py_XDECREF(batch);
    Py_XDECREF(driver);
    Py_XDECREF(r);
    return rc;
}

PyObject *submit_launch(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "submit_launch(scope, op, stream)");
        return NULL;
    }
    if (!g_submit_ready) {
        PyErr_SetString(PyExc_RuntimeError, "submit_launch: configure_submit() first");
        return NULL;
    }
    PyObject *scope = args[0], *op = args[1], *stream = args[2];
    if (Py_TYPE(scope) != t_scope || Py_TYPE(op) != g_launch_type) {
        PyErr_Format(PyExc_TypeError, "submit_launch: expected a ResourceScope and a KernelLaunch, got %.100s and %.100s",
                     Py_TYPE(scope)->tp_name, Py_TYPE(op)->tp_name);
        return NULL;
    }
    PyObject *tracer = read_slot(scope, &r_sc_tracer);
    if (tracer == NULL) return NULL;
    PyObject *prepared = NULL, *function = NULL, *sub = NULL, *id = NULL, *driver = NULL, *handle = NULL,
             *r = NULL, *result = NULL, *mark = NULL;
    PyObject *s = pick(scope, op, stream);
    if (s == NULL) {
        Py_DECREF(tracer);
        return NULL;
    }
    prepared = *(PyObject **)((char *)op + g_launch_off[0]);
    if (prepared == NULL) {
        PyErr_SetString(PyExc_AttributeError, "prepared");
        goto out;
    }
    Py_INCREF(prepared);
    if ((function = function_for(scope, prepared)) == NULL) goto out;
    if (bump(scope, &r_sc_next_id, 1) < 0 || (id = read_slot(scope, &r_sc_next_id)) == NULL) goto out;
    PyObject *values[N_SUB] = {scope,   s,       id,      op,      g_enqueuing, Py_None,  Py_None, Py_None,
                               g_empty, Py_None, Py_False, Py_None, Py_None,     Py_False, Py_None};
    if ((sub = new_instance(t_sub, sub_off, values, N_SUB)) == NULL) goto out;
    if (take_leases(scope, s, sub, op) < 0) goto out;
    if ((driver = read_slot(scope, &r_sc_driver)) == NULL || (handle = read_slot(s, &r_st_handle)) == NULL) goto out;
    int traced = tracer != Py_None;
    if (traced) { /* the device's time mark before the launch, where the trace takes them */
        PyObject *timing = read_slot(scope, &r_sc_trace_timing);
        int yes = timing ? PyObject_IsTrue(timing) : -1;
        Py_XDECREF(timing);
        if (yes < 0) goto out;
        mark = yes ? pmethod(driver, n_timing_mark, &handle, 1) : Py_NewRef(Py_None);
        if (mark == NULL) goto out;
    }
    static AttrMemo launch_memo;
    r = pmethod_memo(driver, n_launch, (PyObject *[]){handle, function, prepared}, 3, &launch_memo);
    if (r == NULL) {
        launch_failed(scope, sub);
        goto out;
    }
    Py_CLEAR(r);
    if (launched(scope, s, sub, op, traced) < 0) goto out;
    if (traced) { /* recorded before its marker, then the marker and the driver's notice */
        PyObject *fn = PyDict_GetItemWithError(g_scope_globals, n_trace_submit); /* (borrowed) */
        if (fn == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "submit_launch: trace_submit is gone");
            goto out;
        }
        PyObject *targv[5] = {scope, tracer, sub, op, mark};
        Py_INCREF(fn);
        int recorded = submit_record(fn, scope, tracer, sub, op, mark); /* (compiled, where it can) */
        r = recorded < 0 ? NULL : recorded ? Py_NewRef(Py_None) : pcall(fn, targv, 5);
        Py_DECREF(fn);
        if (r == NULL) goto out;
        Py_CLEAR(r);
        PyObject *completion = read_slot(scope, &r_sc_completion);
        if (completion == NULL) goto out;
        int rc = submitted(completion, s);
        Py_DECREF(completion);
        if (rc < 0) goto out;
    }
    result = sub;
    Py_INCREF(result);
out:
    Py_DECREF(tracer);
    Py_XDECREF(mark);
    Py_DECREF(s);
    Py_XDECREF(prepared);
    Py_XDECREF(function);
    Py_XDECREF(sub);
    Py_XDECREF(id);
    Py_XDECREF(driver);
    Py_XDECREF(handle);
    Py_XDECREF(r);
    return result;
}

/* enqueue_unsafe(op, stream): ``unsafe.async_on`` of a lone kernel launch,
   as the scope module's ``enqueue_unsafe_py`` does it: the scope open and
   used from its thread (else ``scope._check_open``, which raises the
   reason), the loaded function (step 2 above), the driver's launch, and the
   launch's output. No lease, owner or marker. Anything else is that
   function's. */
PyObject *enqueue_unsafe(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "enqueue_unsafe(op, stream)");
        return NULL;
    }
    if (!g_submit_ready) {
        PyErr_SetString(PyExc_RuntimeError, "enqueue_unsafe: configure_submit() first");
        return NULL;
    }
    PyObject *op = args[0], *stream = args[1];
    PyObject *scope = Py_TYPE(op) == g_launch_type && Py_TYPE(stream) == t_stream ? read_slot(stream, &r_st_scope)
                                                                                   : NULL;
    if (scope == NULL || Py_TYPE(scope) != t_scope) {
        if (PyErr_Occurred()) return NULL;
        Py_XDECREF(scope);
        return PyObject_Vectorcall(g_enqueue_py, args, 2, NULL);
    }
    PyObject *prepared = NULL, *function = NULL, *driver = NULL, *handle = NULL, *r = NULL, *result = NULL;
    PyObject *closing = read_slot(scope, &r_sc_closing);
    PyObject *thread = closing ? read_slot(scope, &r_sc_thread) : NULL;
    if (thread == NULL) goto out;
    int ok = PyObject_IsTrue(closing);
    if (ok < 0) goto out;
    ok = !ok && PyLong_CheckExact(thread) && PyLong_AsUnsignedLong(thread) == PyThread_get_thread_ident();
    if (PyErr_Occurred()) goto out;
    if (!ok && (r = PyObject_CallMethodOneArg(scope, n_check_open, n_async_on)) == NULL) goto out;
    prepared = *(PyObject **)((char *)op + g_launch_off[0]);
    if (prepared == NULL) {
        PyErr_SetString(PyExc_AttributeError, "prepared");
        goto out;
    }
    Py_INCREF(prepared);
    if ((function = function_for(scope, prepared)) == NULL) goto out;
    if ((driver = read_slot(scope, &r_sc_driver)) == NULL || (handle = read_slot(stream, &r_st_handle)) == NULL)
        goto out;
    Py_XDECREF(r);
    PyObject *argv[4] = {driver, handle, function, prepared};
    r = PyObject_VectorcallMethod(n_launch, argv, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (r == NULL) goto out;
    result = *(PyObject **)((char *)op + g_launch_off[3]);
    if (result == NULL)
        PyErr_SetString(PyExc_AttributeError, "_output");
    else
        Py_INCREF(result);
out:
    Py_DECREF(scope);
    Py_XDECREF(closing);
    Py_XDECREF(thread);
    Py_XDECREF(prepared);
    Py_XDECREF(function);
    Py_XDECREF(driver);
    Py_XDECREF(handle);
    Py_XDECREF(r);
    return result;
}

/* 1 if ``v`` (a flag, new reference, stolen) is false; 0 if true; -1 error. */
static int is_false(PyObject *v) {
    if (v == NULL) return -1;
    int truth = v == Py_False ? 0 : v == Py_True ? 1 : PyObject_IsTrue(v);
    Py_DECREF(v);
    return truth < 0 ? -1 : !truth;
}

/* submit_whole(scope, op, stream): the steps of ``ResourceScope.submit``
   after its frame, which stays, so that the Python code these steps call
   (a driver's, a policy's, the Python paths') runs KI-protected as before:
   a lone kernel launch, from the scope's thread while the scope is open
   and not enqueuing, through the scope module's ``submit_launch`` (this
   module's, called here; None: ``ResourceScope._submit_launch``); anything
   else through ``scope._submit(op, stream, "submit")``. Then the idle
   handoff woken, the future made (``future_of``), and watched in a traced
   scope. */
PyObject *submit_whole(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "submit_whole(scope, op, stream)");
        return NULL;
    }
    if (!g_submit_ready) {
        PyErr_SetString(PyExc_RuntimeError, "submit_whole: configure_submit() first");
        return NULL;
    }
    PyObject *scope = args[0], *op = args[1], *stream = args[2];
    if (Py_TYPE(scope) != t_scope) {
        PyErr_Format(PyExc_TypeError, "submit_whole: expected a ResourceScope, got %.100s", Py_TYPE(scope)->tp_name);
        return NULL;
    }
    int lone = Py_TYPE(op) == g_launch_type;
    if (lone) lone = is_false(read_slot(scope, &r_sc_closing));
    if (lone > 0) lone = is_false(read_slot(scope, &r_sc_enqueuing));
    if (lone > 0) {
        PyObject *thread = read_slot(scope, &r_sc_thread);
        if (thread == NULL) return NULL;
        lone = PyLong_CheckExact(thread) && PyLong_AsUnsignedLong(thread) == PyThread_get_thread_ident();
        Py_DECREF(thread);
        if (PyErr_Occurred()) PyErr_Clear(); /* (not a thread's id: the Python path says so) */
    }
    if (lone < 0) return NULL;
    PyObject *sub;
    if (lone) {
        PyObject *fn = global_of(g_scope_globals, n_submit_launch, &m_submit_launch); /* (borrowed) */
        if (fn == NULL && PyErr_Occurred()) return NULL;
        if (fn != NULL && PyCFunction_Check(fn) &&
            PyCFunction_GET_FUNCTION(fn) == (PyCFunction)(void (*)(void))submit_launch) {
            sub = submit_launch(module, args, 3);
        } else if (fn == NULL || fn == Py_None) {
            sub = pmethod(scope, n_py_submit_launch, (PyObject *[]){op, stream}, 2);
        } else {
            Py_INCREF(fn);
            sub = pcall(fn, args, 3);
            Py_DECREF(fn);
        }
    } else {
        sub = pmethod(scope, n_py_submit, (PyObject *[]){op, stream, n_submit}, 3);
    }
    if (sub == NULL) return NULL;
    PyObject *fut = NULL, *completion = read_slot(scope, &r_sc_completion), *idle = NULL, *tracer = NULL;
    if (completion == NULL || (idle = read_slot(completion, &r_c_idle)) == NULL) goto done;
    if (idle != Py_None) { /* nobody may await it: the handoff is its retirer */
        if (store_slot(completion, &r_c_idle, Py_NewRef(Py_None)) < 0) goto done;
        PyObject *r = pmethod(idle, n_set, NULL, 0);
        if (r == NULL) goto done;
        Py_DECREF(r);
    }
    if ((fut = future_of(module, sub)) == NULL || (tracer = read_slot(scope, &r_sc_tracer)) == NULL) goto done;
    if (tracer != Py_None) {
        PyObject *r = pmethod(fut, n_watch, NULL, 0);
        if (r == NULL) Py_CLEAR(fut);
        Py_XDECREF(r);
    }
done:
    Py_DECREF(sub);
    Py_XDECREF(completion);
    Py_XDECREF(idle);
    Py_XDECREF(tracer);
    if (fut == NULL && !PyErr_Occurred()) PyErr_SetString(PyExc_SystemError, "submit_whole: no future made");
    return fut;
}

/* configure_submit(env): after configure_leases() and configure_retire(). */
/* future_of(sub): ``DeviceFuture._create(sub)``, the future of a submission. */
PyObject *future_of(PyObject *module, PyObject *sub) {
    if (t_future == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "future_of: configure_submit() first");
        return NULL;
    }
    if (Py_TYPE(sub) != t_sub) {
        PyErr_Format(PyExc_TypeError, "future_of: sub: expected a Submission, got %.100s", Py_TYPE(sub)->tp_name);
        return NULL;
    }
    return new_instance(t_future, &future_sub_off, &sub, 1);
}

PyObject *configure_submit(PyObject *module, PyObject *env) {
    if (!PyDict_Check(env)) {
        PyErr_SetString(PyExc_TypeError, "configure_submit: expected a dict");
        return NULL;
    }
    if (!g_configured || g_submit_ready) {
        PyErr_SetString(PyExc_RuntimeError, "configure_submit: once per process, after configure()");
        return NULL;
    }
    PyObject *scope_mod = NULL, *submit_mod = NULL;
    if (take(env, "ResourceScope", (PyObject **)&t_scope) < 0 || take(env, "Stream", (PyObject **)&t_stream) < 0 ||
        take(env, "Submission", (PyObject **)&t_sub) < 0 || take(env, "ENQUEUING", &g_enqueuing) < 0 ||
        take(env, "IN_FLIGHT", &g_in_flight) < 0 || take(env, "take_launch_leases", &g_tll) < 0 ||
        take(env, "scope_module", &scope_mod) < 0 || take(env, "submit_module", &submit_mod) < 0 ||
        take(env, "enqueue_unsafe_py", &g_enqueue_py) < 0)
        return NULL;
    if (!PyType_Check(t_scope) || !PyType_Check(t_stream) || !PyType_Check(t_sub)) {
        PyErr_SetString(PyExc_TypeError, "configure_submit: ResourceScope, Stream and Submission must be types");
        return NULL;
    }
    g_scope_globals = PyModule_GetDict(scope_mod);
    g_submit_globals = PyModule_GetDict(submit_mod);
    if (g_scope_globals == NULL || g_submit_globals == NULL) return NULL;
    Py_INCREF(g_scope_globals);
    Py_INCREF(g_submit_globals);
    PyObject *tp_scope = (PyObject *)t_scope, *tp_stream = (PyObject *)t_stream, *tp_sub = (PyObject *)t_sub;
    PyObject *tp_c = PyDict_GetItemString(env, "Completion");
    PyObject *tp_kt = PyDict_GetItemString(env, "KernelTable");
    PyObject *tp_k = PyDict_GetItemString(env, "Kernel");
    if (tp_c == NULL || !PyType_Check(tp_c) || tp_kt == NULL || !PyType_Check(tp_kt) || tp_k == NULL ||
        !PyType_Check(tp_k)) {
        PyErr_SetString(PyExc_TypeError, "configure_submit: Completion, KernelTable and Kernel must be types");
        return NULL;
    }
    struct {
        PyObject *type;
        const char *name;
        SlotRef *ref;
    } refs[] = {{tp_scope, "_functions", &r_sc_functions}, {tp_scope, "_kernels", &r_sc_kernels},
                {tp_scope, "_next_id", &r_sc_next_id},     {tp_scope, "_driver", &r_sc_driver},
                {tp_scope, "_completion", &r_sc_completion}, {tp_scope, "_policy", &r_sc_policy},
                {tp_scope, "_streams", &r_sc_streams},     {tp_scope, "_tracer", &r_sc_tracer},
                {tp_scope, "_trace_timing", &r_sc_trace_timing},
                {tp_scope, "_closing", &r_sc_closing},     {tp_scope, "_thread", &r_sc_thread},
                {tp_scope, "_enqueuing", &r_sc_enqueuing}, {tp_c, "idle", &r_c_idle},
                {tp_stream, "_scope", &r_st_scope},        {tp_stream, "handle", &r_st_handle},
                {tp_stream, "_in_flight", &r_st_in_flight}, {tp_stream, "_unmarked", &r_st_unmarked},
                {tp_c, "in_flight", &r_c_in_flight},       {tp_c, "unflushed", &r_c_unflushed},
                {tp_c, "batch", &r_c_batch},               {tp_c, "driver", &r_c_driver},
                {tp_sub, "error", &r_sub_error},           {tp_sub, "observed", &r_sub_observed},
                {tp_sub, "dirty", &r_sub_dirty},           {tp_sub, "output", &r_sub_output},
                {tp_sub, "state", &r_sub_state},           {tp_kt, "last_checked", &r_kt_last},
                {tp_kt, "functions", &r_kt_functions},     {tp_kt, "ready", &r_kt_ready},
                {tp_kt, "hot", &r_kt_hot},
                {tp_k, "tile", &r_k_tile}};
    for (size_t i = 0; i < sizeof(refs) / sizeof(refs[0]); i++)
        if (make_slot_ref(refs[i].type, refs[i].name, refs[i].ref) < 0) return NULL;
    PyObject *tp_alloc;
    SlotRef future_sub;
    if (take(env, "DeviceFuture", (PyObject **)&t_future) < 0 || !PyType_Check(t_future) ||
        make_slot_ref((PyObject *)t_future, "_sub", &future_sub) < 0)
        return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_TypeError, "configure_submit: DeviceFuture: a type");
    future_sub_off = future_sub.offset;
    if (take(env, "Allocation", &tp_alloc) < 0 || make_slot_ref(tp_alloc, "writers", &r_al_writers) < 0 ||
        take(env, "FollowWriter", (PyObject **)&t_follow) < 0 || take(env, "LeastLoaded", (PyObject **)&t_least) < 0 ||
        (g_follow_choose = PyObject_GetAttrString((PyObject *)t_follow, "choose")) == NULL ||
        (g_least_choose = PyObject_GetAttrString((PyObject *)t_least, "choose")) == NULL)
        return NULL;
    for (int i = 0; i < N_SUB; i++) {
        SlotRef ref;
        if (make_slot_ref(tp_sub, sub_names[i], &ref) < 0) return NULL;
        sub_off[i] = ref.offset;
    }
    /* every slot but __weakref__ is set by new_instance, as __init__ sets them */
    PyObject *slots = PyObject_GetAttrString(tp_sub, "__slots__");
    if (slots == NULL) return NULL;
    Py_ssize_t n = PySequence_Size(slots);
    Py_DECREF(slots);
    if (n != N_SUB + 1) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "configure_submit: Submission has %zd slots, expected %d", n, N_SUB + 1);
        return NULL;
    }
    if ((g_empty = PyTuple_New(0)) == NULL) return NULL;
    if (intern(&n_accesses, "_accesses") < 0 || intern(&n_tll, "take_launch_leases") < 0 || intern(&n_fast, "FAST_LEASES") < 0 ||
        intern(&n_take_whole, "take_whole") < 0 || intern(&n_rest, "take_launch_leases_rest") < 0 || intern(&n_pick, "_pick") < 0 ||
        intern(&n_check_choice, "_check_choice") < 0 || intern(&n_choose, "choose") < 0 ||
        intern(&n_function_for, "function_for") < 0 || intern(&n_launch, "launch") < 0 ||
        intern(&n_finish, "finish") < 0 || intern(&n_flush, "flush") < 0 ||
        intern(&n_notify, "notify_submitted") < 0 || intern(&n_trace_error, "trace_error") < 0 ||
        intern(&n_trace_submit, "trace_submit") < 0 || intern(&n_timing_mark, "timing_mark") < 0 ||
        intern(&n_per_launch, "per_launch_check") < 0 ||
        intern(&n_check_open, "_check_open") < 0 || intern(&n_async_on, "async_on") < 0 ||
        intern(&n_submit_launch, "submit_launch") < 0 || intern(&n_py_submit_launch, "_submit_launch") < 0 ||
        intern(&n_py_submit, "_submit") < 0 || intern(&n_submit, "submit") < 0 || intern(&n_set, "set") < 0 ||
        intern(&n_watch, "_watch") < 0)
        return NULL;
    g_submit_ready = 1;
    Py_RETURN_NONE;
}

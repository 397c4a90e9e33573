/* Shared by the parts of trio_cuda._core._claunch: the module and its
   configuration (_claunch.c), the launch builder (_claunch_builder.c), the
   typed-launch fast path (_claunch_typed.c), a launch's leases
   (_claunch_leases.c) and their cross-stream conflicts (_claunch_order.c), its submission (_claunch_submit.c), the
   retirement of what completed (_claunch_scan.c), an awaiting task's
   checkpoint and look (_claunch_step.c), a trace's records on the awaited
   path (_claunch_trace.c) and Kernel.launch
   (_claunch_method.c). */

#ifndef TRIO_CUDA_CLAUNCH_H
#define TRIO_CUDA_CLAUNCH_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#include "_fastattr.h"

/* A slot of one exact type, read where it is stored: the offset its member
   descriptor gives (what the descriptor's own __get__ reads). */
typedef struct {
    PyTypeObject *type;
    Py_ssize_t offset;
    PyObject *name;
} SlotRef;

enum {
    A_ALLOC, A_CLOSED, A_READONLY, A_OFFSET, A_DTYPE, A_SHAPE, A_WHOLE, A_ORDER,
    L_STATE, L_TABLE, L_PTR, L_SCOPE, L_BORROWED, T_CLOSED, N_SLOTREFS
};

/* set once by configure() */
extern int g_configured;
extern SlotRef g_slot[N_SLOTREFS];
extern PyTypeObject *g_array_type, *g_prepared_type, *g_launch_type, *g_modes_type;
extern PyObject *g_freed, *g_live, *g_write, *g_merge;
extern Py_ssize_t g_prepared_off[9]; /* kernel config plan arena args values cache ready enqueued */
extern Py_ssize_t g_launch_off[5];   /* prepared _acc _lease_plan _output _lease_simple */

/* The value of slot ``ref`` of ``obj`` (a new reference), through getattr
   where ``obj`` is not of the slot's exact type or the slot is empty. */
static inline PyObject *read_slot(PyObject *obj, SlotRef *ref) {
    if (Py_TYPE(obj) == ref->type) {
        PyObject *v = *(PyObject **)((char *)obj + ref->offset);
        if (v != NULL) {
            Py_INCREF(v);
            return v;
        }
    }
    return PyObject_GetAttr(obj, ref->name);
}

/* Store ``value`` (a new reference, stolen) in slot ``ref`` of ``obj`` of
   the slot's exact type; -1 (error set) otherwise. */
static inline int store_slot(PyObject *obj, SlotRef *ref, PyObject *value) {
    if (Py_TYPE(obj) != ref->type) {
        int rc = PyObject_SetAttr(obj, ref->name, value);
        Py_DECREF(value);
        return rc;
    }
    PyObject **at = (PyObject **)((char *)obj + ref->offset);
    PyObject *old = *at;
    *at = value;
    Py_XDECREF(old);
    return 0;
}

/* A module global that a call site reads on every call (a name tests may
   patch: the module's dict is read, never a copy): the dict's entry, borrowed,
   NULL if absent (error set only on an error). On CPython 3.11 and 3.12 the
   site remembers the entry with the dict's version tag, which every change
   to a dict replaces with a number no dict had before, so an unchanged tag
   means an unchanged entry; elsewhere it is a plain lookup. */
typedef struct {
    uint64_t version;
    PyObject *value;
} GlobalMemo;

static inline PyObject *global_of(PyObject *dict, PyObject *name, GlobalMemo *m) {
#if PY_VERSION_HEX < 0x030D0000
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    uint64_t version = ((PyDictObject *)dict)->ma_version_tag;
#pragma GCC diagnostic pop
    if (version != 0 && m->version == version) return m->value;
    PyObject *v = PyDict_GetItemWithError(dict, name); /* (borrowed; a lookup changes no dict) */
    m->version = v != NULL ? version : 0;
    m->value = v;
    return v;
#else
    (void)m;
    return PyDict_GetItemWithError(dict, name);
#endif
}

/* ``v`` plus ``delta`` stored in ``v`` itself: 1, or 0 where that could be
   seen. Only an exact int that its slot alone refers to qualifies, positive,
   of one digit and past the small ints CPython keeps (so not one of them),
   with a sum of the same kind: no other reference exists, so no one can
   tell the object changed rather than being replaced (an int's hash is not
   kept). Only on the layouts it is tested on, CPython 3.11's and 3.12's;
   elsewhere, and where reference counts are not plain (free threading),
   never. */
static inline int bump_in_place(PyObject *v, long delta) {
#if defined(Py_GIL_DISABLED) || defined(Py_LIMITED_API) || PY_VERSION_HEX < 0x030B0000 || PY_VERSION_HEX >= 0x030D0000
    (void)v;
    (void)delta;
    return 0;
#else
    if (Py_REFCNT(v) != 1 || !PyLong_CheckExact(v)) return 0;
#if PY_VERSION_HEX >= 0x030C0000
    if (((PyLongObject *)v)->long_value.lv_tag != ((uintptr_t)1 << 3)) return 0; /* (one digit, positive) */
    digit *d = ((PyLongObject *)v)->long_value.ob_digit;
#else
    if (Py_SIZE(v) != 1) return 0;
    digit *d = ((PyLongObject *)v)->ob_digit;
#endif
    long x = (long)d[0] + delta;
    if (d[0] <= 256 || x <= 256 || x >= (long)PyLong_BASE) return 0;
    d[0] = (digit)x;
    return 1;
#endif
}

/* obj's int slot ``ref`` plus ``delta`` (a small delta; the sum stolen
   into the slot): 0, or -1. An int only the slot holds changes in place
   (bump_in_place); another exact int in C's long range is added in C;
   anything else by ``+``. */
static inline int bump(PyObject *obj, SlotRef *ref, long delta) {
    if (Py_TYPE(obj) == ref->type) {
        PyObject *held = *(PyObject **)((char *)obj + ref->offset);
        if (held != NULL && bump_in_place(held, delta)) return 0;
    }
    PyObject *v = read_slot(obj, ref), *sum;
    if (v == NULL) return -1;
    int overflow = 1;
    long x = PyLong_CheckExact(v) ? PyLong_AsLongAndOverflow(v, &overflow) : 0;
    if (!overflow && x > LONG_MIN / 2 && x < LONG_MAX / 2) {
        sum = PyLong_FromLong(x + delta);
    } else {
        PyObject *d = PyLong_FromLong(delta);
        sum = d ? PyNumber_Add(v, d) : NULL;
        Py_XDECREF(d);
    }
    Py_DECREF(v);
    if (sum == NULL) return -1;
    return store_slot(obj, ref, sum);
}

/* An exact int from 0 to 2**64-1 into *out; 0 (no error set) if it is not one. */
static inline int as_u64(PyObject *obj, unsigned long long *out) {
    if (!PyLong_CheckExact(obj)) return 0;
    unsigned long long v = u64_of(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    *out = v;
    return 1;
}

int make_slot_ref(PyObject *type, const char *name, SlotRef *out);

/* A launch's accesses, its (array, access) items in order. Its ``_acc``
   slot holds either their tuple of pairs, or its typed path's modes (an
   ArrayModes: one access, or None for a scalar, per value; the arrays are
   the launch's values), from which ``KernelLaunch._accesses`` makes the
   pairs when Python asks for them. */
typedef struct {
    PyObject *items;  /* the pairs, or the modes (borrowed) */
    PyObject *values; /* NULL for pairs; else the values' tuple (borrowed) */
    Py_ssize_t n;
} Accesses;

/* ``acc`` (a tuple of pairs, or modes with ``values``) as Accesses: 1, or 0
   where it is neither well formed (the Python path decides). */
static inline int accesses_of(PyObject *acc, PyObject *values, Accesses *out) {
    if (acc == NULL) return 0;
    out->items = acc;
    out->n = PyTuple_Check(acc) ? PyTuple_GET_SIZE(acc) : 0;
    if (PyTuple_CheckExact(acc)) {
        out->values = NULL;
        for (Py_ssize_t i = 0; i < out->n; i++) {
            PyObject *pair = PyTuple_GET_ITEM(acc, i);
            if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2) return 0;
        }
        return 1;
    }
    out->values = values;
    return Py_TYPE(acc) == g_modes_type && values != NULL && PyTuple_CheckExact(values) &&
           PyTuple_GET_SIZE(values) == out->n;
}

/* The access at or after *pos (borrowed; *pos moved past it): 1, or 0 at the end. */
static inline int accesses_next(const Accesses *a, Py_ssize_t *pos, PyObject **arr, PyObject **mode) {
    for (Py_ssize_t i = *pos; i < a->n; i++) {
        PyObject *item = PyTuple_GET_ITEM(a->items, i);
        if (a->values == NULL) {
            *arr = PyTuple_GET_ITEM(item, 0);
            *mode = PyTuple_GET_ITEM(item, 1);
        } else if (item == Py_None) {
            continue;
        } else {
            *arr = PyTuple_GET_ITEM(a->values, i);
            *mode = item;
        }
        *pos = i + 1;
        return 1;
    }
    *pos = a->n;
    return 0;
}

/* The Accesses of launch ``op`` (of the exact launch type): 1, or 0. */
static inline int launch_accesses(PyObject *op, Accesses *out) {
    PyObject *prepared = *(PyObject **)((char *)op + g_launch_off[0]);
    PyObject *values = prepared != NULL && Py_TYPE(prepared) == g_prepared_type
                           ? *(PyObject **)((char *)prepared + g_prepared_off[5])
                           : NULL;
    return accesses_of(*(PyObject **)((char *)op + g_launch_off[1]), values, out);
}

/* The exception being raised, normalised, its traceback attached (a new
   reference); the error indicator cleared. Raise it again with
   ``PyErr_SetObject((PyObject *)Py_TYPE(exc), exc)``. */
static inline PyObject *take_raised(void) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL) PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
}

/* *out = the interned string ``name``: 0, or -1 (error set). */
static inline int intern(PyObject **out, const char *name) {
    return (*out = PyUnicode_InternFromString(name)) ? 0 : -1;
}
/* In a function with an ``int rc`` and a ``done:`` label: decline (rc 0:
   nothing was changed, the Python path decides) or fail (rc -1: an error
   is set). */
#define DECLINE_IF(cond) \
    do {                 \
        if (cond) {      \
            rc = 0;      \
            goto done;   \
        }                \
    } while (0)
#define FAIL_IF_NULL(x)    \
    do {                   \
        if ((x) == NULL) { \
            rc = -1;       \
            goto done;     \
        }                  \
    } while (0)

PyObject *new_instance(PyTypeObject *tp, const Py_ssize_t *offsets, PyObject *const *values, int n);
int take(PyObject *env, const char *name, PyObject **out);

/* _claunch_builder.c */
int builder_init(void);
PyObject *make_base(PyObject *module, PyObject *args);

/* _claunch_leases.c */
PyObject *configure_leases(PyObject *module, PyObject *args);
PyObject *take_whole(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
int take_whole_c(PyObject *scope, PyObject *stream, PyObject *sub, const Accesses *acc, PyObject *allocs);
PyObject *configure_retire(PyObject *module, PyObject *args);
PyObject *retire_done(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

/* _claunch_order.c */
PyObject *configure_order(PyObject *module, PyObject *env);
int order_in_way(PyObject *scope, PyObject *stream, PyObject *sub, const Accesses *acc);

/* _claunch_submit.c */
PyObject *future_of(PyObject *module, PyObject *sub);
PyObject *configure_submit(PyObject *module, PyObject *env);
PyObject *submit_launch(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *submit_whole(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
/* _claunch_protect.c: submit without a frame, and the calls into Python
   that the compiled submission makes (KI-protected while frameless) */
extern int g_frameless;
/* What one call site last read as an instance's attribute from the
   instance's own dict (the backend's hot methods are stored there): kept
   while the type and the dict are unchanged. CPython 3.11 and 3.12 give
   each type and each dict a version tag that every change replaces with a
   number no type or dict had before, so equal tags mean the same lookup
   (a borrowed value: the dict still holds it). Elsewhere: no memo. */
typedef struct {
    PyTypeObject *type;
    unsigned int type_version;
    PyObject *dict; /* (borrowed; compared, never read, unless its tag matches) */
    uint64_t dict_version;
    PyObject *value; /* borrowed */
} AttrMemo;

PyObject *memo_getattr(PyObject *obj, PyObject *name, AttrMemo *m);

PyObject *pcall(PyObject *fn, PyObject *const *args, Py_ssize_t nargs);
PyObject *pmethod(PyObject *obj, PyObject *name, PyObject *const *args, Py_ssize_t nargs);
/* pmethod, the method read through ``m`` (memo_getattr) */
PyObject *pmethod_memo(PyObject *obj, PyObject *name, PyObject *const *args, Py_ssize_t nargs, AttrMemo *m);
PyObject *pgetattr(PyObject *obj, PyObject *name);
PyObject *trust(PyObject *module, PyObject *types);
PyObject *submit_method(PyObject *module, PyObject *args);
PyObject *enqueue_unsafe(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

/* _claunch_scan.c */
PyObject *configure_scan(PyObject *module, PyObject *env);
int flush_stream(PyObject *completion, PyObject *s);
PyObject *scan(PyObject *module, PyObject *completion);
PyObject *look(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *prepare(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *begin(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
int cancel_point(void);

/* _claunch_trace.c */
PyObject *configure_trace(PyObject *module, PyObject *env);
int add_trace_lock(PyObject *module);
int trace_record(PyObject *tr, PyObject *cat, PyObject *name, PyObject *sid, PyObject *stream, PyObject *sub,
                 PyObject *alloc, PyObject *args);
PyObject *trace_await(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
int retire_record(PyObject *completion, PyObject *sub);
int submit_record(PyObject *fn, PyObject *scope, PyObject *tr, PyObject *sub, PyObject *op, PyObject *mark);

/* _claunch_step.c */
PyObject *configure_step(PyObject *module, PyObject *args);
PyObject *make_step(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

/* _claunch_method.c */
PyObject *launch_method(PyObject *module, PyObject *args);

/* _claunch_typed.c */
int typed_init(void);
PyObject *make_typed(PyObject *module, PyObject *args);

#endif

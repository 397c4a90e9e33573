/* An awaiting task's checkpoint and first look, as one awaitable (part of
   trio_cuda._core._claunch).

   ``await step(completion, sub)`` is ``await trio.lowlevel.checkpoint()``
   followed by ``look(completion, sub)``, without the three Python frames of
   Trio's checkpoint:
   - its first step yields Trio's own schedule-point message, the one that
     ``trio.lowlevel.cancel_shielded_checkpoint`` yields (taken from that
     function by configure_step, never named), so the task is rescheduled
     exactly as a checkpoint reschedules it;
   - resumed, it unwraps what Trio sent (an Outcome), then makes Trio's cancel
     point (cancel_point in _claunch_scan.c): where no cancellation is due, the
     task's count of cancel points moves and it gives look's answer; where one
     is due (or Trio's state cannot be read) it gives CHECK and changes
     nothing: the caller then makes Trio's own checkpoint, which raises it.
   It is awaited once; an exception thrown in finishes it and propagates. Its
   caller (ResourceScope.run) is KI-protected, and every step runs inside its
   frame. */

#include "_claunch.h"

static PyObject *g_trap, *g_value_type, *g_check, *n_unwrap;

typedef struct {
    PyObject_HEAD PyObject *completion;
    PyObject *sub;
    int state; /* 0: not started; 1: yielded, waiting to be resumed; 2: finished */
} Step;

static PyTypeObject StepType;

static PySendResult step_send(Step *self, PyObject *arg, PyObject **result) {
    *result = NULL;
    if (self->state == 0) {
        if (arg != Py_None) {
            PyErr_SetString(PyExc_TypeError, "step: can't send a value other than None to a step not started");
            return PYGEN_ERROR;
        }
        self->state = 1;
        *result = Py_NewRef(g_trap);
        return PYGEN_NEXT;
    }
    if (self->state != 1) {
        PyErr_SetString(PyExc_RuntimeError, "step: already awaited");
        return PYGEN_ERROR;
    }
    self->state = 2;
    if (Py_TYPE(arg) != (PyTypeObject *)g_value_type) { /* (Trio sends a Value for this message) */
        PyObject *r = PyObject_CallMethodNoArgs(arg, n_unwrap);
        if (r == NULL) return PYGEN_ERROR;
        Py_DECREF(r);
    }
    int point = cancel_point();
    if (point < 0) return PYGEN_ERROR;
    if (point == 0) {
        *result = Py_NewRef(g_check);
        return PYGEN_RETURN;
    }
    PyObject *args[2] = {self->completion, self->sub};
    if ((*result = look(NULL, args, 2)) == NULL) return PYGEN_ERROR;
    return PYGEN_RETURN;
}

/* A send's outcome as a method's: the value yielded, StopIteration(value) raised, or NULL. */
static PyObject *step_as_call(Step *self, PyObject *arg) {
    PyObject *result;
    PySendResult r = step_send(self, arg, &result);
    if (r == PYGEN_NEXT) return result;
    if (r == PYGEN_RETURN) {
        PyObject *stop = PyObject_CallOneArg(PyExc_StopIteration, result);
        Py_DECREF(result);
        if (stop != NULL) {
            PyErr_SetObject(PyExc_StopIteration, stop);
            Py_DECREF(stop);
        }
    }
    return NULL;
}

static PyObject *step_next(Step *self) { return step_as_call(self, Py_None); }

static PyObject *step_send_method(Step *self, PyObject *arg) { return step_as_call(self, arg); }

/* throw(exc) or throw(type[, value[, traceback]]): finished, and raised. */
static PyObject *step_throw(Step *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "throw expected 1 to 3 arguments");
        return NULL;
    }
    self->state = 2;
    PyObject *typ = args[0], *val = nargs > 1 ? args[1] : Py_None, *tb = nargs > 2 ? args[2] : Py_None;
    if (tb != Py_None && !PyTraceBack_Check(tb)) {
        PyErr_SetString(PyExc_TypeError, "throw() third argument must be a traceback object");
        return NULL;
    }
    if (PyExceptionInstance_Check(typ)) {
        if (val != Py_None) {
            PyErr_SetString(PyExc_TypeError, "instance exception may not have a separate value");
            return NULL;
        }
        if (tb != Py_None) PyException_SetTraceback(typ, tb);
        PyErr_SetObject((PyObject *)Py_TYPE(typ), typ);
    } else if (PyExceptionClass_Check(typ)) {
        PyObject *type = typ, *value = Py_NewRef(val), *trace = tb == Py_None ? NULL : Py_NewRef(tb);
        Py_INCREF(type);
        PyErr_NormalizeException(&type, &value, &trace);
        if (trace != NULL) PyException_SetTraceback(value, trace);
        PyErr_Restore(type, value, trace);
    } else {
        PyErr_Format(PyExc_TypeError, "exceptions must be classes or instances deriving from BaseException, not %.100s",
                     Py_TYPE(typ)->tp_name);
    }
    return NULL;
}

static PyObject *step_close(Step *self, PyObject *unused) {
    self->state = 2;
    Py_RETURN_NONE;
}

static PyObject *step_await(Step *self) { return Py_NewRef(self); }

static int step_traverse(Step *self, visitproc visit, void *arg) {
    Py_VISIT(self->completion);
    Py_VISIT(self->sub);
    return 0;
}

static int step_clear(Step *self) {
    Py_CLEAR(self->completion);
    Py_CLEAR(self->sub);
    return 0;
}

static void step_dealloc(Step *self) {
    PyObject_GC_UnTrack(self);
    step_clear(self);
    PyObject_GC_Del(self);
}

static PyAsyncMethods step_async = {
    .am_await = (unaryfunc)step_await,
    .am_send = (sendfunc)step_send,
};

static PyMethodDef step_methods[] = {
    {"send", (PyCFunction)step_send_method, METH_O, "send(value): the next step."},
    {"throw", (PyCFunction)(void (*)(void))step_throw, METH_FASTCALL, "throw(exc): finished, and exc raised."},
    {"close", (PyCFunction)step_close, METH_NOARGS, "close(): finished."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject StepType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "trio_cuda._core._claunch.Step",
    .tp_basicsize = sizeof(Step),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "An awaiting task's checkpoint and first look (step(completion, sub)).",
    .tp_dealloc = (destructor)step_dealloc,
    .tp_traverse = (traverseproc)step_traverse,
    .tp_clear = (inquiry)step_clear,
    .tp_as_async = &step_async,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)step_next,
    .tp_methods = step_methods,
};

/* step(completion, sub) -> the awaitable (configure_step() first). */
PyObject *make_step(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "step(completion, sub)");
        return NULL;
    }
    if (g_trap == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "step: configure_step() first");
        return NULL;
    }
    Step *self = PyObject_GC_New(Step, &StepType);
    if (self == NULL) return NULL;
    self->completion = Py_NewRef(args[0]);
    self->sub = Py_NewRef(args[1]);
    self->state = 0;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

/* configure_step(trap, Value, CHECK): once per process. ``trap`` is what
   Trio's cancel_shielded_checkpoint yields, ``Value`` the Outcome type Trio
   sends back for it, CHECK what a step gives where Trio's checkpoint decides. */
PyObject *configure_step(PyObject *module, PyObject *args) {
    PyObject *trap, *value_type, *check;
    if (!PyArg_ParseTuple(args, "OO!O", &trap, &PyType_Type, &value_type, &check)) return NULL;
    if (g_trap != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "configure_step: once per process");
        return NULL;
    }
    if (PyType_Ready(&StepType) < 0 || intern(&n_unwrap, "unwrap") < 0) return NULL;
    g_value_type = Py_NewRef(value_type);
    g_check = Py_NewRef(check);
    g_trap = Py_NewRef(trap);
    Py_RETURN_NONE;
}

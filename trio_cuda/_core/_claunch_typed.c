/* A typed launch's fast path, compiled (see _claunch.c for the invariants):
   fast(args, config) -> the launch the checked path would build, or None.
   One kind of launcher serves a SIMT kernel (the table of
   _arena._fast_packer: _kernel._compile_fast_py's guards) and a tile
   kernel's recipe (_tilefast.compile_tile_fast_py's guards: ``tile`` set). */

#include "_claunch.h"

static PyTypeObject *g_typed_type; /* TypedLaunch */
static PyObject *s_closed_attr;

/* ------------------------------------------------------------------ typed launch */

/* The kinds of _arena._fast_packer's table, then a tile recipe's: an array
   of a fixed shape, order and address alignment (its shape and strides
   packed after its pointer), a constant (not packed), and a scalar of
   exactly one type packed by its struct code */
enum { K_INT, K_FLOAT, K_BOOL, K_ARRAY, K_SLICE, K_TILE_ARRAY, K_CONSTANT, K_EXACT };

#define IS_ARRAY(kind) ((kind) == K_ARRAY || (kind) == K_SLICE || (kind) == K_TILE_ARRAY)

typedef struct {
    int kind;
    PyObject *dt;          /* a scalar's NumPy type, or an array's dtype */
    PyObject *access;      /* an array's access */
    char code;             /* struct code: a scalar's, or a slice length's */
    Py_ssize_t offset;     /* of the value, or of an array's pointer */
    Py_ssize_t len_offset; /* of a slice's length */
    PyObject *shape, *order; /* a tile array's */
    long align;              /* a tile array's address modulo 16 */
    PyObject *consts;        /* a tile array's: ((code, offset, int), ...) packed after its pointer */
    PyObject *value;         /* a constant, or a float constant's repr */
    int by_repr;
    int fits32;              /* an int of a tile recipe: 1 it must fit int32, 2 it must not, 0 either */
} Entry;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *kernel, *plan;
    PyObject *modes; /* an ArrayModes: each argument's access, or None (a launch's _acc, see _claunch.h) */
    Py_ssize_t size, n;
    int tile; /* a tile recipe: two arrays of one allocation, one written, go to the checked path */
    Entry *entries;
    unsigned char *start; /* the arena before the arguments: zeros, and the tile arrays' constants packed
                             (NULL: a constant does not fit its code, so each call packs them, and declines) */
} TypedLaunch;

static int typed_traverse(TypedLaunch *self, visitproc visit, void *arg) {
    Py_VISIT(self->kernel);
    Py_VISIT(self->plan);
    Py_VISIT(self->modes);
    for (Py_ssize_t i = 0; i < self->n && self->entries; i++) {
        Entry *e = &self->entries[i];
        Py_VISIT(e->dt);
        Py_VISIT(e->access);
        Py_VISIT(e->shape);
        Py_VISIT(e->order);
        Py_VISIT(e->consts);
        Py_VISIT(e->value);
    }
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int typed_clear(TypedLaunch *self) {
    Py_CLEAR(self->kernel);
    Py_CLEAR(self->plan);
    Py_CLEAR(self->modes);
    for (Py_ssize_t i = 0; i < self->n && self->entries; i++) {
        Entry *e = &self->entries[i];
        Py_CLEAR(e->dt);
        Py_CLEAR(e->access);
        Py_CLEAR(e->shape);
        Py_CLEAR(e->order);
        Py_CLEAR(e->consts);
        Py_CLEAR(e->value);
    }
    return 0;
}

static void typed_dealloc(TypedLaunch *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    typed_clear(self);
    PyMem_Free(self->entries);
    PyMem_Free(self->start);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* The low ``size`` bytes of ``v`` at ``p``, least significant first (the
   kernel ABI's order): one store on a little-endian host. */
static inline void put_le(unsigned char *p, unsigned long long v, int size) {
#if PY_LITTLE_ENDIAN
    switch (size) {
    case 8: memcpy(p, &v, 8); return;
    case 4: { uint32_t x = (uint32_t)v; memcpy(p, &x, 4); return; }
    case 2: { uint16_t x = (uint16_t)v; memcpy(p, &x, 2); return; }
    case 1: *p = (unsigned char)v; return;
    default: break;
    }
#endif
    for (int i = 0; i < size; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static int code_size(char code) {
    switch (code) {
    case 'b': case 'B': case '?': return 1;
    case 'h': case 'H': case 'e': return 2;
    case 'i': case 'I': case 'f': return 4;
    case 'q': case 'Q': case 'd': return 8;
    default: return 0;
    }
}

/* Pack the int ``v`` as struct code ``code`` (little-endian) at ``p``: 1,
   0 if it is out of the code's range (struct.error), -1 error. */
static int pack_int(unsigned char *p, PyObject *v, char code) {
    PyObject *index = PyNumber_Index(v);
    if (index == NULL) return -1;
    int overflow = 0, size = code_size(code);
    int is_signed = code == 'b' || code == 'h' || code == 'i' || code == 'q';
    unsigned long long bits;
    if (is_signed) {
        long long x = PyLong_AsLongLongAndOverflow(index, &overflow);
        Py_DECREF(index);
        if (x == -1 && PyErr_Occurred()) return -1;
        if (overflow) return 0;
        if (size < 8) {
            long long lim = 1LL << (8 * size - 1);
            if (x < -lim || x >= lim) return 0;
        }
        bits = (unsigned long long)x;
    } else {
        long long x = PyLong_AsLongLongAndOverflow(index, &overflow);
        if ((x == -1 && PyErr_Occurred()) || overflow < 0 || (!overflow && x < 0)) {
            Py_DECREF(index);
            return PyErr_Occurred() ? -1 : 0;
        }
        bits = u64_of(index);
        Py_DECREF(index);
        if (bits == (unsigned long long)-1 && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
            PyErr_Clear();
            return 0;
        }
        if (size < 8 && bits >= (1ULL << (8 * size))) return 0;
    }
    put_le(p, bits, size);
    return 1;
}

/* float ``x`` as struct code ``code``: 1, 0 if it does not fit (OverflowError), -1 error. */
static int pack_float(unsigned char *p, double x, char code) {
    int rc = code == 'e' ? PyFloat_Pack2(x, (char *)p, 1) : code == 'f' ? PyFloat_Pack4(x, (char *)p, 1)
                                                                        : PyFloat_Pack8(x, (char *)p, 1);
    if (rc < 0) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
        PyErr_Clear();
        return 0;
    }
    return 1;
}


/* One array argument: its pointer (and a slice's length) packed, its
   allocation in *alloc_out: 1, 0 (None), -1 error. */
/* Whether ``a != b`` for a tile array's shape or order, as Python answers
   it: 1, 0, -1 (error set). Tuples of exact ints in C's long range are
   compared in C. */
static int differs(PyObject *a, PyObject *b) {
    if (a == b) return 0;
    if (PyTuple_CheckExact(a) && PyTuple_CheckExact(b)) {
        Py_ssize_t n = PyTuple_GET_SIZE(a);
        if (n != PyTuple_GET_SIZE(b)) return 1;
        Py_ssize_t i = 0;
        for (; i < n; i++) {
            PyObject *x = PyTuple_GET_ITEM(a, i), *y = PyTuple_GET_ITEM(b, i);
            if (x == y) continue;
            if (!PyLong_CheckExact(x) || !PyLong_CheckExact(y)) break;
            int ox, oy;
            long vx = PyLong_AsLongAndOverflow(x, &ox), vy = PyLong_AsLongAndOverflow(y, &oy);
            if (ox || oy) break;
            if (vx != vy) return 1;
        }
        if (i == n) return 0;
    }
    return PyObject_RichCompareBool(a, b, Py_NE);
}

static int typed_array(Entry *e, PyObject *a, unsigned char *arena, int consts_packed, PyObject **alloc_out) {
    int rc = 0;
    PyObject *flag = NULL, *alloc = NULL, *scope = NULL, *dtype = NULL, *ptr = NULL, *offset = NULL, *shape = NULL;
    if (Py_TYPE(a) != g_array_type) return 0;
    FAIL_IF_NULL(flag = read_slot(a, &g_slot[A_CLOSED]));
    int t = PyObject_IsTrue(flag);
    if (t < 0) rc = -1;
    DECLINE_IF(t != 0);
    Py_CLEAR(flag);
    FAIL_IF_NULL(alloc = read_slot(a, &g_slot[A_ALLOC]));
    FAIL_IF_NULL(flag = read_slot(alloc, &g_slot[L_STATE]));
    DECLINE_IF(flag != g_live);
    Py_CLEAR(flag);
    FAIL_IF_NULL(scope = read_slot(alloc, &g_slot[L_SCOPE]));
    FAIL_IF_NULL(flag = fast_getattr(scope, s_closed_attr));
    t = PyObject_IsTrue(flag);
    if (t < 0) rc = -1;
    DECLINE_IF(t != 0);
    Py_CLEAR(flag);
    FAIL_IF_NULL(dtype = read_slot(a, &g_slot[A_DTYPE]));
    if (dtype != e->dt) {
        int same = PyObject_RichCompareBool(dtype, e->dt, Py_EQ);
        if (same < 0) rc = -1;
        DECLINE_IF(same <= 0);
    }
    if (e->kind == K_TILE_ARRAY) { /* the recipe's shape and order */
        FAIL_IF_NULL(shape = read_slot(a, &g_slot[A_SHAPE]));
        int other = differs(shape, e->shape);
        if (other < 0) rc = -1;
        DECLINE_IF(other != 0);
        FAIL_IF_NULL(flag = read_slot(a, &g_slot[A_ORDER]));
        other = differs(flag, e->order);
        if (other < 0) rc = -1;
        DECLINE_IF(other != 0);
        Py_CLEAR(flag);
    }
    if (e->access == g_write) {
        FAIL_IF_NULL(flag = read_slot(a, &g_slot[A_READONLY]));
        t = PyObject_IsTrue(flag);
        if (t < 0) rc = -1;
        DECLINE_IF(t != 0);
        Py_CLEAR(flag);
    }
    unsigned long long base, off;
    FAIL_IF_NULL(ptr = read_slot(alloc, &g_slot[L_PTR]));
    FAIL_IF_NULL(offset = read_slot(a, &g_slot[A_OFFSET]));
    DECLINE_IF(!as_u64(ptr, &base) || !as_u64(offset, &off) || base + off < base);
    DECLINE_IF(e->kind == K_TILE_ARRAY && (long)((base + off) & 15) != e->align);
    put_le(arena + e->offset, base + off, 8);
    if (e->kind == K_TILE_ARRAY && !consts_packed) { /* (else in the arena's start) */
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(e->consts); i++) {
            PyObject *c = PyTuple_GET_ITEM(e->consts, i); /* (code, offset, value): checked when made */
            const char *code = PyUnicode_AsUTF8(PyTuple_GET_ITEM(c, 0));
            Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(c, 1));
            int packed = code ? pack_int(arena + at, PyTuple_GET_ITEM(c, 2), code[0]) : -1;
            if (packed < 0) rc = -1;
            DECLINE_IF(packed <= 0);
        }
    }
    if (e->kind == K_SLICE) {
        FAIL_IF_NULL(shape = read_slot(a, &g_slot[A_SHAPE]));
        DECLINE_IF(!PyTuple_CheckExact(shape));
        /* math.prod of the shape (ints), then packed as the length's code */
        PyObject *n = PyLong_FromLong(1);
        FAIL_IF_NULL(n);
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shape); i++) {
            PyObject *next = PyNumber_Multiply(n, PyTuple_GET_ITEM(shape, i));
            Py_DECREF(n);
            n = next;
            if (n == NULL) break;
        }
        FAIL_IF_NULL(n);
        int packed = PyLong_CheckExact(n) ? pack_int(arena + e->len_offset, n, e->code) : 0;
        Py_DECREF(n);
        if (packed < 0) rc = -1;
        DECLINE_IF(packed <= 0);
    }
    *alloc_out = alloc;
    alloc = NULL;
    rc = 1;
done:
    Py_XDECREF(flag);
    Py_XDECREF(alloc);
    Py_XDECREF(scope);
    Py_XDECREF(dtype);
    Py_XDECREF(ptr);
    Py_XDECREF(offset);
    Py_XDECREF(shape);
    return rc;
}

/* One scalar argument, packed: 1, 0 (None), -1 error. */
static int typed_scalar(Entry *e, PyObject *a, unsigned char *arena) {
    PyObject *t = (PyObject *)Py_TYPE(a);
    unsigned char *p = arena + e->offset;
    if (e->kind == K_CONSTANT) { /* the recipe's constant: by its repr for a float (-0.0, NaN) */
        if (e->by_repr) {
            if (t != (PyObject *)&PyFloat_Type) return 0;
            PyObject *r = PyObject_Repr(a);
            if (r == NULL) return -1;
            int same = PyUnicode_Compare(r, e->value) == 0;
            Py_DECREF(r);
            if (PyErr_Occurred()) return -1;
            return same;
        }
        if (t != (PyObject *)Py_TYPE(e->value)) return 0;
        int differs = PyObject_RichCompareBool(a, e->value, Py_NE);
        return differs < 0 ? -1 : !differs;
    }
    if (e->kind == K_EXACT) { /* exactly this type, packed as struct packs its code */
        if (t != e->dt) return 0;
        if (e->fits32) { /* the recipe of an int depends on whether it fits int32 */
            int overflow = 0;
            long long v = PyLong_AsLongLongAndOverflow(a, &overflow);
            if (v == -1 && PyErr_Occurred()) return -1;
            int fits = !overflow && v >= -(1LL << 31) && v < (1LL << 31);
            if (fits != (e->fits32 == 1)) return 0;
        }
        if (e->code == '?') {
            int truth = PyObject_IsTrue(a);
            if (truth < 0) return -1;
            *p = (unsigned char)truth;
            return 1;
        }
        if (strchr("efd", e->code) != NULL) {
            double x = PyFloat_AsDouble(a);
            if (x == -1.0 && PyErr_Occurred()) return -1;
            return pack_float(p, x, e->code);
        }
        return pack_int(p, a, e->code);
    }
    if (e->kind == K_INT) {
        if (t != (PyObject *)&PyLong_Type && t != e->dt) return 0;
        return pack_int(p, a, e->code);
    }
    if (e->kind == K_BOOL) {
        if (t != (PyObject *)&PyBool_Type && t != e->dt) return 0;
        int truth = PyObject_IsTrue(a);
        if (truth < 0) return -1;
        *p = (unsigned char)truth;
        return 1;
    }
    /* K_FLOAT: a float (not a NaN for a half), an int that converts exactly,
       or the parameter's own NumPy type (not a NaN: its payload is kept by
       the checked path) */
    double x;
    if (t == (PyObject *)&PyFloat_Type) {
        x = PyFloat_AS_DOUBLE(a);
        if (e->code == 'e' && x != x) return 0;
    } else if (t == (PyObject *)&PyLong_Type) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(a, &overflow);
        if (v == -1 && PyErr_Occurred()) return -1;
        if (overflow || v < -(1LL << 53) || v > (1LL << 53)) return 0;
        x = (double)v;
    } else if (t == e->dt) {
        x = PyFloat_AsDouble(a);
        if (x == -1.0 && PyErr_Occurred()) return -1;
        if (x != x) return 0;
    } else {
        return 0;
    }
    return pack_float(p, x, e->code);
}

/* The access of the ``k``-th array argument. */
static PyObject *access_of(TypedLaunch *self, Py_ssize_t k) {
    for (Py_ssize_t i = 0; i < self->n; i++)
        if (IS_ARRAY(self->entries[i].kind) && k-- == 0) return self->entries[i].access;
    return NULL;
}

static PyObject *typed_call(TypedLaunch *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 2 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "fast(args, config): expected two positional arguments");
        return NULL;
    }
    PyObject *args = argv[0], *config = argv[1];
    if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != self->n) Py_RETURN_NONE;
    Py_ssize_t n = self->n, n_arrays = 0, n_out = 0;
    PyObject *small_allocs[16], *small_acc[16];
    PyObject **allocs = small_allocs, **acc = small_acc;
    PyObject *arena = NULL, *accesses = NULL, *merged = NULL, *lease_plan = NULL, *output = NULL,
             *prepared = NULL, *result = NULL;
    int rc = 1;
    if (n > 16) {
        allocs = PyMem_Calloc((size_t)n, sizeof(PyObject *));
        acc = PyMem_Calloc((size_t)n, sizeof(PyObject *));
        if (allocs == NULL || acc == NULL) {
            PyErr_NoMemory();
            rc = -1;
            goto done;
        }
    }
    FAIL_IF_NULL(arena = PyBytes_FromStringAndSize(NULL, self->size));
    unsigned char *buf = (unsigned char *)PyBytes_AS_STRING(arena);
    if (self->start != NULL)
        memcpy(buf, self->start, (size_t)self->size);
    else
        memset(buf, 0, (size_t)self->size);
    for (Py_ssize_t i = 0; i < n; i++) {
        Entry *e = &self->entries[i];
        PyObject *a = PyTuple_GET_ITEM(args, i);
        if (IS_ARRAY(e->kind)) {
            PyObject *alloc = NULL;
            rc = typed_array(e, a, buf, self->start != NULL, &alloc);
            if (rc <= 0) goto done;
            allocs[n_arrays] = alloc;
            acc[n_arrays++] = a;
            if (e->access == g_write) n_out++;
        } else {
            rc = typed_scalar(e, a, buf);
            if (rc <= 0) goto done;
        }
    }
    int shared = 0, simple = 0;
    for (Py_ssize_t i = 0; i < n_arrays; i++)
        for (Py_ssize_t j = i + 1; j < n_arrays; j++)
            if (allocs[i] == allocs[j]) {
                shared = 1;
                /* a tile kernel's arrays of one allocation, one written: the
                   checked path compares their byte ranges */
                DECLINE_IF(self->tile && (access_of(self, i) == g_write || access_of(self, j) == g_write));
            }
    if (self->tile && n_arrays > 1 && n_out > 0) {
        /* borrowed memory may be borrowed twice (two records, the same bytes) */
        for (Py_ssize_t i = 0; i < n_arrays; i++) {
            PyObject *borrowed = read_slot(allocs[i], &g_slot[L_BORROWED]);
            FAIL_IF_NULL(borrowed);
            int truth = PyObject_IsTrue(borrowed);
            Py_DECREF(borrowed);
            if (truth < 0) rc = -1;
            DECLINE_IF(truth != 0);
        }
    }
    if (shared) { /* (its lease plan: made from the merged accesses at its first safe submission) */
        FAIL_IF_NULL(accesses = PyTuple_New(n_arrays));
        for (Py_ssize_t i = 0, j = 0; i < n; i++) {
            Entry *e = &self->entries[i];
            if (!IS_ARRAY(e->kind)) continue;
            PyObject *pair = PyTuple_Pack(2, acc[j], e->access);
            FAIL_IF_NULL(pair);
            PyTuple_SET_ITEM(accesses, j++, pair);
        }
        FAIL_IF_NULL(merged = PyObject_CallOneArg(g_merge, accesses));
        lease_plan = Py_NewRef(Py_None);
        simple = 0;
    } else { /* (its accesses: the pairs made from its modes and values when asked for) */
        merged = Py_NewRef(self->modes);
        /* its lease plan, as _submit.launch_lease_plan makes it: each
           allocation once, and whether every array is its whole allocation */
        simple = 1;
        for (Py_ssize_t i = 0; i < n_arrays && simple; i++) {
            PyObject *whole = read_slot(acc[i], &g_slot[A_WHOLE]);
            FAIL_IF_NULL(whole);
            simple = whole == Py_True;
            Py_DECREF(whole);
        }
        FAIL_IF_NULL(lease_plan = PyTuple_New(n_arrays));
        for (Py_ssize_t i = 0; i < n_arrays; i++) PyTuple_SET_ITEM(lease_plan, i, Py_NewRef(allocs[i]));
    }
    if (n_out == 0) {
        output = Py_None;
        Py_INCREF(output);
    } else {
        if (n_out > 1) FAIL_IF_NULL(output = PyTuple_New(n_out));
        for (Py_ssize_t i = 0, j = 0, k = 0; i < n; i++) {
            Entry *e = &self->entries[i];
            if (!IS_ARRAY(e->kind)) continue;
            PyObject *a = acc[j++];
            if (e->access != g_write) continue;
            Py_INCREF(a);
            if (n_out == 1)
                output = a;
            else
                PyTuple_SET_ITEM(output, k++, a);
        }
    }
    {
        PyObject *fields[9] = {self->kernel, config, self->plan, arena, Py_None, args, Py_None, Py_None, Py_False};
        FAIL_IF_NULL(prepared = new_instance(g_prepared_type, g_prepared_off, fields, 9));
    }
    {
        PyObject *fields[5] = {prepared, merged, lease_plan, output, simple ? Py_True : Py_False};
        FAIL_IF_NULL(result = new_instance(g_launch_type, g_launch_off, fields, 5));
    }
done:
    for (Py_ssize_t i = 0; i < n_arrays; i++) Py_DECREF(allocs[i]);
    if (allocs != small_allocs) PyMem_Free(allocs);
    if (acc != small_acc) PyMem_Free(acc);
    Py_XDECREF(arena);
    Py_XDECREF(accesses);
    Py_XDECREF(merged);
    Py_XDECREF(lease_plan);
    Py_XDECREF(output);
    Py_XDECREF(prepared);
    if (rc < 0) return NULL;
    if (rc == 0) Py_RETURN_NONE;
    return result;
}

static PyObject *typed_call_tuple(TypedLaunch *self, PyObject *args, PyObject *kwargs) {
    return PyVectorcall_Call((PyObject *)self, args, kwargs);
}

static PyMemberDef typed_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(TypedLaunch, vectorcall), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot typed_slots[] = {
    {Py_tp_dealloc, typed_dealloc},
    {Py_tp_traverse, typed_traverse},
    {Py_tp_clear, typed_clear},
    {Py_tp_call, typed_call_tuple},
    {Py_tp_members, typed_members},
    {Py_tp_doc, "A kernel's typed-launch fast path, compiled: fast(args, config) -> KernelLaunch or None."},
    {0, NULL},
};

static PyType_Spec typed_spec = {
    "trio_cuda._core._claunch.TypedLaunch", sizeof(TypedLaunch), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_HAVE_VECTORCALL,
    typed_slots,
};

/* One entry: (kind, dt, access, code, offset, len_offset, extra), extra
   being None, (shape, order, align, consts) for a tile array, or (value,
   by_repr) for a constant. 0, or -1 (an error set, ValueError for a bad
   entry); what it took is the entry's, released with the launcher. */
static int parse_entry(Entry *e, PyObject *entry, Py_ssize_t size) {
    int kind;
    PyObject *dt, *access, *extra;
    const char *code;
    Py_ssize_t offset, len_offset;
    if (!PyArg_ParseTuple(entry, "iOOsnnO:typed entry", &kind, &dt, &access, &code, &offset, &len_offset, &extra))
        return -1;
    int width = code_size(code[0]);
    int is_array = IS_ARRAY(kind);
    int bad = kind < K_INT || kind > K_EXACT || strlen(code) != 1 || width == 0 || offset < 0 ||
              (is_array && access == Py_None) ||
              (kind != K_CONSTANT && offset + (is_array ? 8 : width) > size) ||
              (kind == K_SLICE && (len_offset < 0 || len_offset + width > size)) ||
              (kind == K_FLOAT && strchr("efd", code[0]) == NULL) || (kind == K_BOOL && code[0] != '?') ||
              ((kind == K_INT || kind == K_SLICE) && strchr("bBhHiIqQ", code[0]) == NULL) ||
              ((kind == K_ARRAY || kind == K_TILE_ARRAY) && code[0] != 'Q') || (kind == K_EXACT && !PyType_Check(dt));
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "a bad entry");
        return -1;
    }
    e->kind = kind;
    Py_INCREF(dt);
    e->dt = dt;
    Py_INCREF(access);
    e->access = access;
    e->code = code[0];
    e->offset = offset;
    e->len_offset = len_offset;
    if (kind == K_TILE_ARRAY) {
        PyObject *shape, *order, *consts;
        long align;
        if (!PyArg_ParseTuple(extra, "O!UlO!:tile array", &PyTuple_Type, &shape, &order, &align, &PyTuple_Type,
                              &consts))
            return -1;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(consts); i++) {
            PyObject *c = PyTuple_GET_ITEM(consts, i);
            const char *ccode;
            Py_ssize_t at;
            PyObject *value;
            if (!PyTuple_Check(c) || !PyArg_ParseTuple(c, "snO!:packed constant", &ccode, &at, &PyLong_Type, &value))
                return -1;
            if (strlen(ccode) != 1 || strchr("bBhHiIqQ", ccode[0]) == NULL || at < 0 ||
                at + code_size(ccode[0]) > size) {
                PyErr_SetString(PyExc_ValueError, "a bad packed constant");
                return -1;
            }
        }
        if (align < 0 || align > 15) {
            PyErr_SetString(PyExc_ValueError, "a bad alignment");
            return -1;
        }
        Py_INCREF(shape);
        e->shape = shape;
        Py_INCREF(order);
        e->order = order;
        e->align = align;
        Py_INCREF(consts);
        e->consts = consts;
    } else if (kind == K_CONSTANT) {
        PyObject *value;
        int by_repr;
        if (!PyArg_ParseTuple(extra, "Op:constant", &value, &by_repr)) return -1;
        if (by_repr && !PyUnicode_Check(value)) {
            PyErr_SetString(PyExc_ValueError, "a float constant is given by its repr");
            return -1;
        }
        Py_INCREF(value);
        e->value = value;
        e->by_repr = by_repr;
    } else if (kind == K_EXACT && extra != Py_None) {
        int fits;
        if (dt != (PyObject *)&PyLong_Type || !PyArg_ParseTuple(extra, "p:int range", &fits)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "an int range is for ints");
            return -1;
        }
        e->fits32 = fits ? 1 : 2;
    } else if (extra != Py_None) {
        PyErr_SetString(PyExc_ValueError, "extra: expected None");
        return -1;
    }
    return 0;
}

/* typed(kernel, plan, size, entries): entries, one per parameter, are
   (kind, dt, access, code, offset, len_offset) */
PyObject *make_typed(PyObject *module, PyObject *args) {
    PyObject *kernel, *plan, *entries;
    Py_ssize_t size;
    int tile = 0;
    if (!PyArg_ParseTuple(args, "OOnO!|p:typed", &kernel, &plan, &size, &PyTuple_Type, &entries, &tile)) return NULL;
    if (!g_configured) {
        PyErr_SetString(PyExc_RuntimeError, "typed: configure() first");
        return NULL;
    }
    if (size < 0) {
        PyErr_SetString(PyExc_ValueError, "typed: size must be >= 0");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(entries);
    TypedLaunch *self = PyObject_GC_New(TypedLaunch, g_typed_type);
    if (self == NULL) return NULL;
    self->vectorcall = (vectorcallfunc)typed_call;
    self->n = 0;
    self->size = size;
    self->tile = tile;
    self->entries = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Entry));
    self->start = NULL;
    Py_INCREF(kernel);
    self->kernel = kernel;
    Py_INCREF(plan);
    self->plan = plan;
    self->modes = NULL;
    PyObject_GC_Track(self);
    if (self->entries == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Entry *e = &self->entries[i];
        if (parse_entry(e, PyTuple_GET_ITEM(entries, i), size) < 0) {
            if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_ValueError))
                PyErr_Format(PyExc_ValueError, "typed: entry %zd does not describe a parameter in %zd bytes", i,
                             size);
            self->n = i + 1; /* (what it took is released) */
            Py_DECREF(self);
            return NULL;
        }
        self->n = i + 1;
    }
    /* the arguments' modes */
    PyObject *modes = PyTuple_New(n);
    if (modes == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Entry *e = &self->entries[i];
        PyTuple_SET_ITEM(modes, i, Py_NewRef(IS_ARRAY(e->kind) ? e->access : Py_None));
    }
    self->modes = PyObject_CallOneArg((PyObject *)g_modes_type, modes);
    Py_DECREF(modes);
    if (self->modes == NULL || Py_TYPE(self->modes) != g_modes_type || PyTuple_GET_SIZE(self->modes) != n) {
        if (self->modes != NULL) PyErr_SetString(PyExc_TypeError, "typed: ArrayModes must make a tuple of its own type");
        Py_DECREF(self);
        return NULL;
    }
    /* the arena's start: the tile arrays' constants packed once, here */
    if ((self->start = PyMem_Calloc((size_t)(size ? size : 1), 1)) == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n && self->start != NULL; i++) {
        Entry *e = &self->entries[i];
        if (e->kind != K_TILE_ARRAY) continue;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(e->consts); j++) {
            PyObject *c = PyTuple_GET_ITEM(e->consts, j); /* (code, offset, value): checked by parse_entry */
            const char *code = PyUnicode_AsUTF8(PyTuple_GET_ITEM(c, 0));
            Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(c, 1));
            if (code == NULL || at < 0 || pack_int(self->start + at, PyTuple_GET_ITEM(c, 2), code[0]) <= 0) {
                PyErr_Clear(); /* (each call packs it, and declines where it does not fit) */
                PyMem_Free(self->start);
                self->start = NULL;
                break;
            }
        }
    }
    return (PyObject *)self;
}

int typed_init(void) {
    s_closed_attr = PyUnicode_InternFromString("_closed");
    if (s_closed_attr == NULL) return -1;
    g_typed_type = (PyTypeObject *)PyType_FromSpec(&typed_spec);
    return g_typed_type == NULL ? -1 : 0;
}

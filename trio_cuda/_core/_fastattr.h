/* fast_getattr(obj, name): ``getattr(obj, name)``, faster where the
   attribute is a slot; class_holds(tp, name, fn): whether a class's
   attribute is still ``fn``, without getattr's work; fast_setattr, the
   same for setattr. Shared by the compiled extensions (a header: each
   file that includes it keeps its own table); and u64_of, an int's value
   as an unsigned 64-bit one.

   Invariants:
   - The result is always what generic getattr gives: a slot is read where
     it is stored only where the type reads attributes the generic way and
     its attribute is a member descriptor of an object slot (what
     ``__slots__`` and attrs' slotted classes make), which generic getattr
     would call first; an empty slot, and anything else, goes to getattr.
   - A table entry, per (type, name), holds while the type is unchanged:
     its version tag. Any change to a type gives it a new tag (0 until
     then), and no type ever gets a tag another type had, so an entry of a
     freed type never matches. The table holds no references. */

#ifndef TRIO_CUDA_FASTATTR_H
#define TRIO_CUDA_FASTATTR_H

#include <Python.h>
#include <structmember.h>
#include <stdint.h>

/* PyLong_AsUnsignedLongLong's answer and errors. Where a long has 64 bits
   this is PyLong_AsUnsignedLong, which reads the digits directly: CPython
   3.11 and 3.12 convert a value past 2**30 (every device address) to an
   unsigned long long through a generic byte-array routine, four times the
   cost (20 against 5 ns a call on a development machine). */
static inline unsigned long long u64_of(PyObject *obj) {
#if SIZEOF_LONG >= 8
    return (unsigned long long)PyLong_AsUnsignedLong(obj);
#else
    return PyLong_AsUnsignedLongLong(obj);
#endif
}

typedef struct {
    PyTypeObject *type;
    PyObject *name;
    unsigned int version;
    Py_ssize_t offset;
} SlotEntry;

#define SLOT_ENTRIES 128
static SlotEntry slot_table[SLOT_ENTRIES];

static inline PyObject *fast_getattr(PyObject *obj, PyObject *name) {
    PyTypeObject *tp = Py_TYPE(obj);
    SlotEntry *e = &slot_table[(((uintptr_t)tp >> 4) ^ ((uintptr_t)name >> 3)) % SLOT_ENTRIES];
    if (e->type != tp || e->name != name || e->version == 0 || e->version != tp->tp_version_tag) {
        e->version = 0;
        if (tp->tp_getattro != PyObject_GenericGetAttr || !PyUnicode_CheckExact(name))
            return PyObject_GetAttr(obj, name);
        PyObject *d = _PyType_Lookup(tp, name); /* (borrowed; no error set) */
        if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type) ||
            ((PyMemberDescrObject *)d)->d_member->type != T_OBJECT_EX ||
            !PyType_IsSubtype(tp, PyDescr_TYPE(d)) || tp->tp_version_tag == 0)
            return PyObject_GetAttr(obj, name);
        e->type = tp;
        e->name = name;
        e->offset = ((PyMemberDescrObject *)d)->d_member->offset;
        e->version = tp->tp_version_tag;
    }
    PyObject *v = *(PyObject **)((char *)obj + e->offset);
    return v != NULL ? Py_NewRef(v) : PyObject_GetAttr(obj, name);
}

/* ``setattr(obj, name, value)``: 0, or -1 (error set). Stores in the slot
   where fast_getattr would read it, and the type also sets attributes the
   generic way (no ``__setattr__`` of its own, as attrs adds for validators)
   and the slot is writable; anything else goes to setattr. Its own table:
   an entry here says more than one there. */
static SlotEntry slot_set_table[SLOT_ENTRIES];

static inline int fast_setattr(PyObject *obj, PyObject *name, PyObject *value) {
    PyTypeObject *tp = Py_TYPE(obj);
    SlotEntry *e = &slot_set_table[(((uintptr_t)tp >> 4) ^ ((uintptr_t)name >> 3)) % SLOT_ENTRIES];
    if (e->type != tp || e->name != name || e->version == 0 || e->version != tp->tp_version_tag) {
        e->version = 0;
        if (tp->tp_setattro != PyObject_GenericSetAttr || !PyUnicode_CheckExact(name))
            return PyObject_SetAttr(obj, name, value);
        PyObject *d = _PyType_Lookup(tp, name); /* (borrowed; no error set) */
        if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type) ||
            ((PyMemberDescrObject *)d)->d_member->type != T_OBJECT_EX ||
            (((PyMemberDescrObject *)d)->d_member->flags & READONLY) || !PyType_IsSubtype(tp, PyDescr_TYPE(d)) ||
            tp->tp_version_tag == 0)
            return PyObject_SetAttr(obj, name, value);
        e->type = tp;
        e->name = name;
        e->offset = ((PyMemberDescrObject *)d)->d_member->offset;
        e->version = tp->tp_version_tag;
    }
    PyObject **at = (PyObject **)((char *)obj + e->offset);
    PyObject *old = *at;
    *at = Py_NewRef(value);
    Py_XDECREF(old);
    return 0;
}

/* Whether ``name``, looked up on the class ``tp`` as getattr looks it up
   there (its MRO; the metaclass holds none of the names asked), is ``fn``:
   1 or 0. No reference is taken, and no error set. */
static inline int class_holds(PyTypeObject *tp, PyObject *name, PyObject *fn) {
    return _PyType_Lookup(tp, name) == fn;
}

#endif

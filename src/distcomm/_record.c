/* The flight recorder's hot record in C: FlightRecorder.started, the record every latency path
 * makes per call (flight_recorder.py holds the Python original, and the recorder uses this one
 * where it is built).
 *
 * Why C: the Python method costs about 1 µs per call (a frame, a frame lookup, a 13-field list),
 * a fifth of a whole 8-byte collective; the same steps here cost about a tenth of that
 * (docs/performance-notes.md, "The flight recorder's record in C").
 *
 * Started(slots, capacity, ids, internal, outside, state) makes a callable
 *     started(group, seq, op, nbytes, dtype, peer, skip) -> record
 * that does what FlightRecorder.started does: the call site is the frame ``skip`` levels up
 * (1: the caller) or the first above it whose file ``internal`` says is not library code (a dict
 * lookup a frame), with ``outside(frame)`` (the Python walk) from the first file it does not know;
 * then the record [id, group, seq, op, nbytes, dtype, peer,
 * site, time, None, state, None, None] goes into ``slots[id % capacity]``.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>
#include <stddef.h>
#include <time.h>

#define FIELDS 13

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall; /* called without a tuple of arguments */
    PyObject *slots;    /* list of capacity records */
    Py_ssize_t capacity;
    PyObject *ids;  /* an iterator of the records' ids (itertools.count) */
    PyObject *internal; /* file name -> whether distcomm's (or torch.distributed's) */
    PyObject *outside;  /* (frame) -> site: the walk for frames not yet known to be the user's */
    PyObject *state;    /* the state a record starts in ("started") */
} Started;

static PyObject *site_of(Started *s, Py_ssize_t skip) {
    PyFrameObject *frame = PyEval_GetFrame(); /* borrowed: the caller's frame, level 1 */
    if (!frame) Py_RETURN_NONE;
    Py_INCREF(frame);
    for (Py_ssize_t i = 1; i < skip; i++) {
        PyFrameObject *back = PyFrame_GetBack(frame);
        Py_DECREF(frame);
        if (!back) Py_RETURN_NONE; /* a thread whose first frame is distcomm's: no user frame */
        frame = back;
    }
    /* up past the frames of files known to be library code (a torch API function calling the
     * backend, distcomm's DDP): one lookup each; a file not classified yet goes to Python's walk */
    for (;;) {
        PyCodeObject *code = PyFrame_GetCode(frame);
        PyObject *inside = PyDict_GetItemWithError(s->internal, code->co_filename);
        if (inside == Py_True) {
            Py_DECREF(code);
            PyFrameObject *back = PyFrame_GetBack(frame);
            Py_DECREF(frame);
            if (!back) Py_RETURN_NONE;
            frame = back;
            continue;
        }
        PyObject *site;
        if (inside == Py_False) {
#if PY_VERSION_HEX >= 0x030B0000
            PyObject *lasti = PyLong_FromLong(PyFrame_GetLasti(frame));
            site = lasti ? PyTuple_Pack(2, (PyObject *)code, lasti) : NULL;
            Py_DECREF(code);
            Py_XDECREF(lasti);
#else
            PyObject *lasti = PyObject_GetAttrString((PyObject *)frame, "f_lasti");
            site = lasti ? Py_BuildValue("(NN)", (PyObject *)code, lasti) : (Py_DECREF(code), NULL);
#endif
        } else {
            Py_DECREF(code);
            site = PyErr_Occurred() ? NULL : PyObject_CallOneArg(s->outside, (PyObject *)frame);
        }
        Py_DECREF(frame);
        return site;
    }
}

static PyObject *Started_call(Started *s, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 7 || kwnames) {
        PyErr_SetString(PyExc_TypeError, "started(group, seq, op, nbytes, dtype, peer, skip)");
        return NULL;
    }
    Py_ssize_t skip = PyLong_AsSsize_t(args[6]);
    if (skip == -1 && PyErr_Occurred()) return NULL;
    PyObject *site = site_of(s, skip);
    if (!site) return NULL;
    PyObject *id = Py_TYPE(s->ids)->tp_iternext(s->ids);
    if (!id) {
        Py_DECREF(site);
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(id);
    if (i == -1 && PyErr_Occurred()) {
        Py_DECREF(site);
        Py_DECREF(id);
        return NULL;
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts); /* time.time()'s clock */
    PyObject *now = PyFloat_FromDouble((double)ts.tv_sec + ts.tv_nsec * 1e-9);
    if (!now) {
        Py_DECREF(site);
        Py_DECREF(id);
        return NULL;
    }
    PyObject *fields[FIELDS] = {id, args[0], args[1], args[2], args[3], args[4], args[5], site, now,
                                Py_None, s->state, Py_None, Py_None};
    Py_ssize_t at = i % s->capacity;
    PyObject *old = PyList_GET_ITEM(s->slots, at);
    if (PyList_CheckExact(old) && Py_REFCNT(old) == 1 && PyList_GET_SIZE(old) == FIELDS) {
        /* the record this one evicts, held by the ring alone (no one can see it change): refilled,
         * where a new list would cost an allocation and the old one's release */
        for (int f = 0; f < FIELDS; f++) {
            if (f != 0 && f != 7 && f != 8) Py_INCREF(fields[f]); /* id, site and now are ours already */
            PyObject *previous = PyList_GET_ITEM(old, f);
            PyList_SET_ITEM(old, f, fields[f]);
            Py_XDECREF(previous);
        }
        return Py_NewRef(old);
    }
    PyObject *entry = PyList_New(FIELDS);
    if (!entry) {
        for (int f = 0; f < FIELDS; f++)
            if (f == 0 || f == 7 || f == 8) Py_DECREF(fields[f]);
        return NULL;
    }
    for (int f = 0; f < FIELDS; f++) {
        if (f != 0 && f != 7 && f != 8) Py_INCREF(fields[f]); /* id, site and now are ours already */
        PyList_SET_ITEM(entry, f, fields[f]);
    }
    Py_INCREF(entry);
    if (PyList_SetItem(s->slots, at, entry) < 0) { /* steals the reference */
        Py_DECREF(entry);
        return NULL;
    }
    return entry;
}

static int Started_init(Started *s, PyObject *args, PyObject *kwds) {
    static char *names[] = {"slots", "capacity", "ids", "internal", "outside", "state", NULL};
    PyObject *slots, *ids, *internal, *outside, *state;
    Py_ssize_t capacity;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!nOO!OO", names, &PyList_Type, &slots, &capacity, &ids,
                                     &PyDict_Type, &internal, &outside, &state))
        return -1;
    if (capacity <= 0 || PyList_GET_SIZE(slots) != capacity) {
        PyErr_SetString(PyExc_ValueError, "Started: slots must be a list of capacity (> 0) entries");
        return -1;
    }
    if (!PyIter_Check(ids)) {
        PyErr_SetString(PyExc_TypeError, "Started: ids must be an iterator (itertools.count)");
        return -1;
    }
    Py_INCREF(slots);
    Py_INCREF(ids);
    Py_INCREF(internal);
    Py_INCREF(outside);
    Py_INCREF(state);
    Py_XSETREF(s->slots, slots);
    Py_XSETREF(s->ids, ids);
    Py_XSETREF(s->internal, internal);
    Py_XSETREF(s->outside, outside);
    Py_XSETREF(s->state, state);
    s->capacity = capacity;
    return 0;
}

static PyObject *Started_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Started *s = (Started *)self;
    if (!s->slots) {
        PyErr_SetString(PyExc_ValueError, "Started is not initialised");
        return NULL;
    }
    return Started_call(s, args, nargsf, kwnames);
}

static PyObject *Started_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Started *s = (Started *)type->tp_alloc(type, 0);
    if (s) s->vectorcall = Started_vectorcall;
    return (PyObject *)s;
}

static int Started_traverse(Started *s, visitproc visit, void *arg) {
    Py_VISIT(s->slots);
    Py_VISIT(s->ids);
    Py_VISIT(s->internal);
    Py_VISIT(s->outside);
    Py_VISIT(s->state);
    return 0;
}

static int Started_clear(Started *s) {
    Py_CLEAR(s->slots);
    Py_CLEAR(s->ids);
    Py_CLEAR(s->internal);
    Py_CLEAR(s->outside);
    Py_CLEAR(s->state);
    return 0;
}

static void Started_dealloc(Started *s) {
    PyObject_GC_UnTrack(s);
    Started_clear(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *Started_tp_call(PyObject *self, PyObject *args, PyObject *kwds) {
    return PyVectorcall_Call(self, args, kwds);
}

static PyTypeObject StartedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "distcomm._record.Started",
    .tp_basicsize = sizeof(Started),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "Started(slots, capacity, ids, internal, outside, state): FlightRecorder.started in C",
    .tp_new = Started_new,
    .tp_init = (initproc)Started_init,
    .tp_dealloc = (destructor)Started_dealloc,
    .tp_traverse = (traverseproc)Started_traverse,
    .tp_clear = (inquiry)Started_clear,
    .tp_call = Started_tp_call,
    .tp_vectorcall_offset = offsetof(Started, vectorcall),
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "distcomm._record", .m_size = -1,
                                    .m_doc = "The flight recorder's hot record in C (see _record.c)."};

PyMODINIT_FUNC PyInit__record(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyType_Ready(&StartedType) < 0 || PyModule_AddObjectRef(m, "Started", (PyObject *)&StartedType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

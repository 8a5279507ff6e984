/* What the whole calls in C share (transport/_shm_calls.c for the shared-memory engine,
 * backends/mpi/_mpi_calls.c for the MPI engine): an array's memory read from numpy's own fields,
 * and the group's side of a call, which is the Python latency paths' side of it:
 *
 *   claim: the group's memory (or communicator) not broken, torch's profiler off (it records calls
 *          on the general path), nothing running or queued on the group (the steps of its
 *          executor's enter_inline, on what its inline_gate gives); leave: the release;
 *   its sequence number, the flight recorder's record (started, then completed), the engine
 *   observer's notice ("latency_<op>", for tests).
 *
 * Static inline functions: each extension compiles its own copy from this one definition.
 */
#ifndef DISTCOMM_CALLS_H
#define DISTCOMM_CALLS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/ndarraytypes.h>
#include <time.h>

/* One array's memory, when it is what the Python paths take: an exact numpy ndarray, C-contiguous,
 * aligned, writeable, in native byte order, of a builtin number dtype (bool, the integers, the
 * floats, the complex ones; their type numbers say the dtype whole, where a string's or a
 * datetime's do not). */
typedef struct {
    PyObject *obj;
    PyObject *dtype; /* borrowed: the array's */
    char *data;
    Py_ssize_t count;
    int type_num;
} Arr;

static inline int array_of(PyTypeObject *ndarray, PyObject *o, Arr *a) {
    if (Py_TYPE(o) != ndarray) return 0;
    PyArrayObject *x = (PyArrayObject *)o;
    if ((PyArray_FLAGS(x) & NPY_ARRAY_CARRAY) != NPY_ARRAY_CARRAY) return 0;
    PyArray_Descr *d = PyArray_DESCR(x);
    if (!PyArray_ISNBO(d->byteorder) || !((d->type_num >= NPY_BOOL && d->type_num <= NPY_CLONGDOUBLE) ||
                                          d->type_num == NPY_HALF))
        return 0;
    npy_intp *dims = PyArray_DIMS(x);
    Py_ssize_t count = 1;
    for (int i = 0; i < PyArray_NDIM(x); i++) count *= dims[i];
    a->obj = o, a->dtype = (PyObject *)d, a->data = PyArray_DATA(x), a->count = count, a->type_num = d->type_num;
    return 1;
}

/* the group's side of a call (see the top of this file) */
typedef struct {
    PyObject *owner; /* whose "broken" attribute, when not None, says the group is unusable */
    PyObject *profiler_flag, *profiler_on, *executor, *queue, *acquire, *leave, *next_seq; /* acquire: the lock's */
    PyObject *recorder_module, *observe_module, *group;
    PyObject *s_broken, *s_recorder, *s_started, *s_current, *s_torch, *s_completed, *two, *s_closed;
    Py_ssize_t t_completed, state; /* a record's fields */
} Group;

/* owner, profiler_flag, executor, leave, next_seq, recorder_module, observe_module, group: see Group
 * and the top of this file; t_completed, state, completed: a record's fields and its final state */
static inline int group_set(Group *g, PyObject *const objects[8], Py_ssize_t t_completed, Py_ssize_t state,
                     PyObject *completed) {
    PyObject **fields[] = {&g->owner, &g->profiler_flag, &g->executor, &g->leave, &g->next_seq, &g->recorder_module,
                           &g->observe_module, &g->group};
    for (int i = 0; i < 8; i++) *fields[i] = Py_NewRef(objects[i]);
    PyObject *gate = PyObject_CallMethod(g->executor, "inline_gate", NULL);
    if (!gate) return -1;
    if (!PyTuple_Check(gate) || PyTuple_GET_SIZE(gate) != 2) {
        Py_DECREF(gate);
        PyErr_SetString(PyExc_TypeError, "executor.inline_gate() must return (queue, lock)");
        return -1;
    }
    g->queue = Py_NewRef(PyTuple_GET_ITEM(gate, 0));
    g->acquire = PyObject_GetAttrString(PyTuple_GET_ITEM(gate, 1), "acquire");
    Py_DECREF(gate);
    if (!g->acquire) return -1;
    g->s_completed = Py_NewRef(completed);
    g->t_completed = t_completed, g->state = state;
    g->s_broken = PyUnicode_InternFromString("broken");
    g->s_recorder = PyUnicode_InternFromString("recorder");
    g->s_started = PyUnicode_InternFromString("started");
    g->s_current = PyUnicode_InternFromString("current");
    g->s_torch = PyUnicode_InternFromString("torch");
    g->two = PyLong_FromLong(2);
    g->s_closed = PyUnicode_InternFromString("closed");
    if (!g->s_broken || !g->s_recorder || !g->s_started || !g->s_current || !g->s_torch || !g->two || !g->s_closed)
        return -1;
    if (t_completed < 0 || state < 0) {
        PyErr_SetString(PyExc_ValueError, "a record's fields are indexes");
        return -1;
    }
    return 0;
}

static inline int group_traverse(Group *g, visitproc visit, void *arg) {
    Py_VISIT(g->owner);
    Py_VISIT(g->profiler_flag);
    Py_VISIT(g->profiler_on);
    Py_VISIT(g->executor);
    Py_VISIT(g->queue);
    Py_VISIT(g->acquire);
    Py_VISIT(g->leave);
    Py_VISIT(g->next_seq);
    Py_VISIT(g->recorder_module);
    Py_VISIT(g->observe_module);
    Py_VISIT(g->group);
    return 0;
}

static inline void group_clear(Group *g) {
    Py_CLEAR(g->owner);
    Py_CLEAR(g->profiler_flag);
    Py_CLEAR(g->profiler_on);
    Py_CLEAR(g->executor);
    Py_CLEAR(g->queue);
    Py_CLEAR(g->acquire);
    Py_CLEAR(g->leave);
    Py_CLEAR(g->next_seq);
    Py_CLEAR(g->recorder_module);
    Py_CLEAR(g->observe_module);
    Py_CLEAR(g->group);
    Py_CLEAR(g->s_broken);
    Py_CLEAR(g->s_recorder);
    Py_CLEAR(g->s_started);
    Py_CLEAR(g->s_current);
    Py_CLEAR(g->s_torch);
    Py_CLEAR(g->s_completed);
    Py_CLEAR(g->two);
    Py_CLEAR(g->s_closed);
}

/* the claim's release (a lock's): keeps an exception being raised */
static inline void group_leave(Group *g) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *r = PyObject_CallNoArgs(g->leave);
    if (r)
        Py_DECREF(r);
    else
        PyErr_WriteUnraisable(g->leave);
    PyErr_Restore(type, value, tb);
}

#define DECLINED 1

/* The group for this call. 0: ours (then group_leave must follow); DECLINED; -1: an error. */
static inline int group_claim(Group *g) {
    PyObject *broken = PyObject_GetAttr(g->owner, g->s_broken);
    if (!broken) return -1;
    Py_DECREF(broken);
    if (broken != Py_None) return DECLINED;
    PyObject *torch = PyDict_GetItemWithError(PyImport_GetModuleDict(), g->s_torch);
    if (torch) { /* without torch loaded its profiler cannot be on */
        if (!g->profiler_on && !(g->profiler_on = PyObject_CallNoArgs(g->profiler_flag))) return -1;
        PyObject *on = PyObject_CallNoArgs(g->profiler_on);
        if (!on) return -1;
        int yes = PyObject_IsTrue(on);
        Py_DECREF(on);
        if (yes) return yes < 0 ? -1 : DECLINED;
    } else if (PyErr_Occurred()) {
        return -1;
    }
    /* enter_inline's steps: nothing queued, not closed, the lock without waiting, still nothing
     * queued (a task queued between the test and the claim was issued first) */
    Py_ssize_t queued = PyObject_Length(g->queue);
    if (queued) return queued < 0 ? -1 : DECLINED;
    PyObject *closed = PyObject_GetAttr(g->executor, g->s_closed);
    if (!closed) return -1;
    int yes = PyObject_IsTrue(closed);
    Py_DECREF(closed);
    if (yes) return yes < 0 ? -1 : DECLINED;
    PyObject *no_wait = Py_False;
    PyObject *taken = PyObject_Vectorcall(g->acquire, &no_wait, 1, NULL);
    if (!taken) return -1;
    yes = PyObject_IsTrue(taken);
    Py_DECREF(taken);
    if (yes <= 0) return yes < 0 ? -1 : DECLINED;
    if ((queued = PyObject_Length(g->queue)) != 0) {
        group_leave(g);
        return queued < 0 ? -1 : DECLINED;
    }
    return 0;
}

/* The flight recorder's record of a call started now (op `name`, sequence number `seq`, `nbytes`,
 * `dtype_name`, root or -1), made as the Python paths make it: a new reference, Py_None (a new
 * reference too) when the recorder is off, NULL on an error. The user's frame is two above: the
 * API function's caller (a distcomm or torch caller there costs the recorder's walk). */
static inline PyObject *group_started(Group *g, PyObject *seq, PyObject *name, Py_ssize_t nbytes, PyObject *dtype_name,
                               long root) {
    PyObject *recorder = PyObject_GetAttr(g->recorder_module, g->s_recorder);
    if (!recorder || recorder == Py_None) return recorder;
    PyObject *started = PyObject_GetAttr(recorder, g->s_started);
    Py_DECREF(recorder);
    if (!started) return NULL;
    PyObject *record = NULL;
    PyObject *size = PyLong_FromSsize_t(nbytes), *peer = root < 0 ? Py_NewRef(Py_None) : PyLong_FromLong(root);
    if (size && peer) {
        PyObject *fields[] = {g->group, seq, name, size, dtype_name, peer, g->two};
        record = PyObject_Vectorcall(started, fields, 7, NULL);
    }
    Py_XDECREF(size);
    Py_XDECREF(peer);
    Py_DECREF(started);
    return record;
}

/* the engine observer's notice of a call it takes (`observed`: "latency_<op>"), when the engine has
 * one (its observe_module, else None) and one is set */
static inline int group_observe(Group *g, PyObject *observed) {
    if (g->observe_module == Py_None) return 0;
    PyObject *observer = PyObject_GetAttr(g->observe_module, g->s_current);
    if (!observer) return -1;
    if (observer == Py_None) {
        Py_DECREF(observer);
        return 0;
    }
    PyObject *r = PyObject_CallOneArg(observer, observed);
    Py_DECREF(observer);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

/* a record (group_started's) marked completed now */
static inline int group_completed(Group *g, PyObject *record) {
    if (record == Py_None) return 0;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts); /* time.time()'s clock */
    PyObject *t = PyFloat_FromDouble((double)ts.tv_sec + ts.tv_nsec * 1e-9);
    if (!t || PyList_SetItem(record, g->t_completed, t) < 0) return -1;
    Py_INCREF(g->s_completed);
    return PyList_SetItem(record, g->state, g->s_completed);
}

/* the exception being raised, normalized, handed to `fail(exc, *more)`, which raises the call's
 * error in the operation's words; if fail returns instead, the first error stands */
static inline void group_fail(PyObject *fail, PyObject *const *more, Py_ssize_t nmore) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb) PyException_SetTraceback(value, tb);
    PyObject *args[8];
    args[0] = value;
    for (Py_ssize_t i = 0; i < nmore && i < 7; i++) args[i + 1] = more[i];
    PyObject *r = PyObject_Vectorcall(fail, args, (size_t)(1 + (nmore < 7 ? nmore : 7)), NULL);
    if (r) {
        Py_DECREF(r);
        PyErr_Restore(type, value, tb);
    } else {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
    }
}

#endif

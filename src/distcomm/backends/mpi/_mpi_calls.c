/* The MPI engine's small all_reduce on a numpy array, the whole call in C: Calls.all_reduce.
 *
 * The Python latency path (latency.py's small_all_reduce) is a persistent request's Start on its
 * staging array and a Test loop, around which sat about a dozen Python calls and two numpy copies:
 * at 8 bytes about 2.5 times raw mpi4py's Allreduce (docs/performance-notes.md, "The MPI engine's
 * small all_reduce in C"). This makes the same calls to mpi4py (the request's Start and Test, as
 * Python methods: no MPI header or library is needed to build it) with everything around them in
 * C, and the same record and errors.
 *
 * Where the MPI library's own MPI_Start and MPI_Test are found (library.py: their addresses in the
 * library mpi4py loaded, and each request's handle address), the request is started and tested
 * through them: each of mpi4py's methods releases and retakes the GIL, and a test loop of them
 * spent more time there than in MPI (docs/performance-notes.md). The loop then runs without the
 * GIL, taken back once. The handle address makes this ABI-neutral: MPI_Request is an int in MPICH
 * and a pointer in Open MPI, and both functions take its address.
 *
 * Python keeps every decision that is not the common case, handed in when the group's latency
 * paths are built (see _calls.h for the group's side: claim, sequence number, record):
 *   describe(op, dtype) -> (signature, dtype name, item size, the persistent requests made for
 *       that datatype and op: element count -> (staging array, request)) or None: MPI has no such
 *       reduction, or it is one the Python path finishes (AVG). Asked once per op and dtype.
 *   fallback(array, op): the Python path, for anything this does not take (a torch tensor, a count
 *       with no persistent request yet: its creation is a collective call, which the Python path
 *       makes on every rank at the same call).
 *   wait(request, seq, sig, nbytes): the long wait, once the spin here is over (the deadline, a closed
 *       transport, a peer waiting in another call: MpiCollectives.watch).
 *   fail(exc, op, seq, sig, request, buffers, record): raises the call's error as the Python path does.
 */
#include "../../_calls.h"

#include <stdint.h>
#include <string.h>

/* How long the request is tested here before the Python wait (transport/mpi.py's wait_request: its
 * spin, then yields and sleeps, the deadline, the transport's health) takes over: a peer that is
 * on its way (most calls complete within a few µs), not one that needs this CPU to get there. */
#define SPIN_NS 20000

typedef struct {
    PyObject_HEAD
    PyTypeObject *ndarray, *redop;
    Group g; /* its owner: the group's MpiCollectives ("broken") */
    PyObject *describe, *fallback, *wait, *fail;
    PyObject *entries; /* (type number, op) -> describe()'s answer, or None */
    PyObject *name, *s_Start, *s_Test;
    Py_ssize_t limit;
    int (*start)(void *request);                            /* MPI_Start, or NULL: mpi4py's method */
    int (*test)(void *request, int *flag, void *status);    /* MPI_Test, or NULL */
} Calls;

/* room for any MPI library's MPI_Status (MPICH's is 20 bytes, Open MPI's 24, the MPI 5 ABI's 32) */
typedef struct {
    int64_t words[16];
} AnyStatus;

static int mpi_failed(int rc) {
    PyErr_Format(PyExc_RuntimeError, "MPI error code %d in the all_reduce's persistent request", rc);
    return -1;
}

/* the request at `handle` tested through the library for up to SPIN_NS, without the GIL: 1 done, 0
 * not yet, -1 an MPI error (raised) */
static int spin(Calls *c, void *handle) {
    int rc, flag = 0;
    AnyStatus status;
    Py_BEGIN_ALLOW_THREADS
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (unsigned i = 1;; i++) {
        if ((rc = c->test(handle, &flag, &status)) != 0 || flag) break;
        if ((i & 15) == 0) {
            clock_gettime(CLOCK_MONOTONIC, &t);
            if ((t.tv_sec - t0.tv_sec) * 1000000000LL + (t.tv_nsec - t0.tv_nsec) > SPIN_NS) break;
        }
    }
    Py_END_ALLOW_THREADS
    return rc == 0 ? flag : mpi_failed(rc);
}

static PyObject *fall_back(Calls *c, PyObject *const *args, Py_ssize_t nargs) {
    return PyObject_Vectorcall(c->fallback, args, (size_t)nargs, NULL);
}

/* describe()'s answer for (dtype, op): 1 and its fields (borrowed: the dict keeps the tuple), 0 for
 * None, -1 on an error */
static int entry_of(Calls *c, const Arr *a, long red, PyObject **sig, PyObject **dtype_name, Py_ssize_t *itemsize,
                    PyObject **made) {
    PyObject *key = PyLong_FromLong((long)a->type_num * 64 + red);
    if (!key) return -1;
    PyObject *t = PyDict_GetItemWithError(c->entries, key);
    if (!t) {
        if (PyErr_Occurred()) {
            Py_DECREF(key);
            return -1;
        }
        t = PyObject_CallFunction(c->describe, "lO", red, a->dtype);
        if (!t || PyDict_SetItem(c->entries, key, t) < 0) {
            Py_XDECREF(t);
            Py_DECREF(key);
            return -1;
        }
        Py_DECREF(t);
    }
    Py_DECREF(key);
    if (t == Py_None) return 0;
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 4 || !PyDict_Check(PyTuple_GET_ITEM(t, 3))) {
        PyErr_SetString(PyExc_TypeError, "describe() must return None or (sig, dtype name, item size, dict)");
        return -1;
    }
    *sig = PyTuple_GET_ITEM(t, 0), *dtype_name = PyTuple_GET_ITEM(t, 1), *made = PyTuple_GET_ITEM(t, 3);
    *itemsize = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 2));
    if (*itemsize <= 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "describe(): an item size must be positive");
        return -1;
    }
    return 1;
}

/* the request's method `name` called, as a truth value (-1: an error) */
static int call_true(PyObject *req, PyObject *name) {
    PyObject *r = PyObject_CallMethodNoArgs(req, name);
    if (!r) return -1;
    int yes = PyObject_IsTrue(r);
    Py_DECREF(r);
    return yes;
}

/* all_reduce(array, op) -> bool: see the top of this file */
static PyObject *Calls_all_reduce(Calls *c, PyObject *const *args, Py_ssize_t nargs) {
    Arr x, staging;
    PyObject *sig, *dtype_name, *made;
    Py_ssize_t itemsize;
    if (nargs != 2 || !array_of(c->ndarray, args[0], &x) || Py_TYPE(args[1]) != c->redop)
        return fall_back(c, args, nargs);
    long red = PyLong_AsLong(args[1]);
    if (red < 0 || red > 62) {
        PyErr_Clear();
        return fall_back(c, args, nargs);
    }
    int known = entry_of(c, &x, red, &sig, &dtype_name, &itemsize, &made);
    if (known < 0) return NULL;
    Py_ssize_t n = x.count * itemsize;
    if (!known || n <= 0 || n > c->limit) return fall_back(c, args, nargs);
    PyObject *count = PyLong_FromSsize_t(x.count);
    if (!count) return NULL;
    /* borrowed: (staging array, request, the request's handle address) */
    PyObject *staged = PyDict_GetItemWithError(made, count);
    Py_DECREF(count);
    if (!staged) return PyErr_Occurred() ? NULL : fall_back(c, args, nargs);
    if (!PyTuple_Check(staged) || PyTuple_GET_SIZE(staged) != 3 ||
        !array_of(c->ndarray, PyTuple_GET_ITEM(staged, 0), &staging) || staging.type_num != x.type_num ||
        staging.count != x.count)
        return fall_back(c, args, nargs);
    PyObject *req = PyTuple_GET_ITEM(staged, 1);
    void *handle = c->test ? PyLong_AsVoidPtr(PyTuple_GET_ITEM(staged, 2)) : NULL;
    if (!handle && PyErr_Occurred()) return NULL;
    int claimed = group_claim(&c->g);
    if (claimed < 0) return NULL;
    if (claimed == DECLINED) return fall_back(c, args, nargs);

    Py_INCREF(staged); /* the request and its staging array, held for the call */
    PyObject *record = NULL, *seq = PyObject_CallNoArgs(c->g.next_seq);
    if (!seq) goto released;
    memcpy(staging.data, x.data, (size_t)n);
    int done = 0;
    if (handle) {
        int rc = c->start(handle);
        if (rc != 0) {
            mpi_failed(rc);
            goto failed;
        }
        /* recorded once MPI has the call, while the peers' calls meet it (the spin gives the GIL away) */
        record = group_started(&c->g, seq, c->name, n, dtype_name, -1);
        if (!record) goto failed;
        if ((done = spin(c, handle)) < 0) goto failed;
    } else {
        if (call_true(req, c->s_Start) < 0) goto failed;
        /* recorded once MPI has the call, as the Python path does: while the peers' calls meet it */
        record = group_started(&c->g, seq, c->name, n, dtype_name, -1);
        if (!record) goto failed;
        struct timespec t0, t;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (unsigned i = 1; !done; i++) {
            if ((done = call_true(req, c->s_Test)) < 0) goto failed;
            if (!done && (i & 15) == 0) {
                clock_gettime(CLOCK_MONOTONIC, &t);
                if ((t.tv_sec - t0.tv_sec) * 1000000000LL + (t.tv_nsec - t0.tv_nsec) > SPIN_NS) break;
            }
        }
    }
    if (!done) { /* the long wait, watched as this call: its sequence number, signature and size */
        PyObject *nbytes = PyLong_FromSsize_t(n);
        if (!nbytes) goto failed;
        PyObject *wargs[] = {req, seq, sig, nbytes};
        PyObject *r = PyObject_Vectorcall(c->wait, wargs, 4, NULL);
        Py_DECREF(nbytes);
        if (!r) goto failed;
        Py_DECREF(r);
    }
    memcpy(x.data, staging.data, (size_t)n);
    group_leave(&c->g);
    Py_DECREF(staged);
    Py_DECREF(seq);
    if (group_completed(&c->g, record) < 0) {
        Py_DECREF(record);
        return NULL;
    }
    Py_DECREF(record);
    Py_RETURN_TRUE;

failed: {
    if (!record) { /* failed before MPI had the call: recorded now, as the Python path does */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        record = group_started(&c->g, seq, c->name, n, dtype_name, -1);
        if (!record) record = Py_NewRef(Py_None);
        PyErr_Clear();
        PyErr_Restore(type, value, tb);
    }
    PyObject *buffers = PyTuple_Pack(2, args[0], PyTuple_GET_ITEM(staged, 0));
    if (!buffers) goto released;
    PyObject *more[] = {c->name, seq, sig, req, buffers, record};
    group_fail(c->fail, more, 6);
    Py_DECREF(buffers);
}
released:
    group_leave(&c->g);
    Py_DECREF(staged);
    Py_XDECREF(seq);
    Py_XDECREF(record);
    return NULL;
}

/* -- the type ------------------------------------------------------------------------------------ */
static int Calls_traverse(Calls *c, visitproc visit, void *arg) {
    Py_VISIT(c->ndarray);
    Py_VISIT(c->redop);
    Py_VISIT(c->describe);
    Py_VISIT(c->fallback);
    Py_VISIT(c->wait);
    Py_VISIT(c->fail);
    Py_VISIT(c->entries);
    return group_traverse(&c->g, visit, arg);
}

static int Calls_clear(Calls *c) {
    Py_CLEAR(c->ndarray);
    Py_CLEAR(c->redop);
    Py_CLEAR(c->describe);
    Py_CLEAR(c->fallback);
    Py_CLEAR(c->wait);
    Py_CLEAR(c->fail);
    Py_CLEAR(c->entries);
    Py_CLEAR(c->name);
    Py_CLEAR(c->s_Start);
    Py_CLEAR(c->s_Test);
    group_clear(&c->g);
    return 0;
}

static void Calls_dealloc(Calls *c) {
    PyObject_GC_UnTrack(c);
    Calls_clear(c);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static int Calls_init(Calls *c, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"ndarray", "redop", "owner", "profiler_flag", "executor", "leave", "next_seq",
                         "recorder_module", "group", "describe", "fallback", "wait", "fail", "limit", "t_completed",
                         "state", "completed", "start", "test", NULL};
    PyTypeObject *ndarray, *redop;
    PyObject *o[11], *completed;
    Py_ssize_t limit, t_completed, state;
    unsigned long long start = 0, test = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!OOOOOOOOOOOnnnO|KK", kw, &PyType_Type, &ndarray, &PyType_Type,
                                     &redop, &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &o[8], &o[9],
                                     &o[10], &limit, &t_completed, &state, &completed, &start, &test))
        return -1;
    if (!start != !test) {
        PyErr_SetString(PyExc_ValueError, "Calls: MPI_Start and MPI_Test come together (both addresses, or neither)");
        return -1;
    }
    if (limit < 0) {
        PyErr_SetString(PyExc_ValueError, "Calls: the limit is a byte count");
        return -1;
    }
    Calls_clear(c);
    /* the group's side: owner, profiler_flag, executor, leave, next_seq, recorder_module, no observer, group */
    PyObject *const side[8] = {o[0], o[1], o[2], o[3], o[4], o[5], Py_None, o[6]};
    if (group_set(&c->g, side, t_completed, state, completed) < 0) return -1;
    c->ndarray = (PyTypeObject *)Py_NewRef(ndarray);
    c->redop = (PyTypeObject *)Py_NewRef(redop);
    c->describe = Py_NewRef(o[7]);
    c->fallback = Py_NewRef(o[8]);
    c->wait = Py_NewRef(o[9]);
    c->fail = Py_NewRef(o[10]);
    c->limit = limit;
    c->start = (int (*)(void *))(uintptr_t)start;
    c->test = (int (*)(void *, int *, void *))(uintptr_t)test;
    c->entries = PyDict_New();
    c->name = PyUnicode_InternFromString("all_reduce");
    c->s_Start = PyUnicode_InternFromString("Start");
    c->s_Test = PyUnicode_InternFromString("Test");
    return c->entries && c->name && c->s_Start && c->s_Test ? 0 : -1;
}

static PyObject *Calls_direct(Calls *c, void *closure) { return PyBool_FromLong(c->test != NULL); }

static PyGetSetDef Calls_getset[] = {
    {"direct", (getter)Calls_direct, NULL, "the requests start and are tested through the MPI library itself", NULL},
    {NULL}};

static PyMethodDef Calls_methods[] = {
    {"all_reduce", (PyCFunction)(void (*)(void))Calls_all_reduce, METH_FASTCALL, "all_reduce(array, op) -> bool"},
    {NULL}};

static PyTypeObject CallsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "distcomm.backends.mpi._mpi_calls.Calls",
    .tp_basicsize = sizeof(Calls),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The MPI engine's small all_reduce on a numpy array, the whole call in C (see _mpi_calls.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Calls_init,
    .tp_dealloc = (destructor)Calls_dealloc,
    .tp_traverse = (traverseproc)Calls_traverse,
    .tp_clear = (inquiry)Calls_clear,
    .tp_methods = Calls_methods,
    .tp_getset = Calls_getset,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "distcomm.backends.mpi._mpi_calls",
                                    .m_size = -1, .m_doc = "The MPI engine's whole calls in C (see _mpi_calls.c)."};

PyMODINIT_FUNC PyInit__mpi_calls(void) {
    if (PyType_Ready(&CallsType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddObjectRef(m, "Calls", (PyObject *)&CallsType) < 0) Py_CLEAR(m);
    return m;
}

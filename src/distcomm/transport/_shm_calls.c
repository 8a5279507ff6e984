/* A group's small collectives on numpy arrays, each a whole call in C: Calls.
 *
 * The latency paths (backends/shm/latency.py) run a small collective's one round as a plan of
 * copies in one C call (shm_move). Around that call sat about thirty Python calls: the array's
 * checks, the signature, the claim of the group, the sequence number, the flight recorder's
 * record, the plan's tuples, the round's opening and closing. At 8 bytes those were most of the
 * time, several times MPICH's whole call (docs/performance-notes.md, "Whole calls in C").
 *
 * A Calls method takes the API function's own arguments, e.g. broadcast(array, root), and does
 * the latency path's call: the same checks, the same round, the same record, the same errors.
 * Python keeps every decision that is not the common case, handed in as callables when the group's
 * latency paths are built:
 *
 *   describe(op, dtype, reduce_op, root) -> what a call of that dtype, op and root needs (its
 *       signatures, dtype name and item size, the C fold's kind, Python's reducer), or None: the
 *       dtype or op is not one the round takes. Asked once per combination; kept in a dict.
 *   fallbacks[op](*args): the Python latency path of the op, called with the same arguments for
 *       anything this does not take (a tensor that is not a plain CPU one, a list of anything but
 *       numpy arrays, a message past the limit, a busy group, torch's profiler on): it takes the
 *       call or declines it to the general path, whose checks and errors stand.
 *   the group's side (_calls.h): its claim (profiler_flag, the executor), leave(), next_seq(),
 *       the flight recorder and the engine observer's modules;
 *   open_round(seq, sig, channel), ring_consumed(): the round's opening where shm_open_round
 *       leaves it to Python (its slot reuse waits that sleep, crash news, a deferred check due)
 *       and the peers to ring, as the Python paths call them.
 *   handback(status, k, seq, header_sig, channel, nbytes, extra, check, reads, kind, red, dtype,
 *            first_copies):
 *       the rest of a round shm_move handed back (a peer asleep, the long wait, a mismatch, a root
 *       that differs); returns None or the first (peer, its extra word) that differs.
 *   fail(exc, op, seq, sig, record): an error within a claimed call: marks the group's memory
 *       broken and raises the error in the operation's words.
 *   refuse(op, seq, sig, root, peer, value, record): raises the root mismatch (the round completed).
 *   settle(seq, sig, channel): GroupShm.settle_deferred, when shm_settle hands the deferred checks
 *       back (one is due and a peer has not posted, or one differs); returns None or a
 *       LateDisagreement, which refuse_late(late, op, seq, sig) raises once the call that found it
 *       has completed. ring_posted(): a peer sleeps (a deferred round's post).
 *   resume_all_to_all(status, k, seq, sig, channel, output, input): an all_to_all_single's first
 *       round handed back (a peer sends another split, or more rounds, or votes for single copies):
 *       its algorithm goes on from there.
 *
 * A rooted call (broadcast, reduce, gather, scatter) runs its round with shm_move's defer: a member
 * that does not read every peer returns without waiting for them, and its checks of their headers
 * are made by a later call, from their history (shm_settle; see _shm_round.c).
 *
 * What this costs and saves is in docs/performance-notes.md. The Python latency paths stay: they
 * take torch tensors, and every call where this module is not built.
 */
#include "_shm_round.h"

#ifndef DISTCOMM_NUMPY_FIELDS

int shm_add_calls(PyObject *module) { return PyModule_AddIntConstant(module, "CALLS", 0); }

#else

#include "../_calls.h"

enum { C_BROADCAST, C_REDUCE, C_ALL_GATHER, C_ALL_GATHER_INTO_TENSOR, C_GATHER, C_SCATTER, C_REDUCE_SCATTER_TENSOR,
       C_ALL_REDUCE, C_BARRIER, C_ALL_TO_ALL_SINGLE, C_NOPS };
static const char *const NAMES[C_NOPS] = {"broadcast", "reduce", "all_gather", "all_gather_into_tensor", "gather",
                                          "scatter", "reduce_scatter_tensor", "all_reduce", "barrier",
                                          "all_to_all_single"};

/* the largest world a call takes here (its plan lives on the stack); larger ones take Python's */
#define MAX_MEMBERS 64

/* torch tensors taken lately, each with its memory as a numpy array (see memory_of) */
#define KNOWN_TENSORS 8

typedef struct {
    PyObject *tensor, *dtype, *flat; /* held: the tensor, its dtype, its memory (a numpy array) */
    long long address;               /* its data pointer then */
    Py_ssize_t numel;
} Known;

/* the numpy views of a call's torch tensors, held until the call returns: another call (another
 * thread's, while this one runs Python code) may replace their entries of `known` meanwhile */
typedef struct {
    PyObject *refs[2];
    int n;
} Held;

typedef struct {
    PyObject_HEAD
    Rounds *rounds;
    PyTypeObject *ndarray, *redop;
    Group g;                                              /* its owner: the GroupShm ("broken") */
    PyObject *open_round, *ring_consumed;
    PyObject *describe, *handback, *fail, *refuse, *resume_all_to_all;
    PyObject *settle, *refuse_late, *ring_posted;
    PyObject *channels, *fallbacks;                       /* tuples in C_* order */
    PyObject *entries;                                    /* key -> describe()'s answer, or None */
    PyObject *names[C_NOPS], *observed[C_NOPS];           /* "broadcast", "latency_broadcast", ... */
    PyObject *s_torch;
    PyObject *tensor_memory;                              /* (tensor) -> its memory as numpy, or None */
    PyObject *tensor_type;                                /* torch.Tensor, once torch is loaded */
    PyObject *s_Tensor, *s_data_ptr, *s_numel, *s_is_contiguous, *s_dtype;
    Known known[KNOWN_TENSORS];
    int next_known; /* the entry of `known` to replace next */
    Py_ssize_t limits[C_NOPS], rs_total, scatter_step;
    int direct_reads;                                     /* peers may read our memory: all_to_all's address */
    int defer;                                            /* rooted calls defer checks (shm_move) */
} Calls;

static void forget(Known *k) {
    Py_CLEAR(k->tensor);
    Py_CLEAR(k->dtype);
    Py_CLEAR(k->flat);
}

/* A method's answer as a C integer (-1 with no exception: not an integer). */
static long long call_long(PyObject *o, PyObject *name) {
    PyObject *r = PyObject_CallMethodNoArgs(o, name);
    if (!r) return -1;
    long long v = PyLong_Check(r) ? PyLong_AsLongLong(r) : -1;
    Py_DECREF(r);
    return v;
}

/* A torch tensor's memory as an Arr: a plain dense CPU tensor (tensor_memory's answer, kept for
 * the next calls with the same tensor, as the Python paths keep theirs), else 0. Only an exact
 * torch.Tensor (a subclass may override what a view means: the Python path decides). */
static int tensor_of(Calls *c, PyObject *o, Arr *a, Held *h) {
    if (h->n >= 2) return 0; /* a call takes at most two tensors here */
    if (!c->tensor_type) {
        PyObject *torch = PyDict_GetItemWithError(PyImport_GetModuleDict(), c->s_torch);
        if (!torch) {
            PyErr_Clear();
            return 0;
        }
        c->tensor_type = PyObject_GetAttr(torch, c->s_Tensor);
        if (!c->tensor_type) {
            PyErr_Clear();
            return 0;
        }
    }
    if ((PyObject *)Py_TYPE(o) != c->tensor_type) return 0;
    for (int i = 0; i < KNOWN_TENSORS; i++) {
        Known *k = &c->known[i];
        if (k->tensor != o) continue;
        PyObject *dtype = PyObject_GetAttr(o, c->s_dtype);
        int same = dtype == k->dtype && call_long(o, c->s_data_ptr) == k->address &&
                   call_long(o, c->s_numel) == k->numel;
        Py_XDECREF(dtype);
        if (same) {
            PyObject *contiguous = PyObject_CallMethodNoArgs(o, c->s_is_contiguous);
            same = contiguous == Py_True;
            Py_XDECREF(contiguous);
        }
        PyErr_Clear();
        if (same && array_of(c->ndarray, k->flat, a)) {
            h->refs[h->n++] = Py_NewRef(k->flat);
            return 1;
        }
        if (same) return 0;
        forget(k);
        break;
    }
    PyObject *flat = PyObject_CallOneArg(c->tensor_memory, o);
    if (!flat) {
        PyErr_Clear();
        return 0;
    }
    if (!array_of(c->ndarray, flat, a)) {
        Py_DECREF(flat);
        return 0;
    }
    long long address = call_long(o, c->s_data_ptr), numel = call_long(o, c->s_numel);
    PyObject *dtype = PyObject_GetAttr(o, c->s_dtype);
    PyErr_Clear();
    if (!dtype || address == -1 || numel < 0) { /* nothing to know it by next time: Python's */
        Py_XDECREF(dtype);
        Py_DECREF(flat);
        return 0;
    }
    Known *k = &c->known[c->next_known];
    c->next_known = (c->next_known + 1) % KNOWN_TENSORS;
    forget(k);
    k->tensor = Py_NewRef(o), k->dtype = dtype, k->flat = flat, k->address = address, k->numel = (Py_ssize_t)numel;
    h->refs[h->n++] = Py_NewRef(flat); /* a->obj is flat: held for the call, whatever becomes of k */
    return 1;
}

/* a numpy array's or a torch tensor's memory (see array_of and tensor_of): at most two tensors a
 * call (the lists of gather, scatter and all_gather take numpy arrays only), their views held in h */
static int memory_of(Calls *c, PyObject *o, Arr *a, Held *h) {
    return array_of(c->ndarray, o, a) || tensor_of(c, o, a, h);
}

/* Calls_<op>: <op>_call with the views of its tensors held until it returns */
#define HOLDING(op)                                                                  \
    static PyObject *Calls_##op(Calls *c, PyObject *const *args, Py_ssize_t nargs) { \
        Held h = {{NULL, NULL}, 0};                                                  \
        PyObject *result = op##_call(c, args, nargs, &h);                            \
        for (int i = 0; i < h.n; i++) Py_DECREF(h.refs[i]);                          \
        return result;                                                               \
    }

/* describe()'s answer for a call */
typedef struct {
    uint64_t sig, header_sig;
    PyObject *sig_obj, *dtype_name, *red, *np_dtype; /* borrowed from the entry, which the dict keeps */
    int kind;
    Py_ssize_t itemsize, stride, head;
} Entry;

static int entry_of(Calls *c, int op, const Arr *a, long reduce_op, long root, Entry *e) {
    /* a: the call's array (NULL for a barrier, whose dtype is None) */
    long long key = (((long long)op * 256 + (a ? a->type_num : 0)) * 64 + (reduce_op + 1)) * 65536 + (root + 1);
    PyObject *k = PyLong_FromLongLong(key);
    if (!k) return -1;
    PyObject *t = PyDict_GetItemWithError(c->entries, k);
    if (!t) {
        if (PyErr_Occurred()) {
            Py_DECREF(k);
            return -1;
        }
        t = PyObject_CallFunction(c->describe, "OOll", c->names[op], a ? a->dtype : Py_None, reduce_op, root);
        if (!t || PyDict_SetItem(c->entries, k, t) < 0) {
            Py_XDECREF(t);
            Py_DECREF(k);
            return -1;
        }
        Py_DECREF(t); /* the dict keeps it */
    }
    Py_DECREF(k);
    if (t == Py_None) return 0;
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 9) {
        PyErr_SetString(PyExc_TypeError, "describe() must return None or a 9-tuple");
        return -1;
    }
    e->sig_obj = PyTuple_GET_ITEM(t, 0);
    e->sig = PyLong_AsUnsignedLongLong(e->sig_obj);
    e->header_sig = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, 1));
    e->dtype_name = PyTuple_GET_ITEM(t, 2);
    e->kind = (int)PyLong_AsLong(PyTuple_GET_ITEM(t, 3));
    e->itemsize = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 4));
    e->stride = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 5));
    e->red = PyTuple_GET_ITEM(t, 6);
    e->np_dtype = PyTuple_GET_ITEM(t, 7);
    e->head = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 8));
    if (PyErr_Occurred()) return -1;
    if (e->itemsize <= 0 || e->stride < 0 || e->head < 0 || (e->kind != -1 && !shm_valid_kind(e->kind))) {
        PyErr_SetString(PyExc_ValueError, "describe(): an item size must be positive and a kind known");
        return -1;
    }
    return 1;
}

/* What a call of op on a's memory needs (entry_of's, into e) and its bytes n (a's elements): 1 when
 * op takes that many bytes here, 0 when Python's path decides (an unknown dtype or op, a message
 * past the limit), -1 on an error. */
static int described(Calls *c, int op, const Arr *a, long reduce_op, long root, Entry *e, Py_ssize_t *n) {
    int known = entry_of(c, op, a, reduce_op, root, e);
    if (known <= 0) return known;
    *n = a->count * e->itemsize;
    return *n > 0 && *n <= c->limits[op];
}

/* A plan: the copies of shm_move, with the Python objects and offsets of every read kept for a
 * round handed back to Python (round_plan.finish reads them as tuples). */
typedef struct {
    Write w[MAX_MEMBERS];
    Read r[MAX_MEMBERS];
    PyObject *src[MAX_MEMBERS], *dst[MAX_MEMBERS]; /* borrowed; src NULL: a member's slot */
    Py_ssize_t src_off[MAX_MEMBERS], dst_off[MAX_MEMBERS];
    Py_ssize_t nw, nr;
    int first_copies; /* a fold's first read copies (shm_move's), else every read folds */
    Expect e[3 * MAX_MEMBERS];
    Py_ssize_t ne;
    int64_t table[3 * MAX_MEMBERS + 3]; /* all_to_all's first words, written into the slot */
} Plan;

/* an empty plan (not the whole struct: a few KiB to clear on every call) */
#define EMPTY_PLAN(p) ((p).nw = (p).nr = (p).ne = 0, (p).first_copies = 1)

static void write_of(Plan *p, const Arr *a, Py_ssize_t off, Py_ssize_t slot_off, Py_ssize_t n) {
    p->w[p->nw++] = (Write){a->data + off, slot_off, n};
}

/* a read from member q's slot (q >= 0) or from array src (q < 0) */
static void read_of(Plan *p, int q, const Arr *src, Py_ssize_t src_off, const Arr *dst, Py_ssize_t dst_off,
                    Py_ssize_t n) {
    Py_ssize_t i = p->nr++;
    p->r[i] = (Read){q, q >= 0 ? NULL : src->data, src_off, n, dst->data + dst_off};
    p->src[i] = q >= 0 ? NULL : src->obj;
    p->dst[i] = dst->obj;
    p->src_off[i] = src_off, p->dst_off[i] = dst_off;
}

static PyObject *reads_as_tuples(const Plan *p) {
    PyObject *reads = PyTuple_New(p->nr);
    if (!reads) return NULL;
    for (Py_ssize_t i = 0; i < p->nr; i++) {
        PyObject *t = p->src[i] ? Py_BuildValue("(OnOnn)", p->src[i], p->src_off[i], p->dst[i], p->dst_off[i],
                                                p->r[i].n)
                                : Py_BuildValue("(inOnn)", p->r[i].peer, p->src_off[i], p->dst[i], p->dst_off[i],
                                                p->r[i].n);
        if (!t) {
            Py_DECREF(reads);
            return NULL;
        }
        PyTuple_SET_ITEM(reads, i, t);
    }
    return reads;
}

/* what a call declined here does: the Python path, with the same arguments */
static PyObject *fall_back(Calls *c, int op, PyObject *const *args, Py_ssize_t nargs) {
    return PyObject_Vectorcall(PyTuple_GET_ITEM(c->fallbacks, op), args, (size_t)nargs, NULL);
}

/* A claimed call: its sequence number, its record, the round, the record completed. As the Python
 * paths' run_round: an error within the round goes through fail() (the group's memory is then
 * broken), a root that differs through refuse() once the group is released. */
static PyObject *run(Calls *c, int op, PyObject *const *call_args, const Entry *e, Plan *p, uint64_t nbytes,
                     uint64_t extra, int check, long root, Py_ssize_t record_bytes) {
    PyObject *seq = NULL, *record = NULL, *disagreeing = NULL, *late = NULL;
    uint64_t k = 0;
    seq = PyObject_CallNoArgs(c->g.next_seq);
    if (!seq) goto released;
    uint64_t seq_value = PyLong_AsUnsignedLongLong(seq);
    if (PyErr_Occurred()) goto released;
    record = group_started(&c->g, seq, c->names[op], record_bytes, e->dtype_name, root);
    if (!record) goto released;
    if (group_observe(&c->g, c->observed[op]) < 0) goto failed;
    PyObject *channel = PyTuple_GET_ITEM(c->channels, op);
    Rounds *rounds = c->rounds;
    if (shm_deferred(rounds)) { /* earlier rooted calls' checks left to later (shm_move's defer) */
        /* Python's, with a deadline: one is due, or differs, or this call will wait for every peer
         * (not a rooted one), so a peer that stopped at a mismatch there must be found first */
        if (shm_settle(rounds) != DONE || (!check && shm_deferred(rounds))) {
            PyObject *settling[] = {seq, e->sig_obj, channel};
            late = PyObject_Vectorcall(c->settle, settling, 3, NULL);
            if (!late) goto failed;
            if (late == Py_None) Py_CLEAR(late);
        }
    }
    if (!shm_open_round(rounds, &k)) { /* Python's opening: it checks, waits and raises */
        PyObject *opening[] = {seq, e->sig_obj, channel};
        PyObject *opened = PyObject_Vectorcall(c->open_round, opening, 3, NULL);
        if (!opened) goto failed;
        k = PyLong_AsUnsignedLongLong(opened);
        Py_DECREF(opened);
        if (PyErr_Occurred()) goto failed;
    }
    /* a rooted call defers the checks it need not wait for: its number (op + 1) names it later */
    int status = shm_move(rounds, k, seq_value, e->header_sig, nbytes, extra, check, p->w, p->nw, p->r, p->nr,
                          e->kind, p->first_copies, p->e, p->ne, check && c->defer ? op + 1 : 0);
    if (!(status & (PENDING | MISMATCH | DIFFERS))) { /* done: ring whoever is due */
        if (status & RING_POSTED) {
            PyObject *r = PyObject_CallNoArgs(c->ring_posted);
            if (!r) goto failed;
            Py_DECREF(r);
        }
        if (status & RING_CONSUMED) {
            PyObject *r = PyObject_CallNoArgs(c->ring_consumed);
            if (!r) goto failed;
            Py_DECREF(r);
        }
    } else if (status != DONE && op == C_ALL_TO_ALL_SINGLE) {
        PyObject *r = PyObject_CallFunction(c->resume_all_to_all, "iKOKOOO", status, k, seq, e->header_sig, channel,
                                            call_args[0], call_args[1]);
        if (!r) goto failed;
        Py_DECREF(r);
    } else if (status != DONE) {
        PyObject *reads = reads_as_tuples(p);
        if (!reads) goto failed;
        disagreeing = PyObject_CallFunction(c->handback, "iKOKOKKOOiOOO", status, k, seq, e->header_sig, channel,
                                            nbytes, extra, check ? Py_True : Py_False, reads, e->kind, e->red,
                                            e->np_dtype, p->first_copies ? Py_True : Py_False);
        Py_DECREF(reads);
        if (!disagreeing) goto failed;
    }
    group_leave(&c->g);
    if (disagreeing && disagreeing != Py_None) {
        PyObject *r = PyObject_CallFunction(c->refuse, "OOKlOO", c->names[op], seq, e->sig, root, disagreeing, record);
        Py_XDECREF(r); /* it raises */
        goto out;
    }
    if (group_completed(&c->g, record) < 0) goto out;
    if (late) { /* an earlier call's root check, completed in this one: raised now that this one is done */
        PyObject *r = PyObject_CallFunction(c->refuse_late, "OOOO", late, c->names[op], seq, e->sig_obj);
        Py_XDECREF(r); /* it raises */
        goto out;
    }
    Py_XDECREF(disagreeing);
    Py_XDECREF(record);
    Py_DECREF(seq);
    Py_RETURN_TRUE;

failed: { /* within the round: fail() marks the memory broken and raises the error in the op's words */
    PyObject *more[] = {c->names[op], seq, e->sig_obj, record};
    group_fail(c->fail, more, 4);
}
released:
    group_leave(&c->g);
out:
    Py_XDECREF(late);
    Py_XDECREF(disagreeing);
    Py_XDECREF(record);
    Py_XDECREF(seq);
    return NULL;
}

/* A call of op that passed its checks: claimed and run here, or (declined) given to Python. */
static PyObject *claim_and_run(Calls *c, int op, PyObject *const *args, Py_ssize_t nargs, const Entry *e, Plan *p,
                               uint64_t nbytes, uint64_t extra, int check, long root, Py_ssize_t record_bytes) {
    int claimed = group_claim(&c->g);
    if (claimed < 0) return NULL;
    if (claimed == DECLINED) return fall_back(c, op, args, nargs);
    return run(c, op, args, e, p, nbytes, extra, check, root, record_bytes);
}

static long root_of(Calls *c, PyObject *o) {
    if (!PyLong_CheckExact(o)) return -1;
    long root = PyLong_AsLong(o);
    if (root < 0 || root >= c->rounds->size) {
        PyErr_Clear();
        return -1;
    }
    return root;
}

/* gather's or scatter's list: on the root, `size` arrays each like `like`; elsewhere none (None or
 * an empty list). 1: it is; 0: Python decides. */
static int root_list(Calls *c, PyObject *list, const Arr *like, long root, Arr *out) {
    Rounds *r = c->rounds;
    if (r->rank != root) return list == Py_None || (PyList_CheckExact(list) && PyList_GET_SIZE(list) == 0);
    if (!PyList_CheckExact(list) || PyList_GET_SIZE(list) != r->size) return 0;
    for (int q = 0; q < r->size; q++)
        if (!array_of(c->ndarray, PyList_GET_ITEM(list, q), &out[q]) || out[q].type_num != like->type_num ||
            out[q].count != like->count)
            return 0;
    return 1;
}

/* broadcast(array, root) */
static PyObject *broadcast_call(Calls *c, PyObject *const *args, Py_ssize_t nargs, Held *h) {
    Arr x;
    long root;
    Entry e;
    if (nargs != 2 || !memory_of(c, args[0], &x, h) || (root = root_of(c, args[1])) < 0) goto python;
    Py_ssize_t n = 0;
    int takes = described(c, C_BROADCAST, &x, -1, root, &e, &n);
    if (takes < 0) return NULL;
    if (!takes) goto python;
    Plan p;
    EMPTY_PLAN(p);
    if (c->rounds->rank == root)
        write_of(&p, &x, 0, 0, n);
    else
        read_of(&p, (int)root, NULL, 0, &x, 0, n);
    return claim_and_run(c, C_BROADCAST, args, nargs, &e, &p, (uint64_t)n, (uint64_t)root, 1, root, n);
python:
    return fall_back(c, C_BROADCAST, args, nargs);
}

/* reduce(array, op, root): every member's copy folded on the root in rank order */
static PyObject *reduce_call(Calls *c, PyObject *const *args, Py_ssize_t nargs, Held *h) {
    Arr x;
    long root, red;
    Entry e;
    if (nargs != 3 || !memory_of(c, args[0], &x, h) || Py_TYPE(args[1]) != c->redop ||
        (root = root_of(c, args[2])) < 0)
        goto python;
    red = PyLong_AsLong(args[1]);
    if (red < 0 || red > 62) {
        PyErr_Clear();
        goto python;
    }
    Py_ssize_t n = 0;
    int takes = described(c, C_REDUCE, &x, red, root, &e, &n);
    if (takes < 0) return NULL;
    if (!takes || e.kind < 0) goto python;
    Plan p;
    EMPTY_PLAN(p);
    write_of(&p, &x, 0, 0, n);
    if (c->rounds->rank == root)
        for (int q = 0; q < c->rounds->size; q++) read_of(&p, q, NULL, 0, &x, 0, n);
    return claim_and_run(c, C_REDUCE, args, nargs, &e, &p, (uint64_t)n, (uint64_t)root, 1, root, n);
python:
    return fall_back(c, C_REDUCE, args, nargs);
}

/* gather_slots' round: every member's block (its own from its array) into outs[q], or into one
 * array at q * n (into_one); only the members that read (reads) read */
static void gather_plan(Plan *p, Rounds *r, const Arr *send, Py_ssize_t n, const Arr *outs, const Arr *into_one,
                        int writes, int reads) {
    if (writes) write_of(p, send, 0, 0, n);
    if (!reads) return;
    for (int q = 0; q < r->size; q++) {
        const Arr *dst = into_one ? into_one : &outs[q];
        Py_ssize_t at = into_one ? q * n : 0;
        if (q == r->rank)
            read_of(p, -1, send, 0, dst, at, n);
        else
            read_of(p, q, NULL, 0, dst, at, n);
    }
}

/* all_gather(list of arrays, array) */
static PyObject *all_gather_call(Calls *c, PyObject *const *args, Py_ssize_t nargs, Held *h) {
    Arr send, outs[MAX_MEMBERS];
    Entry e;
    Rounds *r = c->rounds;
    if (nargs != 2 || !memory_of(c, args[1], &send, h) || !PyList_CheckExact(args[0]) ||
        PyList_GET_SIZE(args[0]) != r->size)
        goto python;
    for (int q = 0; q < r->size; q++)
        if (!array_of(c->ndarray, PyList_GET_ITEM(args[0], q), &outs[q]) || outs[q].type_num != send.type_num ||
            outs[q].count != send.count)
            goto python;
    Py_ssize_t n = 0;
    int takes = described(c, C_ALL_GATHER, &send, -1, -1, &e, &n);
    if (takes < 0) return NULL;
    if (!takes) goto python;
    Plan p;
    EMPTY_PLAN(p);
    gather_plan(&p, r, &send, n, outs, NULL, 1, 1);
    return claim_and_run(c, C_ALL_GATHER, args, nargs, &e, &p, (uint64_t)n, 0, 0, -1, n);
python:
    return fall_back(c, C_ALL_GATHER, args, nargs);
}

/* all_gather_into_tensor(output, input) */
static PyObject *all_gather_into_tensor_call(Calls *c, PyObject *const *args, Py_ssize_t nargs, Held *h) {
    Arr out, send;
    Entry e;
    Rounds *r = c->rounds;
    if (nargs != 2 || !memory_of(c, args[0], &out, h) || !memory_of(c, args[1], &send, h) ||
        out.type_num != send.type_num || out.count != send.count * r->size)
        goto python;
    Py_ssize_t n = 0;
    int takes = described(c, C_ALL_GATHER_INTO_TENSOR, &send, -1, -1, &e, &n);
    if (takes < 0) return NULL;
    if (!takes) goto python;
    Plan p;
    EMPTY_PLAN(p);
    gather_plan(&p, r, &send, n, NULL, &out, 1, 1);
    return claim_and_run(c, C_ALL_GATHER_INTO_TENSOR, args, nargs, &e, &p, (uint64_t)n, 0, 0, -1, n);
python:
    return fall_back(c, C_ALL_GATHER_INTO_TENSOR, args, nargs);
}

/* gather(array, gather_list or None, root) */
static PyObject *gather_call(Calls *c, PyObject *const *args, Py_ssize_t nargs, Held *h) {
    Arr send, outs[MAX_MEMBERS];
    long root;
    Entry e;
    Rounds *r = c->rounds;
    if (nargs != 3 || !memory_of(c, args[0], &send, h) || (root = root_of(c, args[2])) < 0 ||
        !root_list(c, args[1], &send, root, outs))
        goto python;
    Py_ssize_t n = 0;
    int takes = described(c, C_GATHER, &send, -1, root, &e, &n);
    if (takes < 0) return NULL;
    if (!takes) goto python;
    Plan p;
    EMPTY_PLAN(p);
    gather_plan(&p, r, &send, n, outs, NULL, r->rank != root, r->rank == root);
    return claim_and_run(c, C_GATHER, args, nargs, &e, &p, (uint64_t)n, (uint64_t)root, 1, root, n);
python:
    return fall_back(c, C_GATHER, args, nargs);
}

/* scatter(array, scatter_list or None, root): the root's pieces, each in its own part of the slot */
static PyObject *scatter_call(Calls *c, PyObject *const *args, Py_ssize_t nargs, Held *h) {
    Arr out, ins[MAX_MEMBERS];
    long root;
    Entry e;
    Rounds *r = c->rounds;
    if (nargs != 3 || !memory_of(c, args[0], &out, h) || (root = root_of(c, args[2])) < 0 ||
        !root_list(c, args[1], &out, root, ins))
        goto python;
    Py_ssize_t n = 0;
    int takes = described(c, C_SCATTER, &out, -1, root, &e, &n);
    if (takes < 0) return NULL;
    if (!takes || n > c->scatter_step) goto python;
    Plan p;
    EMPTY_PLAN(p);
    if (r->rank == root) {
        for (int q = 0; q < r->size; q++)
            if (q != root) write_of(&p, &ins[q], 0, q * c->scatter_step, n);
        read_of(&p, -1, &ins[root], 0, &out, 0, n);
    } else {
        read_of(&p, (int)root, NULL, r->rank * c->scatter_step, &out, 0, n);
    }
    return claim_and_run(c, C_SCATTER, args, nargs, &e, &p, (uint64_t)n, (uint64_t)root, 1, root, n);
python:
    return fall_back(c, C_SCATTER, args, nargs);
}

/* reduce_scatter_tensor(output, input, op): each member's block q goes to part q of its slot;
 * member q folds every member's part q (its own from its input) in rank order */
static PyObject *reduce_scatter_tensor_call(Calls *c, PyObject *const *args, Py_ssize_t nargs, Held *h) {
    Arr out, inp;
    long red;
    Entry e;
    Rounds *r = c->rounds;
    if (nargs != 3 || !memory_of(c, args[0], &out, h) || !memory_of(c, args[1], &inp, h) ||
        Py_TYPE(args[2]) != c->redop || out.type_num != inp.type_num || inp.count != out.count * r->size)
        goto python;
    red = PyLong_AsLong(args[2]);
    if (red < 0 || red > 62) {
        PyErr_Clear();
        goto python;
    }
    Py_ssize_t n = 0, total;
    int takes = described(c, C_REDUCE_SCATTER_TENSOR, &out, red, -1, &e, &n);
    if (takes < 0) return NULL;
    total = n * r->size;
    if (!takes || total > c->rs_total || e.kind < 0 || e.stride < n ||
        r->size * e.stride > r->slot_bytes)
        goto python;
    if (out.data < inp.data + total && inp.data < out.data + n) goto python; /* in place: Python reduces a copy */
    Plan p;
    EMPTY_PLAN(p);
    for (int q = 0; q < r->size; q++)
        if (q != r->rank) write_of(&p, &inp, q * n, q * e.stride, n);
    for (int q = 0; q < r->size; q++) {
        if (q == r->rank)
            read_of(&p, -1, &inp, r->rank * n, &out, 0, n);
        else
            read_of(&p, q, NULL, r->rank * e.stride, &out, 0, n);
    }
    return claim_and_run(c, C_REDUCE_SCATTER_TENSOR, args, nargs, &e, &p, (uint64_t)total, 0, 0, -1, n);
python:
    return fall_back(c, C_REDUCE_SCATTER_TENSOR, args, nargs);
}

/* all_reduce(array, op): the direct all_reduce's round (shm_all_reduce_plan's) */
static PyObject *all_reduce_call(Calls *c, PyObject *const *args, Py_ssize_t nargs, Held *h) {
    Arr x;
    long red;
    Entry e;
    Rounds *r = c->rounds;
    if (nargs != 2 || !memory_of(c, args[0], &x, h) || Py_TYPE(args[1]) != c->redop) goto python;
    red = PyLong_AsLong(args[1]);
    if (red < 0 || red > 62) {
        PyErr_Clear();
        goto python;
    }
    Py_ssize_t n = 0;
    int takes = described(c, C_ALL_REDUCE, &x, red, -1, &e, &n);
    if (takes < 0) return NULL;
    if (!takes || e.kind < 0) goto python;
    Plan p;
    EMPTY_PLAN(p);
    write_of(&p, &x, 0, 0, n);
    /* member 0 folds every other copy into its own; the others copy member 0's first */
    p.first_copies = r->rank != 0;
    for (int q = r->rank ? 0 : 1; q < r->size; q++) read_of(&p, q, NULL, 0, &x, 0, n);
    return claim_and_run(c, C_ALL_REDUCE, args, nargs, &e, &p, (uint64_t)n, 0, 0, -1, n);
python:
    return fall_back(c, C_ALL_REDUCE, args, nargs);
}

/* barrier(): a round with nothing in it */
static PyObject *Calls_barrier(Calls *c, PyObject *const *args, Py_ssize_t nargs) {
    Entry e;
    if (nargs != 0) return fall_back(c, C_BARRIER, args, nargs);
    int known = entry_of(c, C_BARRIER, NULL, -1, -1, &e);
    if (known <= 0) return known < 0 ? NULL : fall_back(c, C_BARRIER, args, nargs);
    Plan p;
    EMPTY_PLAN(p);
    return claim_and_run(c, C_BARRIER, args, nargs, &e, &p, 0, 0, 0, -1, 0);
}

/* all_to_all_single(output, input), even splits: alltoall_slots' first round as a plan, when it is
 * the only one. Its slot starts with this member's table of words (what it sends each member, the
 * offsets, the counts, one round, no single-copy vote, its input's address), then one region per
 * peer; each peer's table must say it sends `count` elements, in one round, with no vote, else the
 * round is handed back and the algorithm goes on (resume_all_to_all). */
static PyObject *Calls_all_to_all_single(Calls *c, PyObject *const *args, Py_ssize_t nargs) {
    Arr out, inp;
    Entry e;
    Rounds *r = c->rounds;
    int p = r->size, me = r->rank;
    if (nargs != 2 || !array_of(c->ndarray, args[0], &out) || !array_of(c->ndarray, args[1], &inp) ||
        out.type_num != inp.type_num || out.count != inp.count)
        goto python;
    PyArrayObject *ao = (PyArrayObject *)args[0], *ai = (PyArrayObject *)args[1];
    if (PyArray_NDIM(ao) < 1 || PyArray_NDIM(ai) < 1 || PyArray_DIMS(ao)[0] % p || PyArray_DIMS(ai)[0] % p)
        goto python;
    Py_ssize_t total = 0; /* what this member sends, in all */
    int takes = described(c, C_ALL_TO_ALL_SINGLE, &inp, -1, -1, &e, &total);
    if (takes < 0) return NULL;
    if (!takes) goto python;
    Py_ssize_t count = inp.count / p, item = e.itemsize, nb = count * item, per = e.stride / item;
    /* the output over part of the input (not all of it): pieces would land over unsent ones */
    Py_ssize_t span = inp.count * item; /* the output's too: same type, same count */
    if (out.data != inp.data && out.data < inp.data + span && inp.data < out.data + span)
        goto python;
    if (count <= 0 || count > per || e.head < (Py_ssize_t)sizeof(int64_t) * (3 * p + 3) ||
        e.head + (p - 1) * e.stride > r->slot_bytes)
        goto python;
    Plan pl;
    EMPTY_PLAN(pl);
    int64_t *t = pl.table;
    for (int q = 0; q < p; q++) t[q] = count, t[p + q] = (int64_t)q * count, t[2 * p + q] = count;
    t[3 * p] = 1, t[3 * p + 1] = 0, t[3 * p + 2] = c->direct_reads ? (int64_t)(intptr_t)inp.data : 0;
    pl.w[pl.nw++] = (Write){(const char *)t, 0, (Py_ssize_t)sizeof(int64_t) * (3 * p + 3)};
    for (int q = 0; q < p; q++) /* our piece for q: region (q - (q > me)) of our slot */
        if (q != me) write_of(&pl, &inp, q * nb, e.head + (q - (q > me)) * e.stride, nb);
    for (int q = 0; q < p; q++) {
        if (q == me) {
            read_of(&pl, -1, &inp, q * nb, &out, q * nb, nb);
            continue;
        }
        read_of(&pl, q, NULL, e.head + (me - (me > q)) * e.stride, &out, q * nb, nb);
        pl.e[pl.ne++] = (Expect){q, me, (uint64_t)count};
        pl.e[pl.ne++] = (Expect){q, 3 * p, 1};
        pl.e[pl.ne++] = (Expect){q, 3 * p + 1, 0};
    }
    return claim_and_run(c, C_ALL_TO_ALL_SINGLE, args, nargs, &e, &pl, 0, 0, 0, -1, total);
python:
    return fall_back(c, C_ALL_TO_ALL_SINGLE, args, nargs);
}

HOLDING(broadcast)
HOLDING(reduce)
HOLDING(all_gather)
HOLDING(all_gather_into_tensor)
HOLDING(gather)
HOLDING(scatter)
HOLDING(reduce_scatter_tensor)
HOLDING(all_reduce)

/* -- the type ------------------------------------------------------------------------------------ */
static int Calls_traverse(Calls *c, visitproc visit, void *arg) {
    Py_VISIT(c->rounds);
    Py_VISIT(c->ndarray);
    Py_VISIT(c->redop);
    int r = group_traverse(&c->g, visit, arg);
    if (r) return r;
    Py_VISIT(c->open_round);
    Py_VISIT(c->ring_consumed);
    Py_VISIT(c->describe);
    Py_VISIT(c->handback);
    Py_VISIT(c->fail);
    Py_VISIT(c->refuse);
    Py_VISIT(c->resume_all_to_all);
    Py_VISIT(c->settle);
    Py_VISIT(c->refuse_late);
    Py_VISIT(c->ring_posted);
    Py_VISIT(c->channels);
    Py_VISIT(c->fallbacks);
    Py_VISIT(c->entries);
    Py_VISIT(c->tensor_memory);
    Py_VISIT(c->tensor_type);
    for (int i = 0; i < KNOWN_TENSORS; i++) {
        Py_VISIT(c->known[i].tensor);
        Py_VISIT(c->known[i].dtype);
        Py_VISIT(c->known[i].flat);
    }
    return 0;
}

static int Calls_clear(Calls *c) {
    Py_CLEAR(c->rounds);
    Py_CLEAR(c->ndarray);
    Py_CLEAR(c->redop);
    group_clear(&c->g);
    Py_CLEAR(c->open_round);
    Py_CLEAR(c->ring_consumed);
    Py_CLEAR(c->describe);
    Py_CLEAR(c->handback);
    Py_CLEAR(c->fail);
    Py_CLEAR(c->refuse);
    Py_CLEAR(c->resume_all_to_all);
    Py_CLEAR(c->settle);
    Py_CLEAR(c->refuse_late);
    Py_CLEAR(c->ring_posted);
    Py_CLEAR(c->channels);
    Py_CLEAR(c->fallbacks);
    Py_CLEAR(c->entries);
    for (int i = 0; i < C_NOPS; i++) {
        Py_CLEAR(c->names[i]);
        Py_CLEAR(c->observed[i]);
    }
    Py_CLEAR(c->s_torch);
    Py_CLEAR(c->tensor_memory);
    Py_CLEAR(c->tensor_type);
    Py_CLEAR(c->s_Tensor);
    Py_CLEAR(c->s_data_ptr);
    Py_CLEAR(c->s_numel);
    Py_CLEAR(c->s_is_contiguous);
    Py_CLEAR(c->s_dtype);
    for (int i = 0; i < KNOWN_TENSORS; i++) forget(&c->known[i]);
    return 0;
}

static void Calls_dealloc(Calls *c) {
    PyObject_GC_UnTrack(c);
    Calls_clear(c);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static int sized_tuple(PyObject *t, const char *name) {
    if (PyTuple_Check(t) && PyTuple_GET_SIZE(t) == C_NOPS) return 1;
    PyErr_Format(PyExc_ValueError, "Calls: %s must be a tuple of one per op, in Calls.OPS's order", name);
    return 0;
}

static int Calls_init(Calls *c, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"rounds", "ndarray", "redop", "ctx", "profiler_flag", "executor", "leave", "next_seq",
                         "open_round", "ring_consumed", "describe", "handback", "fail", "refuse", "channels",
                         "fallbacks", "recorder_module", "observe_module", "group", "resume_all_to_all", "limits",
                         "rs_total", "scatter_step", "t_completed", "state", "completed", "direct_reads",
                         "tensor_memory", "settle", "refuse_late", "ring_posted", "defer", NULL};
    PyObject *rounds, *o[17], *limits, *completed, *tensor_memory, *settle, *refuse_late, *ring_posted;
    PyTypeObject *ndarray, *redop;
    Py_ssize_t rs_total, scatter_step, t_completed, state;
    int direct_reads, defer;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!O!OOOOOOOOOOOOOOOOOOnnnnOpOOOOp", kw, &ShmRoundsType, &rounds,
                                     &PyType_Type, &ndarray, &PyType_Type, &redop, &o[0], &o[1], &o[2], &o[3], &o[4],
                                     &o[5], &o[6], &o[7], &o[8], &o[9], &o[10], &o[11], &o[12], &o[13], &o[14],
                                     &o[15], &o[16], &limits, &rs_total, &scatter_step, &t_completed, &state,
                                     &completed, &direct_reads, &tensor_memory, &settle, &refuse_late,
                                     &ring_posted, &defer))
        return -1;
    if (!sized_tuple(o[11], "channels") || !sized_tuple(o[12], "fallbacks") || !sized_tuple(limits, "limits"))
        return -1;
    if (((Rounds *)rounds)->size > MAX_MEMBERS) {
        PyErr_Format(PyExc_ValueError, "Calls: at most %d members", MAX_MEMBERS);
        return -1;
    }
    Py_ssize_t lim[C_NOPS];
    for (int i = 0; i < C_NOPS; i++) {
        lim[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(limits, i));
        if (lim[i] == -1 && PyErr_Occurred()) return -1;
        if (lim[i] > ((Rounds *)rounds)->slot_bytes && i != C_ALL_TO_ALL_SINGLE) { /* its pieces: per round */
            PyErr_SetString(PyExc_ValueError, "Calls: a limit is larger than a slot");
            return -1;
        }
    }
    if (scatter_step < 0 || scatter_step * ((Rounds *)rounds)->size > ((Rounds *)rounds)->slot_bytes) {
        PyErr_SetString(PyExc_ValueError, "Calls: the scatter step must fit a slot once per member");
        return -1;
    }
    Calls_clear(c);
    /* the group's side: ctx (the owner), profiler_flag, executor, leave, next_seq, recorder_module,
     * observe_module, group */
    PyObject *const side[8] = {o[0], o[1], o[2], o[3], o[4], o[13], o[14], o[15]};
    if (group_set(&c->g, side, t_completed, state, completed) < 0) return -1;
    PyObject **fields[] = {&c->open_round, &c->ring_consumed, &c->describe, &c->handback, &c->fail, &c->refuse,
                           &c->channels, &c->fallbacks, &c->resume_all_to_all};
    int from[] = {5, 6, 7, 8, 9, 10, 11, 12, 16};
    for (int i = 0; i < 9; i++) *fields[i] = Py_NewRef(o[from[i]]);
    c->rounds = (Rounds *)Py_NewRef(rounds);
    c->ndarray = (PyTypeObject *)Py_NewRef(ndarray);
    c->redop = (PyTypeObject *)Py_NewRef(redop);
    c->tensor_memory = Py_NewRef(tensor_memory);
    c->settle = Py_NewRef(settle);
    c->refuse_late = Py_NewRef(refuse_late);
    c->ring_posted = Py_NewRef(ring_posted);
    c->s_Tensor = PyUnicode_InternFromString("Tensor");
    c->s_data_ptr = PyUnicode_InternFromString("data_ptr");
    c->s_numel = PyUnicode_InternFromString("numel");
    c->s_is_contiguous = PyUnicode_InternFromString("is_contiguous");
    c->s_dtype = PyUnicode_InternFromString("dtype");
    if (!c->s_Tensor || !c->s_data_ptr || !c->s_numel || !c->s_is_contiguous || !c->s_dtype) return -1;
    c->entries = PyDict_New();
    c->s_torch = PyUnicode_InternFromString("torch");
    if (!c->entries || !c->s_torch) return -1;
    for (int i = 0; i < C_NOPS; i++) {
        c->names[i] = PyUnicode_InternFromString(NAMES[i]);
        c->observed[i] = PyUnicode_FromFormat("latency_%s", NAMES[i]);
        if (!c->names[i] || !c->observed[i]) return -1;
        c->limits[i] = lim[i];
    }
    c->rs_total = rs_total, c->scatter_step = scatter_step;
    c->direct_reads = direct_reads;
    c->defer = defer;
    return 0;
}

static PyMethodDef Calls_methods[] = {
    {"broadcast", (PyCFunction)(void (*)(void))Calls_broadcast, METH_FASTCALL, "broadcast(array, root) -> bool"},
    {"reduce", (PyCFunction)(void (*)(void))Calls_reduce, METH_FASTCALL, "reduce(array, op, root) -> bool"},
    {"all_gather", (PyCFunction)(void (*)(void))Calls_all_gather, METH_FASTCALL,
     "all_gather(list of arrays, array) -> bool"},
    {"all_gather_into_tensor", (PyCFunction)(void (*)(void))Calls_all_gather_into_tensor, METH_FASTCALL,
     "all_gather_into_tensor(output, input) -> bool"},
    {"gather", (PyCFunction)(void (*)(void))Calls_gather, METH_FASTCALL,
     "gather(array, gather_list or None, root) -> bool"},
    {"scatter", (PyCFunction)(void (*)(void))Calls_scatter, METH_FASTCALL,
     "scatter(array, scatter_list or None, root) -> bool"},
    {"reduce_scatter_tensor", (PyCFunction)(void (*)(void))Calls_reduce_scatter_tensor, METH_FASTCALL,
     "reduce_scatter_tensor(output, input, op) -> bool"},
    {"all_reduce", (PyCFunction)(void (*)(void))Calls_all_reduce, METH_FASTCALL, "all_reduce(array, op) -> bool"},
    {"barrier", (PyCFunction)(void (*)(void))Calls_barrier, METH_FASTCALL, "barrier() -> bool"},
    {"all_to_all_single", (PyCFunction)(void (*)(void))Calls_all_to_all_single, METH_FASTCALL,
     "all_to_all_single(output, input) -> bool: even splits"},
    {NULL}};

static PyTypeObject CallsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "distcomm.transport._shm_round.Calls",
    .tp_basicsize = sizeof(Calls),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A group's small collectives on numpy arrays, each a whole call in C (see _shm_calls.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Calls_init,
    .tp_dealloc = (destructor)Calls_dealloc,
    .tp_traverse = (traverseproc)Calls_traverse,
    .tp_clear = (inquiry)Calls_clear,
    .tp_methods = Calls_methods,
};

int shm_add_calls(PyObject *module) {
    if (PyType_Ready(&CallsType) < 0) return -1;
    PyObject *ops = PyTuple_New(C_NOPS);
    if (!ops) return -1;
    for (int i = 0; i < C_NOPS; i++) {
        PyObject *name = PyUnicode_FromString(NAMES[i]);
        if (!name) {
            Py_DECREF(ops);
            return -1;
        }
        PyTuple_SET_ITEM(ops, i, name);
    }
    PyObject *most = PyLong_FromLong(MAX_MEMBERS);
    int failed = !most || PyDict_SetItemString(CallsType.tp_dict, "OPS", ops) < 0 ||
                 PyDict_SetItemString(CallsType.tp_dict, "MAX_MEMBERS", most) < 0;
    Py_DECREF(ops);
    Py_XDECREF(most);
    if (failed) return -1;
    PyType_Modified(&CallsType);
    return PyModule_AddObjectRef(module, "Calls", (PyObject *)&CallsType) < 0 ||
                   PyModule_AddIntConstant(module, "CALLS", 1) < 0
               ? -1
               : 0;
}

#endif

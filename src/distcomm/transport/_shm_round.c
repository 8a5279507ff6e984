/* A group's shared-memory round steps in C: a round's opening (its number, once the slot's previous
 * use is consumed), exchange and consume (GroupShm's), the whole round of the direct all_reduce
 * (backends/shm/native.py), and the whole round of any one-round collective given as a plan of
 * copies (move(): backends/shm/round_plan.py).
 *
 * The same steps as the Python ones of transport/shm_group.py over the same memory, so a rank
 * running these and a rank running the Python steps meet in the same rounds. Python keeps
 * everything that is not the common case: waiting for slot reuse past the poll budget, crash news
 * (open_round), ringing a peer that sleeps, sleeping, peer health, timeouts and mismatch errors.
 * These functions do what a round does when every peer arrives within the wait policy's poll
 * budget, and say so when one does not.
 *
 * Deferred checks (shm_move's defer, shm_settle): every post also goes into the member's header
 * history, which outlives its slot's reuse; a rooted call's member that reads only some peers checks
 * the others' headers there, in a later call (transport/shm_group.py's docstring).
 *
 * Why C: one Python round costs about 9 µs of CPU at world size 2 (about 50 Python calls); the
 * same steps here cost under 1 µs (docs/performance-notes.md, "The round in C").
 *
 * The layout (counter and header word indexes, addresses of every member's counters, slot
 * headers and slots) is handed in by Python at construction: shm_group.py stays its only
 * definition.
 *
 * Ordering: stores here are release stores and loads acquire loads, with a full fence where the
 * Python steps take theirs (fence() in shm_wait.py); the Python steps' plain stores rely on x86's
 * store order (as they do between two Python ranks), so a mixed group is as portable as a Python one.
 *
 * Reductions (all_reduce): acc = x0 op x1 op ... in rank order, elementwise, as the Python path's
 * numpy ufuncs compute them (the same IEEE operations; MIN/MAX return the second operand on ties
 * and propagate NaN as numpy.minimum/maximum do; integers wrap as numpy's do).
 */
#include "_shm_round.h"
#include <sched.h>
#include <stddef.h>
#include <structmember.h>
#include <string.h>
#include <time.h>

/* rounds this process consumed in C, and rounds whose writes it streamed (tests read them:
 * completed(), streamed()) */
static unsigned long long completed, streamed;

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#else
#define cpu_relax() ((void)0)
#endif

static inline uint64_t load(uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void store(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

/* Writes into this member's slot: with streaming (non-temporal) stores when ``stream``. The slot's
 * lines were last read by the peers, so an ordinary store must first take each line back from their
 * caches, and when the ranks' CPUs share no cache that costs several times the copy itself (two
 * processes passing 64 KiB through a shared buffer in C: 33 µs a round with memcpy, 7 with
 * streaming stores; docs/performance-notes.md, session 22). A streaming store invalidates the other
 * copies without reading them and writes to memory, where the peers' reads find it. shm_move
 * streams a round's writes from STREAM_FROM bytes in all, unless this member reads its own slot back
 * in the same round (a reduce's root, the direct all_reduce's members but the first): that read
 * would then come from memory instead of its own cache. The head up to the first cache line is
 * copied plainly, so every streaming store fills whole lines. Streaming stores are weakly ordered:
 * the caller fences (slot_fence) before it posts. */
#define STREAM_FROM (32 * 1024)
#if defined(__x86_64__)
#include <emmintrin.h>

static void copy_to_slot(char *dst, const char *src, size_t n, int stream) {
    if (!stream || n < 128) {
        memcpy(dst, src, n);
        return;
    }
    size_t head = (size_t)(-(uintptr_t)dst & 63); /* to the first cache line */
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i)), b = _mm_loadu_si128((const __m128i *)(src + i + 16)),
                c = _mm_loadu_si128((const __m128i *)(src + i + 32)), d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + body, src + body, n - body);
}

static void slot_fence(void) { _mm_sfence(); }
#else
static void copy_to_slot(char *dst, const char *src, size_t n, int stream) {
    (void)stream;
    memcpy(dst, src, n);
}

static void slot_fence(void) {}
#endif

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* every peer in `from` (bit q: member q; members past 63 are always in) has counter `word` >= k */
static int all_reached(Rounds *r, int word, uint64_t k, uint64_t from) {
    for (int q = 0; q < r->size; q++)
        if (q != r->rank && (q >= 64 || (from >> q & 1)) && load(&r->ctl[q][word]) < k) return 0;
    return 1;
}

#define EVERY_PEER (~(uint64_t)0)

/* Spin (or yield, with more ranks than CPUs) until every peer in `from` has counter `word` >= k,
 * at most the budget. */
static int poll_counter(Rounds *r, int word, uint64_t k, uint64_t from) {
    if (all_reached(r, word, k, from)) return 1;
    if (r->budget_ns <= 0) return 0; /* the policy goes straight to sleep: no yield that cannot help */
    int ready = 0;
    Py_BEGIN_ALLOW_THREADS
    int64_t end = now_ns() + r->budget_ns;
    for (unsigned i = 1;; i++) {
        if (r->yields)
            sched_yield();
        else
            cpu_relax();
        if (all_reached(r, word, k, from)) { ready = 1; break; }
        if ((r->yields || (i & 63) == 0) && now_ns() >= end) break;
    }
    Py_END_ALLOW_THREADS
    return ready;
}

/* every peer in `from` posted round k (within the budget) */
static int poll_posted(Rounds *r, uint64_t k, uint64_t from) { return poll_counter(r, r->posted, k, from); }

#define REDUCE_LOOP(T, EXPR)                                  \
    do {                                                      \
        T *a = (T *)acc;                                      \
        const T *x = (const T *)src;                          \
        for (Py_ssize_t i = 0; i < n / (Py_ssize_t)sizeof(T); i++) { \
            T u = a[i], v = x[i];                             \
            a[i] = (EXPR);                                    \
        }                                                     \
    } while (0)

/* integer add/multiply wrap: computed in uint64_t (narrower unsigned types would promote to int,
 * whose overflow is undefined) and cut to the width of T */
#define INT_OPS(T, U)                                                             \
    switch (op) {                                                                 \
    case O_SUM: REDUCE_LOOP(T, (T)((U)((uint64_t)(U)u + (uint64_t)(U)v))); break; \
    case O_PRODUCT: REDUCE_LOOP(T, (T)((U)((uint64_t)(U)u * (uint64_t)(U)v))); break; \
    case O_MIN: REDUCE_LOOP(T, u < v ? u : v); break;                             \
    case O_MAX: REDUCE_LOOP(T, u > v ? u : v); break;                             \
    case O_BAND: REDUCE_LOOP(T, u & v); break;                                    \
    case O_BOR: REDUCE_LOOP(T, u | v); break;                                     \
    case O_BXOR: REDUCE_LOOP(T, u ^ v); break;                                    \
    }

#define FLOAT_OPS(T)                                                              \
    switch (op) {                                                                 \
    case O_SUM: REDUCE_LOOP(T, u + v); break;                                     \
    case O_PRODUCT: REDUCE_LOOP(T, u * v); break;                                 \
    case O_MIN: REDUCE_LOOP(T, (u < v || u != u) ? u : v); break;                 \
    case O_MAX: REDUCE_LOOP(T, (u > v || u != u) ? u : v); break;                \
    }

void shm_reduce_into(char *acc, const char *src, Py_ssize_t n, int kind) {
    int op = kind % 8;
    switch (kind / 8) {
    case T_F32: FLOAT_OPS(float); break;
    case T_F64: FLOAT_OPS(double); break;
    case T_I8: INT_OPS(int8_t, uint8_t); break;
    case T_I16: INT_OPS(int16_t, uint16_t); break;
    case T_I32: INT_OPS(int32_t, uint32_t); break;
    case T_I64: INT_OPS(int64_t, uint64_t); break;
    case T_U8: INT_OPS(uint8_t, uint8_t); break;
    }
}

int shm_valid_kind(long kind) {
    if (kind < 0 || kind >= T_NTYPES * 8 || kind % 8 >= O_NOPS) return 0;
    if ((kind / 8 == T_F32 || kind / 8 == T_F64) && kind % 8 > O_MAX) return 0; /* no bits on floats */
    return 1;
}

/* A Rounds made without __init__ has no addresses: refuse it instead of reading through NULL. */
static int ready(Rounds *r) {
    if (r->ctl && r->hdr && r->slot && r->hist) return 1;
    PyErr_SetString(PyExc_ValueError, "Rounds is not initialised");
    return 0;
}

/* GroupShm.publish: post round k (header, then the counter); 1 if a peer sleeps (ring_posted() is
 * then due: it may be waiting for this post). */
static int shm_post(Rounds *r, uint64_t k, uint64_t seq, uint64_t sig, uint64_t nbytes, uint64_t extra) {
    int s = (int)(k % (uint64_t)r->nslots), me = r->rank;
    uint64_t *h = r->hdr[me * r->nslots + s];
    h[r->s_seq] = seq;
    h[r->s_sig] = sig;
    h[r->s_nbytes] = nbytes;
    h[r->s_extra] = extra;
    store(&h[r->s_round], k);
    if (r->hist_len) { /* the same words in the history, which outlives the slot's reuse */
        uint64_t *e = r->hist[me] + (k % (uint64_t)r->hist_len) * HEADER_WORDS;
        e[r->s_seq] = seq;
        e[r->s_sig] = sig;
        e[r->s_nbytes] = nbytes;
        e[r->s_extra] = extra;
        e[r->h_deferred] = 0;
        store(&e[r->s_round], k);
    }
    store(&r->ctl[me][r->posted], k);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (int q = 0; q < r->size; q++)
        if (q != me && load(&r->ctl[q][r->awaiting])) return 1;
    return 0;
}

/* every peer in `from` posted round k with these words in its header */
static int headers_match(Rounds *r, uint64_t k, uint64_t seq, uint64_t sig, uint64_t nbytes, uint64_t from) {
    int s = (int)(k % (uint64_t)r->nslots);
    for (int q = 0; q < r->size; q++) {
        if (q == r->rank || (q < 64 && !(from >> q & 1))) continue;
        uint64_t *g = r->hdr[q * r->nslots + s];
        if (g[r->s_round] != k || g[r->s_seq] != seq || g[r->s_sig] != sig || g[r->s_nbytes] != nbytes) return 0;
    }
    return 1;
}

/* GroupShm.publish and exchange's wait: post round k, poll every peer's post within the budget,
 * check their headers. */
int shm_post_and_poll(Rounds *r, uint64_t k, uint64_t seq, uint64_t sig, uint64_t nbytes, uint64_t extra) {
    if (shm_post(r, k, seq, sig, nbytes, extra)) return PENDING | RING_POSTED; /* Python rings and waits */
    if (!poll_posted(r, k, EVERY_PEER)) return PENDING;
    return headers_match(r, k, seq, sig, nbytes, EVERY_PEER) ? DONE : MISMATCH;
}

/* GroupShm.consume: done reading round k; RING_CONSUMED if a peer waits to reuse a slot. */
int shm_consume(Rounds *r, uint64_t k) {
    store(&r->ctl[r->rank][r->consumed], k);
    completed++;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (int q = 0; q < r->size; q++)
        if (q != r->rank && load(&r->ctl[q][r->reusing])) return RING_CONSUMED;
    return DONE;
}

/* Any integer a Python step accepts (a numpy integer too: the Python steps store through a "Q"
 * memoryview), so a rank with C and a rank without agree on what is an error. */
static int as_u64(PyObject *o, uint64_t *out) {
    PyObject *i = PyLong_CheckExact(o) ? (Py_INCREF(o), o) : PyNumber_Index(o);
    if (!i) return -1;
    *out = PyLong_AsUnsignedLongLong(i);
    Py_DECREF(i);
    return PyErr_Occurred() ? -1 : 0;
}

static int u64_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, uint64_t *out, const char *usage) {
    if (nargs != want) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    for (Py_ssize_t i = 0; i < want; i++)
        if (as_u64(args[i], &out[i]) < 0) return -1;
    return 0;
}

/* exchange(k, seq, sig, nbytes, extra) -> status bits: GroupShm.exchange's post and poll (the slot
 * written before); DONE: every peer posted round k with our header, ready to read. */
static PyObject *Rounds_exchange(Rounds *r, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t a[5];
    if (u64_args(args, nargs, 5, a, "exchange(k, seq, sig, nbytes, extra)") < 0) return NULL;
    if (!ready(r)) return NULL;
    return PyLong_FromLong(shm_post_and_poll(r, a[0], a[1], a[2], a[3], a[4]));
}

/* consume(k) -> RING_CONSUMED or DONE */
static PyObject *Rounds_consume(Rounds *r, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t k;
    if (u64_args(args, nargs, 1, &k, "consume(k)") < 0) return NULL;
    if (!ready(r)) return NULL;
    return PyLong_FromLong(shm_consume(r, k));
}

/* poll_consumed(k) -> bool: spin (or yield) until every peer's consumed >= k, at most the budget:
 * open_round's wait for a slot's reuse, before Python's wait sleeps */
static PyObject *Rounds_poll_consumed(Rounds *r, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t k;
    if (u64_args(args, nargs, 1, &k, "poll_consumed(k)") < 0) return NULL;
    if (!ready(r)) return NULL;
    return PyBool_FromLong(poll_counter(r, r->consumed, k, EVERY_PEER));
}

/* open_round() -> the next round's number, or None where GroupShm.open_round must decide
 * (shm_open_round) */
static PyObject *Rounds_open_round(Rounds *r, PyObject *unused) {
    uint64_t k;
    if (!ready(r)) return NULL;
    if (!shm_open_round(r, &k)) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(k);
}

/* plans up to this many copies live on the stack */
#define PLAN_STACK 32

/* The direct all_reduce's round as a plan: this member's copy into its slot; member 0 folds every
 * other copy into its buffer, the others copy member 0's and fold the rest, in rank order. */
void shm_all_reduce_plan(Rounds *r, char *buf, Py_ssize_t n, Write *w, Read *rd, Py_ssize_t *nr) {
    w[0] = (Write){buf, 0, n};
    *nr = 0;
    for (int q = r->rank ? 0 : 1; q < r->size; q++) rd[(*nr)++] = (Read){q, NULL, 0, n, buf};
}

/* all_reduce(k, seq, sig, buffer, kind) -> status bits: the direct all_reduce's whole round k on
 * buffer (written, posted, polled, checked, reduced in rank order, consumed); anything but DONE
 * or RING_CONSUMED leaves the rest of the round to Python, unread and unconsumed. */
static PyObject *Rounds_all_reduce(Rounds *r, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "all_reduce(k, seq, sig, buffer, kind)");
        return NULL;
    }
    uint64_t k, seq, sig;
    long kind;
    if (as_u64(args[0], &k) < 0 || as_u64(args[1], &seq) < 0 || as_u64(args[2], &sig) < 0) return NULL;
    kind = PyLong_AsLong(args[4]);
    if (kind == -1 && PyErr_Occurred()) return NULL;
    if (!ready(r)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[3], &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (view.len > r->slot_bytes || !shm_valid_kind(kind)) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "a round carries at most %zd bytes of a known kind (got %zd, kind %ld)",
                     r->slot_bytes, view.len, kind);
        return NULL;
    }
    Write w;
    Read stack[PLAN_STACK], *rd = r->size <= PLAN_STACK ? stack : PyMem_Calloc((size_t)r->size, sizeof(Read));
    if (!rd) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    Py_ssize_t nr;
    shm_all_reduce_plan(r, view.buf, view.len, &w, rd, &nr);
    int status = shm_move(r, k, seq, sig, (uint64_t)view.len, 0, 0, &w, 1, rd, nr, (int)kind, r->rank != 0, NULL, 0, 0);
    if (rd != stack) PyMem_Free(rd);
    PyBuffer_Release(&view);
    return PyLong_FromLong(status);
}

/* the reads of a plan: a copy each (kind -1), else a fold into one destination (with first_copies
 * the first read copies and each later one reduces into it with kind's op; without, every read
 * reduces into what the destination holds); skip_own: not the copies from this member's own
 * memory (made already: own_copies) */
static void do_reads(Rounds *r, int s, const Read *rd, Py_ssize_t nr, int kind, int first_copies, int skip_own) {
    for (Py_ssize_t i = 0; i < nr; i++) {
        const Read *x = &rd[i];
        if (!x->n || (skip_own && x->peer < 0)) continue;
        const char *from = x->peer >= 0 ? r->slot[x->peer * r->nslots + s] + x->src_off : x->src + x->src_off;
        if (kind < 0 || (i == 0 && first_copies))
            memmove(x->dst, from, (size_t)x->n);
        else
            shm_reduce_into(x->dst, from, x->n, kind);
    }
}

/* a plan of plain copies: its copies from this member's own memory (an all_to_all's own block, an
 * all_gather's), made between the post and the poll, while the peers' posts come (each copy has a
 * destination of its own, so their order does not matter; a round handed back makes them again) */
static void own_copies(const Read *rd, Py_ssize_t nr) {
    for (Py_ssize_t i = 0; i < nr; i++)
        if (rd[i].peer < 0 && rd[i].n) memmove(rd[i].dst, rd[i].src + rd[i].src_off, (size_t)rd[i].n);
}

/* shm_move: a one-round collective's whole round k. Copy the writes into this member's slot, post
 * (nbytes, extra), poll, check the headers and, with check, every peer's extra word against ours,
 * and every expected slot word (DIFFERS: a rooted collective's root check failed, or a peer's slot
 * says what the plan did not expect; nothing read or consumed); then the reads (do_reads), then
 * consume. Anything but DONE or RING_CONSUMED leaves the reads and the consume to Python
 * (round_plan.finish). Every address and length was checked by the caller.
 *
 * defer (nonzero: the call's number for its error, see shm_settle; a rooted collective's member
 * that does not read every peer: a broadcast's or scatter's root reads none, their other members
 * the root alone, a reduce's or gather's non-roots none): wait only for the members the reads
 * name, check their headers and extra words, read and consume, and leave the other members'
 * headers to be checked later, from their history (shm_settle). Peers cannot tell. The result is
 * then DONE, or the bits RING_POSTED (a peer sleeps: ring_posted() is due) and RING_CONSUMED.
 * Anything unusual (a read peer not in within the budget, a header or extra word that differs)
 * is PENDING: Python waits for every post and checks the round in full, as without defer. */
int shm_move(Rounds *r, uint64_t k, uint64_t seq, uint64_t sig, uint64_t nbytes, uint64_t extra, int check,
             const Write *w, Py_ssize_t nw, const Read *rd, Py_ssize_t nr, int kind, int first_copies, const Expect *e,
             Py_ssize_t ne, int defer) {
    int s = (int)(k % (uint64_t)r->nslots), me = r->rank;
    char *mine = r->slot[me * r->nslots + s];
    size_t written = 0;
    int reads_own = 0;
    for (Py_ssize_t i = 0; i < nw; i++) written += (size_t)w[i].n;
    for (Py_ssize_t i = 0; i < nr; i++) reads_own |= rd[i].peer == me;
    int stream = written >= STREAM_FROM && !reads_own;
    for (Py_ssize_t i = 0; i < nw; i++)
        if (w[i].n) copy_to_slot(mine + w[i].slot_off, w[i].src, (size_t)w[i].n, stream);
    if (stream) {
        slot_fence(); /* the writes are in memory before the post says so */
        streamed++;
    }
    uint64_t from = 0, everyone = 0;
    if (defer && ne == 0 && r->size <= 64 && r->hist_len > r->nslots + 2) {
        for (Py_ssize_t i = 0; i < nr; i++)
            if (rd[i].peer >= 0 && rd[i].peer != me) from |= (uint64_t)1 << rd[i].peer;
        for (int q = 0; q < r->size; q++)
            if (q != me) everyone |= (uint64_t)1 << q;
        if (from != everyone) {
            int ring = shm_post(r, k, seq, sig, nbytes, extra);
            int ready = poll_posted(r, k, from) && headers_match(r, k, seq, sig, nbytes, from);
            for (int q = 0; ready && check && q < r->size; q++)
                if ((from >> q & 1) && r->hdr[q * r->nslots + s][r->s_extra] != extra) ready = 0;
            if (!ready) return PENDING | (ring ? RING_POSTED : 0);
            do_reads(r, s, rd, nr, kind, first_copies, 0);
            r->hist[me][(k % (uint64_t)r->hist_len) * HEADER_WORDS + r->h_deferred] = (uint64_t)defer;
            if (!load(&r->ctl[me][r->deferred])) store(&r->ctl[me][r->deferred], k);
            return shm_consume(r, k) | (ring ? RING_POSTED : 0);
        }
    }
    /* a check (the root's) that fails must find nothing read: then every read waits for the poll */
    int early = kind < 0 && !check, status;
    if (shm_post(r, k, seq, sig, nbytes, extra)) {
        status = PENDING | RING_POSTED; /* Python rings and waits */
    } else {
        if (early) own_copies(rd, nr);
        status = !poll_posted(r, k, EVERY_PEER) ? PENDING : headers_match(r, k, seq, sig, nbytes, EVERY_PEER) ? DONE : MISMATCH;
    }
    if (status == DONE && check) {
        for (int q = 0; q < r->size; q++)
            if (q != me && r->hdr[q * r->nslots + s][r->s_extra] != extra) status = DIFFERS;
    }
    for (Py_ssize_t i = 0; i < ne && status == DONE; i++) {
        const uint64_t *words = (const uint64_t *)r->slot[e[i].member * r->nslots + s];
        if (__atomic_load_n(&words[e[i].word], __ATOMIC_RELAXED) != e[i].value) status = DIFFERS;
    }
    if (status != DONE) return status;
    do_reads(r, s, rd, nr, kind, first_copies, early);
    return shm_consume(r, k);
}

/* shm_settle: check the rounds whose checks this member deferred (shm_move), oldest first, from
 * the counter word `deferred` (the oldest not yet checked) to its last post: each such round (its
 * own history entry says so: word h_deferred) once every peer has posted it, every peer's history entry
 * of it against ours (round, sequence number, signature, byte count, extra word). A peer may
 * reuse its slots as soon as we consume, so the slot headers may be gone: a history entry lasts
 * until its owner posts hist_len rounds later, which needs our consume of a round hist_len -
 * nslots later; so a round is checked before this member opens a round that far on.
 *
 * DONE: every deferred round checked, or the rest not posted yet by some peer and not yet due.
 * PENDING: the oldest one must be checked now and a peer has not posted it. MISMATCH: a history
 * entry differs. Either leaves the rest to Python (GroupShm.settle_deferred), which waits with a
 * deadline and says what differs. (`due`, from Python: hist_len - nslots - 2 rounds.) */
int shm_settle(Rounds *r) {
    int me = r->rank;
    uint64_t j = load(&r->ctl[me][r->deferred]), last = load(&r->ctl[me][r->posted]);
    uint64_t n = (uint64_t)r->hist_len;
    for (; j && j <= last; j++) {
        const uint64_t *mine = r->hist[me] + (j % n) * HEADER_WORDS;
        if (mine[r->s_round] != j || !mine[r->h_deferred]) continue; /* not posted here, or checked in its round */
        if (!all_reached(r, r->posted, j, EVERY_PEER)) {
            store(&r->ctl[me][r->deferred], j);
            return last - j >= r->due ? PENDING : DONE;
        }
        for (int q = 0; q < r->size; q++) {
            if (q == me) continue;
            const uint64_t *g = r->hist[q] + (j % n) * HEADER_WORDS;
            if (load((uint64_t *)&g[r->s_round]) != j || g[r->s_seq] != mine[r->s_seq] || g[r->s_sig] != mine[r->s_sig] ||
                g[r->s_nbytes] != mine[r->s_nbytes] || g[r->s_extra] != mine[r->s_extra]) {
                store(&r->ctl[me][r->deferred], j);
                return MISMATCH;
            }
        }
    }
    store(&r->ctl[me][r->deferred], 0);
    return DONE;
}

/* GroupShm.open_round's common case: number the next round (*k) once every peer has consumed its
 * slot's previous use, polled within the budget. 0 where Python's open_round must take the call
 * instead, with nothing changed here: a rank of this host crashed (the news word), a deferred
 * check is due, or a peer has not consumed in time (Python's wait sleeps, with the deadline). The
 * round number and the consumed floor live here, shared with Python (GroupShm.round). */
int shm_open_round(Rounds *r, uint64_t *k) {
    if (r->news && load(r->news)) return 0;
    uint64_t deferred = shm_deferred(r);
    if (deferred && r->round - deferred >= r->due) return 0;
    uint64_t next = r->round + 1, n = (uint64_t)r->nslots;
    if (next > n && next - n > r->floor) { /* the floor only rises: most rounds read no counter at all */
        if (!poll_counter(r, r->consumed, next - n, EVERY_PEER)) return 0;
        uint64_t floor = UINT64_MAX;
        for (int q = 0; q < r->size; q++)
            if (q != r->rank) {
                uint64_t c = load(&r->ctl[q][r->consumed]);
                if (c < floor) floor = c;
            }
        r->floor = floor;
    }
    *k = r->round = next;
    return 1;
}

/* move()'s plan from Python: the buffers each copy names, held while the round runs */
typedef struct {
    Py_buffer *views;
    Py_ssize_t count;
} Held;

static void release_held(Held *h) {
    for (Py_ssize_t i = 0; i < h->count; i++) PyBuffer_Release(&h->views[i]);
    h->count = 0;
}

static int bad_copy(const char *what, Py_ssize_t i) {
    PyErr_Format(PyExc_ValueError, "move(): %s %zd is out of bounds or malformed", what, i);
    return -1;
}

/* a buffer of the plan, held (its bytes stay where they are until released) */
static Py_buffer *hold(Held *h, PyObject *obj, int flags) {
    Py_buffer *v = &h->views[h->count];
    if (PyObject_GetBuffer(obj, v, flags) < 0) return NULL;
    h->count++;
    return v;
}

/* writes: (src, src_off, slot_off, n) into this member's slot; reads: (src, src_off, dst, dst_off, n)
 * where src is a member (its slot) or a buffer. Everything is checked before the round is posted,
 * so a bad plan raises having changed nothing. */
static int parse_writes(Rounds *r, PyObject *seq, Write *w, Py_ssize_t count, Held *h) {
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 4) return bad_copy("write", i);
        Py_ssize_t src_off = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 1));
        w[i].slot_off = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 2));
        w[i].n = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 3));
        if (PyErr_Occurred()) return -1;
        if (src_off < 0 || w[i].slot_off < 0 || w[i].n < 0 || w[i].slot_off > r->slot_bytes - w[i].n)
            return bad_copy("write", i);
        Py_buffer *v = hold(h, PyTuple_GET_ITEM(t, 0), PyBUF_C_CONTIGUOUS);
        if (!v) return -1;
        if (src_off > v->len - w[i].n) return bad_copy("write", i);
        w[i].src = (const char *)v->buf + src_off;
    }
    return 0;
}

static int parse_reads(Rounds *r, PyObject *seq, Read *rd, Py_ssize_t count, Held *h) {
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 5) return bad_copy("read", i);
        PyObject *src = PyTuple_GET_ITEM(t, 0);
        rd[i].peer = -1;
        rd[i].src = NULL;
        rd[i].src_off = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 1));
        Py_ssize_t dst_off = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 3));
        rd[i].n = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 4));
        if (PyErr_Occurred()) return -1;
        if (rd[i].src_off < 0 || dst_off < 0 || rd[i].n < 0) return bad_copy("read", i);
        if (PyLong_Check(src)) {
            long q = PyLong_AsLong(src);
            if (q < 0 || q >= r->size || rd[i].src_off > r->slot_bytes - rd[i].n) return bad_copy("read", i);
            rd[i].peer = (int)q;
        } else {
            Py_buffer *v = hold(h, src, PyBUF_C_CONTIGUOUS);
            if (!v) return -1;
            if (rd[i].src_off > v->len - rd[i].n) return bad_copy("read", i);
            rd[i].src = v->buf;
        }
        Py_buffer *d = hold(h, PyTuple_GET_ITEM(t, 2), PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS);
        if (!d) return -1;
        if (dst_off > d->len - rd[i].n) return bad_copy("read", i);
        rd[i].dst = (char *)d->buf + dst_off;
    }
    return 0;
}

/* expect: (member, word, value): member's slot holds value at 64-bit word index word */
static int parse_expects(Rounds *r, PyObject *seq, Py_ssize_t count, Expect *out) {
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 3) return bad_copy("expect", i);
        Py_ssize_t q = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 0)), w = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 1));
        uint64_t v;
        if (PyErr_Occurred() || as_u64(PyTuple_GET_ITEM(t, 2), &v) < 0) return -1;
        if (q < 0 || q >= r->size || w < 0 || w >= r->slot_bytes / 8) return bad_copy("expect", i);
        out[i].member = q, out[i].word = w, out[i].value = v;
    }
    return 0;
}

/* move(k, seq, sig, nbytes, extra, check, writes, reads, kind, expect) -> status bits: shm_move's
 * round from a plan of Python tuples (see round_plan.py). */
static PyObject *Rounds_move(Rounds *r, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "move(k, seq, sig, nbytes, extra, check, writes, reads, kind, expect)");
        return NULL;
    }
    uint64_t a[5];
    for (int i = 0; i < 5; i++)
        if (as_u64(args[i], &a[i]) < 0) return NULL;
    int check = PyObject_IsTrue(args[5]);
    long kind = PyLong_AsLong(args[8]);
    if (check < 0 || (kind == -1 && PyErr_Occurred())) return NULL;
    if (kind != -1 && !shm_valid_kind(kind)) {
        PyErr_Format(PyExc_ValueError, "move(): unknown reduction kind %ld", kind);
        return NULL;
    }
    if (!ready(r)) return NULL;
    PyObject *wseq = PySequence_Fast(args[6], "writes must be a sequence");
    if (!wseq) return NULL;
    PyObject *rseq = PySequence_Fast(args[7], "reads must be a sequence");
    if (!rseq) {
        Py_DECREF(wseq);
        return NULL;
    }
    PyObject *eseq = PySequence_Fast(args[9], "expect must be a sequence");
    if (!eseq) {
        Py_DECREF(wseq);
        Py_DECREF(rseq);
        return NULL;
    }
    Py_ssize_t nw = PySequence_Fast_GET_SIZE(wseq), nr = PySequence_Fast_GET_SIZE(rseq);
    Py_ssize_t ne = PySequence_Fast_GET_SIZE(eseq), nviews = nw + 2 * nr;
    Write wstack[PLAN_STACK], *w = nw <= PLAN_STACK ? wstack : PyMem_Calloc((size_t)nw, sizeof(Write));
    Read rstack[PLAN_STACK], *rd = nr <= PLAN_STACK ? rstack : PyMem_Calloc((size_t)nr, sizeof(Read));
    Expect estack[PLAN_STACK], *e = ne <= PLAN_STACK ? estack : PyMem_Calloc((size_t)ne, sizeof(Expect));
    Py_buffer vstack[3 * PLAN_STACK];
    Held held = {nviews <= 3 * PLAN_STACK ? vstack : PyMem_Calloc((size_t)nviews, sizeof(Py_buffer)), 0};
    PyObject *result = NULL;
    if (!w || !rd || !e || !held.views) {
        PyErr_NoMemory();
        goto out;
    }
    if (parse_writes(r, wseq, w, nw, &held) < 0 || parse_reads(r, rseq, rd, nr, &held) < 0 ||
        parse_expects(r, eseq, ne, e) < 0)
        goto out;
    result = PyLong_FromLong(shm_move(r, a[0], a[1], a[2], a[3], a[4], check, w, nw, rd, nr, (int)kind, 1, e, ne, 0));
out:
    release_held(&held);
    if (w && w != wstack) PyMem_Free(w);
    if (rd && rd != rstack) PyMem_Free(rd);
    if (e && e != estack) PyMem_Free(e);
    if (held.views && held.views != vstack) PyMem_Free(held.views);
    Py_DECREF(wseq);
    Py_DECREF(rseq);
    Py_DECREF(eseq);
    return result;
}

static int addresses(PyObject *seq, Py_ssize_t count, void ***out) {
    PyObject *fast = PySequence_Fast(seq, "addresses must be a sequence of ints");
    if (!fast) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != count) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "expected %zd addresses", count);
        return -1;
    }
    *out = PyMem_Calloc((size_t)count, sizeof(void *));
    if (!*out) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        (*out)[i] = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(fast, i));
        if (PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

static void Rounds_dealloc(Rounds *r) {
    PyMem_Free(r->ctl);
    PyMem_Free(r->hdr);
    PyMem_Free(r->slot);
    PyMem_Free(r->hist);
    Py_XDECREF(r->keepalive);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static int Rounds_init(Rounds *r, PyObject *args, PyObject *kwds) {
    PyObject *ctl, *hdr, *slot, *hist, *keepalive, *news;
    long long budget_ns, due;
    static char *names[] = {"rank", "size", "nslots", "slot_bytes", "ctl", "headers", "slots", "history",
                            "history_len", "h_deferred", "due", "news", "posted", "consumed", "reusing", "awaiting",
                            "deferred", "s_round", "s_seq", "s_sig", "s_nbytes", "s_extra", "budget_ns", "yields",
                            "keepalive", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iiinOOOOiiLOiiiiiiiiiiLpO", names, &r->rank, &r->size, &r->nslots,
                                     &r->slot_bytes, &ctl, &hdr, &slot, &hist, &r->hist_len, &r->h_deferred, &due,
                                     &news, &r->posted, &r->consumed, &r->reusing, &r->awaiting, &r->deferred,
                                     &r->s_round, &r->s_seq, &r->s_sig, &r->s_nbytes, &r->s_extra, &budget_ns,
                                     &r->yields, &keepalive))
        return -1;
    if (r->size < 1 || r->rank < 0 || r->rank >= r->size || r->nslots < 1 || r->slot_bytes < 0 || r->hist_len < 0 ||
        due < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "need 0 <= rank < size, nslots >= 1, slot_bytes >= 0, history_len >= 0 and due >= 0");
        return -1;
    }
    r->due = (uint64_t)due;
    r->news = news == Py_None ? NULL : PyLong_AsVoidPtr(news);
    if (PyErr_Occurred()) return -1;
    r->round = r->floor = 0;
    int words[] = {r->posted, r->consumed, r->reusing, r->awaiting, r->deferred},
        fields[] = {r->s_round, r->s_seq, r->s_sig, r->s_nbytes, r->s_extra, r->h_deferred};
    for (int i = 0; i < 5; i++)
        if (words[i] < 0 || words[i] >= CTL_WORDS) {
            PyErr_SetString(PyExc_ValueError, "a counter index is outside the counters' words");
            return -1;
        }
    for (int i = 0; i < 6; i++)
        if (fields[i] < 0 || fields[i] >= HEADER_WORDS) {
            PyErr_SetString(PyExc_ValueError, "a slot header index is outside the header's words");
            return -1;
        }
    PyMem_Free(r->ctl);
    PyMem_Free(r->hdr);
    PyMem_Free(r->slot);
    PyMem_Free(r->hist);
    r->ctl = NULL, r->hdr = NULL, r->slot = NULL, r->hist = NULL;
    r->budget_ns = budget_ns;
    Py_ssize_t slots = (Py_ssize_t)r->size * r->nslots;
    if (addresses(ctl, r->size, (void ***)&r->ctl) < 0 || addresses(hdr, slots, (void ***)&r->hdr) < 0 ||
        addresses(slot, slots, (void ***)&r->slot) < 0 || addresses(hist, r->size, (void ***)&r->hist) < 0)
        return -1;
    Py_INCREF(keepalive);
    Py_XSETREF(r->keepalive, keepalive);
    return 0;
}

static PyMethodDef Rounds_methods[] = {
    {"open_round", (PyCFunction)Rounds_open_round, METH_NOARGS,
     "open_round() -> the next round's number, or None where Python's open_round must decide"},
    {"exchange", (PyCFunction)(void (*)(void))Rounds_exchange, METH_FASTCALL,
     "exchange(k, seq, sig, nbytes, extra) -> status bits: post round k, poll the peers' posts, check them"},
    {"poll_consumed", (PyCFunction)(void (*)(void))Rounds_poll_consumed, METH_FASTCALL,
     "poll_consumed(k) -> bool: every peer's consumed reached k within the poll budget"},
    {"consume", (PyCFunction)(void (*)(void))Rounds_consume, METH_FASTCALL,
     "consume(k) -> RING_CONSUMED or DONE: done reading round k"},
    {"all_reduce", (PyCFunction)(void (*)(void))Rounds_all_reduce, METH_FASTCALL,
     "all_reduce(k, seq, sig, buffer, kind) -> status bits: the direct all_reduce's whole round k"},
    {"move", (PyCFunction)(void (*)(void))Rounds_move, METH_FASTCALL,
     "move(k, seq, sig, nbytes, extra, check, writes, reads, kind, expect) -> status bits: "
     "a one-round collective's round k"},
    {NULL}};

/* shared with GroupShm, whose round and consumed floor these are when it has a Rounds */
static PyMemberDef Rounds_members[] = {
    {"round", T_ULONGLONG, offsetof(Rounds, round), 0, "the last round this member opened"},
    {"consumed_floor", T_ULONGLONG, offsetof(Rounds, floor), 0, "a lower bound of every peer's consumed counter"},
    {NULL}};

PyTypeObject ShmRoundsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "distcomm.transport._shm_round.Rounds",
    .tp_basicsize = sizeof(Rounds),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One group's rounds in C (see the module's source).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Rounds_init,
    .tp_dealloc = (destructor)Rounds_dealloc,
    .tp_methods = Rounds_methods,
    .tp_members = Rounds_members,
};

static PyObject *completed_rounds(PyObject *self, PyObject *unused) { return PyLong_FromUnsignedLongLong(completed); }
static PyObject *streamed_rounds(PyObject *self, PyObject *unused) { return PyLong_FromUnsignedLongLong(streamed); }

/* address(buffer) -> the address of a C-contiguous buffer's first byte (numpy's ctypes.data costs
 * a ctypes object per call) */
static PyObject *buffer_address(PyObject *self, PyObject *obj) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    PyObject *address = PyLong_FromVoidPtr(view.buf);
    PyBuffer_Release(&view);
    return address;
}

static PyMethodDef module_methods[] = {
    {"completed", completed_rounds, METH_NOARGS, "completed() -> rounds this process completed in C"},
    {"streamed", streamed_rounds, METH_NOARGS, "streamed() -> rounds whose slot writes this process streamed"},
    {"address", buffer_address, METH_O, "address(buffer) -> the address of a C-contiguous buffer's first byte"},
    {NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "distcomm.transport._shm_round", .m_size = -1,
                                    .m_methods = module_methods};

PyMODINIT_FUNC PyInit__shm_round(void) {
    if (PyType_Ready(&ShmRoundsType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "Rounds", (PyObject *)&ShmRoundsType) < 0 ||
        PyModule_AddIntConstant(m, "DONE", DONE) < 0 || PyModule_AddIntConstant(m, "PENDING", PENDING) < 0 ||
        PyModule_AddIntConstant(m, "MISMATCH", MISMATCH) < 0 ||
        PyModule_AddIntConstant(m, "RING_POSTED", RING_POSTED) < 0 ||
        PyModule_AddIntConstant(m, "RING_CONSUMED", RING_CONSUMED) < 0 ||
        PyModule_AddIntConstant(m, "DIFFERS", DIFFERS) < 0 || shm_add_calls(m) < 0)
        return NULL;
    return m;
}

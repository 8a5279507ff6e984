/* What the two C files of the round steps share: _shm_round.c (a group's rounds: exchange, consume,
 * the direct all_reduce's round, a plan's round) and _shm_calls.c (whole latency calls on numpy
 * arrays, over the same rounds). See _shm_round.c for the design. */
#ifndef DISTCOMM_SHM_ROUND_H
#define DISTCOMM_SHM_ROUND_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* exchange()'s and all_reduce()'s result: bits */
#define DONE 0
#define PENDING 1       /* posted; not every peer's post arrived within the budget (or one sleeps) */
#define MISMATCH 2      /* every peer posted, one header differs: nothing was read or consumed */
#define RING_POSTED 4   /* a peer sleeps: ring_posted() is due, then the Python wait */
#define RING_CONSUMED 8 /* after consuming, a peer waits to reuse a slot: ring_consumed() is due */
#define DIFFERS 16 /* move(): every post matched; a peer's extra word (check) or an expected slot word differs */

/* the words Python may name: a member's counters (before its "opened" bytes at byte 192) and a
 * slot header's (64 bytes; a history entry has the same words, and one more: h_deferred) */
#define CTL_WORDS 24
#define HEADER_WORDS 8


/* kinds: dtype * 8 + op */
enum { T_F32, T_F64, T_I8, T_I16, T_I32, T_I64, T_U8, T_NTYPES };
enum { O_SUM, O_PRODUCT, O_MIN, O_MAX, O_BAND, O_BOR, O_BXOR, O_NOPS };

typedef struct {
    PyObject_HEAD
    int rank, size, nslots;
    Py_ssize_t slot_bytes;
    uint64_t **ctl;  /* [size]: each member's counters */
    uint64_t **hdr;  /* [size * nslots]: each member's slot headers */
    char **slot;     /* [size * nslots]: each member's slots */
    int posted, consumed, reusing, awaiting;       /* counter word indexes */
    int deferred;                                  /* counter word: this member's oldest unchecked round */
    uint64_t **hist;                               /* [size]: each member's header history (see shm_settle) */
    int hist_len;                                  /* entries in a history; 0: no deferred checks */
    int h_deferred;                                /* history word: which call deferred the entry's checks */
    int s_round, s_seq, s_sig, s_nbytes, s_extra;  /* slot header word indexes */
    uint64_t due;                                  /* rounds past a deferred one that make its check due */
    uint64_t *news;                                /* the host's crash-news word (NULL: none) */
    uint64_t round;                                /* the last round this member opened */
    uint64_t floor;                                /* a lower bound of every peer's consumed */
    int64_t budget_ns;
    int yields;
    PyObject *keepalive; /* whatever owns the mappings */
} Rounds;

/* A plan's copies (see shm_move), with plain addresses: a write is n bytes of src into this
 * member's slot at slot_off; a read is n bytes into dst from member peer's slot at src_off (peer
 * >= 0) or from src. */
typedef struct {
    const char *src;
    Py_ssize_t slot_off, n;
} Write;

typedef struct {
    int peer;
    const char *src;
    Py_ssize_t src_off, n;
    char *dst;
} Read;

/* an expected word: member's slot holds value at 64-bit word index word */
typedef struct {
    Py_ssize_t member, word;
    uint64_t value;
} Expect;

extern PyTypeObject ShmRoundsType;

/* the direct all_reduce's plan of n bytes in buf: one write, and r->size reads at most into rd */
void shm_all_reduce_plan(Rounds *r, char *buf, Py_ssize_t n, Write *w, Read *rd, Py_ssize_t *nr);

int shm_post_and_poll(Rounds *r, uint64_t k, uint64_t seq, uint64_t sig, uint64_t nbytes, uint64_t extra);
int shm_consume(Rounds *r, uint64_t k);
void shm_reduce_into(char *acc, const char *src, Py_ssize_t n, int kind);
int shm_valid_kind(long kind);
int shm_move(Rounds *r, uint64_t k, uint64_t seq, uint64_t sig, uint64_t nbytes, uint64_t extra, int check,
             const Write *w, Py_ssize_t nw, const Read *rd, Py_ssize_t nr, int kind, int first_copies, const Expect *e,
             Py_ssize_t ne, int defer);
int shm_settle(Rounds *r);
int shm_open_round(Rounds *r, uint64_t *k);

/* this member's deferred round (see shm_move), or 0 */
static inline uint64_t shm_deferred(const Rounds *r) {
    return __atomic_load_n(&r->ctl[r->rank][r->deferred], __ATOMIC_RELAXED);
}

/* _shm_calls.c: adds its type (Calls) to the module where numpy's headers were found at build time;
 * returns -1 with an exception set on failure */
int shm_add_calls(PyObject *module);

#endif

/* The TCPStore client's add() round trip in C: one request out, one reply in, on the client's
 * blocking socket, with the GIL released while it waits (client.py's TCPStoreClient.add).
 *
 * Why C: with many clients per CPU every add() blocks and comes back to cold caches, and what the
 * client's Python still did per add() (building the frame, two socket method calls, a 64 KiB
 * receive buffer, unpacking and checking the reply) cost about as much CPU as the kernel's send
 * and receive themselves (docs/performance-notes.md, session 21).
 *
 *     round_trip(fd, key, request_id, amount, wait) -> int | bytes | None
 *
 * sends the Add frame (frames.ADD_HEAD, then the key) and receives at most one Integer reply's
 * worth of bytes. It returns the value when those bytes are exactly the Integer frame answering
 * ``request_id``; otherwise the bytes it received (b"" when the server closed the connection), for
 * the client's general parser to go on with (an Error, a late answer to an earlier request, a
 * reply not all here yet); None when no byte of a reply came in time. A failed send (SO_SNDTIMEO
 * passing included: part of the frame may be out) or a failed receive raises OSError, as the
 * socket methods would. Signal handlers run as in Python's own socket calls (PEP 475: on EINTR and
 * after a short send; go on unless one raised), except that a handler's exception during a send
 * that is already under way is raised once the whole frame is out.
 *
 * How it waits for the reply: with ``wait`` None, asleep in recv(), until the socket's SO_RCVTIMEO
 * (a TCP socket); with ``wait`` a number of seconds, asleep in poll() for at most that long in all
 * for the reply's first bytes, receiving without waiting whenever poll() says there are some (a
 * Unix socket). On a Unix stream socket a reader asleep in recv() is also woken each time the
 * server reads what this socket sent (the kernel's write-space wake-up wakes every sleeper on the
 * socket), so every request would cost the client a second, empty wake-up; poll() is woken only
 * for what it waits for. On TCP that wake-up does not happen, and poll() would be one system call
 * more.
 *
 * The layout (little-endian, packed): request  u64 length, u8 opcode, u32 request_id, i64 amount,
 * key; reply  u64 length, u8 opcode, u32 request_id, i64 value. The module's ADD_OPCODE,
 * ADD_LENGTH, INTEGER_OPCODE and INTEGER_LENGTH name the constants; client.py uses this module only
 * where they equal frames.py's, and tests hold its bytes to frames.encode_add's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#define ADD_OPCODE 0x03
#define INTEGER_OPCODE 0x82
#define HEAD_SIZE 21      /* u64 + u8 + u32 + i64, the request's head and the whole reply */
#define ADD_LENGTH 13     /* the request's length field counts opcode, id, amount, then the key */
#define INTEGER_LENGTH 13 /* and the reply's: opcode, id, value */

static void put_le(unsigned char *at, uint64_t value, int size) {
    for (int i = 0; i < size; i++) at[i] = (unsigned char)(value >> (8 * i));
}

static uint64_t get_le(const unsigned char *at, int size) {
    uint64_t value = 0;
    for (int i = size - 1; i >= 0; i--) value = (value << 8) | at[i];
    return value;
}

/* Send all of iov[0..count) (advanced in place), running signal handlers as Python's sendall runs
 * them: on EINTR and after every short send. A handler that raises before any byte is out ends the
 * send, with the stream intact. Once part of the frame is out, its exception is held and the rest
 * of the frame sent first: the server would otherwise read the next request as this one's rest.
 * Returns 0 when all is sent (an exception may then be set: the caller raises it without waiting
 * for the reply, which a later call drops by its request id), or -1 with an exception set, or with
 * errno set and none. If the frame cannot be finished while an exception is held, the connection
 * is shut down (its stream is torn; the client's next call finds it closed) and that exception
 * raised. */
static int send_all(int fd, struct iovec *iov, int count) {
    PyObject *type = NULL, *value = NULL, *traceback = NULL; /* a handler's exception, held */
    int started = 0;
    while (count > 0) {
        struct msghdr message = {.msg_iov = iov, .msg_iovlen = (size_t)count};
        ssize_t sent;
        Py_BEGIN_ALLOW_THREADS
        sent = sendmsg(fd, &message, MSG_NOSIGNAL);
        Py_END_ALLOW_THREADS
        if (sent < 0) {
            if (errno != EINTR) {
                if (type) {
                    shutdown(fd, SHUT_RDWR);
                    PyErr_Restore(type, value, traceback);
                }
                return -1;
            }
            sent = 0;
        } else if (sent > 0) {
            started = 1;
        }
        while (count > 0 && (size_t)sent >= iov->iov_len) {
            sent -= (ssize_t)iov->iov_len;
            iov++;
            count--;
        }
        if (count > 0) {
            iov->iov_base = (char *)iov->iov_base + sent;
            iov->iov_len -= (size_t)sent;
            if (!type && PyErr_CheckSignals() < 0) {
                if (!started) return -1;
                PyErr_Fetch(&type, &value, &traceback);
            }
        }
    }
    if (type) PyErr_Restore(type, value, traceback);
    return 0;
}

static double monotonic_seconds(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

/* Wait in poll() until fd has something to read (bytes, the end of the stream, an error) or the
 * monotonic clock reaches ``deadline`` (any distance away: poll() takes at most INT_MAX
 * milliseconds at a time). 1 when it has, 0 when the deadline passed, -1 with an exception set when
 * poll() failed or a signal handler raised. */
static int wait_readable(int fd, double deadline) {
    for (;;) {
        double left = deadline - monotonic_seconds();
        if (left < 0) left = 0;
        double milliseconds = ceil(left * 1000.0);
        struct pollfd readable = {.fd = fd, .events = POLLIN};
        int ready;
        Py_BEGIN_ALLOW_THREADS
        ready = poll(&readable, 1, milliseconds < INT_MAX ? (int)milliseconds : INT_MAX);
        Py_END_ALLOW_THREADS
        if (ready > 0) return 1;
        if (ready < 0) {
            if (errno != EINTR) {
                PyErr_SetFromErrno(PyExc_OSError);
                return -1;
            }
            if (PyErr_CheckSignals() < 0) return -1;
        } else if (left == 0) {
            return 0;
        }
    }
}

static PyObject *round_trip(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "round_trip(fd, key, request_id, amount, wait) takes 5 arguments (%zd given)",
                     nargs);
        return NULL;
    }
    long fd = PyLong_AsLong(args[0]);
    if (fd == -1 && PyErr_Occurred()) return NULL;
    if (fd < 0 || fd > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "round_trip: %ld is not a file descriptor", fd);
        return NULL;
    }
    if (!PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "round_trip: the key must be bytes");
        return NULL;
    }
    unsigned long request_id = PyLong_AsUnsignedLong(args[2]);
    if (request_id == (unsigned long)-1 && PyErr_Occurred()) return NULL;
    if (request_id > 0xFFFFFFFFUL) {
        PyErr_SetString(PyExc_OverflowError, "round_trip: the request id does not fit 32 bits");
        return NULL;
    }
    long long amount = PyLong_AsLongLong(args[3]);
    if (amount == -1 && PyErr_Occurred()) return NULL;
    int in_poll = args[4] != Py_None;
    double wait = 0.0;
    if (in_poll) {
        wait = PyFloat_AsDouble(args[4]);
        if (wait == -1.0 && PyErr_Occurred()) return NULL;
        if (!(wait >= 0.0)) {
            PyErr_SetString(PyExc_ValueError, "round_trip: wait must be None or a number of seconds, 0 or more");
            return NULL;
        }
    }

    /* the key's bytes are read without the GIL: a bytes object is immutable, and the caller's
     * argument keeps it alive until this call returns */
    Py_ssize_t key_size = PyBytes_GET_SIZE(args[1]);
    unsigned char head[HEAD_SIZE];
    put_le(head, (uint64_t)(ADD_LENGTH + key_size), 8);
    head[8] = ADD_OPCODE;
    put_le(head + 9, (uint64_t)request_id, 4);
    put_le(head + 13, (uint64_t)amount, 8);
    struct iovec iov[2] = {{head, HEAD_SIZE}, {PyBytes_AS_STRING(args[1]), (size_t)key_size}};
    if (send_all((int)fd, iov, key_size ? 2 : 1) < 0) {
        return PyErr_Occurred() ? NULL : PyErr_SetFromErrno(PyExc_OSError);
    }
    if (PyErr_Occurred()) return NULL; /* a signal handler raised while the frame went out whole */

    unsigned char reply[HEAD_SIZE];
    ssize_t got;
    double deadline = in_poll ? monotonic_seconds() + wait : 0.0; /* inf stays inf */
    for (;;) {
        if (in_poll) {
            int ready = wait_readable((int)fd, deadline);
            if (ready < 0) return NULL;
            if (ready == 0) Py_RETURN_NONE; /* the request is out */
        }
        Py_BEGIN_ALLOW_THREADS
        got = recv((int)fd, reply, HEAD_SIZE, in_poll ? MSG_DONTWAIT : 0);
        Py_END_ALLOW_THREADS
        if (got >= 0) break;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            if (in_poll) continue; /* readable, and then nothing to receive: wait the rest */
            Py_RETURN_NONE;        /* SO_RCVTIMEO: the request is out */
        }
        if (errno != EINTR) return PyErr_SetFromErrno(PyExc_OSError);
        if (PyErr_CheckSignals() < 0) return NULL;
    }
    if (got == HEAD_SIZE && get_le(reply, 8) == INTEGER_LENGTH && reply[8] == INTEGER_OPCODE &&
        get_le(reply + 9, 4) == request_id) {
        return PyLong_FromLongLong((long long)get_le(reply + 13, 8));
    }
    return PyBytes_FromStringAndSize((const char *)reply, got);
}

static PyMethodDef methods[] = {
    {"round_trip", (PyCFunction)(void (*)(void))round_trip, METH_FASTCALL,
     "round_trip(fd, key, request_id, amount, wait) -> the Integer reply's value, the bytes received "
     "instead, or None if none came in time (wait: None, until SO_RCVTIMEO; or seconds, in poll())"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "distcomm.store.tcp._add_trip", .m_size = -1,
                                    .m_doc = "The TCPStore client's add() round trip in C (see _add_trip.c).",
                                    .m_methods = methods};

PyMODINIT_FUNC PyInit__add_trip(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "ADD_OPCODE", ADD_OPCODE) < 0 ||
        PyModule_AddIntConstant(m, "ADD_LENGTH", ADD_LENGTH) < 0 ||
        PyModule_AddIntConstant(m, "INTEGER_OPCODE", INTEGER_OPCODE) < 0 ||
        PyModule_AddIntConstant(m, "INTEGER_LENGTH", INTEGER_LENGTH) < 0 ||
        PyModule_AddIntConstant(m, "REPLY_SIZE", HEAD_SIZE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

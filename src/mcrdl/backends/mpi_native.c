/* mcrdl's compiled MPI hot path: one call starts a nonblocking MPI operation
 * on raw CPU addresses and waits for it, without the GIL, under mcrdl's wait
 * policy and a deadline. Built against the MPI that mpi4py uses (see
 * native.py); communicators, datatypes and ops come in as mpi4py objects.
 *
 * Every op returns None once complete, or, when `timeout` seconds pass first,
 * the still-pending mpi4py Request (the caller abandons it; MPI may still
 * write the buffers, which the caller keeps alive). A `timeout` of 0 or less
 * only starts the op and returns its Request: the async fast paths, whose
 * requests the engine tracks. MPI errors raise the
 * class given to set_error (mcrdl's CommError) naming the MPI call and MPI's
 * message; counts outside C int raise OverflowError. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <mpi.h>
#include <mpi4py/mpi4py.h>
#include <limits.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>

/* Seconds a wait polls without giving up the CPU: 0 (yield policy: only the
 * first FIRST_POLLS polls) or SPIN_S (spin policy). */
#define FIRST_POLLS 200
#define SPIN_S 1e-3
static double busy_s = 0.0;
static PyObject *error_class = NULL; /* set_error(); RuntimeError until then */

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void pause_for(double seconds)
{
    struct timespec t = {0, (long)(seconds * 1e9)};
    nanosleep(&t, NULL);
}

/* Poll `req` until it completes (1), `timeout` passes (0) or MPI fails (-rc).
 * Busy first; then yields the CPU (a descheduled peer gets to run) and, under
 * the yield policy after 5 ms, sleeps briefly: the schedule of work.spin_until. */
static int wait_request(MPI_Request *req, double timeout)
{
    int flag = 0, rc;
    long polls = 0;
    double start = 0.0, waited;
    for (;;) {
        rc = MPI_Test(req, &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS)
            return -rc;
        if (flag)
            return 1;
        if (++polls < FIRST_POLLS)
            continue;
        if (start == 0.0)
            start = now_s();
        waited = now_s() - start;
        if (waited > timeout)
            return 0;
        if (waited < busy_s)
            continue;
        if (busy_s > 0.0 || waited < 0.005)
            sched_yield();
        else
            pause_for(waited < 0.1 ? 5e-5 : 1e-3);
    }
}

static PyObject *mpi_error(int rc, const char *call)
{
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS)
        len = 0;
    msg[len] = '\0';
    PyErr_Format(error_class ? error_class : PyExc_RuntimeError,
                 "%s on backend 'mpi' failed: MPI error %d: %s", call, rc, msg);
    return NULL;
}

/* The end of every op: `rc` from starting `call`, then the wait. */
static PyObject *finish(int rc, MPI_Request req, double timeout, const char *call)
{
    if (rc != MPI_SUCCESS)
        return mpi_error(rc, call);
    if (timeout <= 0.0) { /* start only: the engine tests it (and reports its errors) */
        rc = 0;
    } else {
        Py_BEGIN_ALLOW_THREADS
        rc = wait_request(&req, timeout);
        Py_END_ALLOW_THREADS
    }
    if (rc < 0)
        return mpi_error(-rc, call);
    if (rc == 0) {
        PyObject *pending = PyMPIRequest_New(req);
        if (pending == NULL) { /* MPI still owns the buffers: wait before failing */
            Py_BEGIN_ALLOW_THREADS
            MPI_Wait(&req, MPI_STATUS_IGNORE);
            Py_END_ALLOW_THREADS
        }
        return pending;
    }
    Py_RETURN_NONE;
}

/* Argument helpers: NULL / -1 with a Python error set on a bad argument. */
static int nargs(Py_ssize_t n, Py_ssize_t want, const char *name)
{
    if (n == want)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, want, n);
    return -1;
}

static int as_address(PyObject *o, void **out)
{
    *out = o == Py_None ? NULL : PyLong_AsVoidPtr(o);
    return *out == NULL && PyErr_Occurred() ? -1 : 0;
}

static int as_int(PyObject *o, int *out)
{
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < INT_MIN || v > INT_MAX) {
        PyErr_Format(PyExc_OverflowError, "%lld does not fit an MPI count (C int)", v);
        return -1;
    }
    *out = (int)v;
    return 0;
}

#define ARGS(name, n_)                                                          \
    if (nargs(n, n_, name) < 0)                                                 \
        return NULL;                                                            \
    MPI_Comm *comm = PyMPIComm_Get(a[0]);                                       \
    if (comm == NULL)                                                           \
        return NULL;                                                            \
    double timeout = PyFloat_AsDouble(a[n_ - 1]);                               \
    if (timeout == -1.0 && PyErr_Occurred())                                    \
        return NULL;                                                            \
    MPI_Request req = MPI_REQUEST_NULL;                                         \
    int rc

/* allreduce(comm, buf, count, datatype, op, timeout): in place. */
static PyObject *allreduce(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    ARGS("allreduce", 6);
    void *buf;
    int count;
    MPI_Datatype *dt;
    MPI_Op *op;
    if (as_address(a[1], &buf) < 0 || as_int(a[2], &count) < 0
        || !(dt = PyMPIDatatype_Get(a[3])) || !(op = PyMPIOp_Get(a[4])))
        return NULL;
    rc = MPI_Iallreduce(MPI_IN_PLACE, buf, count, *dt, *op, *comm, &req);
    return finish(rc, req, timeout, "MPI_Iallreduce");
}

/* bcast(comm, buf, count, datatype, root, timeout). */
static PyObject *bcast(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    ARGS("bcast", 6);
    void *buf;
    int count, root;
    MPI_Datatype *dt;
    if (as_address(a[1], &buf) < 0 || as_int(a[2], &count) < 0
        || !(dt = PyMPIDatatype_Get(a[3])) || as_int(a[4], &root) < 0)
        return NULL;
    rc = MPI_Ibcast(buf, count, *dt, root, *comm, &req);
    return finish(rc, req, timeout, "MPI_Ibcast");
}

/* reduce(comm, buf, count, datatype, op, root, is_root, timeout): in place on the root. */
static PyObject *reduce(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    ARGS("reduce", 8);
    void *buf;
    int count, root, is_root;
    MPI_Datatype *dt;
    MPI_Op *op;
    if (as_address(a[1], &buf) < 0 || as_int(a[2], &count) < 0
        || !(dt = PyMPIDatatype_Get(a[3])) || !(op = PyMPIOp_Get(a[4]))
        || as_int(a[5], &root) < 0 || as_int(a[6], &is_root) < 0)
        return NULL;
    if (is_root)
        rc = MPI_Ireduce(MPI_IN_PLACE, buf, count, *dt, *op, root, *comm, &req);
    else
        rc = MPI_Ireduce(buf, NULL, count, *dt, *op, root, *comm, &req);
    return finish(rc, req, timeout, "MPI_Ireduce");
}

/* The send buffer, receive buffer, count and datatype of the ops below. */
static int two_buffers(PyObject *const *a, void **sbuf, void **rbuf, int *count, MPI_Datatype **dt)
{
    if (as_address(a[1], sbuf) < 0 || as_address(a[2], rbuf) < 0 || as_int(a[3], count) < 0
        || !(*dt = PyMPIDatatype_Get(a[4])))
        return -1;
    return 0;
}

/* Collectives with a send and a receive buffer and one count:
 * allgather(comm, sendbuf, recvbuf, count, datatype, timeout)          count sent per rank
 * alltoall(comm, sendbuf, recvbuf, count, datatype, timeout)           count per peer
 * reduce_scatter_block(comm, sendbuf, recvbuf, count, datatype, op, timeout)  count received
 * gather(comm, sendbuf, recvbuf or None, count, datatype, root, timeout)
 * scatter(comm, sendbuf or None, recvbuf, count, datatype, root, timeout) */
static PyObject *allgather(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    ARGS("allgather", 6);
    void *sbuf, *rbuf;
    int count;
    MPI_Datatype *dt;
    if (two_buffers(a, &sbuf, &rbuf, &count, &dt) < 0)
        return NULL;
    rc = MPI_Iallgather(sbuf, count, *dt, rbuf, count, *dt, *comm, &req);
    return finish(rc, req, timeout, "MPI_Iallgather");
}

static PyObject *alltoall(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    ARGS("alltoall", 6);
    void *sbuf, *rbuf;
    int count;
    MPI_Datatype *dt;
    if (two_buffers(a, &sbuf, &rbuf, &count, &dt) < 0)
        return NULL;
    rc = MPI_Ialltoall(sbuf, count, *dt, rbuf, count, *dt, *comm, &req);
    return finish(rc, req, timeout, "MPI_Ialltoall");
}

static PyObject *reduce_scatter_block(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    ARGS("reduce_scatter_block", 7);
    void *sbuf, *rbuf;
    int count;
    MPI_Datatype *dt;
    MPI_Op *op;
    if (two_buffers(a, &sbuf, &rbuf, &count, &dt) < 0 || !(op = PyMPIOp_Get(a[5])))
        return NULL;
    rc = MPI_Ireduce_scatter_block(sbuf, rbuf, count, *dt, *op, *comm, &req);
    return finish(rc, req, timeout, "MPI_Ireduce_scatter_block");
}

static PyObject *gather(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    ARGS("gather", 7);
    void *sbuf, *rbuf;
    int count, root;
    MPI_Datatype *dt;
    if (two_buffers(a, &sbuf, &rbuf, &count, &dt) < 0 || as_int(a[5], &root) < 0)
        return NULL;
    rc = MPI_Igather(sbuf, count, *dt, rbuf, count, *dt, root, *comm, &req);
    return finish(rc, req, timeout, "MPI_Igather");
}

static PyObject *scatter(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    ARGS("scatter", 7);
    void *sbuf, *rbuf;
    int count, root;
    MPI_Datatype *dt;
    if (two_buffers(a, &sbuf, &rbuf, &count, &dt) < 0 || as_int(a[5], &root) < 0)
        return NULL;
    rc = MPI_Iscatter(sbuf, count, *dt, rbuf, count, *dt, root, *comm, &req);
    return finish(rc, req, timeout, "MPI_Iscatter");
}

/* counts[i] and their prefix sums (displacements) from a sequence of `size`
 * ints; OverflowError where a displacement leaves C int. */
static int counts_of(PyObject *seq, int size, int *counts, int *displs)
{
    PyObject *fast = PySequence_Fast(seq, "counts must be a sequence");
    if (fast == NULL)
        return -1;
    int ok = PySequence_Fast_GET_SIZE(fast) == size ? 0 : -1;
    if (ok < 0)
        PyErr_Format(PyExc_ValueError, "expected %d counts", size);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    long long acc = 0;
    for (int i = 0; ok == 0 && i < size; i++) {
        if (as_int(items[i], &counts[i]) < 0 || counts[i] < 0 || acc > INT_MAX) {
            if (PyErr_Occurred())
                ;
            else if (counts[i] < 0)
                PyErr_Format(PyExc_ValueError, "count %d is negative", counts[i]);
            else
                PyErr_Format(PyExc_OverflowError, "displacement %lld does not fit an MPI count (C int)", acc);
            ok = -1;
            break;
        }
        displs[i] = (int)acc;
        acc += counts[i];
    }
    Py_DECREF(fast);
    return ok;
}

/* alltoallv(comm, sendbuf, sendcounts, recvbuf, recvcounts, datatype, timeout).
 * MPI may read the count arrays until the op completes: after a timeout they
 * are left allocated. */
static PyObject *alltoallv(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    ARGS("alltoallv", 7);
    void *sbuf, *rbuf;
    int size;
    MPI_Datatype *dt;
    if (as_address(a[1], &sbuf) < 0 || as_address(a[3], &rbuf) < 0 || !(dt = PyMPIDatatype_Get(a[5])))
        return NULL;
    if ((rc = MPI_Comm_size(*comm, &size)) != MPI_SUCCESS)
        return mpi_error(rc, "MPI_Comm_size");
    int *arrays = malloc(4 * (size_t)size * sizeof(int));
    if (arrays == NULL)
        return PyErr_NoMemory();
    int *sc = arrays, *sd = arrays + size, *rcn = arrays + 2 * size, *rd = arrays + 3 * size;
    if (counts_of(a[2], size, sc, sd) < 0 || counts_of(a[4], size, rcn, rd) < 0) {
        free(arrays);
        return NULL;
    }
    rc = MPI_Ialltoallv(sbuf, sc, sd, *dt, rbuf, rcn, rd, *dt, *comm, &req);
    PyObject *out = finish(rc, req, timeout, "MPI_Ialltoallv");
    if (out == NULL || out == Py_None) /* failed or complete: MPI no longer reads them */
        free(arrays);
    return out;
}

/* send(comm, buf, count, datatype, peer, tag, timeout) and recv(...): one peer. */
static int one_peer(PyObject *const *a, void **buf, int *count, MPI_Datatype **dt, int *peer, int *tag)
{
    if (as_address(a[1], buf) < 0 || as_int(a[2], count) < 0 || !(*dt = PyMPIDatatype_Get(a[3]))
        || as_int(a[4], peer) < 0 || as_int(a[5], tag) < 0)
        return -1;
    return 0;
}

static PyObject *send(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    ARGS("send", 7);
    void *buf;
    int count, peer, tag;
    MPI_Datatype *dt;
    if (one_peer(a, &buf, &count, &dt, &peer, &tag) < 0)
        return NULL;
    rc = MPI_Isend(buf, count, *dt, peer, tag, *comm, &req);
    return finish(rc, req, timeout, "MPI_Isend");
}

static PyObject *recv(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    ARGS("recv", 7);
    void *buf;
    int count, peer, tag;
    MPI_Datatype *dt;
    if (one_peer(a, &buf, &count, &dt, &peer, &tag) < 0)
        return NULL;
    rc = MPI_Irecv(buf, count, *dt, peer, tag, *comm, &req);
    return finish(rc, req, timeout, "MPI_Irecv");
}

/* set_error(cls): the exception class MPI errors raise. */
static PyObject *set_error(PyObject *self, PyObject *cls)
{
    if (!PyExceptionClass_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "set_error takes an exception class");
        return NULL;
    }
    Py_INCREF(cls);
    Py_XSETREF(error_class, cls);
    Py_RETURN_NONE;
}

/* set_busy(seconds): how long a wait polls before it yields (0: FIRST_POLLS polls). */
static PyObject *set_busy(PyObject *self, PyObject *arg)
{
    double s = PyFloat_AsDouble(arg);
    if (s == -1.0 && PyErr_Occurred())
        return NULL;
    busy_s = s;
    Py_RETURN_NONE;
}

/* library_version(): the MPI library this module is linked with. */
static PyObject *library_version(PyObject *self, PyObject *unused)
{
    char v[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    if (MPI_Get_library_version(v, &len) != MPI_SUCCESS)
        len = 0;
    return PyUnicode_DecodeUTF8(v, len, "replace");
}

#define FAST(f) {#f, (PyCFunction)(void (*)(void))f, METH_FASTCALL, NULL}
static PyMethodDef methods[] = {
    FAST(allreduce), FAST(bcast), FAST(reduce), FAST(allgather), FAST(alltoall),
    FAST(reduce_scatter_block), FAST(gather), FAST(scatter), FAST(alltoallv),
    FAST(send), FAST(recv),
    {"set_busy", set_busy, METH_O, NULL},
    {"set_error", set_error, METH_O, NULL},
    {"library_version", library_version, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "mcrdl_mpi_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit_mcrdl_mpi_native(void)
{
    if (import_mpi4py() < 0)
        return NULL;
    return PyModule_Create(&module);
}

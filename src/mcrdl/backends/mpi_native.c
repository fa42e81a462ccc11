/* mcrdl's compiled MPI hot path: one call starts a nonblocking MPI operation
 * on raw CPU addresses and waits for it, without the GIL, under mcrdl's wait
 * policy and a deadline. Built against the MPI that mpi4py uses (see
 * native.py); communicators, datatypes and ops come in as mpi4py objects.
 *
 * Every op returns None once complete, or, when `timeout` seconds pass first,
 * the still-pending mpi4py Request (the caller abandons it; MPI may still
 * write the buffers, which the caller keeps alive). MPI errors raise
 * RuntimeError with MPI's message. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <mpi.h>
#include <mpi4py/mpi4py.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>

/* Seconds a wait polls without giving up the CPU: 0 (yield policy: only the
 * first FIRST_POLLS polls) or SPIN_S (spin policy). */
#define FIRST_POLLS 200
#define SPIN_S 1e-3
static double busy_s = 0.0;

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
 * Busy first; then yields the CPU (a descheduled peer gets to run) and, in
 * long waits, sleeps briefly: the same schedule as work.spin_until. */
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
        if (waited < (busy_s > 0.0 ? 0.1 : 0.005))
            sched_yield();
        else
            pause_for(waited < 0.1 ? 5e-5 : 1e-3);
    }
}

static PyObject *mpi_error(int rc)
{
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS)
        len = 0;
    msg[len] = '\0';
    PyErr_Format(PyExc_RuntimeError, "MPI error %d: %s", rc, msg);
    return NULL;
}

/* The end of every op: `rc` from the start call, then the wait. */
static PyObject *finish(int rc, MPI_Request req, double timeout)
{
    if (rc != MPI_SUCCESS)
        return mpi_error(rc);
    Py_BEGIN_ALLOW_THREADS
    rc = wait_request(&req, timeout);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        return mpi_error(-rc);
    if (rc == 0)
        return PyMPIRequest_New(req);
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

static void *address(PyObject *o)
{
    return o == Py_None ? NULL : PyLong_AsVoidPtr(o);
}

static int as_int(PyObject *o, int *out)
{
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = (int)v;
    return 0;
}

#define ARGS(name, n_)                                                          \
    if (nargs(n, n_, name) < 0)                                                 \
        return NULL;                                                            \
    MPI_Comm *comm = PyMPIComm_Get(a[0]);                                       \
    double timeout = PyFloat_AsDouble(a[n_ - 1]);                               \
    if (comm == NULL || PyErr_Occurred())                                       \
        return NULL;                                                            \
    MPI_Request req = MPI_REQUEST_NULL;                                         \
    int rc

/* allreduce(comm, buf, count, datatype, op, timeout): in place. */
static PyObject *allreduce(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    ARGS("allreduce", 6);
    int count;
    void *buf = address(a[1]);
    MPI_Datatype *dt = PyMPIDatatype_Get(a[3]);
    MPI_Op *op = PyMPIOp_Get(a[4]);
    if (as_int(a[2], &count) < 0 || !dt || !op || PyErr_Occurred())
        return NULL;
    rc = MPI_Iallreduce(MPI_IN_PLACE, buf, count, *dt, *op, *comm, &req);
    return finish(rc, req, timeout);
}

/* bcast(comm, buf, count, datatype, root, timeout). */
static PyObject *bcast(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    ARGS("bcast", 6);
    int count, root;
    void *buf = address(a[1]);
    MPI_Datatype *dt = PyMPIDatatype_Get(a[3]);
    if (as_int(a[2], &count) < 0 || as_int(a[4], &root) < 0 || !dt || PyErr_Occurred())
        return NULL;
    rc = MPI_Ibcast(buf, count, *dt, root, *comm, &req);
    return finish(rc, req, timeout);
}

/* reduce(comm, buf, count, datatype, op, root, is_root, timeout): in place on the root. */
static PyObject *reduce(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    ARGS("reduce", 8);
    int count, root, is_root;
    void *buf = address(a[1]);
    MPI_Datatype *dt = PyMPIDatatype_Get(a[3]);
    MPI_Op *op = PyMPIOp_Get(a[4]);
    if (as_int(a[2], &count) < 0 || as_int(a[5], &root) < 0 || as_int(a[6], &is_root) < 0
        || !dt || !op || PyErr_Occurred())
        return NULL;
    if (is_root)
        rc = MPI_Ireduce(MPI_IN_PLACE, buf, count, *dt, *op, root, *comm, &req);
    else
        rc = MPI_Ireduce(buf, NULL, count, *dt, *op, root, *comm, &req);
    return finish(rc, req, timeout);
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
    int count;
    void *sbuf = address(a[1]), *rbuf = address(a[2]);
    MPI_Datatype *dt = PyMPIDatatype_Get(a[4]);
    if (as_int(a[3], &count) < 0 || !dt || PyErr_Occurred())
        return NULL;
    rc = MPI_Iallgather(sbuf, count, *dt, rbuf, count, *dt, *comm, &req);
    return finish(rc, req, timeout);
}

static PyObject *alltoall(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    ARGS("alltoall", 6);
    int count;
    void *sbuf = address(a[1]), *rbuf = address(a[2]);
    MPI_Datatype *dt = PyMPIDatatype_Get(a[4]);
    if (as_int(a[3], &count) < 0 || !dt || PyErr_Occurred())
        return NULL;
    rc = MPI_Ialltoall(sbuf, count, *dt, rbuf, count, *dt, *comm, &req);
    return finish(rc, req, timeout);
}

static PyObject *reduce_scatter_block(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    ARGS("reduce_scatter_block", 7);
    int count;
    void *sbuf = address(a[1]), *rbuf = address(a[2]);
    MPI_Datatype *dt = PyMPIDatatype_Get(a[4]);
    MPI_Op *op = PyMPIOp_Get(a[5]);
    if (as_int(a[3], &count) < 0 || !dt || !op || PyErr_Occurred())
        return NULL;
    rc = MPI_Ireduce_scatter_block(sbuf, rbuf, count, *dt, *op, *comm, &req);
    return finish(rc, req, timeout);
}

static PyObject *gather(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    ARGS("gather", 7);
    int count, root;
    void *sbuf = address(a[1]), *rbuf = address(a[2]);
    MPI_Datatype *dt = PyMPIDatatype_Get(a[4]);
    if (as_int(a[3], &count) < 0 || as_int(a[5], &root) < 0 || !dt || PyErr_Occurred())
        return NULL;
    rc = MPI_Igather(sbuf, count, *dt, rbuf, count, *dt, root, *comm, &req);
    return finish(rc, req, timeout);
}

static PyObject *scatter(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    ARGS("scatter", 7);
    int count, root;
    void *sbuf = address(a[1]), *rbuf = address(a[2]);
    MPI_Datatype *dt = PyMPIDatatype_Get(a[4]);
    if (as_int(a[3], &count) < 0 || as_int(a[5], &root) < 0 || !dt || PyErr_Occurred())
        return NULL;
    rc = MPI_Iscatter(sbuf, count, *dt, rbuf, count, *dt, root, *comm, &req);
    return finish(rc, req, timeout);
}

/* counts[i] (and their prefix sums) from a sequence of `size` ints. */
static int counts_of(PyObject *seq, int size, int *counts, int *displs)
{
    PyObject *fast = PySequence_Fast(seq, "counts must be a sequence");
    if (fast == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) != size) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "expected %d counts", size);
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    int acc = 0;
    for (int i = 0; i < size; i++) {
        if (as_int(items[i], &counts[i]) < 0) {
            Py_DECREF(fast);
            return -1;
        }
        displs[i] = acc;
        acc += counts[i];
    }
    Py_DECREF(fast);
    return 0;
}

/* alltoallv(comm, sendbuf, sendcounts, recvbuf, recvcounts, datatype, timeout).
 * MPI may read the count arrays until the op completes: after a timeout they
 * are left allocated. */
static PyObject *alltoallv(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    ARGS("alltoallv", 7);
    int size;
    void *sbuf = address(a[1]), *rbuf = address(a[3]);
    MPI_Datatype *dt = PyMPIDatatype_Get(a[5]);
    if (!dt || PyErr_Occurred() || MPI_Comm_size(*comm, &size) != MPI_SUCCESS)
        return NULL;
    int *arrays = malloc(4 * (size_t)size * sizeof(int));
    if (arrays == NULL)
        return PyErr_NoMemory();
    int *sc = arrays, *sd = arrays + size, *rcn = arrays + 2 * size, *rd = arrays + 3 * size;
    if (counts_of(a[2], size, sc, sd) < 0 || counts_of(a[4], size, rcn, rd) < 0) {
        free(arrays);
        return NULL;
    }
    rc = MPI_Ialltoallv(sbuf, sc, sd, *dt, rbuf, rcn, rd, *dt, *comm, &req);
    PyObject *out = finish(rc, req, timeout);
    if (out == Py_None || rc != MPI_SUCCESS)
        free(arrays);
    return out;
}

/* send(comm, buf, count, datatype, peer, tag, timeout) and recv(...): one peer. */
static PyObject *send(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    ARGS("send", 7);
    int count, peer, tag;
    void *buf = address(a[1]);
    MPI_Datatype *dt = PyMPIDatatype_Get(a[3]);
    if (as_int(a[2], &count) < 0 || as_int(a[4], &peer) < 0 || as_int(a[5], &tag) < 0
        || !dt || PyErr_Occurred())
        return NULL;
    rc = MPI_Isend(buf, count, *dt, peer, tag, *comm, &req);
    return finish(rc, req, timeout);
}

static PyObject *recv(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    ARGS("recv", 7);
    int count, peer, tag;
    void *buf = address(a[1]);
    MPI_Datatype *dt = PyMPIDatatype_Get(a[3]);
    if (as_int(a[2], &count) < 0 || as_int(a[4], &peer) < 0 || as_int(a[5], &tag) < 0
        || !dt || PyErr_Occurred())
        return NULL;
    rc = MPI_Irecv(buf, count, *dt, peer, tag, *comm, &req);
    return finish(rc, req, timeout);
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

/* mcrdl's compiled MPI hot path: a Starter starts one nonblocking MPI
 * operation on raw CPU addresses and waits for it, without the GIL, under
 * mcrdl's wait policy and a deadline. Built against the MPI that mpi4py uses
 * (see native.py); communicators, datatypes and ops come in as mpi4py objects.
 *
 * A start returns DONE once complete, or, when `timeout` seconds pass first,
 * the still-pending request as a Request (work.py's Pending, compiled: the
 * engine tests and waits for it without a Python frame; it keeps the buffers
 * alive while MPI may use them). A `timeout` of 0 or less only starts the op:
 * the async fast paths, whose requests the engine tracks. MPI errors at the
 * start raise the class given to setup (mcrdl's CommError) naming the MPI call
 * and MPI's message, errors in a later test a RuntimeError (the engine names
 * the op); counts outside C int raise OverflowError. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <mpi.h>
#include <mpi4py/mpi4py.h>
#include <limits.h>
#include <sched.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Seconds a wait polls without giving up the CPU: 0 (yield policy: only the
 * first FIRST_POLLS polls) or SPIN_S (spin policy). */
#define FIRST_POLLS 200
#define SPIN_S 1e-3
static double busy_s = 0.0;
static PyObject *error_class = NULL; /* setup(); RuntimeError until then */

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

/* Raise `type` with `what`, then MPI's own words for `rc`; returns NULL. */
static PyObject *raise_mpi(PyObject *type, const char *what, int rc)
{
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS)
        len = 0;
    msg[len] = '\0';
    return PyErr_Format(type, "%s: MPI error %d: %s", what, rc, msg);
}

static PyObject *mpi_error(int rc, const char *call)
{
    char what[64];
    snprintf(what, sizeof what, "%s on backend 'mpi' failed", call);
    return raise_mpi(error_class ? error_class : PyExc_RuntimeError, what, rc);
}

/* The end of every start: `rc` from starting `call`, then the wait; 1 once
 * complete, 0 still pending, -1 with an exception set. */
static int wait_started(int rc, MPI_Request *req, double timeout, const char *call)
{
    if (rc != MPI_SUCCESS)
        return mpi_error(rc, call), -1;
    if (timeout <= 0.0) /* start only: the engine tests it (and reports its errors) */
        return 0;
    Py_BEGIN_ALLOW_THREADS
    rc = wait_request(req, timeout);
    Py_END_ALLOW_THREADS
    return rc < 0 ? (mpi_error(-rc, call), -1) : rc;
}

/* A started request mcrdl's engine tracks (the Pending protocol of work.py):
 * test() and block(deadline) call MPI_Test, the latter without the GIL; a
 * point-to-point one can be withdrawn (cancel). It keeps the tensors MPI uses
 * and, for the uneven all-to-all, the count arrays MPI may read, freed once
 * it completes (one dropped while pending leaves them to MPI). */
typedef struct {
    PyObject_HEAD
    MPI_Request req;
    int p2p;
    int *arrays;
    PyObject *keep;
} Request;

static PyTypeObject RequestType;

/* A Request for `req`, keeping args[0..tensors-1]; if none can be made, the
 * op is waited for (MPI owns the buffers until then) and NULL returned. */
static PyObject *request_new(MPI_Request req, int p2p, int *arrays, PyObject *const *args, int tensors)
{
    Request *r = PyObject_New(Request, &RequestType);
    PyObject *keep = r ? PyTuple_New(tensors) : NULL;
    if (keep == NULL) {
        Py_BEGIN_ALLOW_THREADS
        MPI_Wait(&req, MPI_STATUS_IGNORE);
        Py_END_ALLOW_THREADS
        free(arrays);
        if (r != NULL) {
            r->keep = NULL;
            r->arrays = NULL;
            r->req = MPI_REQUEST_NULL;
            Py_DECREF(r);
        }
        return NULL;
    }
    for (int i = 0; i < tensors; i++)
        PyTuple_SET_ITEM(keep, i, Py_NewRef(args[i]));
    r->req = req;
    r->p2p = p2p;
    r->arrays = arrays;
    r->keep = keep;
    return (PyObject *)r;
}

/* What a test or block of `r` found: rc as wait_request's. */
static PyObject *request_state(Request *r, int rc)
{
    if (rc < 0)
        return raise_mpi(PyExc_RuntimeError, "MPI_Test", -rc);
    if (rc > 0 && r->arrays != NULL) {
        free(r->arrays);
        r->arrays = NULL;
    }
    return PyBool_FromLong(rc);
}

static PyObject *request_test(Request *r, PyObject *unused)
{
    int flag = 1, rc = MPI_SUCCESS;
    if (r->req != MPI_REQUEST_NULL)
        rc = MPI_Test(&r->req, &flag, MPI_STATUS_IGNORE);
    return request_state(r, rc != MPI_SUCCESS ? -rc : flag);
}

static PyObject *request_block(Request *r, PyObject *deadline)
{
    double until = PyFloat_AsDouble(deadline);
    int rc = 1;
    if (until == -1.0 && PyErr_Occurred())
        return NULL;
    if (r->req != MPI_REQUEST_NULL) {
        Py_BEGIN_ALLOW_THREADS
        rc = wait_request(&r->req, until - now_s());
        Py_END_ALLOW_THREADS
    }
    return request_state(r, rc);
}

static PyObject *request_cancel(Request *r, PyObject *unused)
{
    if (r->p2p && r->req != MPI_REQUEST_NULL) /* (one already matched completes anyway) */
        MPI_Cancel(&r->req);
    Py_RETURN_NONE;
}

static PyObject *request_nothing(Request *r, PyObject *unused)
{
    Py_RETURN_NONE;
}

static PyObject *request_source(Request *r, PyObject *unused)
{
    PyErr_SetString(PyExc_NotImplementedError, "a compiled receive names its peer: it has no other source");
    return NULL;
}

static PyObject *s_mpi = NULL; /* "mpi", interned at import: read on every async op */

static PyObject *request_domain(Request *r, void *unused)
{
    return Py_NewRef(s_mpi);
}

static PyObject *request_true(Request *r, void *unused)
{
    Py_RETURN_TRUE;
}

static PyObject *request_none(Request *r, void *unused)
{
    Py_RETURN_NONE;
}

static void request_dealloc(Request *r)
{
    if (r->req == MPI_REQUEST_NULL)
        free(r->arrays);
    Py_XDECREF(r->keep);
    PyObject_Free(r);
}

static PyObject *request_repr(Request *r)
{
    return PyUnicode_FromFormat("<compiled MPI request: %s>", r->req == MPI_REQUEST_NULL ? "complete" : "pending");
}

static PyMethodDef request_methods[] = {
    {"test", (PyCFunction)request_test, METH_NOARGS, "True once complete; never blocks."},
    {"block", (PyCFunction)request_block, METH_O, "Wait until complete or the deadline (monotonic s)."},
    {"cancel", (PyCFunction)request_cancel, METH_NOARGS, "Withdraw a point-to-point request."},
    {"prepare_poll", (PyCFunction)request_nothing, METH_NOARGS, NULL},
    {"native_future", (PyCFunction)request_nothing, METH_NOARGS, NULL},
    {"source", (PyCFunction)request_source, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef request_getset[] = {
    {"progress_domain", (getter)request_domain, NULL, "MPI progresses only inside MPI calls.", NULL},
    {"resumable_block", (getter)request_true, NULL, NULL, NULL},
    {"stream", (getter)request_none, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef request_members[] = {
    {"keep", T_OBJECT, offsetof(Request, keep), READONLY, "The tensors MPI may use until it completes."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject RequestType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mcrdl_mpi_native.Request",
    .tp_basicsize = sizeof(Request),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A started MPI request the engine tracks (see mpi_native.c).",
    .tp_dealloc = (destructor)request_dealloc,
    .tp_repr = (reprfunc)request_repr,
    .tp_methods = request_methods,
    .tp_getset = request_getset,
    .tp_members = request_members,
};

/* An int argument that fits C int; -1 with OverflowError otherwise. */
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

/* A Starter is one op's start-and-wait with everything but the buffers fixed
 * (a plan's start, see backends/mpi.py): Starter(op, comm, datatype, count,
 * timeout, reduction=None, root=0, tag=0), where `op` is the mcrdl
 * op it runs, `root` is the root or the peer, `count` the elements of the
 * single buffer (all_gather_into_tensor: sent; reduce_scatter_tensor:
 * received; all_to_all_single's even form: per peer), `reduction` an MPI op.
 * Called with the op's tensors (None for a buffer this rank does not pass;
 * all_to_all_single also takes the output and input element counts per peer,
 * or two Nones for even rows) it reads their addresses, starts the op and
 * waits: DONE once complete, else its Request.
 * The compiled driver (csrc/driver.cpp's drive) calls `starter_start` (exported as
 * the capsule `start`) with addresses it read itself: no Python per call. */
enum kind { ALL_REDUCE, BROADCAST, REDUCE, ALL_GATHER, REDUCE_SCATTER, GATHER, SCATTER, ALL_TO_ALL, SEND, RECV };
static const struct {
    const char *op;
    int tensors, args; /* the tensors it takes; the arguments a call passes */
} KINDS[] = {
    {"all_reduce", 1, 1}, {"broadcast", 1, 1}, {"reduce", 1, 1}, {"all_gather_into_tensor", 2, 2},
    {"reduce_scatter_tensor", 2, 2}, {"gather", 2, 2}, {"scatter", 2, 2}, {"all_to_all_single", 2, 4},
    {"send", 1, 1}, {"recv", 1, 1},
};
#define N_KINDS ((int)(sizeof KINDS / sizeof KINDS[0]))

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    enum kind kind;
    int count, root, tag, is_root;
    double timeout;
    MPI_Comm *comm;    /* inside the mpi4py objects held below: a freed one reads as null */
    MPI_Datatype *dt;
    MPI_Op *reduction;
    PyObject *held[3]; /* comm, datatype, reduction */
} Starter;

static PyObject *done = NULL; /* setup(): what a start returns once complete */
static PyObject *s_data_ptr = NULL; /* "data_ptr", interned at import */

/* Start all_to_all_single's uneven form: MPI_Ialltoallv's return code, or -1
 * with an exception set (bad counts). The count arrays MPI may read until it
 * completes are left in *arrays. */
static int start_uneven(Starter *s, void *sbuf, void *rbuf, PyObject *out_counts, PyObject *in_counts,
                        MPI_Request *req, int **arrays)
{
    int size, rc;
    if ((rc = MPI_Comm_size(*s->comm, &size)) != MPI_SUCCESS)
        return mpi_error(rc, "MPI_Comm_size"), -1;
    int *a = malloc(4 * (size_t)size * sizeof(int));
    if (a == NULL)
        return PyErr_NoMemory(), -1;
    if (counts_of(in_counts, size, a, a + size) < 0 || counts_of(out_counts, size, a + 2 * size, a + 3 * size) < 0) {
        free(a);
        return -1;
    }
    *arrays = a;
    return MPI_Ialltoallv(sbuf, a, a + size, *s->dt, rbuf, a + 2 * size, a + 3 * size, *s->dt, *s->comm, req);
}

/* Start s's op on the buffers at `addr` (one per tensor) and wait; `args`:
 * the call's arguments (the tensors, then any counts). */
static PyObject *starter_start(PyObject *self, void *const *addr, PyObject *const *args, Py_ssize_t n)
{
    Starter *s = (Starter *)self;
    if (n != KINDS[s->kind].args) {
        PyErr_Format(PyExc_TypeError, "the %s starter takes %d arguments (%zd given)", KINDS[s->kind].op,
                     KINDS[s->kind].args, n);
        return NULL;
    }
    void *a0 = addr[0], *a1 = KINDS[s->kind].tensors > 1 ? addr[1] : NULL;
    MPI_Comm comm = *s->comm;
    MPI_Datatype dt = *s->dt;
    MPI_Request req = MPI_REQUEST_NULL;
    const char *call;
    int rc, c = s->count, *arrays = NULL;
    switch (s->kind) {
    case ALL_REDUCE:
        call = "MPI_Iallreduce";
        rc = MPI_Iallreduce(MPI_IN_PLACE, a0, c, dt, *s->reduction, comm, &req);
        break;
    case BROADCAST:
        call = "MPI_Ibcast";
        rc = MPI_Ibcast(a0, c, dt, s->root, comm, &req);
        break;
    case REDUCE:
        call = "MPI_Ireduce";
        rc = s->is_root ? MPI_Ireduce(MPI_IN_PLACE, a0, c, dt, *s->reduction, s->root, comm, &req)
                        : MPI_Ireduce(a0, NULL, c, dt, *s->reduction, s->root, comm, &req);
        break;
    case ALL_GATHER: /* (output, input) */
        call = "MPI_Iallgather";
        rc = MPI_Iallgather(a1, c, dt, a0, c, dt, comm, &req);
        break;
    case REDUCE_SCATTER:
        call = "MPI_Ireduce_scatter_block";
        rc = MPI_Ireduce_scatter_block(a1, a0, c, dt, *s->reduction, comm, &req);
        break;
    case GATHER:
        call = "MPI_Igather";
        rc = MPI_Igather(a1, c, dt, a0, c, dt, s->root, comm, &req);
        break;
    case SCATTER:
        call = "MPI_Iscatter";
        rc = MPI_Iscatter(a1, c, dt, a0, c, dt, s->root, comm, &req);
        break;
    case ALL_TO_ALL:
        if (args[3] != Py_None) {
            call = "MPI_Ialltoallv";
            if ((rc = start_uneven(s, a1, a0, args[2], args[3], &req, &arrays)) < 0)
                return NULL;
            break;
        }
        call = "MPI_Ialltoall";
        rc = MPI_Ialltoall(a1, c, dt, a0, c, dt, comm, &req);
        break;
    case SEND:
        call = "MPI_Isend";
        rc = MPI_Isend(a0, c, dt, s->root, s->tag, comm, &req);
        break;
    default: /* RECV */
        call = "MPI_Irecv";
        rc = MPI_Irecv(a0, c, dt, s->root, s->tag, comm, &req);
        break;
    }
    int state = wait_started(rc, &req, s->timeout, call);
    if (state != 0) { /* failed or complete: MPI no longer reads the arrays */
        free(arrays);
        return state < 0 ? NULL : Py_NewRef(done);
    }
    return request_new(req, s->kind == SEND || s->kind == RECV, arrays, args, KINDS[s->kind].tensors);
}

/* From Python: the tensors' addresses through data_ptr(). */
static PyObject *starter_call(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    void *addr[2] = {NULL, NULL};
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0) {
        PyErr_SetString(PyExc_TypeError, "a starter takes no keyword arguments");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n && i < KINDS[((Starter *)self)->kind].tensors; i++) {
        if (args[i] == Py_None)
            continue;
        PyObject *at = PyObject_VectorcallMethod(s_data_ptr, (PyObject *[]){args[i]},
                                                 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (at == NULL)
            return NULL;
        addr[i] = PyLong_AsVoidPtr(at);
        Py_DECREF(at);
        if (addr[i] == NULL && PyErr_Occurred())
            return NULL;
    }
    return starter_start(self, addr, args, n);
}

static PyObject *starter_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"op", "comm", "datatype", "count", "timeout", "reduction", "root", "tag", NULL};
    const char *op;
    PyObject *comm, *dt, *reduction = Py_None, *count;
    int root = 0, tag = 0, kind, rank, rc;
    double timeout;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "sOOOd|Oii:Starter", names, &op, &comm, &dt, &count, &timeout,
                                     &reduction, &root, &tag))
        return NULL;
    for (kind = 0; kind < N_KINDS && strcmp(KINDS[kind].op, op) != 0; kind++)
        ;
    if (kind == N_KINDS)
        return PyErr_Format(PyExc_ValueError, "Starter: no compiled form of op %R", PyTuple_GET_ITEM(args, 0));
    int needs_reduction = kind == ALL_REDUCE || kind == REDUCE || kind == REDUCE_SCATTER;
    Starter *s = (Starter *)type->tp_alloc(type, 0);
    if (s == NULL)
        return NULL;
    s->vectorcall = starter_call;
    s->kind = (enum kind)kind;
    s->root = root;
    s->tag = tag;
    s->timeout = timeout;
    s->held[0] = Py_NewRef(comm);
    s->held[1] = Py_NewRef(dt);
    s->held[2] = Py_NewRef(reduction);
    if (as_int(count, &s->count) < 0 || !(s->comm = PyMPIComm_Get(comm)) || !(s->dt = PyMPIDatatype_Get(dt))
        || (needs_reduction && !(s->reduction = PyMPIOp_Get(reduction)))) {
        Py_DECREF(s);
        return NULL;
    }
    if (kind == REDUCE) {
        if ((rc = MPI_Comm_rank(*s->comm, &rank)) != MPI_SUCCESS) {
            Py_DECREF(s);
            return mpi_error(rc, "MPI_Comm_rank");
        }
        s->is_root = rank == root;
    }
    return (PyObject *)s;
}

static int starter_traverse(Starter *s, visitproc visit, void *arg)
{
    for (int i = 0; i < 3; i++)
        Py_VISIT(s->held[i]);
    return 0;
}

static int starter_clear(Starter *s)
{
    for (int i = 0; i < 3; i++)
        Py_CLEAR(s->held[i]);
    return 0;
}

static void starter_dealloc(Starter *s)
{
    PyObject_GC_UnTrack(s);
    starter_clear(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *starter_repr(Starter *s)
{
    return PyUnicode_FromFormat("<compiled %s starter: %d elements>", KINDS[s->kind].op, s->count);
}

static PyTypeObject StarterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mcrdl_mpi_native.Starter",
    .tp_basicsize = sizeof(Starter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "One op's compiled start-and-wait (see mpi_native.c).",
    .tp_vectorcall_offset = offsetof(Starter, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = starter_new,
    .tp_traverse = (traverseproc)starter_traverse,
    .tp_clear = (inquiry)starter_clear,
    .tp_dealloc = (destructor)starter_dealloc,
    .tp_repr = (reprfunc)starter_repr,
};

/* setup(error, done): the exception class MPI errors raise (a RuntimeError
 * until then) and what a start returns once complete. */
static PyObject *setup(PyObject *self, PyObject *const *a, Py_ssize_t n)
{
    if (n != 2 || !PyExceptionClass_Check(a[0])) {
        PyErr_SetString(PyExc_TypeError, "setup takes an exception class and the DONE object");
        return NULL;
    }
    Py_XSETREF(error_class, Py_NewRef(a[0]));
    Py_XSETREF(done, Py_NewRef(a[1]));
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

static PyMethodDef methods[] = {
    {"setup", (PyCFunction)(void (*)(void))setup, METH_FASTCALL, NULL},
    {"set_busy", set_busy, METH_O, NULL},
    {"library_version", library_version, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "mcrdl_mpi_native", NULL, -1, methods};

/* The capsule `start` holds starter_start for csrc/driver.cpp's drive, which
 * declares the same signature (typedef start_fn there). */
PyMODINIT_FUNC PyInit_mcrdl_mpi_native(void)
{
    if (import_mpi4py() < 0 || PyType_Ready(&StarterType) < 0 || PyType_Ready(&RequestType) < 0
        || (s_data_ptr = PyUnicode_InternFromString("data_ptr")) == NULL
        || (s_mpi = PyUnicode_InternFromString("mpi")) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    PyObject *capsule = PyCapsule_New((void *)starter_start, "mcrdl_mpi_native.start", NULL);
    if (capsule == NULL || PyModule_AddObjectRef(m, "start", capsule) < 0
        || PyModule_AddObjectRef(m, "Starter", (PyObject *)&StarterType) < 0
        || PyModule_AddObjectRef(m, "Request", (PyObject *)&RequestType) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    Py_DECREF(capsule);
    return m;
}

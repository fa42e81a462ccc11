// The engine's compiled parts: RLock (work.py's engine lock, taken without the GIL
// while it waits and without a call by track() and finished()), track() (Engine.run
// for an op started from its plan: its Work made and made outstanding), clear_of()
// (Engine.order_before's common case), finished() (Work.wait()'s common case on a
// request type adopt_starter() adopted), adopt_work() (what those read of work.py).
// Mirrors: work.py (Engine.run, Engine.order_before, Work.wait, Work._finish).
// Covered by: tests/test_facts.py (the lock), tests/test_order_checks.py,
// tests/test_hazards.py, tests/test_collectives.py (async forms on both builds).

// ---------------------------------------------------------------- the engine's lock
// RLock(): threading.RLock (reentrant, owned by the thread that took it, taken
// without the GIL while it waits), which track() and finished() take and give
// back without a call: CPython's RLock.acquire parses its arguments on every
// call, and an async op takes the lock twice. It has what threading.Condition uses (_is_owned,
// _release_save, _acquire_restore). owner and count change only under the GIL.
struct RLock {
    PyObject_HEAD
    PyThread_type_lock mutex;
    unsigned long owner, count;
};

// Wait up to ``timeout`` µs (-1: forever) for the mutex, without the GIL,
// running signal handlers when a signal interrupts the wait; false on a
// timeout, false with an error if a handler raised.
bool wait_for(PyThread_type_lock mutex, long long timeout)
{
    if (PyThread_acquire_lock_timed(mutex, 0, 0) == PY_LOCK_ACQUIRED)
        return true;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    long long deadline = now.tv_sec * 1000000LL + now.tv_nsec / 1000 + timeout;
    while (timeout != 0) {
        PyLockStatus got;
        Py_BEGIN_ALLOW_THREADS
        got = PyThread_acquire_lock_timed(mutex, timeout, 1);
        Py_END_ALLOW_THREADS
        if (got != PY_LOCK_INTR)
            return got == PY_LOCK_ACQUIRED;
        if (Py_MakePendingCalls() < 0)
            return false;
        if (timeout > 0) {
            clock_gettime(CLOCK_MONOTONIC, &now);
            timeout = std::max(0LL, deadline - (now.tv_sec * 1000000LL + now.tv_nsec / 1000));
        }
    }
    return PyThread_acquire_lock_timed(mutex, 0, 0) == PY_LOCK_ACQUIRED;
}

// Take ``lock`` for this thread, waiting up to ``timeout`` µs (-1: forever).
bool take(RLock *lock, long long timeout = -1)
{
    unsigned long me = PyThread_get_thread_ident();
    if (lock->count > 0 && lock->owner == me) {
        if (lock->count == ULONG_MAX) {
            PyErr_SetString(PyExc_OverflowError, "RLock: taken too many times");
            return false;
        }
        lock->count++;
        return true;
    }
    if (!wait_for(lock->mutex, timeout))
        return false;
    lock->owner = me;
    lock->count = 1;
    return true;
}

// Give ``lock`` back once; false with an error if this thread does not hold it.
bool give(RLock *lock)
{
    if (lock->count == 0 || lock->owner != PyThread_get_thread_ident()) {
        PyErr_SetString(PyExc_RuntimeError, "cannot release un-acquired lock");
        return false;
    }
    if (--lock->count == 0) {
        lock->owner = 0;
        PyThread_release_lock(lock->mutex);
    }
    return true;
}

PyObject *rlock_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "RLock() takes no arguments");
        return nullptr;
    }
    auto *self = reinterpret_cast<RLock *>(type->tp_alloc(type, 0));
    if (self != nullptr && (self->mutex = PyThread_allocate_lock()) == nullptr) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return reinterpret_cast<PyObject *>(self);
}

void rlock_dealloc(RLock *self)
{
    if (self->mutex != nullptr) {
        if (self->count > 0)
            PyThread_release_lock(self->mutex);
        PyThread_free_lock(self->mutex);
    }
    Py_TYPE(self)->tp_free(reinterpret_cast<PyObject *>(self));
}

// acquire(blocking=True, timeout=-1): as threading.RLock's.
PyObject *rlock_acquire(PyObject *self, PyObject *args, PyObject *kwargs)
{
    int blocking = 1;
    double seconds = -1;
    static const char *names[] = {"blocking", "timeout", nullptr};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|pd:acquire", const_cast<char **>(names), &blocking, &seconds))
        return nullptr;
    if (!blocking && seconds != -1) {
        PyErr_SetString(PyExc_ValueError, "can't specify a timeout for a non-blocking call");
        return nullptr;
    }
    if (std::isnan(seconds)) {
        PyErr_SetString(PyExc_ValueError, "Invalid value NaN (not a number)");
        return nullptr;
    }
    if (seconds < 0 && seconds != -1) {
        PyErr_SetString(PyExc_ValueError, "timeout value must be positive");
        return nullptr;
    }
    if (seconds > static_cast<double>(PY_TIMEOUT_MAX) / 1e6) {
        PyErr_SetString(PyExc_OverflowError, "timeout value is too large");
        return nullptr;
    }
    long long timeout = !blocking ? 0 : seconds < 0 ? -1 : static_cast<long long>(std::ceil(seconds * 1e6));
    if (take(reinterpret_cast<RLock *>(self), timeout))
        Py_RETURN_TRUE;
    return PyErr_Occurred() ? nullptr : Py_NewRef(Py_False);
}

PyObject *rlock_enter(PyObject *self, PyObject *)
{
    return take(reinterpret_cast<RLock *>(self)) ? Py_NewRef(Py_True) : nullptr;
}

PyObject *rlock_release(PyObject *self, PyObject *)
{
    return give(reinterpret_cast<RLock *>(self)) ? Py_NewRef(Py_None) : nullptr;
}

PyObject *rlock_exit(PyObject *self, PyObject *const *, Py_ssize_t)
{
    return rlock_release(self, nullptr);
}

PyObject *rlock_is_owned(PyObject *self, PyObject *)
{
    auto *lock = reinterpret_cast<RLock *>(self);
    return PyBool_FromLong(lock->count > 0 && lock->owner == PyThread_get_thread_ident());
}

// _release_save(): given back however often it was taken; (count, owner) for _acquire_restore.
PyObject *rlock_release_save(PyObject *self, PyObject *)
{
    auto *lock = reinterpret_cast<RLock *>(self);
    if (lock->count == 0) {
        PyErr_SetString(PyExc_RuntimeError, "cannot release un-acquired lock");
        return nullptr;
    }
    PyObject *state = Py_BuildValue("(kk)", lock->count, lock->owner);
    if (state == nullptr)
        return nullptr;
    lock->count = 0;
    lock->owner = 0;
    PyThread_release_lock(lock->mutex);
    return state;
}

PyObject *rlock_acquire_restore(PyObject *self, PyObject *state)
{
    auto *lock = reinterpret_cast<RLock *>(self);
    unsigned long count, owner;
    if (!PyArg_ParseTuple(state, "kk:_acquire_restore", &count, &owner))
        return nullptr;
    if (PyThread_acquire_lock(lock->mutex, NOWAIT_LOCK) == 0) { // (no signal ends this wait: as CPython's)
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(lock->mutex, WAIT_LOCK);
        Py_END_ALLOW_THREADS
    }
    lock->owner = owner;
    lock->count = count;
    Py_RETURN_NONE;
}

PyObject *rlock_repr(PyObject *self)
{
    auto *lock = reinterpret_cast<RLock *>(self);
    return PyUnicode_FromFormat("<%s mcrdl_facts.RLock owner=%lu count=%lu at %p>",
                                lock->count ? "locked" : "unlocked", lock->owner, lock->count, self);
}

PyMethodDef rlock_methods[] = {
    {"acquire", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(rlock_acquire)),
     METH_VARARGS | METH_KEYWORDS, "acquire(blocking=True, timeout=-1): as threading.RLock's"},
    {"release", rlock_release, METH_NOARGS, "release(): once (RuntimeError if this thread does not hold it)"},
    {"__enter__", rlock_enter, METH_NOARGS, nullptr},
    {"__exit__", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(rlock_exit)), METH_FASTCALL, nullptr},
    {"_is_owned", rlock_is_owned, METH_NOARGS, nullptr},
    {"_release_save", rlock_release_save, METH_NOARGS, nullptr},
    {"_acquire_restore", rlock_acquire_restore, METH_O, nullptr},
    {nullptr, nullptr, 0, nullptr},
};

PyTypeObject RLockType = [] {
    PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
    t.tp_name = "mcrdl_facts.RLock";
    t.tp_basicsize = sizeof(RLock);
    t.tp_flags = Py_TPFLAGS_DEFAULT;
    t.tp_doc = "RLock(): threading.RLock, which compiled code takes without a call";
    t.tp_new = rlock_new;
    t.tp_dealloc = reinterpret_cast<destructor>(rlock_dealloc);
    t.tp_repr = rlock_repr;
    t.tp_methods = rlock_methods;
    return t;
}();

// ---------------------------------------------------------------- AVG's divide
// AVG's divide of a finished result, as ``result.div_(n)`` with grad off (a parameter is a
// leaf that requires grad): up to 1024 float32 or float64 elements of CPU memory in a loop
// here, the same IEEE quotients without TensorIterator's set-up (2-3 us of a 4 B call); the
// rest by div_, whose kernel is vectorized (this loop is not: 256 KiB took 1.7x raw's time).
template <typename T> void divide_elements(const at::Tensor &t, long n)
{
    T *p = t.data_ptr<T>(), d = static_cast<T>(n);
    for (int64_t i = 0, e = t.numel(); i < e; i++)
        p[i] = p[i] / d;
}

void divide_in_place(const at::Tensor &t, long n)
{
    bool small = t.numel() <= 1024 && t.is_contiguous() && t.is_cpu();
    if (small && t.scalar_type() == at::kFloat)
        divide_elements<float>(t, n);
    else if (small && t.scalar_type() == at::kDouble)
        divide_elements<double>(t, n);
    else {
        at::NoGradGuard no_grad;
        t.div_(n);
        return;
    }
    t.unsafeGetTensorImpl()->bump_version(); // (what an in-place op does: autograd sees the change)
}

// Divide(result, n): an async AVG's completion step. Called (Work._finish, run_post), it
// divides; finished() runs it without a call, so the work stays on the compiled path.
struct Divide {
    PyObject_HEAD
    PyObject *result;
    long n;
};

// divide_in_place on a Divide's result; false with an error.
bool divide_now(Divide *step)
{
    try {
        divide_in_place(THPVariable_Unpack(step->result), step->n);
        return true;
    } catch (const std::exception &e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return false;
    }
}

PyObject *divide_new(PyTypeObject *, PyObject *args, PyObject *);

void divide_dealloc(Divide *self)
{
    Py_XDECREF(self->result);
    Py_TYPE(self)->tp_free(reinterpret_cast<PyObject *>(self));
}

PyObject *divide_call(PyObject *self, PyObject *, PyObject *)
{
    return divide_now(reinterpret_cast<Divide *>(self)) ? Py_NewRef(Py_None) : nullptr;
}

PyObject *divide_repr(PyObject *self)
{
    return PyUnicode_FromFormat("Divide(n=%ld)", reinterpret_cast<Divide *>(self)->n);
}

PyTypeObject DivideType = [] {
    PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
    t.tp_name = "mcrdl_facts.Divide";
    t.tp_basicsize = sizeof(Divide);
    t.tp_flags = Py_TPFLAGS_DEFAULT;
    t.tp_doc = "Divide(result, n): AVG's completion step, result /= n in place with grad off";
    t.tp_new = divide_new;
    t.tp_dealloc = reinterpret_cast<destructor>(divide_dealloc);
    t.tp_call = divide_call;
    t.tp_repr = divide_repr;
    return t;
}();

// A new Divide of ``result`` (a tensor) by ``n`` > 0, without Divide()'s argument parsing (drive's).
PyObject *divide_step(PyObject *result, long n)
{
    auto *self = reinterpret_cast<Divide *>(DivideType.tp_alloc(&DivideType, 0));
    if (self != nullptr) {
        self->result = Py_NewRef(result);
        self->n = n;
    }
    return reinterpret_cast<PyObject *>(self);
}

PyObject *divide_new(PyTypeObject *, PyObject *args, PyObject *)
{
    PyObject *result;
    long n;
    if (!PyArg_ParseTuple(args, "O!l:Divide", THPVariableClass, &result, &n))
        return nullptr;
    if (n <= 0) {
        PyErr_Format(PyExc_ValueError, "Divide: the divisor must be positive, got %ld", n);
        return nullptr;
    }
    return divide_step(result, n);
}

// The Divide a work's completion steps are, if they are one and nothing else; nullptr if not.
Divide *lone_divide(PyObject *post)
{
    PyObject *only = PyTuple_CheckExact(post) && PyTuple_GET_SIZE(post) == 1 ? PyTuple_GET_ITEM(post, 0) : nullptr;
    return only != nullptr && Py_TYPE(only) == &DivideType ? reinterpret_cast<Divide *>(only) : nullptr;
}

// What track() and finished() read: Work's slots (their offsets, from its
// member descriptors) and work.RECEIVES; set by adopt_work().
struct WorkSlots {
    PyTypeObject *type = nullptr;
    PyObject *receives = nullptr, *empty = nullptr;
    PyObject *s_domains = nullptr, *s_test = nullptr, *s_domain = nullptr;
    Py_ssize_t op, engine, pending, post, done, error, future, stream, backend, group, peer, reads, writes, deadline,
        result, settled, spans;
} W;

inline PyObject *&slot(PyObject *o, Py_ssize_t offset) { return *reinterpret_cast<PyObject **>(reinterpret_cast<char *>(o) + offset); }

inline void put(PyObject *o, Py_ssize_t offset, PyObject *value)
{
    Py_INCREF(value);
    Py_XSETREF(slot(o, offset), value);
}

// An address kept as a Python int (ranges()'s): PyLong_AsSize_t reads its
// digits in a loop, where PyLong_AsUnsignedLongLong goes through a byte array
// for every value over 2**30, as every address is.
size_t address(PyObject *o)
{
    return PyLong_AsSize_t(o);
}

// Do two lists of ranges (ranges()'s third item) conflict: a byte of one
// device in both, one of the two writing it (work.py's _conflict)? -1 on an error.
int conflict(PyObject *mine, PyObject *theirs)
{
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(mine); i++) {
        PyObject *a = PyList_GET_ITEM(mine, i);
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(theirs); j++) {
            PyObject *b = PyList_GET_ITEM(theirs, j);
            size_t s1 = address(PyTuple_GET_ITEM(a, 1)), e1 = address(PyTuple_GET_ITEM(a, 2)),
                   s2 = address(PyTuple_GET_ITEM(b, 1)), e2 = address(PyTuple_GET_ITEM(b, 2));
            if (PyErr_Occurred())
                return -1;
            if (!(s1 < e2 && s2 < e1) || (PyTuple_GET_ITEM(a, 3) != Py_True && PyTuple_GET_ITEM(b, 3) != Py_True))
                continue;
            int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(a, 0), PyTuple_GET_ITEM(b, 0), Py_EQ);
            if (same != 0)
                return same;
        }
    }
    return 0;
}

// clear_of(engine, reads, writes): Engine.order_before's common case compiled:
// the new op's ranges when no outstanding work's tensors conflict with its
// own (each work's ranges computed once and kept in it, as order_before
// does). None: order_before decides (a conflict, which it waits for and
// names if it failed; a tensor only facts.ranges reads; a work not Work; no
// Work adopted, as in a process without MPI).
PyObject *clear_of(PyObject *engine, PyObject *reads, PyObject *writes)
{
    if (W.type == nullptr) // (Work not adopted)
        Py_RETURN_NONE;
    PyObject *mine_args[2] = {reads, writes};
    THPObjectPtr mine(ranges(nullptr, mine_args, 2));
    if (!mine || mine.get() == Py_None)
        return mine.release();
    // (the list itself, not a copy: only keeping a work's ranges allocates, so
    // only then can a finalizer run Python code that lets another thread
    // change the list; the walk then starts again)
    THPObjectPtr works(get(engine, a_outstanding));
    if (!works)
        return nullptr;
    if (!PyList_CheckExact(works.get()))
        Py_RETURN_NONE;
    size_t low = address(PyTuple_GET_ITEM(mine.get(), 0)), high = address(PyTuple_GET_ITEM(mine.get(), 1));
    if (PyErr_Occurred())
        return nullptr;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(works.get()); i++) {
        PyObject *work = PyList_GET_ITEM(works.get(), i);
        if (!PyObject_TypeCheck(work, W.type))
            Py_RETURN_NONE;
        if (slot(work, W.done) == Py_True)
            continue;
        PyObject *spans = slot(work, W.spans);
        if (spans == nullptr || spans == Py_None) { // (a work started with nothing outstanding)
            THPObjectPtr held(Py_NewRef(work));
            PyObject *reads_of = slot(work, W.reads), *writes_of = slot(work, W.writes);
            if (reads_of == nullptr || writes_of == nullptr)
                Py_RETURN_NONE;
            PyObject *their_args[2] = {reads_of, writes_of};
            THPObjectPtr theirs(ranges(nullptr, their_args, 2));
            if (!theirs || theirs.get() == Py_None)
                return theirs.release();
            put(held.get(), W.spans, theirs.get());
            if (slot(held.get(), W.spans) != theirs.get())
                Py_RETURN_NONE;
            i = -1; // (that allocated: a finalizer may have changed the list, so walk it again)
            continue;
        }
        size_t start = address(PyTuple_GET_ITEM(spans, 0)), end = address(PyTuple_GET_ITEM(spans, 1));
        if (PyErr_Occurred())
            return nullptr;
        if (!(low < end && start < high))
            continue;
        int hit = conflict(PyTuple_GET_ITEM(mine.get(), 2), PyTuple_GET_ITEM(spans, 2));
        if (hit != 0)
            return hit < 0 ? nullptr : Py_NewRef(Py_None);
    }
    return mine.release();
}

// track(engine, g, name, backend, pending, reads, writes, result, spans, peer, post, done):
// Engine.run for a started async op, compiled: its Work, made here with every
// slot Work.__init__ sets (``post``: no completion step, or AVG's Divide), added to the engine's outstanding works (and its
// library to the engine's progress domains) under the engine's lock. ``done``:
// the op completed in its start (an MPI request its first test found done):
// its Work is made as finished() leaves one, and no other thread ever sees it
// outstanding. None: Work is not adopted, the engine's lock is not an RLock
// of this module, or a member of the group died meanwhile: Engine.run's turn.
PyObject *track(PyObject *engine, PyObject *g, PyObject *name, PyObject *backend, PyObject *pending, PyObject *reads,
                PyObject *writes, PyObject *result, PyObject *spans, PyObject *peer, PyObject *post, bool done)
{
    // (a death noted refuses new work, but not one already done: as Engine.block)
    int lost = W.type == nullptr ? 1 : done ? 0 : truth(engine, a_lost);
    if (lost != 0)
        return lost < 0 ? nullptr : Py_NewRef(Py_None);
    THPObjectPtr lock(done ? nullptr : get(engine, a_lock));
    if (!done && !lock)
        return nullptr;
    if (!done && Py_TYPE(lock.get()) != &RLockType)
        Py_RETURN_NONE;
    THPObjectPtr timeout(get(g, a_timeout));
    double seconds = timeout ? PyFloat_AsDouble(timeout.get()) : -1.0;
    if (seconds == -1.0 && PyErr_Occurred())
        return nullptr;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now); // (time.monotonic()'s clock)
    THPObjectPtr deadline(PyFloat_FromDouble(static_cast<double>(now.tv_sec) + now.tv_nsec * 1e-9 + seconds));
    THPObjectPtr domain(deadline && !done ? PyObject_GetAttr(pending, W.s_domain) : nullptr);
    THPObjectPtr work(domain || (deadline && done) ? W.type->tp_alloc(W.type, 0) : nullptr);
    if (!work)
        return nullptr;
    PyObject *o = work.get();
    int receive = done ? PySet_Contains(W.receives, name) : 1;
    if (receive < 0)
        return nullptr;
    struct { Py_ssize_t at; PyObject *value; } slots[] = {
        {W.op, name}, {W.backend, backend}, {W.group, g}, {W.peer, peer}, {W.engine, engine},
        {W.pending, receive ? pending : Py_None}, // (a receive's request still names its sender)
        {W.post, done ? W.empty : post}, {W.reads, reads}, {W.writes, writes}, {W.deadline, deadline.get()},
        {W.done, done ? Py_True : Py_False}, {W.error, Py_None}, {W.result, result}, {W.future, Py_None},
        {W.settled, Py_False}, {W.spans, spans}, {W.stream, Py_None}};
    for (auto &entry : slots)
        put(o, entry.at, entry.value);
    if (done)
        return work.release();
    auto *held = reinterpret_cast<RLock *>(lock.get());
    if (!take(held))
        return nullptr;
    bool ok = true;
    if (domain.get() != Py_None) { // (the set is replaced, never mutated: readers take it without the lock)
        THPObjectPtr domains(get(engine, a_domains));
        int known = domains ? PySet_Contains(domains.get(), domain.get()) : -1;
        if (known == 0) {
            THPObjectPtr one(PyFrozenSet_New(nullptr));
            ok = one && PySet_Add(one.get(), domain.get()) == 0;
            THPObjectPtr more(ok ? PyNumber_Or(domains.get(), one.get()) : nullptr);
            ok = more && PyObject_SetAttr(engine, W.s_domains, more.get()) == 0;
        } else
            ok = known == 1;
    }
    THPObjectPtr outstanding(ok ? get(engine, a_outstanding) : nullptr);
    ok = outstanding && PyList_Append(outstanding.get(), o) == 0;
    if (!give(held) || !ok)
        return nullptr;
    return work.release();
}

// finished(work, burst, turns): Work.wait()'s common case compiled: an
// untimed wait for a work whose request is of a type adopt_starter() adopted,
// its library the only one ever outstanding (the engine's progress domains), no future, no completion steps
// but AVG's Divide (run here), and the engine's lock an RLock of this module. It makes up to
// ``turns`` turns of ``burst`` tests under the engine's lock, as the Python
// wait's first polls do (Engine._test_one); complete, it takes the work out of
// the engine and marks it done as Work._finish does (True). False: not done
// by then, or another case; the Python wait goes on from where this left it.
// What a test raises (the library failed) raises here; the caller retires the
// work with it. finish() is its body: 1 (done), 0 (not, or another case), -1 (an error).
int finish(PyObject *work, long burst, long turns)
{
    if (W.type == nullptr || !PyObject_TypeCheck(work, W.type))
        return 0;
    PyObject *pending = slot(work, W.pending), *post = slot(work, W.post), *engine = slot(work, W.engine);
    PyObject *domain = pending == nullptr ? nullptr : domain_of(Py_TYPE(pending));
    if (domain == nullptr || engine == nullptr || post == nullptr
        || !((PyTuple_CheckExact(post) && (PyTuple_GET_SIZE(post) == 0 || lone_divide(post) != nullptr))
             || (PyList_CheckExact(post) && PyList_GET_SIZE(post) == 0)))
        return 0;
    THPObjectPtr domains(get(engine, a_domains));
    if (!domains)
        return -1;
    if (!PyFrozenSet_CheckExact(domains.get()) || PySet_GET_SIZE(domains.get()) != 1)
        return 0;
    int alone = PySet_Contains(domains.get(), domain);
    if (alone <= 0)
        return alone;
    THPObjectPtr lock(get(engine, a_lock));
    if (!lock)
        return -1;
    if (Py_TYPE(lock.get()) != &RLockType)
        return 0;
    auto *held = reinterpret_cast<RLock *>(lock.get());
    Py_INCREF(pending);
    THPObjectPtr own(pending); // (another thread may finish the work and drop it between turns)
    for (long turn = 0; turn < turns; turn++) {
        if (!take(held))
            return -1;
        if (slot(work, W.done) != Py_False || slot(work, W.pending) != pending || slot(work, W.future) != Py_None) {
            bool clean = slot(work, W.done) == Py_True && slot(work, W.error) == Py_None
                         && slot(work, W.stream) == Py_None; // (finished by another thread)
            return give(held) ? clean : -1;
        }
        int complete = 0;
        for (long i = 0; i < burst && complete == 0; i++) {
            THPObjectPtr tested(PyObject_VectorcallMethod(W.s_test, &pending, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr));
            complete = tested ? PyObject_IsTrue(tested.get()) : -1;
        }
        if (complete == 0) {
            if (!give(held))
                return -1;
            continue;
        }
        Divide *divide = complete == 1 ? lone_divide(slot(work, W.post)) : nullptr; // (before it is seen done)
        if (divide != nullptr && !divide_now(divide)) {
            give(held);
            return -1;
        }
        THPObjectPtr outstanding(complete == 1 ? get(engine, a_outstanding) : nullptr);
        int receive = outstanding ? PySet_Contains(W.receives, slot(work, W.op)) : -1;
        if (receive < 0) {
            give(held);
            return -1;
        }
        if (PyList_CheckExact(outstanding.get()))
            for (Py_ssize_t i = 0; i < PyList_GET_SIZE(outstanding.get()); i++)
                if (PyList_GET_ITEM(outstanding.get(), i) == work) {
                    if (PyList_SetSlice(outstanding.get(), i, i + 1, nullptr) < 0) {
                        give(held);
                        return -1;
                    }
                    break;
                }
        put(work, W.stream, Py_None); // (a CPU request's results are in place: no stream)
        put(work, W.error, Py_None);
        put(work, W.done, Py_True);
        if (!receive) // (a receive's request still names its sender)
            put(work, W.pending, Py_None);
        put(work, W.post, W.empty);
        return give(held) ? 1 : -1;
    }
    return 0;
}

PyObject *finished(PyObject *, PyObject *const *args, Py_ssize_t n)
{
    if (!nargs("finished", n, 3))
        return nullptr;
    long burst = PyLong_AsLong(args[1]), turns = PyLong_AsLong(args[2]);
    if ((burst == -1 || turns == -1) && PyErr_Occurred())
        return nullptr;
    int done = finish(args[0], burst, turns);
    return done < 0 ? nullptr : Py_NewRef(done ? Py_True : Py_False);
}

// The Work slots track() sets, each as Work.__init__ does: adopt_work() refuses a
// Work with a slot not named here (a slot added in Python must be set here too).
const char *const WORK_SLOTS[] = {"op", "backend", "group", "peer", "_engine", "_pending", "_post", "_reads",
                                  "_writes", "_deadline", "_done", "_error", "_result", "_future", "_settled",
                                  "_spans", "_stream"};

// adopt_work(Work, RECEIVES): what track() and finished() need of work.py.
PyObject *adopt_work(PyObject *, PyObject *const *args, Py_ssize_t n)
{
    if (!nargs("adopt_work", n, 2))
        return nullptr;
    if (!PyType_Check(args[0]) || !PyFrozenSet_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "adopt_work: the Work type and a frozenset of receives");
        return nullptr;
    }
    auto *work = reinterpret_cast<PyTypeObject *>(args[0]);
    THPObjectPtr declared(PyObject_GetAttrString(args[0], "__slots__"));
    if (!declared || !PyTuple_Check(declared.get())) {
        PyErr_SetString(PyExc_TypeError, "adopt_work: Work.__slots__ is not a tuple");
        return nullptr;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(declared.get()); i++) {
        bool known = false;
        for (const char *name : WORK_SLOTS)
            known = known || PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(declared.get(), i), name) == 0;
        if (!known) {
            PyErr_Format(PyExc_RuntimeError, "adopt_work: Work slot %R is not one track() sets (csrc/engine.cpp "
                         "WORK_SLOTS): set it there as Work.__init__ does", PyTuple_GET_ITEM(declared.get(), i));
            return nullptr;
        }
    }
    WorkSlots w;
    if ((w.op = offset_of(work, "op")) < 0 || (w.engine = offset_of(work, "_engine")) < 0
        || (w.pending = offset_of(work, "_pending")) < 0 || (w.post = offset_of(work, "_post")) < 0
        || (w.done = offset_of(work, "_done")) < 0 || (w.error = offset_of(work, "_error")) < 0
        || (w.future = offset_of(work, "_future")) < 0 || (w.stream = offset_of(work, "_stream")) < 0
        || (w.backend = offset_of(work, "backend")) < 0 || (w.group = offset_of(work, "group")) < 0
        || (w.peer = offset_of(work, "peer")) < 0 || (w.reads = offset_of(work, "_reads")) < 0
        || (w.writes = offset_of(work, "_writes")) < 0 || (w.deadline = offset_of(work, "_deadline")) < 0
        || (w.result = offset_of(work, "_result")) < 0 || (w.settled = offset_of(work, "_settled")) < 0
        || (w.spans = offset_of(work, "_spans")) < 0)
        return nullptr;
    struct { PyObject **s; const char *text; } names[] = {
        {&w.s_domains, "_domains"}, {&w.s_test, "test"}, {&w.s_domain, "progress_domain"}};
    for (auto &entry : names)
        if (*entry.s == nullptr && (*entry.s = PyUnicode_InternFromString(entry.text)) == nullptr)
            return nullptr;
    if ((w.empty = W.empty != nullptr ? W.empty : PyTuple_New(0)) == nullptr)
        return nullptr;
    Py_INCREF(args[0]); // (each kept for the process's life, as the module is)
    Py_INCREF(args[1]);
    w.type = work;
    w.receives = args[1];
    W = w;
    Py_RETURN_NONE;
}

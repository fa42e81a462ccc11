// Beats: the watchdog's heartbeat, sent from a thread that never takes the GIL.
// Mirrors: watchdog.py's own beating thread (its fallback without this module).
// Covered by: tests/test_facts.py::test_beats_*, tests/test_faults.py.

// ---------------------------------------------------------------- the watchdog's beats
// Beats(interval): a thread that writes "beat\n" to each socket added (add(fd)) every
// interval seconds, never taking the GIL, so that a rank whose Python is held up (a long
// call that keeps the GIL, threads crowding it out) still beats and only a process that
// does not run at all (stopped, swapped out) falls silent. The beats go out under the
// lock that remove(fd) takes: once remove returns, that descriptor is never written
// again, so the caller may close it. In a forked child every method does nothing (its
// thread was not forked, and its lock may have been held at the fork).
struct BeatState {
    std::mutex lock;
    std::condition_variable wake;
    std::vector<int> fds;
    bool stopping = false;
    std::thread thread;
};

struct Beats {
    PyObject_HEAD
    BeatState *state;
    pid_t owner;
};

void beat_until_stopped(BeatState *s, double interval)
{
    std::unique_lock<std::mutex> held(s->lock);
    const auto period = std::chrono::duration<double>(interval);
    while (!s->wake.wait_for(held, period, [s] { return s->stopping; }))
        for (int fd : s->fds) // (a full buffer or a gone peer: the reader side sees to it)
            (void)send(fd, "beat\n", 5, MSG_DONTWAIT | MSG_NOSIGNAL);
}

BeatState *beat_state(Beats *self)
{
    return self->owner == getpid() ? self->state : nullptr;
}

void beats_stop(Beats *self)
{
    BeatState *s = beat_state(self);
    if (s == nullptr || !s->thread.joinable())
        return;
    {
        std::lock_guard<std::mutex> held(s->lock);
        s->stopping = true;
        s->fds.clear();
    }
    s->wake.notify_all();
    Py_BEGIN_ALLOW_THREADS
    s->thread.join();
    Py_END_ALLOW_THREADS
}

PyObject *beats_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    double interval;
    static const char *names[] = {"interval", nullptr};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "d", const_cast<char **>(names), &interval))
        return nullptr;
    if (!(interval > 0)) {
        char got[32];
        snprintf(got, sizeof got, "%g", interval);
        PyErr_Format(PyExc_ValueError, "Beats: interval must be > 0 seconds, got %s", got);
        return nullptr;
    }
    auto *self = reinterpret_cast<Beats *>(type->tp_alloc(type, 0));
    if (self == nullptr)
        return nullptr;
    self->owner = getpid();
    try {
        self->state = new BeatState();
        self->state->thread = std::thread(beat_until_stopped, self->state, interval);
    } catch (const std::exception &exc) {
        delete self->state;
        self->state = nullptr;
        Py_DECREF(self);
        PyErr_Format(PyExc_RuntimeError, "Beats: could not start its thread (%s)", exc.what());
        return nullptr;
    }
    return reinterpret_cast<PyObject *>(self);
}

void beats_dealloc(Beats *self)
{
    beats_stop(self);
    if (beat_state(self) != nullptr)
        delete self->state; // (in a forked child it is left: its lock may be held)
    Py_TYPE(self)->tp_free(reinterpret_cast<PyObject *>(self));
}

PyObject *beats_change(Beats *self, PyObject *arg, bool add)
{
    long value = PyLong_AsLong(arg);
    if (value == -1 && PyErr_Occurred())
        return nullptr;
    if (value < 0 || value > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "Beats: %ld is not a file descriptor", value);
        return nullptr;
    }
    int fd = static_cast<int>(value);
    if (BeatState *s = beat_state(self)) {
        std::lock_guard<std::mutex> held(s->lock);
        auto found = std::find(s->fds.begin(), s->fds.end(), fd);
        if (add && found == s->fds.end() && !s->stopping)
            s->fds.push_back(fd);
        else if (!add && found != s->fds.end())
            s->fds.erase(found);
    }
    Py_RETURN_NONE;
}

PyObject *beats_add(PyObject *self, PyObject *fd)
{
    return beats_change(reinterpret_cast<Beats *>(self), fd, true);
}

PyObject *beats_remove(PyObject *self, PyObject *fd)
{
    return beats_change(reinterpret_cast<Beats *>(self), fd, false);
}

PyObject *beats_stop_method(PyObject *self, PyObject *)
{
    beats_stop(reinterpret_cast<Beats *>(self));
    Py_RETURN_NONE;
}

PyMethodDef beats_methods[] = {
    {"add", beats_add, METH_O, "add(fd): beat on this socket too"},
    {"remove", beats_remove, METH_O, "remove(fd): never write to this socket again"},
    {"stop", beats_stop_method, METH_NOARGS, "stop(): end the thread (no socket is written after)"},
    {nullptr, nullptr, 0, nullptr},
};

PyTypeObject BeatsType = [] {
    PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
    t.tp_name = "mcrdl_facts.Beats";
    t.tp_basicsize = sizeof(Beats);
    t.tp_flags = Py_TPFLAGS_DEFAULT;
    t.tp_doc = "Beats(interval): 'beat\\n' to each added socket every interval seconds, without the GIL";
    t.tp_new = beats_new;
    t.tp_dealloc = reinterpret_cast<destructor>(beats_dealloc);
    t.tp_methods = beats_methods;
    return t;
}();

// The compiled driver: drive() runs a call from its plan (ops.run, compiled up to
// the plan: a blocking call started here, an async one ordered, started and
// tracked by start_async()), hands calls with a plan it leaves to ops.planned,
// calls that never have one to ops.general and the rest to ops.run (which builds
// the plans); setup() gives it what it reads.
// Mirrors: ops.run and ops._from_plan (the pure-Python build's driver).
// Covered by: tests/test_collectives.py and tests/test_regressions.py (every op
// and form, compiled and MCRDL_NATIVE=0), tests/test_hotpath.py.

// The error being raised, taken (cleared), normalized and with its traceback;
// nullptr if none.
PyObject *raised()
{
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    PyErr_NormalizeException(&type, &value, &trace);
    if (trace != nullptr && value != nullptr)
        PyException_SetTraceback(value, trace);
    Py_XDECREF(type);
    Py_XDECREF(trace);
    return value;
}

// nullptr with the CommError naming the op and backend (ops.could_not_start)
// in place of the error being raised: an async start that failed.
PyObject *unstarted(PyObject *op, PyObject *backend)
{
    THPObjectPtr value(raised());
    PyObject *error_args[3] = {op, backend, value.get()};
    PyObject *error = value ? PyObject_Vectorcall(D.unstarted, error_args, 3, nullptr) : nullptr;
    if (error != nullptr) {
        PyErr_SetObject(reinterpret_cast<PyObject *>(Py_TYPE(error)), error);
        Py_DECREF(error);
    }
    return nullptr;
}

// An async call from its plan (ops._from_plan's async branch, with no observer):
// ordered after outstanding work on the same memory, started, tracked by the
// engine; its Work.
PyObject *start_async(PyObject *engine, PyObject *g, PyObject *op, PyObject *plan, PyObject *tensors,
                      PyObject *const *argv, Py_ssize_t argc, PyObject *listed_result)
{
    THPObjectPtr reads(pick(tensors, PyTuple_GET_ITEM(op, D.reads)));
    THPObjectPtr writes(reads ? pick(tensors, PyTuple_GET_ITEM(op, D.writes)) : nullptr);
    THPObjectPtr outstanding(writes ? get(engine, a_outstanding) : nullptr);
    if (!outstanding)
        return nullptr;
    int busy = PyObject_IsTrue(outstanding.get());
    if (busy < 0)
        return nullptr;
    PyObject *name = PyTuple_GET_ITEM(op, D.name), *backend = PyTuple_GET_ITEM(plan, 0);
    THPObjectPtr spans;
    if (busy) {
        spans = THPObjectPtr(clear_of(engine, reads.get(), writes.get()));
        if (spans.get() == Py_None) {
            PyObject *order_args[4] = {engine, reads.get(), writes.get(), name};
            spans = THPObjectPtr(PyObject_VectorcallMethod(s_order_before, order_args,
                                                           4 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr));
        }
    } else {
        Py_INCREF(Py_None);
        spans = THPObjectPtr(Py_None);
    }
    if (!spans)
        return nullptr;
    THPObjectPtr pending(start_plan(PyTuple_GET_ITEM(plan, 1), argv, argc));
    if (!pending)
        return unstarted(op, backend);
    // A send or receive often completes in its start (an eager send, a message
    // already here): one test, and its Work is born done, never outstanding.
    // What the test raises (the library failed) retires the work, as the
    // engine's own test would: its wait raises it, after the runtime's failure
    // handling (the peers' verdict, the flight recorder, the abort at exit).
    bool done = false;
    THPObjectPtr failed;
    if (Py_TYPE(pending.get()) == W.request && PyObject_IsTrue(PyTuple_GET_ITEM(op, D.collective)) == 0) {
        PyObject *request = pending.get();
        THPObjectPtr tested(PyObject_VectorcallMethod(W.s_test, &request, 1, nullptr));
        if (!tested) {
            if (!(failed = THPObjectPtr(raised())))
                return nullptr;
        } else
            done = tested.get() == Py_True;
    }
    THPObjectPtr result(listed_result != nullptr ? Py_NewRef(listed_result)
                        : PySequence_List(PyTuple_GET_SIZE(PyTuple_GET_ITEM(op, D.writes)) ? writes.get() : reads.get()));
    if (!result)
        return nullptr;
    PyObject *work = track(engine, g, name, backend, pending.get(), reads.get(), writes.get(), result.get(), spans.get(),
                           PyTuple_GET_ITEM(plan, 3), done);
    if (work == Py_None) {
        Py_DECREF(work);
        PyObject *run_args[11] = {engine, name, backend, pending.get(), reads.get(), writes.get(), D.empty, g,
                                  result.get(), Py_True, spans.get()};
        work = PyObject_VectorcallMethod(s_run, run_args, 11 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
        if (work != nullptr && PyObject_SetAttr(work, s_peer, PyTuple_GET_ITEM(plan, 3)) < 0)
            Py_CLEAR(work);
    }
    if (work != nullptr && failed) {
        PyObject *retire_args[3] = {engine, work, failed.get()};
        THPObjectPtr retired(PyObject_VectorcallMethod(s_retire, retire_args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                                       nullptr));
        if (!retired)
            Py_CLEAR(work);
    }
    return work;
}

// drive(rt, op, group, async_op, backend[, tensors[, fixed[, splits]]]):
// ops.run, compiled up to the plan: it checks what ops.run checks and looks
// the call's plan up. A blocking call with the logger and the profiler off,
// valid split sizes (if any), and a list (if any) of blocks back to back, it
// then starts here, handing it to ops.blocked when its start did not finish
// it; an async call of some bytes it orders, starts and hands to the engine
// (start_async), its list viewed and its split sizes counted as a blocking
// call's; other calls with a plan go to
// ops.planned, calls that never have one to ops.general, and the rest to
// ops.run (which also builds the plans).
PyObject *drive(PyObject *, PyObject *const *args, Py_ssize_t n) try { // (no torch warning handler: drive reads tensors only through plan_key_of and span)
    if (n < 6 || n > 8) {
        PyErr_Format(PyExc_TypeError, "drive takes 6 to 8 arguments (%zd given)", n);
        return nullptr;
    }
    if (D.slow == nullptr) {
        PyErr_SetString(PyExc_RuntimeError, "drive: setup() has not run");
        return nullptr;
    }
    PyObject *rt = args[0], *op = args[1], *group = args[2], *async_op = args[3], *backend = args[4],
             *tensors = args[5], *fixed = n > 6 ? args[6] : D.empty, *splits = n > 7 ? args[7] : Py_None;
    if ((async_op != Py_False && async_op != Py_True) || rt == Py_None || !PyTuple_CheckExact(tensors)
        || PyTuple_GET_SIZE(tensors) > 2 || !PyTuple_CheckExact(fixed)
        || (backend != Py_None && !PyUnicode_CheckExact(backend)) || !PyTuple_Check(op)
        || PyTuple_GET_SIZE(op) <= D.last)
        return PyObject_Vectorcall(D.slow, args, n, nullptr);
    int state;
    if ((state = truth(rt, a_debug)) != 0)
        return state < 0 ? nullptr : PyObject_Vectorcall(D.slow, args, n, nullptr);
    THPObjectPtr engine(get(rt, a_engine));
    if (!engine)
        return nullptr;
    state = async_op == Py_True ? 0 : truth(engine.get(), a_outstanding);
    if (state != 0 || (state = truth(engine.get(), a_lost)) != 0)
        return state < 0 ? nullptr : PyObject_Vectorcall(D.slow, args, n, nullptr);
    THPObjectPtr g(group == Py_None ? get(rt, a_world) : (Py_INCREF(group), group));
    if (!g)
        return nullptr;
    // (A group holds plans only while it belongs to the live runtime and this
    // rank is in it: ops.run builds them after checking both, and destroying
    // the group or the runtime clears them. So a plan found is a plan to run.)
    if (Py_TYPE(g.get()) != reinterpret_cast<PyTypeObject *>(D.group_type))
        return PyObject_Vectorcall(D.slow, args, n, nullptr);
    long recipe = PyLong_AsLong(PyTuple_GET_ITEM(op, D.recipe));
    Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(op, D.at)),
               listed = PyLong_AsSsize_t(PyTuple_GET_ITEM(op, D.listed));
    if (PyErr_Occurred())
        return nullptr;
    THPObjectPtr facts(plan_key_of(recipe, at, tensors, fixed));
    if (!facts)
        return nullptr;
    if (facts.get() == Py_None) // (no plan for such calls: CUDA tensors, lists of copies, other reductions)
        return PyObject_Vectorcall(D.general, args, n, nullptr);
    PyObject *name = PyTuple_GET_ITEM(op, D.name);
    THPObjectPtr key(splits == Py_None ? PyTuple_Pack(4, name, facts.get(), backend, async_op)
                                       : PyTuple_Pack(5, name, facts.get(), backend, async_op, D.zero));
    THPObjectPtr starters(key ? get(g.get(), a_starters) : nullptr);
    if (!starters)
        return nullptr;
    PyObject *plan = PyDict_CheckExact(starters.get()) ? PyDict_GetItemWithError(starters.get(), key.get()) : nullptr;
    if (plan == nullptr || !PyTuple_CheckExact(plan) || PyTuple_GET_SIZE(plan) != 5)
        return PyErr_Occurred() ? nullptr : PyObject_Vectorcall(D.slow, args, n, nullptr);
    Py_INCREF(plan);
    THPObjectPtr held(plan); // (a start may replace the group's plans)
    PyObject *planned_args[10] = {rt, g.get(), op, plan, group, async_op, backend, tensors, fixed, splits};
    if ((state = truth(D.profiler, s_enabled)) != 0)
        return state < 0 ? nullptr : PyObject_Vectorcall(D.planned, planned_args, 10, nullptr);
    THPObjectPtr observer(get(rt, a_observer));
    if (!observer)
        return nullptr;
    if (observer.get() != Py_None)
        return PyObject_Vectorcall(D.planned, planned_args, 10, nullptr);
    PyObject *argv[4];
    Py_ssize_t argc = PyTuple_GET_SIZE(tensors);
    for (Py_ssize_t i = 0; i < argc; i++)
        argv[i] = PyTuple_GET_ITEM(tensors, i);
    THPObjectPtr whole, call, out_counts, in_counts, listed_result;
    if (listed >= 0) { // the list as the view of its blocks the group remembers
        if (argc != 2 || listed > 1)
            return PyObject_Vectorcall(D.planned, planned_args, 10, nullptr);
        PyObject *parts = argv[listed], *single = argv[1 - listed];
        THPObjectPtr rank(get(g.get(), a_rank));
        long root = PyLong_AsLong(PyTuple_GET_ITEM(plan, 3)), my_rank = rank ? PyLong_AsLong(rank.get()) : -1;
        if (PyErr_Occurred())
            return nullptr;
        if (PyObject_IsTrue(PyTuple_GET_ITEM(op, D.at_root)) == 1 && root != my_rank) {
            int has = parts == Py_None ? 0 : PyObject_IsTrue(parts);
            if (has < 0)
                return nullptr;
            if (has == 0) { // (a list here: ops.planned sends the call to the general path)
                Py_INCREF(Py_None);
                whole = THPObjectPtr(Py_None);
            }
        } else {
            whole = THPObjectPtr(list_view(g.get(), name, parts, PyTuple_GET_ITEM(plan, 4), single));
        }
        if (!whole)
            return PyErr_Occurred() ? nullptr : PyObject_Vectorcall(D.planned, planned_args, 10, nullptr);
        int written = async_op == Py_True ? PySequence_Contains(PyTuple_GET_ITEM(op, D.writes), PyTuple_GET_ITEM(op, D.listed)) : 0;
        if (written < 0)
            return nullptr;
        if (written) { // (an async Work's result: the blocks, as the general path's; the list was accepted)
            listed_result = THPObjectPtr(whole.get() == Py_None ? PyList_New(0) : PySequence_List(parts));
            if (!listed_result)
                return nullptr;
        }
        argv[listed] = whole.get();
        call = THPObjectPtr(PyTuple_Pack(2, argv[0], argv[1]));
        if (!call)
            return nullptr;
    } else {
        Py_INCREF(tensors);
        call = THPObjectPtr(tensors);
    }
    if (PyObject_IsTrue(PyTuple_GET_ITEM(op, D.split)) == 1) {
        argv[argc] = argv[argc + 1] = Py_None;
        if (splits != Py_None) { // (output, input) split sizes as element counts per peer
            const at::Tensor *out = usable(argv[0]), *in = usable(argv[1]);
            long long row = PyLong_AsLongLong(PyTuple_GET_ITEM(plan, 4));
            if (!PyTuple_CheckExact(splits) || PyTuple_GET_SIZE(splits) != 2 || out == nullptr || in == nullptr
                || row < 0)
                return PyErr_Occurred() ? nullptr : PyObject_Vectorcall(D.planned, planned_args, 10, nullptr);
            Py_ssize_t size = PyLong_AsSsize_t(THPObjectPtr(get(g.get(), a_size)).get());
            out_counts = THPObjectPtr(counts_of(PyTuple_GET_ITEM(splits, 0), size, out->dim() ? out->size(0) : 1, row));
            in_counts = THPObjectPtr(out_counts ? counts_of(PyTuple_GET_ITEM(splits, 1), size,
                                                            in->dim() ? in->size(0) : 1, row) : nullptr);
            if (!in_counts)
                return PyErr_Occurred() ? nullptr : PyObject_Vectorcall(D.planned, planned_args, 10, nullptr);
            argv[argc] = out_counts.get();
            argv[argc + 1] = in_counts.get();
        }
        argc += 2;
    } else if (PyObject_IsTrue(PyTuple_GET_ITEM(op, D.collective)) == 1) {
        size_t nbytes = PyLong_AsSize_t(PyTuple_GET_ITEM(plan, 2));
        if (nbytes == static_cast<size_t>(-1) && PyErr_Occurred())
            return nullptr;
        if (nbytes == 0) { // every rank skips a zero-byte collective (an async one: ops.planned's done Work)
            if (async_op == Py_True)
                return PyObject_Vectorcall(D.planned, planned_args, 10, nullptr);
            Py_RETURN_NONE;
        }
    }
    if (async_op == Py_True)
        return start_async(engine.get(), g.get(), op, plan, call.get(), argv, argc, listed_result.get());
    PyObject *pending = start_plan(PyTuple_GET_ITEM(plan, 1), argv, argc);
    if (pending == nullptr || pending == D.done) {
        Py_XDECREF(pending);
        return pending == nullptr ? nullptr : (Py_INCREF(Py_None), Py_None);
    }
    PyObject *bargs[6] = {rt, g.get(), op, PyTuple_GET_ITEM(plan, 0), pending, call.get()};
    PyObject *out = PyObject_Vectorcall(D.blocked, bargs, 6, nullptr);
    Py_DECREF(pending);
    return out;
} catch (const std::exception &e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
}

Py_ssize_t field(PyObject *fields, const char *name)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(fields); i++)
        if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(fields, i), name) == 0)
            return i;
    PyErr_Format(PyExc_ValueError, "setup: Op has no field %s", name);
    return -1;
}

// setup(run, general, planned, blocked, could_not_start, Group, DONE, SUM, profiler module, Op._fields,
// Runtime, Engine):
// what drive() needs.
PyObject *setup(PyObject *, PyObject *const *args, Py_ssize_t n)
{
    if (!nargs("setup", n, 12))
        return nullptr;
    PyObject *fields = args[9];
    if (!PyTuple_Check(fields) || !PyType_Check(args[5]) || !PyType_Check(args[10]) || !PyType_Check(args[11])) {
        PyErr_SetString(PyExc_TypeError, "setup: the Group type, Op._fields, the Runtime and Engine types");
        return nullptr;
    }
    Driver d;
    if ((d.name = field(fields, "name")) < 0 || (d.recipe = field(fields, "recipe")) < 0
        || (d.at = field(fields, "at")) < 0 || (d.listed = field(fields, "listed")) < 0
        || (d.at_root = field(fields, "at_root")) < 0 || (d.collective = field(fields, "collective")) < 0
        || (d.split = field(fields, "split")) < 0
        || (d.reads = field(fields, "reads")) < 0 || (d.writes = field(fields, "writes")) < 0)
        return nullptr;
    d.last = std::max({d.name, d.recipe, d.at, d.listed, d.at_root, d.collective, d.split, d.reads, d.writes});
    PyObject **slots[] = {&d.slow, &d.general, &d.planned, &d.blocked, &d.unstarted, &d.group_type, &d.done, &SUM,
                          &d.profiler};
    for (int i = 0; i < 9; i++) {
        Py_INCREF(args[i]);
        *slots[i] = args[i]; // (kept for the process's life, as the module is)
    }
    if ((d.empty = PyTuple_New(0)) == nullptr || (d.zero = PyLong_FromLong(0)) == nullptr)
        return nullptr;
    D = d;
    struct { PyObject **s; const char *text; } names[] = {
        {&s_enabled, "_is_profiler_enabled"}, {&s_order_before, "order_before"}, {&s_run, "run"}, {&s_retire, "_retire"},
        {&s_peer, "peer"}, {&s_runtime, "_runtime"}, {&s_run_op, "run_op"}, {&s_wait, "wait"},
        {&s_burst, "_burst"}, {&s_first_polls, "FIRST_POLLS"}};
    for (auto &entry : names)
        if (*entry.s == nullptr && (*entry.s = PyUnicode_InternFromString(entry.text)) == nullptr)
            return nullptr;
    auto *runtime = reinterpret_cast<PyTypeObject *>(args[10]), *engine = reinterpret_cast<PyTypeObject *>(args[11]),
         *group = reinterpret_cast<PyTypeObject *>(args[5]);
    struct { Attr &a; PyTypeObject *type; const char *name; } attrs[] = {
        {a_debug, runtime, "debug"}, {a_engine, runtime, "engine"}, {a_observer, runtime, "observer"},
        {a_world, runtime, "world"}, {a_outstanding, engine, "outstanding"}, {a_lost, engine, "lost"},
        {a_lock, engine, "_lock"}, {a_domains, engine, "_domains"}, {a_starters, group, "starters"},
        {a_timeout, group, "timeout"}, {a_rank, group, "rank"}, {a_size, group, "size"}, {a_ranks, group, "ranks"}};
    for (auto &entry : attrs)
        if (!attr(entry.a, entry.type, entry.name))
            return nullptr;
    Py_RETURN_NONE;
}

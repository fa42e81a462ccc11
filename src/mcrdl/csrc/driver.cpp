// The compiled driver: drive() runs a call from its plan, the one implementation
// of that: looks the call's plan up (ops.plan makes it on a miss), starts a
// blocking call here (ops.blocked waits when its start did not finish it), orders,
// starts and tracks an async one (start_async()), and tells the logger and the
// profiler (the observer's begin and end) when one is on; every call that does
// not run from a plan goes to ops.general. setup() reads what it needs of
// mcrdl.ops by name.
// Mirrors: nothing in Python (the pure-Python build runs every call on ops.general).
// Covered by: tests/test_collectives.py and tests/test_regressions.py (every op
// and form, compiled and MCRDL_NATIVE=0), tests/test_hotpath.py, tests/test_logger.py.
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
// in place of the error being raised: a start that failed.
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

// An async call from its plan: ordered after outstanding work on the same
// memory, started, tracked by the engine (track(), or Engine.run when it has
// completion steps: ``post``, the observer's end); its Work.
PyObject *start_async(PyObject *engine, PyObject *g, PyObject *op, PyObject *plan, PyObject *reads, PyObject *writes,
                      PyObject *const *argv, Py_ssize_t argc, PyObject *listed_result, PyObject *post)
{
    THPObjectPtr outstanding(get(engine, a_outstanding));
    if (!outstanding)
        return nullptr;
    int busy = PyObject_IsTrue(outstanding.get());
    if (busy < 0)
        return nullptr;
    PyObject *name = PyTuple_GET_ITEM(op, D.name), *backend = PyTuple_GET_ITEM(plan, D.backend);
    THPObjectPtr spans;
    if (busy) {
        spans = THPObjectPtr(clear_of(engine, reads, writes));
        if (spans.get() == Py_None) {
            PyObject *order_args[4] = {engine, reads, writes, name};
            spans = THPObjectPtr(PyObject_VectorcallMethod(s_order_before, order_args,
                                                           4 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr));
        }
    } else {
        Py_INCREF(Py_None);
        spans = THPObjectPtr(Py_None);
    }
    if (!spans)
        return nullptr;
    THPObjectPtr pending(start_plan(PyTuple_GET_ITEM(plan, D.start), argv, argc));
    if (!pending)
        return unstarted(op, backend);
    // A send or receive often completes in its start (an eager send, a message
    // already here): one test, and its Work is born done, never outstanding.
    // What the test raises (the library failed) retires the work, as the
    // engine's own test would: its wait raises it, after the runtime's failure
    // handling (the peers' verdict, the flight recorder, the abort at exit).
    bool done = false;
    THPObjectPtr failed;
    // (AVG's Divide alone keeps the work compiled: finished() runs it)
    bool steps = PyTuple_GET_SIZE(post) > 0 && lone_divide(post) == nullptr;
    if (PyTuple_GET_SIZE(post) == 0 && domain_of(Py_TYPE(pending.get())) != nullptr && PyObject_IsTrue(PyTuple_GET_ITEM(op, D.collective)) == 0) {
        PyObject *request = pending.get();
        THPObjectPtr tested(PyObject_VectorcallMethod(W.s_test, &request, 1, nullptr));
        if (!tested) {
            if (!(failed = THPObjectPtr(raised())))
                return nullptr;
        } else
            done = tested.get() == Py_True;
    }
    THPObjectPtr result(listed_result != nullptr ? Py_NewRef(listed_result)
                        : PySequence_List(PyTuple_GET_SIZE(PyTuple_GET_ITEM(op, D.writes)) ? writes : reads));
    if (!result)
        return nullptr;
    PyObject *work = steps ? Py_NewRef(Py_None)
                           : track(engine, g, name, backend, pending.get(), reads, writes, result.get(), spans.get(),
                                   PyTuple_GET_ITEM(plan, D.peer), post, done);
    if (work == Py_None) {
        Py_DECREF(work);
        PyObject *run_args[11] = {engine, name, backend, pending.get(), reads, writes, post, g,
                                  result.get(), Py_True, spans.get()};
        work = PyObject_VectorcallMethod(s_run, run_args, 11 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
        if (work != nullptr && PyObject_SetAttr(work, s_peer, PyTuple_GET_ITEM(plan, D.peer)) < 0)
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

// The call to ops.general: every call drive() does not run from a plan.
inline PyObject *general(PyObject *const *args, Py_ssize_t n) { return PyObject_Vectorcall(D.general, args, n, nullptr); }

// drive(rt, op, group, async_op, backend[, tensors[, fixed[, splits]]]): the
// driver every API call goes through (api.run_op). A call on a group of this
// runtime, with debug mode off and (a blocking call) nothing outstanding, whose
// tensors have the facts a plan is keyed on, runs from the group's plan for it
// (made by ops.plan on the first such call): its list (if any) as the view of
// its blocks back to back, its split sizes (if any) as counts, started here and
// waited for by ops.blocked when its start did not finish it, or (async) ordered,
// started and handed to the engine; the observer (logger, profiler) told when
// one is on. Every other call goes to ops.general, which also names bad input.
PyObject *drive(PyObject *, PyObject *const *args, Py_ssize_t n) try { // (no torch warning handler: drive reads tensors only through plan_key_of and span)
    if (n < 6 || n > 8) {
        PyErr_Format(PyExc_TypeError, "drive takes 6 to 8 arguments (%zd given)", n);
        return nullptr;
    }
    if (D.general == nullptr) {
        PyErr_SetString(PyExc_RuntimeError, "drive: setup() has not run");
        return nullptr;
    }
    PyObject *rt = args[0], *op = args[1], *group = args[2], *async_op = args[3], *backend = args[4],
             *tensors = args[5], *fixed = n > 6 ? args[6] : D.empty, *splits = n > 7 ? args[7] : Py_None;
    if ((async_op != Py_False && async_op != Py_True) || rt == Py_None || !PyTuple_CheckExact(tensors)
        || PyTuple_GET_SIZE(tensors) > 2 || !PyTuple_CheckExact(fixed)
        || (backend != Py_None && !PyUnicode_CheckExact(backend)) || !PyTuple_Check(op)
        || PyTuple_GET_SIZE(op) <= D.last)
        return general(args, n);
    int state;
    if ((state = truth(rt, a_debug)) != 0)
        return state < 0 ? nullptr : general(args, n);
    THPObjectPtr engine(get(rt, a_engine));
    if (!engine)
        return nullptr;
    state = async_op == Py_True ? 0 : truth(engine.get(), a_outstanding);
    if (state != 0 || (state = truth(engine.get(), a_lost)) != 0)
        return state < 0 ? nullptr : general(args, n);
    THPObjectPtr g(group == Py_None ? get(rt, a_world) : (Py_INCREF(group), group));
    if (!g)
        return nullptr;
    // (A group holds plans only while it belongs to the live runtime and this
    // rank is in it: ops.plan makes them after checking both, and destroying
    // the group or the runtime clears them. So a plan found is a plan to run.)
    if (Py_TYPE(g.get()) != reinterpret_cast<PyTypeObject *>(D.group_type))
        return general(args, n);
    long recipe = PyLong_AsLong(PyTuple_GET_ITEM(op, D.recipe));
    Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(op, D.at)),
               listed = PyLong_AsSsize_t(PyTuple_GET_ITEM(op, D.listed));
    if (PyErr_Occurred())
        return nullptr;
    THPObjectPtr facts(plan_key_of(recipe, at, tensors, fixed));
    if (!facts)
        return nullptr;
    if (facts.get() == Py_None) // (no plan for such calls: CUDA tensors, lists of copies, other reductions)
        return general(args, n);
    PyObject *name = PyTuple_GET_ITEM(op, D.name);
    THPObjectPtr key(splits == Py_None ? PyTuple_Pack(4, name, facts.get(), backend, async_op)
                                       : PyTuple_Pack(5, name, facts.get(), backend, async_op, D.zero));
    THPObjectPtr plans(key ? get(g.get(), a_plans) : nullptr);
    if (!plans)
        return nullptr;
    PyObject *found = PyDict_CheckExact(plans.get()) ? PyDict_GetItemWithError(plans.get(), key.get()) : nullptr;
    if (found == nullptr && PyErr_Occurred())
        return nullptr;
    THPObjectPtr held; // (a start may replace the group's plans)
    if (found == nullptr) {
        PyObject *plan_args[9] = {rt, g.get(), op, key.get(), tensors, fixed, backend, async_op,
                                  splits == Py_None ? Py_True : Py_False};
        held = THPObjectPtr(PyObject_Vectorcall(D.plan, plan_args, 9, nullptr));
        if (!held)
            return nullptr;
    } else
        held = THPObjectPtr(Py_NewRef(found));
    if (Py_TYPE(held.get()) != reinterpret_cast<PyTypeObject *>(D.plan_type))
        return general(args, n); // (None: no plan for calls like this one)
    PyObject *plan = held.get();
    if ((state = truth(D.profiler, s_enabled)) < 0)
        return nullptr;
    THPObjectPtr observer(state ? PyObject_GetAttr(rt, s_traced) : get(rt, a_observer));
    if (!observer)
        return nullptr;
    PyObject *argv[4];
    Py_ssize_t argc = PyTuple_GET_SIZE(tensors);
    for (Py_ssize_t i = 0; i < argc; i++)
        argv[i] = PyTuple_GET_ITEM(tensors, i);
    THPObjectPtr whole, call, out_counts, in_counts, listed_result;
    if (listed >= 0) { // the list as the view of its blocks the group remembers
        if (argc != 2 || listed > 1)
            return general(args, n);
        PyObject *parts = argv[listed], *single = argv[1 - listed];
        THPObjectPtr rank(get(g.get(), a_rank));
        long root = PyLong_AsLong(PyTuple_GET_ITEM(plan, D.peer)), my_rank = rank ? PyLong_AsLong(rank.get()) : -1;
        if (PyErr_Occurred())
            return nullptr;
        if (PyObject_IsTrue(PyTuple_GET_ITEM(op, D.at_root)) == 1 && root != my_rank) {
            int has = parts == Py_None ? 0 : PyObject_IsTrue(parts);
            if (has != 0) // (a list here: the general path names it)
                return has < 0 ? nullptr : general(args, n);
            whole = THPObjectPtr(Py_NewRef(Py_None));
        } else {
            whole = THPObjectPtr(list_view(g.get(), name, parts, PyTuple_GET_ITEM(plan, D.extra), single));
            if (!whole)
                return PyErr_Occurred() ? nullptr : general(args, n);
        }
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
        call = THPObjectPtr(Py_NewRef(tensors));
    }
    if (PyObject_IsTrue(PyTuple_GET_ITEM(op, D.split)) == 1) {
        argv[argc] = argv[argc + 1] = Py_None;
        if (splits != Py_None) { // (output, input) split sizes as element counts per peer
            const at::Tensor *out = usable(argv[0]), *in = usable(argv[1]);
            long long row = PyLong_AsLongLong(PyTuple_GET_ITEM(plan, D.extra));
            if (!PyTuple_CheckExact(splits) || PyTuple_GET_SIZE(splits) != 2 || out == nullptr || in == nullptr
                || row < 0)
                return PyErr_Occurred() ? nullptr : general(args, n);
            Py_ssize_t size = PyLong_AsSsize_t(THPObjectPtr(get(g.get(), a_size)).get());
            out_counts = THPObjectPtr(counts_of(PyTuple_GET_ITEM(splits, 0), size, out->dim() ? out->size(0) : 1, row));
            in_counts = THPObjectPtr(out_counts ? counts_of(PyTuple_GET_ITEM(splits, 1), size,
                                                            in->dim() ? in->size(0) : 1, row) : nullptr);
            if (!in_counts) // (the general path names what is wrong)
                return PyErr_Occurred() ? nullptr : general(args, n);
            argv[argc] = out_counts.get();
            argv[argc + 1] = in_counts.get();
        }
        argc += 2;
    } else if (PyObject_IsTrue(PyTuple_GET_ITEM(op, D.collective)) == 1) {
        size_t nbytes = PyLong_AsSize_t(PyTuple_GET_ITEM(plan, D.nbytes));
        if (nbytes == static_cast<size_t>(-1) && PyErr_Occurred())
            return nullptr;
        if (nbytes == 0) { // every rank skips a zero-byte collective (an async one: the general path's done Work)
            if (async_op == Py_True)
                return general(args, n);
            Py_RETURN_NONE;
        }
    }
    bool observed = observer.get() != Py_None;
    PyObject *chosen = PyTuple_GET_ITEM(plan, D.backend);
    THPObjectPtr reads, writes, end, post;
    // the tensors the call reads and writes (an unobserved blocking call needs them only when it waits)
    auto touched = [&]() {
        reads = THPObjectPtr(pick(call.get(), PyTuple_GET_ITEM(op, D.reads)));
        writes = THPObjectPtr(reads ? pick(call.get(), PyTuple_GET_ITEM(op, D.writes)) : nullptr);
        return static_cast<bool>(writes);
    };
    if ((observed || async_op == Py_True) && !touched())
        return nullptr;
    if (observed) { // the observer's begin now, its end when the call completes
        THPObjectPtr counts(in_counts ? scaled(in_counts.get(), usable(argv[1])->element_size()) : Py_NewRef(Py_None)); // (bytes per peer)
        if (!counts)
            return nullptr;
        PyObject *begin_args[10] = {observer.get(), name, chosen, g.get(), PyTuple_GET_ITEM(plan, D.nbytes), async_op,
                                    PyTuple_GET_ITEM(plan, D.peer), counts.get(), reads.get(), writes.get()};
        end = THPObjectPtr(PyObject_VectorcallMethod(s_begin, begin_args, 10 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr));
        post = THPObjectPtr(end ? PyTuple_Pack(1, end.get()) : nullptr);
        if (!post)
            return nullptr;
    } else
        post = THPObjectPtr(Py_NewRef(D.empty));
    // AVG: the result divided by the plan's ``divide`` (the first completion step, when the start
    // does not finish the op)
    PyObject *divisor = PyTuple_GET_ITEM(plan, D.divide);
    int divides = PyObject_IsTrue(divisor);
    auto divide_first = [&]() {
        long by = PyLong_AsLong(divisor);
        THPObjectPtr step(by == -1 && PyErr_Occurred() ? nullptr : divide_step(argv[0], by));
        THPObjectPtr first(step ? PyTuple_Pack(1, step.get()) : nullptr);
        post = THPObjectPtr(!first || PyTuple_GET_SIZE(post.get()) == 0 ? first.release()
                                                                        : PySequence_Concat(first.get(), post.get()));
        return static_cast<bool>(post);
    };
    if (divides < 0 || (async_op == Py_True && divides && !divide_first()))
        return nullptr;
    if (async_op == Py_True)
        return start_async(engine.get(), g.get(), op, plan, reads.get(), writes.get(), argv, argc, listed_result.get(),
                           post.get());
    THPObjectPtr pending(start_plan(PyTuple_GET_ITEM(plan, D.start), argv, argc));
    if (!pending) // (the CommError the general path raises, the library's error its cause)
        return unstarted(op, chosen);
    if (pending.get() == D.done) { // (finished inside the backend: AVG's divide and the observer's end)
        if (divides)
            divide_in_place(THPVariable_Unpack(argv[0]), PyLong_AsLong(divisor));
        THPObjectPtr ended(observed ? PyObject_CallNoArgs(end.get()) : Py_NewRef(Py_None));
        return ended ? Py_NewRef(Py_None) : nullptr;
    }
    if (!reads && !touched())
        return nullptr;
    if (divides && !divide_first())
        return nullptr;
    PyObject *bargs[8] = {rt, g.get(), op, chosen, pending.get(), reads.get(), writes.get(), post.get()};
    return PyObject_Vectorcall(D.blocked, bargs, 8, nullptr);
} catch (const std::exception &e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
}

// The index of field ``name`` of namedtuple ``type`` (its _fields); -1 with an error.
Py_ssize_t field(PyObject *fields, const char *type, const char *name)
{
    for (Py_ssize_t i = 0; PyTuple_Check(fields) && i < PyTuple_GET_SIZE(fields); i++)
        if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(fields, i), name) == 0)
            return i;
    PyErr_Format(PyExc_ValueError, "setup: ops.%s has no field %s", type, name);
    return -1;
}

// ops.<name>, a new reference; nullptr with an error naming it.
PyObject *named(PyObject *ops, const char *name)
{
    PyObject *v = PyObject_GetAttrString(ops, name);
    if (v == nullptr)
        PyErr_Format(PyExc_AttributeError, "setup: mcrdl.ops has no %s, which drive needs", name);
    return v;
}

// setup(ops): what drive() reads, taken from the module mcrdl.ops by name (its
// functions general, plan, blocked, could_not_start; its Op and Plan fields;
// the Group, Runtime and Engine types' slots; DONE, ReduceOp's members, functools.partial, the
// profiler module and SPAN_MEMO_BYTES).
PyObject *setup(PyObject *, PyObject *const *args, Py_ssize_t n)
{
    if (!nargs("setup", n, 1))
        return nullptr;
    PyObject *ops = args[0];
    THPObjectPtr op_type(named(ops, "Op")), plan_type(op_type ? named(ops, "Plan") : nullptr),
        runtime_type(plan_type ? named(ops, "Runtime") : nullptr),
        engine_type(runtime_type ? named(ops, "Engine") : nullptr), group_type(engine_type ? named(ops, "Group") : nullptr),
        reduce_op(group_type ? named(ops, "ReduceOp") : nullptr),
        memo(reduce_op ? named(ops, "SPAN_MEMO_BYTES") : nullptr);
    if (!memo)
        return nullptr;
    struct { PyObject *value; const char *name; } types[] = {{op_type.get(), "Op"}, {plan_type.get(), "Plan"},
        {runtime_type.get(), "Runtime"}, {engine_type.get(), "Engine"}, {group_type.get(), "Group"}};
    for (auto &entry : types)
        if (!PyType_Check(entry.value)) {
            PyErr_Format(PyExc_TypeError, "setup: ops.%s is not a type", entry.name);
            return nullptr;
        }
    THPObjectPtr op_fields(PyObject_GetAttrString(op_type.get(), "_fields")),
        plan_fields(op_fields ? PyObject_GetAttrString(plan_type.get(), "_fields") : nullptr);
    if (!plan_fields)
        return nullptr;
    Driver d;
    PyObject *of = op_fields.get(), *pf = plan_fields.get();
    if ((d.name = field(of, "Op", "name")) < 0 || (d.recipe = field(of, "Op", "recipe")) < 0
        || (d.at = field(of, "Op", "at")) < 0 || (d.listed = field(of, "Op", "listed")) < 0
        || (d.at_root = field(of, "Op", "at_root")) < 0 || (d.collective = field(of, "Op", "collective")) < 0
        || (d.split = field(of, "Op", "split")) < 0 || (d.reads = field(of, "Op", "reads")) < 0
        || (d.writes = field(of, "Op", "writes")) < 0 || (d.backend = field(pf, "Plan", "backend")) < 0
        || (d.start = field(pf, "Plan", "start")) < 0 || (d.nbytes = field(pf, "Plan", "nbytes")) < 0
        || (d.peer = field(pf, "Plan", "peer")) < 0 || (d.extra = field(pf, "Plan", "extra")) < 0
        || (d.divide = field(pf, "Plan", "divide")) < 0)
        return nullptr;
    d.last = std::max({d.name, d.recipe, d.at, d.listed, d.at_root, d.collective, d.split, d.reads, d.writes});
    if ((d.memo_bytes = PyLong_AsSsize_t(memo.get())) < 0)
        return PyErr_Occurred() ? nullptr : (PyErr_SetString(PyExc_ValueError, "setup: ops.SPAN_MEMO_BYTES < 0"), nullptr);
    struct { PyObject **slot; const char *name; } kept[] = {
        {&d.general, "general"}, {&d.plan, "plan"}, {&d.blocked, "blocked"}, {&d.unstarted, "could_not_start"},
        {&d.done, "DONE"}, {&d.profiler, "_torch_profiler"}};
    for (auto &entry : kept) // (each kept for the process's life, as the module is)
        if ((*entry.slot = named(ops, entry.name)) == nullptr)
            return nullptr;
    const char *reductions[5] = {"SUM", "PRODUCT", "MIN", "MAX", "AVG"};
    for (int i = 0; i < 5; i++)
        if ((REDUCTIONS[i] = PyObject_GetAttrString(reduce_op.get(), reductions[i])) == nullptr)
            return nullptr;
    SUM = REDUCTIONS[0];
    d.group_type = group_type.release();
    d.plan_type = plan_type.release();
    if ((d.empty = PyTuple_New(0)) == nullptr || (d.zero = PyLong_FromLong(0)) == nullptr)
        return nullptr;
    D = d;
    struct { PyObject **s; const char *text; } names[] = {
        {&s_enabled, "_is_profiler_enabled"}, {&s_order_before, "order_before"}, {&s_run, "run"}, {&s_retire, "_retire"},
        {&s_peer, "peer"}, {&s_traced, "traced"}, {&s_begin, "begin"}, {&s_runtime, "_runtime"}, {&s_run_op, "run_op"},
        {&s_wait, "wait"}, {&s_burst, "_burst"}, {&s_first_polls, "FIRST_POLLS"}};
    for (auto &entry : names)
        if (*entry.s == nullptr && (*entry.s = PyUnicode_InternFromString(entry.text)) == nullptr)
            return nullptr;
    auto *runtime = reinterpret_cast<PyTypeObject *>(runtime_type.get()),
         *engine = reinterpret_cast<PyTypeObject *>(engine_type.get()), *group = reinterpret_cast<PyTypeObject *>(D.group_type);
    struct { Attr &a; PyTypeObject *type; const char *name; } attrs[] = {
        {a_debug, runtime, "debug"}, {a_engine, runtime, "engine"}, {a_observer, runtime, "observer"},
        {a_world, runtime, "world"}, {a_outstanding, engine, "outstanding"}, {a_lost, engine, "lost"},
        {a_lock, engine, "_lock"}, {a_domains, engine, "_domains"}, {a_plans, group, "plans"},
        {a_timeout, group, "timeout"}, {a_rank, group, "rank"}, {a_size, group, "size"}, {a_ranks, group, "ranks"}};
    for (auto &entry : attrs)
        if (!attr(entry.a, entry.type, entry.name))
            return nullptr;
    Py_RETURN_NONE;
}

// TorchMethod: ProcessGroupMCRDL's common calls in C, and its Works' wait. It reads
// torch's options struct and calls the driver without a Python frame, and hands
// every other call to the Python method it stands for.
// Mirrors: integrations/torch_backend.py (ProcessGroupMCRDL's methods, _COMPILED).
// Covered by: tests/test_torch_backend.py (compiled and MCRDL_NATIVE=0), tests/test_compile.py.

// -- ProcessGroupMCRDL's common calls ---------------------------------------------------------
// TorchMethod(op, name, fallback, module_globals, work_type, work_init, reduce_kinds, group_type)
// stands for one of ProcessGroupMCRDL's methods (``fallback``, the Python one):
// called as pg.<method>(...) by torch's Python or through its C++ trampoline,
// it does what the Python method does for the common case (one tensor, a
// reduction mcrdl has, a root or peer in the group, no split sizes, outside a
// coalescing block): reads torch's options struct in C++ (from Python each
// field is a pybind property, 0.3 us a read), calls the driver (api.run_op,
// from ``module_globals``, api's) and returns None for a blocking call or an
// MCRDLTorchWork. Any other call, and any call with keywords, goes to the
// Python method, which also names every bad input; so both give the same
// results and errors. So does any call made while dynamo's frame hook is live
// (frames_hooked). Kind T_WAIT stands for MCRDLTorchWork.wait (torch_wait).
enum TorchKind { T_ALLREDUCE, T_BROADCAST, T_ALLGATHER, T_REDUCE_SCATTER, T_ALL_TO_ALL, T_SEND, T_RECV, T_WAIT, T_KINDS };
// Each kind's method name: a TorchMethod is made for a method by its name (the
// module's TORCH_METHODS lists them), never by a position Python must keep in step.
const char *const KIND_NAMES[T_KINDS] = {"allreduce", "broadcast", "all_gather_single", "reduce_scatter_single",
                                         "all_to_all_single", "send", "recv", "wait"};

struct TorchMethod {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    int kind;
    PyObject *op, *name, *fallback, *module_globals, *work_type, *work_init, *reduce_kinds;
};

// The one tensor of torch's list (tensors[0] of a one-item list), else nullptr.
PyObject *only_tensor(PyObject *tensors)
{
    if (!PyList_CheckExact(tensors) || PyList_GET_SIZE(tensors) != 1)
        return nullptr;
    PyObject *t = PyList_GET_ITEM(tensors, 0);
    return THPVariable_Check(t) && THPVariable_Unpack(t).layout() == at::kStrided ? t : nullptr;
}

// mcrdl's ReduceOp of torch's (borrowed), else nullptr (PREMUL_SUM, BAND ...).
PyObject *reduction(const TorchMethod *m, const c10d::ReduceOp &op)
{
    THPObjectPtr kind(PyLong_FromLong(static_cast<long>(op.op_)));
    return kind ? PyDict_GetItemWithError(m->reduce_kinds, kind.get()) : nullptr;
}

// The global rank at group rank ``at`` (an int or a Python int), else nullptr.
PyObject *global_rank(PyObject *g, long long at)
{
    THPObjectPtr ranks(get(g, a_ranks));
    if (!ranks || !PyTuple_CheckExact(ranks.get()) || at < 0 || at >= PyTuple_GET_SIZE(ranks.get())) {
        PyErr_Clear();
        return nullptr;
    }
    PyObject *r = PyTuple_GET_ITEM(ranks.get(), at);
    Py_INCREF(r);
    return r;
}

template <typename Options> const Options *options(PyObject *opts)
{
    try {
        return &py::cast<const Options &>(py::handle(opts));
    } catch (const py::cast_error &) {
        return nullptr;
    }
}

// Whether torch's options ``opts`` (None: torch's default) ask for an async op; -1: not such options.
template <typename Options> int asynchronous(PyObject *opts)
{
    if (opts == Py_None)
        return 1;
    const Options *o = options<Options>(opts);
    return o == nullptr ? -1 : o->asyncOp;
}

// The call as TorchMethod runs it; nullptr without an error: the Python method's.
PyObject *torch_fast(const TorchMethod *m, PyObject *const *args, Py_ssize_t n)
{
    PyTypeObject *work_type = reinterpret_cast<PyTypeObject *>(m->work_type);
    if (n < 2 || a_work.type != work_type || a_result.type != work_type || a_op.type != work_type)
        return nullptr; // (the Work's slots are known for one type)
    PyObject *self = args[0], *found = PyDict_GetItemWithError(m->module_globals, s_runtime);
    THPObjectPtr rt(found == nullptr || found == Py_None ? nullptr : Py_NewRef(found));
    found = rt ? PyDict_GetItemWithError(m->module_globals, s_run_op) : nullptr;
    THPObjectPtr run_op(found == nullptr ? nullptr : Py_NewRef(found));
    if (!run_op)
        return nullptr;
    // (no such attribute: the Python method names the problem)
    THPObjectPtr coalescing(get(self, a_coalescing)), g(coalescing ? get(self, a_g) : nullptr);
    if (!g || coalescing.get() != Py_None) {
        PyErr_Clear();
        return nullptr;
    }
    bool async_op = true;
    PyObject *out = nullptr;  // the tensor the Work's result lists
    THPObjectPtr tensors, fixed, peer;
    PyObject *opts = Py_None;
    switch (m->kind) {
    case T_ALLREDUCE:
    case T_BROADCAST: {
        if (n > 3 || (out = only_tensor(args[1])) == nullptr)
            return nullptr;
        opts = n == 3 ? args[2] : Py_None;
        PyObject *what; // the reduction, or the root's global rank
        if (m->kind == T_ALLREDUCE) {
            const c10d::AllreduceOptions *o = opts == Py_None ? nullptr : options<c10d::AllreduceOptions>(opts);
            if (opts != Py_None && o == nullptr)
                return nullptr;
            what = o == nullptr ? SUM : reduction(m, o->reduceOp);
            Py_XINCREF(what);
            async_op = o == nullptr || o->asyncOp;
        } else {
            const c10d::BroadcastOptions *o = opts == Py_None ? nullptr : options<c10d::BroadcastOptions>(opts);
            if ((opts != Py_None && o == nullptr) || (o != nullptr && o->rootTensor != 0))
                return nullptr;
            what = global_rank(g.get(), o == nullptr ? 0 : o->rootRank);
            async_op = o == nullptr || o->asyncOp;
        }
        if (what == nullptr)
            return nullptr;
        fixed = THPObjectPtr(PyTuple_Pack(1, what));
        Py_DECREF(what);
        tensors = THPObjectPtr(fixed ? PyTuple_Pack(1, out) : nullptr);
        break;
    }
    case T_ALLGATHER:
    case T_REDUCE_SCATTER:
    case T_ALL_TO_ALL: {
        Py_ssize_t n_opts = m->kind == T_ALL_TO_ALL ? 5 : 3;
        if (n > n_opts + 1 || n < n_opts)
            return nullptr;
        if (m->kind == T_ALL_TO_ALL && (!PyList_CheckExact(args[3]) || PyList_GET_SIZE(args[3]) != 0
                                        || !PyList_CheckExact(args[4]) || PyList_GET_SIZE(args[4]) != 0))
            return nullptr; // (split sizes: the Python method converts them)
        out = args[1];
        if (m->kind == T_REDUCE_SCATTER && !THPVariable_Check(out))
            return nullptr; // (the Python method reads its dtype first)
        opts = n == n_opts + 1 ? args[n_opts] : Py_None;
        if (m->kind == T_REDUCE_SCATTER) {
            const c10d::ReduceScatterOptions *o = opts == Py_None ? nullptr : options<c10d::ReduceScatterOptions>(opts);
            if (opts != Py_None && o == nullptr)
                return nullptr;
            PyObject *rop = o == nullptr ? SUM : reduction(m, o->reduceOp);
            if (rop == nullptr)
                return nullptr;
            fixed = THPObjectPtr(PyTuple_Pack(1, rop));
            async_op = o == nullptr || o->asyncOp;
        } else {
            int async_of = m->kind == T_ALLGATHER ? asynchronous<c10d::AllgatherOptions>(opts)
                                                  : asynchronous<c10d::AllToAllOptions>(opts);
            if (async_of < 0)
                return nullptr;
            async_op = async_of == 1;
            fixed = THPObjectPtr(Py_NewRef(D.empty));
        }
        tensors = THPObjectPtr(fixed ? PyTuple_Pack(2, args[1], args[2]) : nullptr);
        break;
    }
    case T_SEND:
    case T_RECV: { // (tensors, peer, tag=0): always async
        if (n > 4 || n < 3 || (out = only_tensor(args[1])) == nullptr || !PyLong_CheckExact(args[2])
            || (n == 4 && !PyLong_CheckExact(args[3])))
            return nullptr;
        long long at = PyLong_AsLongLong(args[2]);
        if (at == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return nullptr;
        }
        peer = THPObjectPtr(global_rank(g.get(), at));
        if (!peer)
            return nullptr;
        fixed = THPObjectPtr(PyTuple_Pack(2, peer.get(), n == 4 ? args[3] : D.zero));
        tensors = THPObjectPtr(fixed ? PyTuple_Pack(1, out) : nullptr);
        break;
    }
    default:
        return nullptr;
    }
    if (!tensors) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        return nullptr;
    }
    PyObject *call[7] = {rt.get(), m->op, g.get(), async_op ? Py_True : Py_False, Py_None, tensors.get(), fixed.get()};
    THPObjectPtr work(PyObject_Vectorcall(run_op.get(), call, 7, nullptr));
    if (!work)
        return nullptr;
    if (!async_op)
        Py_RETURN_NONE; // torch waits only on a Work it gets
    if (m->kind == T_SEND && W.type != nullptr && Py_TYPE(work.get()) == W.type && slot(work.get(), W.done) == Py_True
        && slot(work.get(), W.error) == Py_None && slot(work.get(), W.stream) == Py_None)
        work = THPObjectPtr(Py_NewRef(Py_None)); // (a send done in its start: the Work stands for a completed op)
    THPObjectPtr result(PyList_New(1));
    if (!result)
        return nullptr;
    Py_INCREF(out);
    PyList_SET_ITEM(result.get(), 0, out);
    // MCRDLTorchWork(work, result, name), made as its __init__ does without its frame
    THPObjectPtr made(work_type->tp_new(work_type, D.empty, nullptr));
    PyObject *self_arg[1] = {made.get()};
    THPObjectPtr base(made ? PyObject_Vectorcall(m->work_init, self_arg, 1, nullptr) : nullptr);
    if (!base)
        return nullptr;
    if (Py_TYPE(made.get()) != work_type) {
        PyErr_Format(PyExc_TypeError, "TorchMethod: %s() made a %s", work_type->tp_name, Py_TYPE(made.get())->tp_name);
        return nullptr;
    }
    put(made.get(), a_work.offset, work.get()); // (its slots: made is of exactly that type)
    put(made.get(), a_result.offset, result.get());
    put(made.get(), a_op.offset, m->name);
    return made.release();
}

// MCRDLTorchWork.wait() without a timeout as TorchMethod runs it (kind T_WAIT,
// ``globals`` work.py's): what that method and mcrdl's Work.wait do, for an
// op that completed in its start (no Work) or an MPI request finished() can
// wait for; nullptr without an error: the Python method's (a failed work, a
// CUDA one, any other library), which then finds it done where this waited.
PyObject *torch_wait(const TorchMethod *m, PyObject *const *args, Py_ssize_t n)
{
    if (n < 1 || n > 2 || (n == 2 && args[1] != Py_None) || Py_TYPE(args[0]) != a_work.type)
        return nullptr;
    PyObject *work = slot(args[0], a_work.offset);
    if (work == Py_None)
        Py_RETURN_TRUE;
    if (work == nullptr || W.type == nullptr || Py_TYPE(work) != W.type)
        return nullptr;
    if (slot(work, W.done) == Py_False) {
        PyObject *burst = PyDict_GetItemWithError(m->module_globals, s_burst);
        PyObject *turns = burst ? PyDict_GetItemWithError(m->module_globals, s_first_polls) : nullptr;
        long b = turns ? PyLong_AsLong(burst) : -1, t = turns ? PyLong_AsLong(turns) : -1;
        if (b == -1 || t == -1) {
            PyErr_Clear();
            return nullptr;
        }
        if (slot(work, W.engine) == nullptr || slot(work, W.deadline) == nullptr)
            return nullptr;
        // (held: the slots may change while the wait runs Python)
        THPObjectPtr own(Py_NewRef(work)), engine(Py_NewRef(slot(work, W.engine))),
            deadline(Py_NewRef(slot(work, W.deadline)));
        int done = finish(work, b, t);
        if (done < 0) { // the library failed: Work.wait retires the work with its error
            if (!PyErr_ExceptionMatches(PyExc_Exception))
                return nullptr;
            THPObjectPtr exc(raised());
            PyObject *retire_args[3] = {engine.get(), work, exc.get()};
            THPObjectPtr retired(PyObject_VectorcallMethod(s_retire, retire_args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                                           nullptr));
            return nullptr; // (retired: the Python method raises its error as Work.wait does)
        }
        if (done == 0 && slot(work, W.done) == Py_False) {
            PyObject *wait_args[3] = {engine.get(), work, deadline.get()};
            THPObjectPtr waited(PyObject_VectorcallMethod(s_wait, wait_args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr));
            if (!waited)
                return nullptr;
        }
    }
    if (slot(work, W.done) == Py_True && slot(work, W.error) == Py_None && slot(work, W.stream) == Py_None)
        Py_RETURN_TRUE;
    return nullptr;
}

// Is a frame evaluator other than CPython's installed? dynamo's is, while a
// compiled function runs (its graph breaks run eagerly): the Python method
// then runs, whose frame torch_backend.py marks for dynamo to skip with all it
// calls; from here the driver's Python (ops.run ...) would be traced.
bool frames_hooked()
{
    return _PyInterpreterState_GetEvalFrameFunc(PyInterpreterState_Get()) != _PyEval_EvalFrameDefault;
}

PyObject *torch_method_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) try {
    const TorchMethod *m = reinterpret_cast<TorchMethod *>(callable);
    if (m->fallback == nullptr) { // (cleared by the collector: only a dying cycle holds it)
        PyErr_SetString(PyExc_RuntimeError, "TorchMethod: called after it was cleared");
        return nullptr;
    }
    if ((kwnames == nullptr || PyTuple_GET_SIZE(kwnames) == 0) && !frames_hooked()) {
        Py_ssize_t n = PyVectorcall_NARGS(nargsf);
        PyObject *out = m->kind == T_WAIT ? torch_wait(m, args, n) : torch_fast(m, args, n);
        if (out != nullptr || PyErr_Occurred())
            return out;
    }
    return PyObject_Vectorcall(m->fallback, args, nargsf, kwnames);
} catch (const std::exception &e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
}

PyObject *torch_method_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *op, *name, *fallback, *module_globals, *work_type, *work_init, *reduce_kinds, *group_type;
    if (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "TorchMethod takes no keyword arguments");
        return nullptr;
    }
    if (!PyArg_ParseTuple(args, "OUOO!O!OO!O!:TorchMethod", &op, &name, &fallback, &PyDict_Type, &module_globals,
                          &PyType_Type, &work_type, &work_init, &PyDict_Type, &reduce_kinds, &PyType_Type,
                          &group_type))
        return nullptr;
    int kind = 0;
    while (kind < T_KINDS && PyUnicode_CompareWithASCIIString(name, KIND_NAMES[kind]) != 0)
        kind++;
    if (kind == T_KINDS) {
        PyErr_Format(PyExc_ValueError, "TorchMethod: no compiled form of method %R (see TORCH_METHODS)", name);
        return nullptr;
    }
    auto *pg_type = reinterpret_cast<PyTypeObject *>(group_type);
    auto *made_type = reinterpret_cast<PyTypeObject *>(work_type);
    if (!attr(a_g, pg_type, "_g") || !attr(a_coalescing, pg_type, "_coalescing") || !attr(a_work, made_type, "_work")
        || !attr(a_result, made_type, "_result") || !attr(a_op, made_type, "_op"))
        return nullptr;
    if (!PyCallable_Check(fallback) || !PyCallable_Check(work_init)) {
        PyErr_SetString(PyExc_ValueError, "TorchMethod: a function, a type and its base's __init__");
        return nullptr;
    }
    if (D.general == nullptr) {
        PyErr_SetString(PyExc_RuntimeError, "TorchMethod: setup() has not run");
        return nullptr;
    }
    TorchMethod *m = reinterpret_cast<TorchMethod *>(type->tp_alloc(type, 0));
    if (m == nullptr)
        return nullptr;
    m->vectorcall = torch_method_call;
    m->kind = kind;
    PyObject **fields[] = {&m->op, &m->name, &m->fallback, &m->module_globals, &m->work_type, &m->work_init,
                           &m->reduce_kinds};
    PyObject *given[] = {op, name, fallback, module_globals, work_type, work_init, reduce_kinds};
    for (size_t i = 0; i < 7; i++) {
        Py_INCREF(given[i]);
        *fields[i] = given[i];
    }
    return reinterpret_cast<PyObject *>(m);
}

// (it holds the class's own method and the api module's globals: a cycle the collector may break)
int torch_method_traverse(TorchMethod *m, visitproc visit, void *arg)
{
    Py_VISIT(m->op);
    Py_VISIT(m->name);
    Py_VISIT(m->fallback);
    Py_VISIT(m->module_globals);
    Py_VISIT(m->work_type);
    Py_VISIT(m->work_init);
    Py_VISIT(m->reduce_kinds);
    return 0;
}

int torch_method_clear(TorchMethod *m)
{
    Py_CLEAR(m->op);
    Py_CLEAR(m->name);
    Py_CLEAR(m->fallback);
    Py_CLEAR(m->module_globals);
    Py_CLEAR(m->work_type);
    Py_CLEAR(m->work_init);
    Py_CLEAR(m->reduce_kinds);
    return 0;
}

void torch_method_dealloc(TorchMethod *m)
{
    PyObject_GC_UnTrack(m);
    torch_method_clear(m);
    Py_TYPE(m)->tp_free(reinterpret_cast<PyObject *>(m));
}

// As a function's: pg.method is bound (pybind's trampoline then sees a Python override).
PyObject *torch_method_get(PyObject *self, PyObject *obj, PyObject *)
{
    if (obj == nullptr || obj == Py_None) {
        Py_INCREF(self);
        return self;
    }
    return PyMethod_New(self, obj);
}

PyMemberDef torch_method_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(TorchMethod, fallback), READONLY, "the Python method"},
    {"__name__", T_OBJECT, offsetof(TorchMethod, name), READONLY, "the method's name (its Works' op name)"},
    {nullptr, 0, 0, 0, nullptr},
};

// The Python method's own, as a function has them (wrappers read them: DeepSpeed's nvtx
// wrapper reads the __qualname__ of a Work's bound wait).
PyObject *torch_method_delegated(TorchMethod *m, void *name)
{
    if (m->fallback == nullptr) {
        PyErr_SetString(PyExc_RuntimeError, "TorchMethod: read after it was cleared");
        return nullptr;
    }
    return PyObject_GetAttrString(m->fallback, static_cast<const char *>(name));
}

PyGetSetDef torch_method_getset[] = {
    {"__qualname__", reinterpret_cast<getter>(torch_method_delegated), nullptr, "the Python method's",
     const_cast<char *>("__qualname__")},
    {"__module__", reinterpret_cast<getter>(torch_method_delegated), nullptr, "the Python method's",
     const_cast<char *>("__module__")},
    {"__doc__", reinterpret_cast<getter>(torch_method_delegated), nullptr, "the Python method's",
     const_cast<char *>("__doc__")},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyTypeObject TorchMethodType = [] {
    PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
    t.tp_name = "mcrdl_facts.TorchMethod";
    t.tp_basicsize = sizeof(TorchMethod);
    t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR;
    t.tp_doc = "TorchMethod(kind, op, name, fallback, module_globals, work_type, work_init, reduce_kinds, group_type): "
               "a ProcessGroupMCRDL method's common calls in C";
    t.tp_new = torch_method_new;
    t.tp_dealloc = reinterpret_cast<destructor>(torch_method_dealloc);
    t.tp_traverse = reinterpret_cast<traverseproc>(torch_method_traverse);
    t.tp_clear = reinterpret_cast<inquiry>(torch_method_clear);
    t.tp_vectorcall_offset = offsetof(TorchMethod, vectorcall);
    t.tp_call = PyVectorcall_Call;
    t.tp_descr_get = torch_method_get;
    t.tp_members = torch_method_members;
    t.tp_getset = torch_method_getset;
    return t;
}();

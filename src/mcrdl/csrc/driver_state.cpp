// What the compiled driver reads: what setup() reads of mcrdl.ops by name (Driver),
// the compiled starters it starts without Python (adopt_starter(): any backend's
// starter type and its "<module>.start" capsule), slot reads at their offsets
// (Attr), a list's view (remembered per group) and split sizes as counts.
// Mirrors: nothing in Python (the pure-Python build takes ops.general).
// Covered by: tests/test_collectives.py, tests/test_regressions.py,
// tests/test_facts.py::test_span*.

// What drive() reads, set once by setup() from mcrdl.ops, each by its name.
struct Driver {
    PyObject *plan = nullptr;      // ops.plan: makes and keeps a call's Plan (None: the general path)
    PyObject *general = nullptr;   // ops.general: every call that does not run from a plan
    PyObject *blocked = nullptr;   // ops.blocked(rt, g, op, backend, pending, reads, writes, post)
    PyObject *unstarted = nullptr; // ops.could_not_start(op, backend, exc): the error of a start that raised
    PyObject *group_type = nullptr, *plan_type = nullptr, *done = nullptr, *profiler = nullptr, *empty = nullptr,
             *zero = nullptr;
    Py_ssize_t memo_bytes = 0; // ops.SPAN_MEMO_BYTES
    Py_ssize_t name, recipe, at, listed, at_root, collective, split, reads, writes, last; // Op's fields
    Py_ssize_t backend, start, nbytes, peer, extra, divide;                              // Plan's fields
} D;

// Compiled starters drive() starts without Python: each backend's starter type
// and its start on addresses read here (a PyCapsule named "<module>.start"),
// registered by adopt_starter() (MPI's by adopt()); a plan's start of any other
// type is called.
typedef PyObject *(*start_fn)(PyObject *starter, void *const *addr, PyObject *const *args, Py_ssize_t n);
constexpr int MAX_STARTERS = 8;
struct { PyTypeObject *type; start_fn start; } starters[MAX_STARTERS];
int n_starters = 0;

PyObject *s_runtime, *s_run_op, *s_wait, *s_burst, *s_first_polls; // (TorchMethod's)
PyObject *s_enabled, *s_order_before, *s_run, *s_retire, *s_peer, *s_traced, *s_begin;

// A borrowed-like read: a new reference to obj.name (nullptr with an error).
inline PyObject *get(PyObject *obj, PyObject *name) { return PyObject_GetAttr(obj, name); }

// Is obj.name truthy? -1 on an error.
int truth(PyObject *obj, PyObject *name)
{
    THPObjectPtr v(get(obj, name));
    return v ? PyObject_IsTrue(v.get()) : -1;
}

// An attribute the calls read: at its slot's offset on objects of the class
// that declares it (Runtime, Engine, Group, ProcessGroupMCRDL: their
// __slots__, found by setup() and TorchMethod), by name on any other object;
// a lookup by name costs 40-80 ns, and an async call made a dozen.
struct Attr {
    PyObject *name = nullptr;
    PyTypeObject *type = nullptr;
    Py_ssize_t offset = 0;
};

Attr a_debug, a_engine, a_observer, a_world;          // Runtime's
Attr a_outstanding, a_lost, a_lock, a_domains;        // Engine's
Attr a_plans, a_timeout, a_rank, a_size, a_ranks;     // Group's
Attr a_g, a_coalescing;                               // ProcessGroupMCRDL's (TorchMethod's)
Attr a_work, a_result, a_op;                          // MCRDLTorchWork's (TorchMethod's)

// A new reference to obj.<a> (nullptr with an error; an unset slot's is the lookup's).
inline PyObject *get(PyObject *obj, const Attr &a)
{
    if (Py_TYPE(obj) == a.type) {
        PyObject *v = *reinterpret_cast<PyObject **>(reinterpret_cast<char *>(obj) + a.offset);
        if (v != nullptr)
            return Py_NewRef(v);
    }
    return PyObject_GetAttr(obj, a.name);
}

int truth(PyObject *obj, const Attr &a)
{
    THPObjectPtr v(get(obj, a));
    return v ? PyObject_IsTrue(v.get()) : -1;
}

// The offset of type's slot ``name`` (a member descriptor of an object slot).
Py_ssize_t offset_of(PyTypeObject *type, const char *name)
{
    PyObject *descr = PyDict_GetItemString(type->tp_dict, name);
    if (descr == nullptr || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        PyErr_Format(PyExc_TypeError, "%s has no slot %s", type->tp_name, name);
        return -1;
    }
    PyMemberDef *member = reinterpret_cast<PyMemberDescrObject *>(descr)->d_member;
    if (member->type != T_OBJECT_EX && member->type != T_OBJECT) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not an object slot", type->tp_name, name);
        return -1;
    }
    return member->offset;
}

// ``a``, found on ``type``'s slot ``name``; false with an error when it has none.
bool attr(Attr &a, PyTypeObject *type, const char *name)
{
    if (a.type == type)
        return true; // found already (every init calls setup)
    if (a.name == nullptr && (a.name = PyUnicode_InternFromString(name)) == nullptr)
        return false;
    Py_ssize_t offset = offset_of(type, name);
    if (offset < 0)
        return false;
    Py_INCREF(type); // (kept for the process's life, as the module is)
    a.type = type;
    a.offset = offset;
    return true;
}

// The list form's view of its blocks: one flat tensor over ``parts`` if they
// are the group's size of blocks of ``kind`` (nbytes, dtype) lying back to back
// in memory (as ``x.chunk(n)`` makes them) and sharing no byte with ``single``;
// nullptr without an error when they are not (the general path copies). A group
// remembers the view of its last small list per op (up to ops.SPAN_MEMO_BYTES),
// under the op's name in its plans: a list at the same address next time reuses
// it while the view is still there (its storage keeps that memory allocated
// unless it was resized or freed in place, as FSDP frees parameters: then the
// view has moved and is not reused).
PyObject *list_view(PyObject *g, PyObject *name, PyObject *parts, PyObject *kind, PyObject *single)
{
    THPObjectPtr size(get(g, a_size));
    if (!size || !PyTuple_CheckExact(kind) || PyTuple_GET_SIZE(kind) != 2 || !THPDtype_Check(PyTuple_GET_ITEM(kind, 1)))
        return nullptr;
    Py_ssize_t count = PyLong_AsSsize_t(size.get()), step = PyLong_AsSsize_t(PyTuple_GET_ITEM(kind, 0));
    uintptr_t at;
    if (PyErr_Occurred()
        || !span_at(parts, count, reinterpret_cast<THPDtype *>(PyTuple_GET_ITEM(kind, 1))->scalar_type, step, single, &at))
        return nullptr;
    THPObjectPtr plans(get(g, a_plans));
    if (!plans)
        return nullptr;
    if (!PyDict_CheckExact(plans.get())) {
        PyErr_SetString(PyExc_TypeError, "drive: a group's plans are not a dict");
        return nullptr;
    }
    PyObject *memo = PyDict_GetItemWithError(plans.get(), name); // (address, nbytes, dtype, view)
    if (memo == nullptr && PyErr_Occurred())
        return nullptr;
    if (memo != nullptr && PyTuple_CheckExact(memo) && PyTuple_GET_SIZE(memo) == 4
        && PyLong_CheckExact(PyTuple_GET_ITEM(memo, 0)) && PyLong_CheckExact(PyTuple_GET_ITEM(memo, 1))
        && PyLong_AsSize_t(PyTuple_GET_ITEM(memo, 0)) == at && PyLong_AsSsize_t(PyTuple_GET_ITEM(memo, 1)) == step
        && PyTuple_GET_ITEM(memo, 2) == PyTuple_GET_ITEM(kind, 1) && THPVariable_Check(PyTuple_GET_ITEM(memo, 3))
        && reinterpret_cast<uintptr_t>(THPVariable_Unpack(PyTuple_GET_ITEM(memo, 3)).data_ptr()) == at)
        return Py_NewRef(PyTuple_GET_ITEM(memo, 3));
    PyErr_Clear(); // (a memo int past size_t: not this list's)
    const at::Tensor &first = THPVariable_Unpack(PySequence_Fast_ITEMS(parts)[0]);
    THPObjectPtr whole;
    try { // a view of the first block's storage, which must hold them all
        whole = THPObjectPtr(THPVariable_Wrap(first.as_strided({count * first.numel()}, {1})));
    } catch (const c10::Error &) {
        return nullptr;
    }
    if (whole && step * count <= D.memo_bytes) {
        THPObjectPtr address(PyLong_FromSize_t(at));
        THPObjectPtr entry(address ? PyTuple_Pack(4, address.get(), PyTuple_GET_ITEM(kind, 0), PyTuple_GET_ITEM(kind, 1),
                                                  whole.get()) : nullptr);
        if (!entry)
            return nullptr;
        if (PyDict_GET_SIZE(plans.get()) >= 4096) // (as ops.plan bounds them)
            PyDict_Clear(plans.get());
        if (PyDict_SetItem(plans.get(), name, entry.get()) < 0)
            return nullptr;
    }
    return whole.release();
}

// A list of ints each times ``factor`` (the list itself for 1); nullptr with an error.
PyObject *scaled(PyObject *ints, long long factor)
{
    if (factor == 1)
        return Py_NewRef(ints);
    PyObject *out = PyList_New(PyList_GET_SIZE(ints));
    for (Py_ssize_t i = 0; out != nullptr && i < PyList_GET_SIZE(ints); i++) {
        PyObject *v = PyLong_FromLongLong(PyLong_AsLongLong(PyList_GET_ITEM(ints, i)) * factor);
        if (v == nullptr)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, v);
    }
    return out;
}

// Elements per peer from split sizes: a list of ``size``
// non-negative ints summing to ``rows``, times ``row``; nullptr without an
// error when they are not.
PyObject *counts_of(PyObject *splits, Py_ssize_t size, int64_t rows, long long row)
{
    if (!PyList_CheckExact(splits) || PyList_GET_SIZE(splits) != size)
        return nullptr;
    long long total = 0;
    for (Py_ssize_t i = 0; i < size; i++) {
        PyObject *item = PyList_GET_ITEM(splits, i);
        long long v = PyLong_CheckExact(item) ? PyLong_AsLongLong(item) : -1;
        if (v < 0) {
            PyErr_Clear();
            return nullptr;
        }
        total += v;
    }
    if (total != rows)
        return nullptr;
    return scaled(splits, row);
}

// The tensors at ``at`` (a tuple of indices) that are not None:
// ``tensors`` itself when that is all of them, in order.
PyObject *pick(PyObject *tensors, PyObject *at)
{
    bool whole = PyTuple_GET_SIZE(at) == PyTuple_GET_SIZE(tensors);
    for (Py_ssize_t i = 0; whole && i < PyTuple_GET_SIZE(at); i++)
        whole = PyLong_AsSsize_t(PyTuple_GET_ITEM(at, i)) == i && PyTuple_GET_ITEM(tensors, i) != Py_None;
    if (whole)
        return Py_NewRef(tensors);
    PyErr_Clear(); // (an index that is not one: named below)
    PyObject *out = PyTuple_New(PyTuple_GET_SIZE(at));
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; out != nullptr && i < PyTuple_GET_SIZE(at); i++) {
        Py_ssize_t k = PyLong_AsSsize_t(PyTuple_GET_ITEM(at, i));
        if (k < 0 || k >= PyTuple_GET_SIZE(tensors)) {
            Py_CLEAR(out);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_IndexError, "drive: an Op names a tensor the call does not pass");
        } else if (PyTuple_GET_ITEM(tensors, k) != Py_None) {
            Py_INCREF(PyTuple_GET_ITEM(tensors, k));
            PyTuple_SET_ITEM(out, n++, PyTuple_GET_ITEM(tensors, k));
        }
    }
    if (out != nullptr && n < PyTuple_GET_SIZE(out) && _PyTuple_Resize(&out, n) < 0)
        return nullptr;
    return out;
}

// Run a plan's start on the call's arguments: a compiled MPI starter on the
// addresses read here (the plan fits the tensors: CPU, contiguous), else a call.
PyObject *start_plan(PyObject *start, PyObject *const *argv, Py_ssize_t argc)
{
    int i = 0;
    while (i < n_starters && Py_TYPE(start) != starters[i].type)
        i++;
    if (i == n_starters)
        return PyObject_Vectorcall(start, argv, argc, nullptr);
    void *addr[2] = {nullptr, nullptr};
    for (Py_ssize_t k = 0; k < 2 && k < argc; k++)
        if (THPVariable_Check(argv[k]))
            addr[k] = THPVariable_Unpack(argv[k]).data_ptr();
    return starters[i].start(start, addr, argv, argc);
}

// Request types whose works finished() completes without Python, each with the
// progress domain its backend names (Pending.progress_domain): registered by
// adopt_starter() with the starter that makes them.
struct { PyTypeObject *type; PyObject *domain; } requests[MAX_STARTERS];
int n_requests = 0;

// The progress domain of requests of ``type``, if adopted (borrowed), else nullptr.
PyObject *domain_of(PyTypeObject *type)
{
    for (int i = 0; i < n_requests; i++)
        if (requests[i].type == type)
            return requests[i].domain;
    return nullptr;
}

// Register ``type``'s start (a capsule named "<module>.start"); false with an error.
bool add_starter(PyObject *type, PyObject *capsule)
{
    const char *name = PyCapsule_GetName(capsule);
    size_t len = name == nullptr ? 0 : strlen(name);
    if (!PyType_Check(type) || len < 6 || strcmp(name + len - 6, ".start") != 0) {
        PyErr_SetString(PyExc_TypeError, "adopt_starter: a starter type and its capsule named '<module>.start'");
        return false;
    }
    void *fn = PyCapsule_GetPointer(capsule, name);
    if (fn == nullptr)
        return false;
    for (int i = 0; i < n_starters; i++)
        if (starters[i].type == reinterpret_cast<PyTypeObject *>(type)) {
            starters[i].start = reinterpret_cast<start_fn>(fn);
            return true;
        }
    if (n_starters == MAX_STARTERS) {
        PyErr_SetString(PyExc_RuntimeError, "adopt_starter: too many starter types");
        return false;
    }
    Py_INCREF(type);  // (kept for the process's life, as the module is)
    starters[n_starters++] = {reinterpret_cast<PyTypeObject *>(type), reinterpret_cast<start_fn>(fn)};
    return true;
}

// adopt_starter(type, capsule[, request_type, domain]): a backend's compiled
// starter, which drive() starts directly, and the type of the requests it
// returns with their progress domain (a str), whose works finished() completes.
PyObject *adopt_starter(PyObject *, PyObject *const *args, Py_ssize_t n)
{
    if (n != 2 && n != 4) {
        PyErr_Format(PyExc_TypeError, "adopt_starter takes 2 or 4 arguments (%zd given)", n);
        return nullptr;
    }
    if (!add_starter(args[0], args[1]))
        return nullptr;
    if (n == 2)
        Py_RETURN_NONE;
    if (!PyType_Check(args[2]) || !PyUnicode_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "adopt_starter: a request type and its progress domain (a str)");
        return nullptr;
    }
    auto *type = reinterpret_cast<PyTypeObject *>(args[2]);
    if (domain_of(type) != nullptr)
        Py_RETURN_NONE;
    if (n_requests == MAX_STARTERS) {
        PyErr_SetString(PyExc_RuntimeError, "adopt_starter: too many request types");
        return nullptr;
    }
    Py_INCREF(args[2]); // (kept for the process's life, as the module is)
    Py_INCREF(args[3]);
    requests[n_requests++] = {type, args[3]};
    Py_RETURN_NONE;
}

// Tensor facts: what a call's plan is keyed on (key, pair, plan_key), the view
// of a list's blocks (span) and the memory an async op touches (ranges), read
// from the tensors in C++: from Python each torch attribute read costs 60-240 ns,
// and a call made 5 to 20 of them. A tensor qualifies when it is a strided CPU
// tensor that is contiguous, not nested, has storage and no Python dispatch (a
// wrapper subclass takes the general path); torch's errors raise as in Python.
// ranges() is the exception: it reads any strided tensor with storage, CUDA ones too.
// Mirrors: facts.py (the same functions in Python, the fallback).
// Covered by: tests/test_facts.py (both on the same tensors).

const at::Tensor *usable(PyObject *o)
{
    if (!THPVariable_Check(o))
        return nullptr;
    const at::Tensor &t = THPVariable_Unpack(o);
    if (!t.defined() || t.layout() != at::kStrided || !t.is_cpu() || t.is_nested() || !t.has_storage()
        || t.key_set().has(c10::DispatchKey::Python) || !t.is_contiguous())
        return nullptr;
    return &t;
}

PyObject *dtype_of(const at::Tensor &t)
{
    PyObject *dtype = reinterpret_cast<PyObject *>(torch::getTHPDtype(t.scalar_type()));
    Py_INCREF(dtype);
    return dtype;
}

PyObject *shape_of(const at::Tensor &t)
{
    auto sizes = t.sizes();
    PyObject *shape = PyTuple_New(static_cast<Py_ssize_t>(sizes.size()));
    for (size_t i = 0; shape != nullptr && i < sizes.size(); i++) {
        PyObject *n = PyLong_FromLongLong(sizes[i]);
        if (n == nullptr) {
            Py_CLEAR(shape);
            break;
        }
        PyTuple_SET_ITEM(shape, static_cast<Py_ssize_t>(i), n);
    }
    return shape;
}

bool nargs(const char *name, Py_ssize_t given, Py_ssize_t wanted)
{
    if (given != wanted)
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, wanted, given);
    return given == wanted;
}

// key(t): (nbytes, dtype) of a qualifying tensor, else None.
PyObject *key(PyObject *, PyObject *o)
{
    HANDLE_TH_ERRORS
    const at::Tensor *t = usable(o);
    if (t == nullptr)
        Py_RETURN_NONE;
    PyObject *nbytes = PyLong_FromSize_t(t->nbytes());
    return nbytes == nullptr ? nullptr : Py_BuildValue("(NN)", nbytes, dtype_of(*t));
    END_HANDLE_TH_ERRORS
}

// pair(a, b): (a's nbytes, dtype, shape, b's nbytes, dtype, shape) of two
// qualifying tensors that share no byte, else None.
PyObject *pair(PyObject *, PyObject *const *args, Py_ssize_t n)
{
    HANDLE_TH_ERRORS
    if (!nargs("pair", n, 2))
        return nullptr;
    const at::Tensor *a = usable(args[0]), *b = usable(args[1]);
    if (a == nullptr || b == nullptr)
        Py_RETURN_NONE;
    auto pa = reinterpret_cast<uintptr_t>(a->data_ptr()), pb = reinterpret_cast<uintptr_t>(b->data_ptr());
    size_t na = a->nbytes(), nb = b->nbytes();
    if (pa < pb + nb && pb < pa + na)
        Py_RETURN_NONE;
    PyObject *sa = shape_of(*a), *sb = sa == nullptr ? nullptr : shape_of(*b);
    if (sb == nullptr) {
        Py_XDECREF(sa);
        return nullptr;
    }
    return Py_BuildValue("(nNNnNN)", static_cast<Py_ssize_t>(na), dtype_of(*a), sa,
                         static_cast<Py_ssize_t>(nb), dtype_of(*b), sb);
    END_HANDLE_TH_ERRORS
}

// The address of parts[0] in ``base`` when parts is a list or tuple of
// ``count`` qualifying tensors of ``dtype`` and ``step`` bytes each, none
// requiring grad, lying back to back in memory (x.chunk(n) makes them) and
// sharing no byte with the qualifying tensor ``apart`` (when not None); else false.
bool span_at(PyObject *parts, Py_ssize_t count, at::ScalarType dtype, Py_ssize_t step, PyObject *apart,
             uintptr_t *base)
{
    if (!PyList_CheckExact(parts) && !PyTuple_CheckExact(parts))
        return false;
    PyObject **items = PySequence_Fast_ITEMS(parts);
    if (count < 1 || PySequence_Fast_GET_SIZE(parts) != count)
        return false;
    for (Py_ssize_t i = 0; i < count; i++) {
        const at::Tensor *t = usable(items[i]);
        if (t == nullptr || t->scalar_type() != dtype || t->nbytes() != static_cast<size_t>(step)
            || t->requires_grad())
            return false;
        auto at = reinterpret_cast<uintptr_t>(t->data_ptr());
        if (i == 0)
            *base = at;
        else if (at != *base + static_cast<uintptr_t>(i * step))
            return false;
    }
    if (apart != Py_None) { // (checked last, as facts.py does)
        const at::Tensor *other = usable(apart);
        if (other == nullptr)
            return false;
        auto at = reinterpret_cast<uintptr_t>(other->data_ptr());
        if (at < *base + static_cast<uintptr_t>(count * step) && *base < at + other->nbytes())
            return false;
    }
    return true;
}

// span(parts, n, dtype, nbytes[, apart]): span_at's address, else None.
PyObject *span(PyObject *, PyObject *const *args, Py_ssize_t n)
{
    HANDLE_TH_ERRORS
    if (n != 5 && !nargs("span", n, 4))
        return nullptr;
    if (!THPDtype_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "span: dtype must be a torch.dtype");
        return nullptr;
    }
    if (!PyList_CheckExact(args[0]) && !PyTuple_CheckExact(args[0]))
        Py_RETURN_NONE;
    Py_ssize_t count = PyLong_AsSsize_t(args[1]), step = PyLong_AsSsize_t(args[3]);
    if ((count == -1 || step == -1) && PyErr_Occurred())
        return nullptr;
    uintptr_t base;
    if (!span_at(args[0], count, reinterpret_cast<THPDtype *>(args[2])->scalar_type, step, n == 5 ? args[4] : Py_None,
                 &base))
        Py_RETURN_NONE;
    return PyLong_FromSize_t(base);
    END_HANDLE_TH_ERRORS
}

// The bytes [start, end) a strided tensor with storage and no Python dispatch
// may touch, in `out`; false for any other object (or a span past 2^64). It
// reads the tensor itself: a __torch_function__ override of data_ptr() is not
// asked, as it is by facts.extent.
bool extent(PyObject *o, uintptr_t out[2], c10::Device *device)
{
    if (!THPVariable_Check(o))
        return false;
    const at::Tensor &t = THPVariable_Unpack(o);
    if (!t.defined() || t.layout() != at::kStrided || !t.has_storage() || t.key_set().has(c10::DispatchKey::Python))
        return false;
    *device = t.device();
    out[0] = out[1] = 0;
    if (t.is_contiguous()) {
        size_t nbytes = t.nbytes();
        if (nbytes) {
            out[0] = reinterpret_cast<uintptr_t>(t.data_ptr());
            out[1] = out[0] + nbytes;
        }
    } else if (t.numel()) {
        int64_t reach = 1, step;
        for (int64_t d = 0; d < t.dim(); d++)
            if (__builtin_mul_overflow(t.size(d) - 1, std::abs(t.stride(d)), &step)
                || __builtin_add_overflow(reach, step, &reach))
                return false; // (a meta tensor's strides can be anything: Python's ints then)
        uintptr_t bytes;
        out[0] = reinterpret_cast<uintptr_t>(t.data_ptr());
        if (__builtin_mul_overflow(static_cast<uintptr_t>(reach), static_cast<uintptr_t>(t.element_size()), &bytes)
            || __builtin_add_overflow(out[0], bytes, &out[1]))
            return false;
    }
    return true;
}

// A tuple of ``items`` (new references, stolen); nullptr, releasing them, if one is nullptr.
PyObject *tuple_of(std::initializer_list<PyObject *> items)
{
    PyObject *out = std::find(items.begin(), items.end(), nullptr) == items.end() ? PyTuple_New(items.size()) : nullptr;
    Py_ssize_t i = 0;
    for (PyObject *item : items) {
        if (out != nullptr)
            PyTuple_SET_ITEM(out, i++, item);
        else
            Py_XDECREF(item);
    }
    return out;
}

// (device, start, end, written): one tensor's range; the CPU's device object
// made once (an async call with work in flight lists its tensors' ranges).
PyObject *range_of(const c10::Device &device, const uintptr_t span[2], bool is_write)
{
    static PyObject *cpu = nullptr;
    if (cpu == nullptr && device.is_cpu() && (cpu = THPDevice_New(device)) == nullptr)
        return nullptr;
    return tuple_of({device.is_cpu() ? Py_NewRef(cpu) : THPDevice_New(device), PyLong_FromSize_t(span[0]),
                     PyLong_FromSize_t(span[1]), Py_NewRef(is_write ? Py_True : Py_False)});
}

// ranges(reads, writes): (low, high, [(device, start, end, written), ...]) for
// every tensor of the two lists or tuples (a read that is also written is
// listed once, as written), low and high over them; None when an item is not
// a strided tensor with storage and no Python dispatch (facts.ranges then).
PyObject *ranges(PyObject *, PyObject *const *args, Py_ssize_t n)
{
    HANDLE_TH_ERRORS
    if (!nargs("ranges", n, 2))
        return nullptr;
    for (PyObject *seq : {args[0], args[1]})
        if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq))
            Py_RETURN_NONE;
    // tuples: a list could change under a collection's finalizer while this allocates
    THPObjectPtr reads(PySequence_Tuple(args[0])), writes(reads ? PySequence_Tuple(args[1]) : nullptr);
    if (!writes)
        return nullptr;
    Py_ssize_t n_writes = PyTuple_GET_SIZE(writes.get()), n_reads = PyTuple_GET_SIZE(reads.get());
    PyObject **written = PySequence_Fast_ITEMS(writes.get()), **read = PySequence_Fast_ITEMS(reads.get());
    PyObject *list = PyList_New(0);
    if (list == nullptr)
        return nullptr;
    uintptr_t low = UINTPTR_MAX, high = 0;
    for (Py_ssize_t i = 0; i < n_writes + n_reads; i++) {
        bool is_write = i < n_writes;
        PyObject *o = is_write ? written[i] : read[i - n_writes];
        if (!is_write && std::find(written, written + n_writes, o) != written + n_writes)
            continue;
        uintptr_t span[2];
        c10::Device device(c10::kCPU);
        if (!extent(o, span, &device)) {
            Py_DECREF(list);
            Py_RETURN_NONE;
        }
        PyObject *item = range_of(device, span, is_write);
        if (item == nullptr || PyList_Append(list, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(list);
            return nullptr;
        }
        Py_DECREF(item);
        low = std::min(low, span[0]);
        high = std::max(high, span[1]);
    }
    if (PyList_GET_SIZE(list) == 0)
        low = 0;
    PyObject *bounds[2] = {PyLong_FromSize_t(low), PyLong_FromSize_t(high)};
    return tuple_of({bounds[0], bounds[1], list});
    END_HANDLE_TH_ERRORS
}


// The recipes of facts.plan_key, numbered alike.
enum Recipe { KEY, REDUCED, ROOTED, ROOTED_REDUCED, PAIRED, PAIRED_REDUCED, P2P, RECIPE_COUNT };
// Their names in that order: the module's RECIPES, which facts.py checks its own against at load.
const char *const RECIPE_NAMES[RECIPE_COUNT] = {"KEY", "REDUCED", "ROOTED", "ROOTED_REDUCED", "PAIRED",
                                                "PAIRED_REDUCED", "P2P"};

PyObject *SUM = nullptr; // mcrdl.types.ReduceOp.SUM (setup)
// Every mcrdl.types.ReduceOp member (setup): a call with another reduction takes the general path.
PyObject *REDUCTIONS[5] = {};

// ``op`` (fixed's last) is a reduction a plan can carry: SUM (the common case, not in
// the key) or another member of ReduceOp (in the key: the starter is made for it).
inline bool plannable(PyObject *op)
{
    for (PyObject *r : REDUCTIONS)
        if (op == r)
            return true;
    return false;
}

// ``key``, or (key, op) for a reduction other than SUM; steals key.
PyObject *with_reduction(PyObject *key, PyObject *op)
{
    if (key == nullptr || key == Py_None || op == SUM)
        return key;
    return Py_BuildValue("(NO)", key, op);
}

PyObject *kind_of(const at::Tensor &t)
{
    PyObject *kind = PyTuple_New(2), *nbytes = kind ? PyLong_FromSize_t(t.nbytes()) : nullptr;
    if (nbytes == nullptr) {
        Py_XDECREF(kind);
        return nullptr;
    }
    PyTuple_SET_ITEM(kind, 0, nbytes);
    PyTuple_SET_ITEM(kind, 1, dtype_of(t));
    return kind;
}

// (kind, *fixed[:count]): a new reference, or nullptr with an error.
PyObject *kind_and(const at::Tensor &t, PyObject *fixed, Py_ssize_t count)
{
    PyObject *kind = kind_of(t), *out = kind ? PyTuple_New(1 + count) : nullptr;
    if (out == nullptr) {
        Py_XDECREF(kind);
        return nullptr;
    }
    PyTuple_SET_ITEM(out, 0, kind);
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_INCREF(PyTuple_GET_ITEM(fixed, i));
        PyTuple_SET_ITEM(out, 1 + i, PyTuple_GET_ITEM(fixed, i));
    }
    return out;
}

// plan_key without the argument checks: a new reference, Py_None, or nullptr with an error.
PyObject *plan_key_of(long recipe, Py_ssize_t at, PyObject *tensors, PyObject *fixed)
{
    Py_ssize_t nt = PyTuple_GET_SIZE(tensors), nf = PyTuple_GET_SIZE(fixed);
    if (recipe >= PAIRED) {
        if (recipe == P2P) {
            if (nf < 2 || at >= nt || !PyLong_CheckExact(PyTuple_GET_ITEM(fixed, 0))
                || !PyLong_CheckExact(PyTuple_GET_ITEM(fixed, 1)))
                Py_RETURN_NONE;
            const at::Tensor *t = usable(PyTuple_GET_ITEM(tensors, at));
            if (t == nullptr)
                Py_RETURN_NONE;
            return kind_and(*t, fixed, 2);
        }
        if (nt < 2 || (recipe == PAIRED_REDUCED && (nf < 1 || !plannable(PyTuple_GET_ITEM(fixed, nf - 1)))))
            Py_RETURN_NONE;
        PyObject *args[2] = {PyTuple_GET_ITEM(tensors, 1), PyTuple_GET_ITEM(tensors, 0)};
        const at::Tensor *a = usable(args[0]);
        if (recipe == PAIRED_REDUCED && a != nullptr && a->scalar_type() == at::kBool)
            Py_RETURN_NONE;
        PyObject *both = pair(nullptr, args, 2);
        return recipe == PAIRED_REDUCED ? with_reduction(both, PyTuple_GET_ITEM(fixed, nf - 1)) : both;
    }
    bool reduced = recipe == REDUCED || recipe == ROOTED_REDUCED, rooted = recipe == ROOTED || recipe == ROOTED_REDUCED;
    if (at >= nt || (reduced && (nf < 1 || !plannable(PyTuple_GET_ITEM(fixed, nf - 1))))
        || (rooted && (nf < 1 || !PyLong_CheckExact(PyTuple_GET_ITEM(fixed, 0)))))
        Py_RETURN_NONE;
    const at::Tensor *t = usable(PyTuple_GET_ITEM(tensors, at));
    if (t == nullptr || (reduced && t->scalar_type() == at::kBool))
        Py_RETURN_NONE;
    PyObject *key = rooted ? kind_and(*t, fixed, 1) : kind_of(*t);
    return reduced ? with_reduction(key, PyTuple_GET_ITEM(fixed, nf - 1)) : key;
}

// plan_key(recipe, at, tensors, fixed): what a call's plan is keyed on, else None.
PyObject *plan_key(PyObject *, PyObject *const *args, Py_ssize_t n)
{
    HANDLE_TH_ERRORS
    if (!nargs("plan_key", n, 4))
        return nullptr;
    if (SUM == nullptr) {
        PyErr_SetString(PyExc_RuntimeError, "plan_key: setup() has not run");
        return nullptr;
    }
    long recipe = PyLong_AsLong(args[0]);
    Py_ssize_t at = PyLong_AsSsize_t(args[1]);
    if ((recipe == -1 || at == -1) && PyErr_Occurred())
        return nullptr;
    if (recipe < KEY || recipe > P2P || at < 0 || !PyTuple_Check(args[2]) || !PyTuple_Check(args[3])) {
        PyErr_SetString(PyExc_ValueError, "plan_key: a recipe of 0-6, an index >= 0 and two tuples");
        return nullptr;
    }
    return plan_key_of(recipe, at, args[2], args[3]);
    END_HANDLE_TH_ERRORS
}

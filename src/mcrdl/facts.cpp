// The facts mcrdl's ops key their plans on, read from the tensors in C++
// (facts.py has the same functions in Python, the fallback): from Python
// each torch attribute read costs 60-240 ns, and a call made 5 to 20 of
// them. A tensor qualifies when it is a strided CPU tensor that is
// contiguous, not nested, has storage and no Python dispatch (a wrapper
// subclass takes the general path). torch's errors raise as they do in Python.
// ranges() is the exception: it reads any strided tensor with storage (the
// memory an async op touches, for the order check), CUDA ones too.
// drive() is ops.run's compiled twin for the calls that run from a plan; it
// starts any backend's compiled starters (adopt_starter(); MPI's by adopt())
// itself, and an async call's Work is made (track) and, on MPI, waited for
// (finished) here too.
// Beats is the watchdog's heartbeat (watchdog.py), sent from a thread that never
// takes the GIL; RLock is the engine's lock (work.py), which track() and
// finished() take without a call.
// TorchMethod is ProcessGroupMCRDL's (integrations/torch_backend.py) common
// calls in C, and its Works' wait: it reads torch's options struct and calls
// the driver without a Python frame, and hands every other call to the Python
// method it stands for.
#include <Python.h>
#include <structmember.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/utils/object_ptr.h>
#include <torch/csrc/utils/pybind.h>

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <initializer_list>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <mutex>
#include <thread>
#include <vector>

namespace {

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
enum Recipe { KEY, REDUCED, ROOTED, ROOTED_REDUCED, PAIRED, PAIRED_REDUCED, P2P };

PyObject *SUM = nullptr; // mcrdl.types.ReduceOp.SUM (setup)

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
        if (nt < 2 || (recipe == PAIRED_REDUCED && (nf < 1 || PyTuple_GET_ITEM(fixed, nf - 1) != SUM)))
            Py_RETURN_NONE;
        PyObject *args[2] = {PyTuple_GET_ITEM(tensors, 1), PyTuple_GET_ITEM(tensors, 0)};
        const at::Tensor *a = usable(args[0]);
        if (recipe == PAIRED_REDUCED && a != nullptr && a->scalar_type() == at::kBool)
            Py_RETURN_NONE;
        return pair(nullptr, args, 2);
    }
    bool reduced = recipe == REDUCED || recipe == ROOTED_REDUCED, rooted = recipe == ROOTED || recipe == ROOTED_REDUCED;
    if (at >= nt || (reduced && (nf < 1 || PyTuple_GET_ITEM(fixed, nf - 1) != SUM))
        || (rooted && (nf < 1 || !PyLong_CheckExact(PyTuple_GET_ITEM(fixed, 0)))))
        Py_RETURN_NONE;
    const at::Tensor *t = usable(PyTuple_GET_ITEM(tensors, at));
    if (t == nullptr || (reduced && t->scalar_type() == at::kBool))
        Py_RETURN_NONE;
    if (rooted)
        return kind_and(*t, fixed, 1);
    return kind_of(*t);
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

// What drive() reads, set once by setup().
struct Driver {
    PyObject *slow = nullptr;     // ops.run: calls without a plan
    PyObject *general = nullptr;  // ops.general: calls that never have one
    PyObject *planned = nullptr;  // ops.planned: calls with a plan that drive() does not run
    PyObject *blocked = nullptr;  // ops.blocked(rt, g, op, backend, pending, tensors): a start that did not finish
    PyObject *unstarted = nullptr; // ops.could_not_start(op, backend, exc): the error of an async start that raised
    PyObject *group_type = nullptr, *done = nullptr, *profiler = nullptr, *empty = nullptr, *zero = nullptr;
    Py_ssize_t name, recipe, at, listed, at_root, collective, split, reads, writes, last; // Op's fields
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
PyObject *s_enabled, *s_order_before, *s_run, *s_retire, *s_peer;

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
Attr a_starters, a_timeout, a_rank, a_size, a_ranks;  // Group's
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

// The list form's view of its blocks (ops.span): the one the group remembers,
// else a new view (not remembered: ops.span remembers small lists' views when
// it runs); nullptr without an error when the blocks do not lie back to back.
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
    THPObjectPtr starters(get(g, a_starters));
    if (!starters)
        return nullptr;
    PyObject *memo = PyDict_GetItemWithError(starters.get(), name); // (address, nbytes, dtype, view)
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
    try { // a view of the first block's storage, which must hold them all
        return THPVariable_Wrap(first.as_strided({count * first.numel()}, {1}));
    } catch (const c10::Error &) {
        return nullptr;
    }
}

// Elements per peer from split sizes (ops._counts): a list of ``size``
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
    if (row == 1) {
        Py_INCREF(splits);
        return splits;
    }
    PyObject *out = PyList_New(size);
    for (Py_ssize_t i = 0; out != nullptr && i < size; i++) {
        PyObject *v = PyLong_FromLongLong(PyLong_AsLongLong(PyList_GET_ITEM(splits, i)) * row);
        if (v == nullptr)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, v);
    }
    return out;
}

// The tensors at ``at`` (a tuple of indices) that are not None (ops._pick):
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

// adopt_starter(type, capsule): a backend's compiled starter, which drive() starts directly.
PyObject *adopt_starter(PyObject *, PyObject *const *args, Py_ssize_t n)
{
    if (!nargs("adopt_starter", n, 2) || !add_starter(args[0], args[1]))
        return nullptr;
    Py_RETURN_NONE;
}

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

// What track() and finished() read: Work's slots (their offsets, from its
// member descriptors), the MPI Request type and work.RECEIVES; set by adopt().
struct WorkSlots {
    PyTypeObject *type = nullptr, *request = nullptr;
    PyObject *receives = nullptr, *domain = nullptr, *empty = nullptr;
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
    if (W.type == nullptr) // (Work not adopted: no MPI in this process)
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

// track(engine, g, name, backend, pending, reads, writes, result, spans, peer, done):
// Engine.run for a started async op, compiled: its Work, made here with every
// slot Work.__init__ sets, added to the engine's outstanding works (and its
// library to the engine's progress domains) under the engine's lock. ``done``:
// the op completed in its start (an MPI request its first test found done):
// its Work is made as finished() leaves one, and no other thread ever sees it
// outstanding. None: Work is not adopted, the engine's lock is not an RLock
// of this module, or a member of the group died meanwhile: Engine.run's turn.
PyObject *track(PyObject *engine, PyObject *g, PyObject *name, PyObject *backend, PyObject *pending, PyObject *reads,
                PyObject *writes, PyObject *result, PyObject *spans, PyObject *peer, bool done)
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
        {W.post, W.empty}, {W.reads, reads}, {W.writes, writes}, {W.deadline, deadline.get()},
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

// finished(work, burst, turns): Work.wait()'s common case compiled: an
// untimed wait for a work whose request is an MPI Request, MPI the only
// library ever outstanding, no future, no completion steps, and the engine's
// lock an RLock of this module. It makes up to
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
    if (pending == nullptr || Py_TYPE(pending) != W.request || engine == nullptr || post == nullptr
        || !((PyTuple_CheckExact(post) && PyTuple_GET_SIZE(post) == 0)
             || (PyList_CheckExact(post) && PyList_GET_SIZE(post) == 0)))
        return 0;
    THPObjectPtr domains(get(engine, a_domains));
    if (!domains)
        return -1;
    if (!PyFrozenSet_CheckExact(domains.get()) || PySet_GET_SIZE(domains.get()) != 1)
        return 0;
    int mpi_only = PySet_Contains(domains.get(), W.domain);
    if (mpi_only <= 0)
        return mpi_only;
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
        put(work, W.stream, Py_None); // (an MPI Request's results are in place: no stream)
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

// adopt(Starter, start capsule, Request, Work, RECEIVES): the compiled MPI
// starters drive() calls directly, and what finished() needs to complete
// their requests' works.
PyObject *adopt(PyObject *, PyObject *const *args, Py_ssize_t n)
{
    if (!nargs("adopt", n, 5))
        return nullptr;
    if (PyCapsule_GetPointer(args[1], "mcrdl_mpi_native.start") == nullptr)
        return nullptr;
    if (!PyType_Check(args[0]) || !PyType_Check(args[2]) || !PyType_Check(args[3]) || !PyFrozenSet_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "adopt: the Starter type, its start capsule, the Request and Work types "
                                         "and a frozenset of receives");
        return nullptr;
    }
    auto *work = reinterpret_cast<PyTypeObject *>(args[3]);
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
        {&w.s_domains, "_domains"},
        {&w.s_test, "test"}, {&w.domain, "mpi"}, {&w.s_domain, "progress_domain"}};
    for (auto &entry : names)
        if (*entry.s == nullptr && (*entry.s = PyUnicode_InternFromString(entry.text)) == nullptr)
            return nullptr;
    if ((w.empty = W.empty != nullptr ? W.empty : PyTuple_New(0)) == nullptr)
        return nullptr;
    // (each kept for the process's life, as the module is)
    if (!add_starter(args[0], args[1]))
        return nullptr;
    for (int i : {2, 3, 4})
        Py_INCREF(args[i]);
    w.request = reinterpret_cast<PyTypeObject *>(args[2]);
    w.type = work;
    w.receives = args[4];
    W = w;
    Py_RETURN_NONE;
}


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

// -- ProcessGroupMCRDL's common calls ---------------------------------------------------------
// TorchMethod(kind, op, name, fallback, module_globals, work_type, work_init, reduce_kinds, group_type)
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
    int kind;
    PyObject *op, *name, *fallback, *module_globals, *work_type, *work_init, *reduce_kinds, *group_type;
    if (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "TorchMethod takes no keyword arguments");
        return nullptr;
    }
    if (!PyArg_ParseTuple(args, "iOUOO!O!OO!O!:TorchMethod", &kind, &op, &name, &fallback, &PyDict_Type, &module_globals,
                          &PyType_Type, &work_type, &work_init, &PyDict_Type, &reduce_kinds, &PyType_Type,
                          &group_type))
        return nullptr;
    auto *pg_type = reinterpret_cast<PyTypeObject *>(group_type);
    auto *made_type = reinterpret_cast<PyTypeObject *>(work_type);
    if (!attr(a_g, pg_type, "_g") || !attr(a_coalescing, pg_type, "_coalescing") || !attr(a_work, made_type, "_work")
        || !attr(a_result, made_type, "_result") || !attr(a_op, made_type, "_op"))
        return nullptr;
    if (kind < 0 || kind >= T_KINDS || !PyCallable_Check(fallback) || !PyCallable_Check(work_init)) {
        PyErr_Format(PyExc_ValueError, "TorchMethod: a kind of 0-%d, a function, a type and its base's __init__",
                     T_KINDS - 1);
        return nullptr;
    }
    if (D.slow == nullptr) {
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

PyMethodDef methods[] = {
    {"key", key, METH_O, nullptr},
    {"plan_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(plan_key)), METH_FASTCALL, nullptr},
    {"drive", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(drive)), METH_FASTCALL, nullptr},
    {"setup", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(setup)), METH_FASTCALL, nullptr},
    {"finished", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(finished)), METH_FASTCALL, nullptr},
    {"adopt", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(adopt)), METH_FASTCALL, nullptr},
    {"adopt_starter", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(adopt_starter)), METH_FASTCALL,
     nullptr},
    {"pair", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(pair)), METH_FASTCALL, nullptr},
    {"span", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(span)), METH_FASTCALL, nullptr},
    {"ranges", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(ranges)), METH_FASTCALL, nullptr},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "mcrdl_facts", nullptr, -1, methods};

} // namespace

PyMODINIT_FUNC PyInit_mcrdl_facts(void)
{
    if (PyType_Ready(&BeatsType) < 0 || PyType_Ready(&TorchMethodType) < 0 || PyType_Ready(&RLockType) < 0)
        return nullptr;
    PyObject *m = PyModule_Create(&module);
    if (m == nullptr)
        return nullptr;
    if (PyModule_AddObjectRef(m, "Beats", reinterpret_cast<PyObject *>(&BeatsType)) < 0
        || PyModule_AddObjectRef(m, "RLock", reinterpret_cast<PyObject *>(&RLockType)) < 0
        || PyModule_AddObjectRef(m, "TorchMethod", reinterpret_cast<PyObject *>(&TorchMethodType)) < 0) {
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}

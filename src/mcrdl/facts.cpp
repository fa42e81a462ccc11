// The facts mcrdl's fast paths key their plans on, read from the tensors in
// C++ (facts.py has the same functions in Python, the fallback): from Python
// each torch attribute read costs 60-240 ns, and a fast path made 5 to 20 of
// them per call. A tensor qualifies when it is a strided CPU tensor that is
// contiguous, not nested, has storage and no Python dispatch (a wrapper
// subclass takes the general path). torch's errors raise as they do in Python.
// ranges() is the exception: it reads any strided tensor with storage (the
// memory an async op touches, for the order check), CUDA ones too.
#include <Python.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include <algorithm>
#include <cstdlib>

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

// span(parts, n, dtype, nbytes[, apart]): the address of parts[0] when parts
// is a list or tuple of n qualifying tensors of that dtype and size, none
// requiring grad, lying back to back in memory (x.chunk(n) makes them) and
// sharing no byte with the qualifying tensor apart (when given); else None.
PyObject *span(PyObject *, PyObject *const *args, Py_ssize_t n)
{
    HANDLE_TH_ERRORS
    if (n != 5 && !nargs("span", n, 4))
        return nullptr;
    PyObject *parts = args[0];
    if (!THPDtype_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "span: dtype must be a torch.dtype");
        return nullptr;
    }
    if (!PyList_CheckExact(parts) && !PyTuple_CheckExact(parts))
        Py_RETURN_NONE;
    Py_ssize_t count = PyLong_AsSsize_t(args[1]), step = PyLong_AsSsize_t(args[3]);
    if ((count == -1 || step == -1) && PyErr_Occurred())
        return nullptr;
    at::ScalarType dtype = reinterpret_cast<THPDtype *>(args[2])->scalar_type;
    PyObject **items = PySequence_Fast_ITEMS(parts);
    if (count < 1 || PySequence_Fast_GET_SIZE(parts) != count)
        Py_RETURN_NONE;
    uintptr_t base = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        const at::Tensor *t = usable(items[i]);
        if (t == nullptr || t->scalar_type() != dtype || t->nbytes() != static_cast<size_t>(step)
            || t->requires_grad())
            Py_RETURN_NONE;
        auto at = reinterpret_cast<uintptr_t>(t->data_ptr());
        if (i == 0)
            base = at;
        else if (at != base + static_cast<uintptr_t>(i * step))
            Py_RETURN_NONE;
    }
    if (n == 5 && args[4] != Py_None) { // (checked last, as facts.py does)
        const at::Tensor *apart = usable(args[4]);
        if (apart == nullptr)
            Py_RETURN_NONE;
        auto at = reinterpret_cast<uintptr_t>(apart->data_ptr());
        if (at < base + static_cast<uintptr_t>(count * step) && base < at + apart->nbytes())
            Py_RETURN_NONE;
    }
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
        PyObject *item = Py_BuildValue("(NKKO)", THPDevice_New(device), static_cast<unsigned long long>(span[0]),
                                       static_cast<unsigned long long>(span[1]), is_write ? Py_True : Py_False);
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
    return Py_BuildValue("(KKN)", static_cast<unsigned long long>(low), static_cast<unsigned long long>(high), list);
    END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"key", key, METH_O, nullptr},
    {"pair", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(pair)), METH_FASTCALL, nullptr},
    {"span", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(span)), METH_FASTCALL, nullptr},
    {"ranges", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(ranges)), METH_FASTCALL, nullptr},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "mcrdl_facts", nullptr, -1, methods};

} // namespace

PyMODINIT_FUNC PyInit_mcrdl_facts(void)
{
    return PyModule_Create(&module);
}

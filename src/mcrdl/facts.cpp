// The facts mcrdl's fast paths key their plans on, read from the tensors in
// C++ (facts.py has the same functions in Python, the fallback): from Python
// each torch attribute read costs 60-240 ns, and a fast path made 5 to 20 of
// them per call. A tensor qualifies when it is a strided CPU tensor that is
// contiguous, not nested, has storage and no Python dispatch (a wrapper
// subclass takes the general path). torch's errors raise as they do in Python.
#include <Python.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

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

// span(parts, n, dtype, nbytes): the address of parts[0] when parts is a list
// or tuple of n qualifying tensors of that dtype and size, none requiring grad,
// lying back to back in memory (x.chunk(n) makes them); else None.
PyObject *span(PyObject *, PyObject *const *args, Py_ssize_t n)
{
    HANDLE_TH_ERRORS
    if (!nargs("span", n, 4))
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
    return PyLong_FromSize_t(base);
    END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"key", key, METH_O, nullptr},
    {"pair", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(pair)), METH_FASTCALL, nullptr},
    {"span", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(span)), METH_FASTCALL, nullptr},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "mcrdl_facts", nullptr, -1, methods};

} // namespace

PyMODINIT_FUNC PyInit_mcrdl_facts(void)
{
    return PyModule_Create(&module);
}

// mcrdl_facts, the compiled helpers of mcrdl's call path, one translation unit
// built from the files below, one concern each (facts.py builds it: module.cpp
// with the others included here in this order, each using what the ones before
// it define). Each file's header says what it mirrors in Python and which tests
// cover it; without a compiler, or with MCRDL_NATIVE=0, the Python runs instead.
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

#include "tensor_facts.cpp"
#include "driver_state.cpp"
#include "engine.cpp"
#include "driver.cpp"
#include "beats.cpp"
#include "torch_method.cpp"

PyMethodDef methods[] = {
    {"key", key, METH_O, nullptr},
    {"plan_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(plan_key)), METH_FASTCALL, nullptr},
    {"drive", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(drive)), METH_FASTCALL, nullptr},
    {"setup", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(setup)), METH_FASTCALL, nullptr},
    {"finished", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(finished)), METH_FASTCALL, nullptr},
    {"adopt_work", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(adopt_work)), METH_FASTCALL, nullptr},
    {"adopt_starter", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(adopt_starter)), METH_FASTCALL,
     nullptr},
    {"pair", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(pair)), METH_FASTCALL, nullptr},
    {"span", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(span)), METH_FASTCALL, nullptr},
    {"ranges", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(ranges)), METH_FASTCALL, nullptr},
    {nullptr, nullptr, 0, nullptr},
};

// module.<attr> = a tuple of ``count`` names (what Python binds by name and checks at load).
bool add_names(PyObject *m, const char *attr, const char *const *names, int count)
{
    THPObjectPtr tuple(PyTuple_New(count));
    for (int i = 0; tuple && i < count; i++) {
        PyObject *name = PyUnicode_FromString(names[i]);
        if (name == nullptr)
            return false;
        PyTuple_SET_ITEM(tuple.get(), i, name);
    }
    return tuple && PyModule_AddObjectRef(m, attr, tuple.get()) == 0;
}

PyModuleDef module = {PyModuleDef_HEAD_INIT, "mcrdl_facts", nullptr, -1, methods};

} // namespace

PyMODINIT_FUNC PyInit_mcrdl_facts(void)
{
    if (PyType_Ready(&BeatsType) < 0 || PyType_Ready(&TorchMethodType) < 0 || PyType_Ready(&RLockType) < 0
        || PyType_Ready(&DivideType) < 0)
        return nullptr;
    PyObject *m = PyModule_Create(&module);
    if (m == nullptr)
        return nullptr;
    if (!add_names(m, "RECIPES", RECIPE_NAMES, RECIPE_COUNT) || !add_names(m, "TORCH_METHODS", KIND_NAMES, T_KINDS)
        || PyModule_AddObjectRef(m, "Beats", reinterpret_cast<PyObject *>(&BeatsType)) < 0
        || PyModule_AddObjectRef(m, "RLock", reinterpret_cast<PyObject *>(&RLockType)) < 0
        || PyModule_AddObjectRef(m, "Divide", reinterpret_cast<PyObject *>(&DivideType)) < 0
        || PyModule_AddObjectRef(m, "TorchMethod", reinterpret_cast<PyObject *>(&TorchMethodType)) < 0) {
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}

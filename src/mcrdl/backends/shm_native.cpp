// mcrdl's binding of DeepSpeed's CPU shared-memory all-reduce (backends/shm.py).
//
// Compiled together with DeepSpeed's own csrc/cpu/comm/shm.cpp, taken unmodified
// from the installed deepspeed package. DeepSpeed's binding (shm_interface.cpp)
// is not used: it registers the torch library namespace "deepspeed" (so a second
// copy in one process fails to load, and DeepSpeed's own would clash with ours),
// names its segments from MASTER_ADDR/MASTER_PORT and needs LOCAL_SIZE in the
// environment. This one registers nothing with torch, takes the segment name's
// parts as arguments, and leaves the GIL while it waits for its peers.
//
// Covered by tests/test_shm.py (every case the backend serves against local
// references, and what it must refuse).
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>

#include <omp.h>

#include "shm.h"

namespace {

int initialized_size = -1;
int initialized_rank = -1;
bool ready = false;                        // mark_ready(): the job's first op is done, segments unlinked
std::atomic<long> started{0}, ended{0};    // ops that entered / left the library (the sentinel reads them)
std::atomic<long> queued{0};               // ops handed to the backend's worker thread, not finished
int thread_cap = 1;                        // set_thread_cap(): this rank's share of the host's cores
std::atomic<int> last_threads{0};          // the OpenMP threads the last op's kernels ran with

// Chunks of at most 1 GiB: all_reduce_outer_loop takes the byte count as an int.
constexpr int64_t MAX_CALL_BYTES = int64_t(1) << 30;

void initialize(int size, int rank, const std::string& job, const std::string& tag)
{
    TORCH_CHECK(initialized_size < 0 || (initialized_size == size && initialized_rank == rank),
                "shm: this process already set up rank ", initialized_rank, " of ", initialized_size);
    if (initialized_size >= 0) return;
    std::vector<char> a(job.begin(), job.end()), p(tag.begin(), tag.end());
    a.push_back(0);
    p.push_back(0);
    {
        pybind11::gil_scoped_release no_gil;  // it waits until every peer created its segment
        shm_initialize(size, rank, a.data(), p.data());
    }
    initialized_size = size;
    initialized_rank = rank;
}

bool servable(const at::Tensor& data)
{
    auto type = data.scalar_type();
    return data.device().is_cpu() && data.is_contiguous()
           && (type == at::kFloat || type == at::kBFloat16 || type == at::kHalf);
}

// Sum ``data`` over every rank, in place; called without the GIL. The kernels' OpenMP
// loops run on the calling thread's OpenMP setting (torch's), capped at this rank's share
// of the cores: with more threads than that, a peer spinning in its wait holds the core a
// descheduled OpenMP thread needs (2 ranks x 2 threads on 2 cores: 10-16 ms a call, not 7-18 us).
void sum_in_place(at::Tensor& data)
{
    const int had = omp_get_max_threads();
    const int threads = std::min(had, thread_cap);
    if (threads != had) omp_set_num_threads(threads);
    last_threads.store(threads);
    const int64_t element = data.element_size();
    const int64_t per_call = MAX_CALL_BYTES / element;
    const int64_t numel = data.numel();
    started.fetch_add(1);
    if (numel <= per_call) {  // one call: the kernel reads data_ptr() and the counts only
        all_reduce_outer_loop(data, numel, static_cast<int>(numel * element));
    } else {
        torch::Tensor flat = data.view({-1});
        for (int64_t start = 0; start < numel; start += per_call) {
            int64_t count = std::min(per_call, numel - start);
            torch::Tensor part = flat.narrow(0, start, count);
            all_reduce_outer_loop(part, count, static_cast<int>(count * element));
        }
    }
    ended.store(started.load());
    if (threads != had) omp_set_num_threads(had);  // (torch's own setting, for its compute)
}

void all_reduce(torch::Tensor& data)
{
    TORCH_CHECK(initialized_size > 0, "shm: all_reduce before initialize");
    TORCH_CHECK(servable(data), "shm: a contiguous CPU float32, bfloat16 or float16 tensor is needed, got ",
                data.scalar_type());
    pybind11::gil_scoped_release no_gil;
    sum_in_place(data);
}

// -- the blocking fast path's starter, which csrc/driver.cpp's drive() starts without Python
// (adopt_starter): it runs the op here when the job's first op is done and nothing is
// queued on the worker, else calls ``fallback`` (backends/shm.py's inline start).
struct Starter {
    PyObject_HEAD
    PyObject *fallback;
    PyObject *done;  // work.DONE
};

PyObject *start(PyObject *self, void *const *, PyObject *const *args, Py_ssize_t n)
{
    auto *s = reinterpret_cast<Starter *>(self);
    if (!ready || queued.load() != 0 || n != 1 || !THPVariable_Check(args[0]))
        return PyObject_Vectorcall(s->fallback, args, n, nullptr);
    at::Tensor data = THPVariable_Unpack(args[0]);
    if (!servable(data))
        return PyObject_Vectorcall(s->fallback, args, n, nullptr);
    Py_BEGIN_ALLOW_THREADS
    sum_in_place(data);
    Py_END_ALLOW_THREADS
    return Py_NewRef(s->done);
}

PyObject *starter_call(PyObject *self, PyObject *args, PyObject *kwargs)
{
    if (kwargs != nullptr && PyDict_GET_SIZE(kwargs) > 0) {
        PyErr_SetString(PyExc_TypeError, "shm starter: no keyword arguments");
        return nullptr;
    }
    return start(self, nullptr, &PyTuple_GET_ITEM(args, 0), PyTuple_GET_SIZE(args));
}

void starter_dealloc(PyObject *self)
{
    auto *s = reinterpret_cast<Starter *>(self);
    Py_XDECREF(s->fallback);
    Py_XDECREF(s->done);
    PyTypeObject *type = Py_TYPE(self);
    type->tp_free(self);
    Py_DECREF(type);
}

PyType_Slot starter_slots[] = {
    {Py_tp_call, reinterpret_cast<void *>(starter_call)},
    {Py_tp_dealloc, reinterpret_cast<void *>(starter_dealloc)},
    {Py_tp_doc, const_cast<char *>("shm's blocking all_reduce: start(tensor) -> DONE (or fallback(tensor))")},
    {0, nullptr}};
PyType_Spec starter_spec = {"mcrdl_shm_native.Starter", sizeof(Starter), 0, Py_TPFLAGS_DEFAULT, starter_slots};
PyObject *starter_type = nullptr;

pybind11::object make_starter(pybind11::object fallback, pybind11::object done)
{
    auto *s = PyObject_New(Starter, reinterpret_cast<PyTypeObject *>(starter_type));
    if (s == nullptr)
        throw pybind11::error_already_set();
    s->fallback = fallback.release().ptr();
    s->done = done.release().ptr();
    return pybind11::reinterpret_steal<pybind11::object>(reinterpret_cast<PyObject *>(s));
}

int vector_kernel_level()
{
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx512bw")) return 2;  // bf16/fp16 kernels (and fp32)
    if (__builtin_cpu_supports("avx2")) return 1;      // fp32 kernels only
    return 0;
#else
    return 2;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("initialize", &initialize, "map every rank's segment (names: <prefix>_<job>_<tag>_<rank>)");
    m.def("all_reduce", &all_reduce, "sum a contiguous tensor over every rank, in place");
    m.def("mark_ready", [] { ready = true; }, "the job's first op is done: starters may run ops themselves");
    m.def("set_threads", [](int n) { omp_set_num_threads(n); },
          "OpenMP threads of the kernels called from this thread (torch's libgomp: this thread only)");
    m.def("set_thread_cap", [](int n) { thread_cap = std::max(1, n); },
          "the most OpenMP threads the kernels may use (this rank's share of the host's cores)");
    m.def("last_threads", [] { return last_threads.load(); }, "OpenMP threads of the last op's kernels");
    m.def("counts", [] { return std::make_pair(started.load(), ended.load()); }, "ops (entered, left) the library");
    m.def("queue", [](long change) { return queued.fetch_add(change) + change; },
          "add to the count of ops on the worker thread; returns it");
    starter_type = PyType_FromSpec(&starter_spec);
    if (starter_type == nullptr)
        throw pybind11::error_already_set();
    m.attr("Starter") = pybind11::reinterpret_borrow<pybind11::object>(starter_type);
    m.attr("start") = pybind11::reinterpret_steal<pybind11::object>(
        PyCapsule_New(reinterpret_cast<void *>(start), "mcrdl_shm_native.start", nullptr));
    m.def("starter", &make_starter, "a Starter running all_reduce, calling fallback(tensor) when it cannot");
    m.def("vector_kernel_level", &vector_kernel_level, "1: fp32 kernels, 2: also bf16/fp16");
}

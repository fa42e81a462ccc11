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
#include <torch/extension.h>

#include "shm.h"

namespace {

int initialized_size = -1;
int initialized_rank = -1;

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

void all_reduce(torch::Tensor& data)
{
    TORCH_CHECK(initialized_size > 0, "shm: all_reduce before initialize");
    TORCH_CHECK(data.device().is_cpu() && data.is_contiguous(), "shm: a contiguous CPU tensor is needed");
    auto type = data.scalar_type();
    TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kHalf,
                "shm: float32, bfloat16 or float16 only, got ", type);
    const int64_t element = data.element_size();
    const int64_t per_call = MAX_CALL_BYTES / element;
    const int64_t numel = data.numel();
    torch::Tensor flat = data.view({-1});
    pybind11::gil_scoped_release no_gil;
    for (int64_t start = 0; start < numel; start += per_call) {
        int64_t count = std::min(per_call, numel - start);
        torch::Tensor part = flat.narrow(0, start, count);
        all_reduce_outer_loop(part, count, static_cast<int>(count * element));
    }
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
    m.def("all_reduce", &all_reduce, "sum a flat tensor over every rank, in place");
    m.def("vector_kernel_level", &vector_kernel_level, "1: fp32 kernels, 2: also bf16/fp16");
}

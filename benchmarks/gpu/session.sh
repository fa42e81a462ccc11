#!/usr/bin/env bash
# The CUDA checks of #17 in one run, for a machine with a GPU (docs/results/gpu.md):
#   bash benchmarks/gpu/session.sh OUTDIR
# Runs from the source tree with the machine's python3 (torch with CUDA, mpi4py
# on whatever MPI it has); each step has its own time limit, and a failed step
# does not stop the next (ops_job checks every op on CPU tensors under the
# machine's MPI, where the compiled paths meet it). Writes session.log and the
# bench JSONs to OUTDIR.
# CUDA_TESTS: a pytest -k expression (default: all); BENCH_VARIANTS: the 2-rank
# bench's backends (default mpi_staged,gloo).
set -u
out=${1:-out/gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
# Open MPI refuses root and oversubscription unless told
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
py=${PYTHON:-python3}
log=$out/session.log

step() {  # step SECONDS TITLE COMMAND...
    local limit=$1 title=$2
    shift 2
    echo "=== $title ($(date -u +%H:%M:%S), limit ${limit}s): $*" >> "$log"
    local t0=$SECONDS
    timeout "$limit" "$@" >> "$log" 2>&1
    echo "=== rc=$? after $((SECONDS - t0))s" >> "$log"
}

step 20 environment bash -c "nvidia-smi -L; $py -c 'import torch, mpi4py; from mpi4py import MPI; \
print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), mpi4py.__version__); \
print(MPI.Get_library_version().splitlines()[0])'"
step 100 "mcrdl info (builds the compiled helpers)" $py -m mcrdl.cli info
if ! grep -q "fast-path tensor checks: compiled" "$log"; then  # no job should try the build again
    export MCRDL_NATIVE=0
    echo "=== the compiled helpers did not build: MCRDL_NATIVE=0 from here on" >> "$log"
fi
step 120 "every op on CPU tensors under this MPI, 2 ranks (the compiled paths)" $py -m mcrdl.cli run -n 2 \
    $py tests/jobs/ops_job.py mpi
step 320 "CUDA tests (the demo among them)" $py -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py -k "${CUDA_TESTS:-}"
variants=${BENCH_VARIANTS:-mpi_staged,gloo}
step 80 "bench, 2 ranks on one GPU, 4 B-1 MiB" $py -m mcrdl.cli bench -n 2 --device cuda --variants $variants \
    --sizes 4,1K,64K,1M --iters 20 --large-iters 5 --warmup 2 --rounds 1 --json "$out/bench_cuda_2ranks_small.json"
step 100 "bench, 2 ranks on one GPU, 16-64 MiB" $py -m mcrdl.cli bench -n 2 --device cuda --variants $variants \
    --sizes 16M,64M --large-iters 3 --warmup 1 --rounds 1 --json "$out/bench_cuda_2ranks_large.json"
step 60 "NCCL: mcrdl against the raw process group, 1 rank" $py -m mcrdl.cli run -n 1 $py benchmarks/gpu/nccl_overhead.py
step 60 "profile of the CUDA op path, 1 rank" $py -m mcrdl.cli run -n 1 $py benchmarks/gpu/profile_cuda_ops.py
for n in 1 2; do
    step 45 "staging, part by part: $n rank(s) on one GPU" $py -m mcrdl.cli run -n $n $py benchmarks/gpu/staging_parts.py 4 65536
done
grep "^=== rc" "$log"

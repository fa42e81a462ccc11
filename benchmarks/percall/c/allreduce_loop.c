/* The OSU-style timed loop of benchmarks/percall/allreduce_latency.py, in C: the
 * "C MPI_Allreduce" baseline, called through ctypes inside the same job so it
 * is interleaved with the Python variants (same machine phase).
 * Build: mpicc -O2 -shared -fPIC allreduce_loop.c -o allreduce_loop.so */
#include <mpi.h>

/* Warm-up, barrier, then `iters` back-to-back in-place SUM all-reduces of
 * `count` floats on the communicator with Fortran handle `fcomm`.
 * Returns this rank's seconds per call. */
double allreduce_loop(MPI_Fint fcomm, float *buf, int count, int iters, int warmup)
{
    MPI_Comm comm = MPI_Comm_f2c(fcomm);
    for (int i = 0; i < warmup; i++)
        MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, comm);
    MPI_Barrier(comm);
    double start = MPI_Wtime();
    for (int i = 0; i < iters; i++)
        MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, comm);
    return (MPI_Wtime() - start) / iters;
}

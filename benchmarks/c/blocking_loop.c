/* The floor of mcrdl's MPI hot path, in C: each collective as a blocking call
 * (what raw mpi4py and OSU time) and as its nonblocking form completed by an
 * MPI_Test spin (what mcrdl's compiled path runs: src/mcrdl/backends/mpi_native.c),
 * with nothing else in the loop. Called through ctypes by
 * benchmarks/blocking_floor.py. Build: mpicc -O2 -shared -fPIC blocking_loop.c */
#include <mpi.h>

enum { ALLREDUCE, BCAST, REDUCE, ALLGATHER, GATHER, SCATTER, ALLTOALL, REDUCE_SCATTER };

static void call(int op, int nonblocking, MPI_Comm comm, float *a, float *b, int count)
{
    MPI_Request req = MPI_REQUEST_NULL;
    int flag = 0;
    switch (op) {
    case ALLREDUCE:
        if (nonblocking) MPI_Iallreduce(MPI_IN_PLACE, a, count, MPI_FLOAT, MPI_SUM, comm, &req);
        else MPI_Allreduce(MPI_IN_PLACE, a, count, MPI_FLOAT, MPI_SUM, comm);
        break;
    case BCAST:
        if (nonblocking) MPI_Ibcast(a, count, MPI_FLOAT, 0, comm, &req);
        else MPI_Bcast(a, count, MPI_FLOAT, 0, comm);
        break;
    case REDUCE:
        if (nonblocking) MPI_Ireduce(a, b, count, MPI_FLOAT, MPI_SUM, 0, comm, &req);
        else MPI_Reduce(a, b, count, MPI_FLOAT, MPI_SUM, 0, comm);
        break;
    case ALLGATHER:
        if (nonblocking) MPI_Iallgather(a, count, MPI_FLOAT, b, count, MPI_FLOAT, comm, &req);
        else MPI_Allgather(a, count, MPI_FLOAT, b, count, MPI_FLOAT, comm);
        break;
    case GATHER:
        if (nonblocking) MPI_Igather(a, count, MPI_FLOAT, b, count, MPI_FLOAT, 0, comm, &req);
        else MPI_Gather(a, count, MPI_FLOAT, b, count, MPI_FLOAT, 0, comm);
        break;
    case SCATTER:
        if (nonblocking) MPI_Iscatter(b, count, MPI_FLOAT, a, count, MPI_FLOAT, 0, comm, &req);
        else MPI_Scatter(b, count, MPI_FLOAT, a, count, MPI_FLOAT, 0, comm);
        break;
    case ALLTOALL:
        if (nonblocking) MPI_Ialltoall(a, count, MPI_FLOAT, b, count, MPI_FLOAT, comm, &req);
        else MPI_Alltoall(a, count, MPI_FLOAT, b, count, MPI_FLOAT, comm);
        break;
    case REDUCE_SCATTER:
        if (nonblocking) MPI_Ireduce_scatter_block(b, a, count, MPI_FLOAT, MPI_SUM, comm, &req);
        else MPI_Reduce_scatter_block(b, a, count, MPI_FLOAT, MPI_SUM, comm);
        break;
    }
    while (nonblocking && !flag)
        MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
}

/* Warm-up, barrier, then `iters` calls of `op` on `count` floats per rank
 * (`a`: count floats, `b`: count x group size). Returns this rank's seconds per call. */
double blocking_loop(MPI_Fint fcomm, int op, int nonblocking, float *a, float *b, int count,
                     int iters, int warmup)
{
    MPI_Comm comm = MPI_Comm_f2c(fcomm);
    for (int i = 0; i < warmup; i++)
        call(op, nonblocking, comm, a, b, count);
    MPI_Barrier(comm);
    double start = MPI_Wtime();
    for (int i = 0; i < iters; i++)
        call(op, nonblocking, comm, a, b, count);
    return (MPI_Wtime() - start) / iters;
}

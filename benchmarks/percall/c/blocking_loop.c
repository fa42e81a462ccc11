/* The floor of mcrdl's MPI hot path, in C: each collective as a blocking call
 * (what raw mpi4py and OSU time; form 0), as its nonblocking form completed by
 * an MPI_Test spin (what mcrdl's compiled path runs: src/mcrdl/backends/mpi_native.c;
 * form 1) and completed by MPI_Wait (form 2), with nothing else in the loop. Called through ctypes by
 * benchmarks/percall/blocking_floor.py. Build: mpicc -O2 -shared -fPIC blocking_loop.c */
#include <mpi.h>

enum { ALLREDUCE, BCAST, REDUCE, ALLGATHER, GATHER, SCATTER, ALLTOALL, REDUCE_SCATTER };

static void call(int op, int form, MPI_Comm comm, float *a, float *b, int count)
{
    MPI_Request req = MPI_REQUEST_NULL;
    int flag = 0;
    switch (op) {
    case ALLREDUCE:
        if (form) MPI_Iallreduce(MPI_IN_PLACE, a, count, MPI_FLOAT, MPI_SUM, comm, &req);
        else MPI_Allreduce(MPI_IN_PLACE, a, count, MPI_FLOAT, MPI_SUM, comm);
        break;
    case BCAST:
        if (form) MPI_Ibcast(a, count, MPI_FLOAT, 0, comm, &req);
        else MPI_Bcast(a, count, MPI_FLOAT, 0, comm);
        break;
    case REDUCE:
        if (form) MPI_Ireduce(a, b, count, MPI_FLOAT, MPI_SUM, 0, comm, &req);
        else MPI_Reduce(a, b, count, MPI_FLOAT, MPI_SUM, 0, comm);
        break;
    case ALLGATHER:
        if (form) MPI_Iallgather(a, count, MPI_FLOAT, b, count, MPI_FLOAT, comm, &req);
        else MPI_Allgather(a, count, MPI_FLOAT, b, count, MPI_FLOAT, comm);
        break;
    case GATHER:
        if (form) MPI_Igather(a, count, MPI_FLOAT, b, count, MPI_FLOAT, 0, comm, &req);
        else MPI_Gather(a, count, MPI_FLOAT, b, count, MPI_FLOAT, 0, comm);
        break;
    case SCATTER:
        if (form) MPI_Iscatter(b, count, MPI_FLOAT, a, count, MPI_FLOAT, 0, comm, &req);
        else MPI_Scatter(b, count, MPI_FLOAT, a, count, MPI_FLOAT, 0, comm);
        break;
    case ALLTOALL:
        if (form) MPI_Ialltoall(a, count, MPI_FLOAT, b, count, MPI_FLOAT, comm, &req);
        else MPI_Alltoall(a, count, MPI_FLOAT, b, count, MPI_FLOAT, comm);
        break;
    case REDUCE_SCATTER:
        if (form) MPI_Ireduce_scatter_block(b, a, count, MPI_FLOAT, MPI_SUM, comm, &req);
        else MPI_Reduce_scatter_block(b, a, count, MPI_FLOAT, MPI_SUM, comm);
        break;
    }
    if (form == 2)
        MPI_Wait(&req, MPI_STATUS_IGNORE);
    while (form == 1 && !flag)
        MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
}

/* Warm-up, barrier, then `iters` calls of `op` on `count` floats per rank
 * (`a`: count floats, `b`: count x group size). Returns this rank's seconds per call. */
double blocking_loop(MPI_Fint fcomm, int op, int form, float *a, float *b, int count,
                     int iters, int warmup)
{
    MPI_Comm comm = MPI_Comm_f2c(fcomm);
    for (int i = 0; i < warmup; i++)
        call(op, form, comm, a, b, count);
    MPI_Barrier(comm);
    double start = MPI_Wtime();
    for (int i = 0; i < iters; i++)
        call(op, form, comm, a, b, count);
    return (MPI_Wtime() - start) / iters;
}

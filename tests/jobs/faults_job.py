"""One rank (the victim) dies or stops calling mid-run; every other rank must
end with an error naming op, backend and (when it can be known) the peer.

    faults_job.py BACKEND WHEN ACTION VICTIM REPORT_DIR

BACKEND: mpi | gloo | mixed (MPI and gloo work outstanding together).
WHEN: collective (victim fails while peers are inside a blocking op),
      async (peers have async ops outstanding, including p2p with the victim),
      between (victim fails after an op completed; peers then start the next),
      p2p (2 ranks: the survivor is inside a blocking recv from the victim).
ACTION: kill (SIGKILL) | exit (os._exit(1): the process ends at once, without
its exit handlers, so without a goodbye, as a crash that exits would) | stall
(stops calling, process alive) | freeze (SIGSTOP: the whole process stops, its
threads too; the launcher kills it later).
FAULT_STRANGERS=1: before the fault step, rank 1 attacks rank 0's watchdog
(see ``strangers``) and rank 0 writes the connections it dropped to
REPORT_DIR/rejected.
Each survivor appends every error as it catches it to REPORT_DIR/rank<R>.jsonl
(seconds from the fault step, message) and creates REPORT_DIR/done<R> at the
end. Under mpiexec, launch with ``--extra=-disable-auto-cleanup`` and ACTION exit
so that Hydra does not kill the survivors as soon as the victim ends: it kills
them anyway, within milliseconds, when the victim dies by a signal (seen with
MPICH 5.0.2's Hydra), and MPICH ends the job when a survivor's MPI progress
sees the dead peer (it has no fault tolerance).
"""
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch

import mcrdl

backend, when, action, victim, report_dir = sys.argv[1:6]
victim = int(victim)
report_dir = Path(report_dir)
mcrdl.init_process_group(timeout=float(os.environ.get("FAULT_TIMEOUT", "4")))
rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
survivors = world - 1
backends = ["mpi", "gloo"] if backend == "mixed" else [backend]
x = torch.ones(1000)
for b in backends:  # connections are up before the fault
    mcrdl.all_reduce(x, backend=b)
    mcrdl.all_gather_into_tensor(torch.empty(world * 1000), x, backend=b)


def strangers() -> None:
    """Rank 1 attacks rank 0's watchdog as a stranger on the network would:
    false death claims, garbage, a flood of connections, a replayed hello and
    goodbye, a second claim of a connected rank. None may end or blind it."""
    from mcrdl import api
    from mcrdl.watchdog import _mac
    host, port = api.current_runtime().store.get("watchdog/0").decode().split()[:2]
    secret = api.current_runtime().watchdog._secret  # the replay below needs a hello that once was valid

    def connect():
        sock = socket.create_connection((host, int(port)), timeout=10)
        return sock, sock.recv(64).decode().strip()  # rank 0's nonce

    for payload in (b"1\n", b"dead 2\n", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"A" * 4000,
                    b"\xff\xfe\n", b"1 2 3 4\n", b"-1 ab cd\n", b"bye\n"):
        sock, _ = connect()
        sock.sendall(payload)
        sock.close()
    flood = [socket.create_connection((host, int(port)), timeout=10) for _ in range(200)]
    for sock in flood:
        sock.close()
    sock, nonce = connect()  # a hello valid for this nonce only
    hello = f"2 {'ab' * 16} {_mac(secret, 'rank', '2', nonce)}\n".encode()
    sock.close()
    sock, _ = connect()
    sock.sendall(hello + b"bye\n")  # replayed on a connection with another nonce
    sock.close()
    sock, nonce = connect()
    sock.sendall(f"2 {'ab' * 16} {_mac(secret, 'rank', '2', nonce)}\n".encode())  # rank 2 is connected
    assert sock.recv(64) == b"", "a second claim of rank 2 was admitted"
    sock.close()


if os.environ.get("FAULT_STRANGERS") == "1":
    if rank == 1:
        strangers()
    time.sleep(1.0)  # a false death would be told within milliseconds
    expected = x * world
    mcrdl.all_reduce(x, backend=backends[0])
    assert torch.equal(x, expected), "the step after the strangers is wrong"
    if rank == 0:
        (report_dir / "rejected").write_text(str(mcrdl.api.current_runtime().watchdog.rejected))


def fail() -> None:
    if action == "exit":
        os._exit(1)
    if action in ("kill", "freeze"):
        os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGSTOP)
    deadline = time.monotonic() + 120  # stuck: alive, not calling, until the survivors reported
    while len(list(report_dir.glob("done*"))) < survivors and time.monotonic() < deadline:
        time.sleep(0.1)
    os._exit(0)


def start_ops(async_op: bool):
    """The fault step's ops on this rank; the victim is a p2p peer of rank (victim+1)."""
    works = []
    if when == "p2p":
        if rank == (victim + 1) % world:
            mcrdl.recv(torch.empty(10), src=victim, backend=backends[0])
        return works
    for b in backends:
        works.append(mcrdl.all_reduce(torch.ones(1000), backend=b, async_op=async_op))
        if async_op:
            works.append(mcrdl.broadcast(torch.ones(100), src=victim, backend=b, async_op=True))
    if async_op and rank == (victim + 1) % world:
        works.append(mcrdl.irecv(torch.empty(10), src=victim, backend=backends[0]))
    return works


if rank == victim:
    if when == "between":
        mcrdl.all_reduce(x, backend=backends[-1])
    else:
        time.sleep(0.5)  # the survivors are inside the step by now
    fail()

if when == "between":
    mcrdl.all_reduce(x, backend=backends[-1])
    time.sleep(0.5)  # the victim is gone before the next op starts
errors = 0
t0 = time.monotonic()


def record(exc: Exception) -> None:
    global errors
    errors += 1
    with open(report_dir / f"rank{rank}.jsonl", "a") as f:
        f.write(json.dumps([round(time.monotonic() - t0, 3), str(exc)]) + "\n")


if when == "collective" and backend == "mixed":
    works = [mcrdl.all_reduce(torch.ones(1000), backend="mpi", async_op=True)]
    try:
        mcrdl.all_reduce(torch.ones(1000), backend="gloo")
    except mcrdl.CommError as exc:
        record(exc)
else:
    try:
        works = start_ops(async_op=(when == "async"))
    except mcrdl.CommError as exc:
        record(exc)
        works = []
for w in works:
    try:
        w.wait()
    except mcrdl.CommError as exc:
        record(exc)
(report_dir / f"done{rank}").touch()
print(f"rank {rank}: {errors} errors after {time.monotonic() - t0:.1f} s", flush=True)
# Stay until every survivor has reported (Hydra ends the job when one exits),
# then exit through the normal path (atexit shutdown, MPI_Finalize).
deadline = time.monotonic() + 60
while len(list(report_dir.glob("done*"))) < survivors and time.monotonic() < deadline:
    time.sleep(0.1)
sys.exit(3 if errors else 0)

"""Process-group lifecycle: start the backends of one job, and groups over them."""
from __future__ import annotations

import atexit
import json
import os
import secrets
import sys
import time
import warnings
from datetime import timedelta
from typing import Iterable, Mapping, Optional, Sequence, Union

import torch

from .autotune import Autotuner
from .backends import OPS, REGISTRY, Backend, BackendUnavailable, Context
from . import pmi, rendezvous, settings
from .backends.mpi import init_launched, library_name
from .rank_env import mpi_launched
from .features.flight_recorder import FlightRecorder, buffer_size, dump_prefix
from .features.profiler import PROFILER, observers
from .health import Health
from .selector import Selector, parse_op_backends
from .tuning import TuningTable
from .types import CommTimeoutError, ReduceOp
from .watchdog import Watchdog
from .work import DEATH_GRACE_S, Engine, _seconds, set_wait_policy, wait_policy_from_env

FR_WAIT_S = 5.0  # seconds a rank that asked for every flight recorder dump waits for them


class Group:
    """A set of ranks usable with every live backend (an MPI communicator and
    a torch process group behind one object)."""

    __slots__ = ("ranks", "rank", "size", "handles", "timeout", "name", "seq", "owner", "_index",
                 "plans", "tuned", "trying", "tuned_calls", "declined", "declined_async")

    def __init__(self, ranks: Sequence[int], my_global_rank: int, timeout: float, name: str,
                 owner: "Runtime"):
        self.owner = owner  # the runtime whose backends hold the handles
        self.ranks = tuple(ranks)
        self._index = {r: i for i, r in enumerate(self.ranks)}
        self.rank = self._index.get(my_global_rank, -1)  # -1: not a member
        self.size = len(self.ranks)
        self.timeout = timeout
        self.name = name
        self.handles: dict[str, object] = {}
        #: ((backend, why), ...): live backends that cannot serve this group (no handle; the selector skips them)
        self.declined: tuple = ()
        #: the same for selected async calls: also the backends whose async calls would slow the caller
        self.declined_async: tuple = ()
        self.seq = 0  # collectives issued (debug mode fingerprints)
        #: csrc/driver.cpp's: (op, tensor facts, backend, async_op[, 0: split sizes]) -> its ops.Plan,
        #: and a list op's name -> its last small list's view (address, nbytes, dtype, view)
        self.plans: dict = {}
        #: autotune's buckets of this group ((class, device, bucket) -> Bucket; mcrdl.autotune). Per
        #: object, not per name: torch reuses a destroyed group's name for another group.
        self.tuned: dict = {}
        self.trying = None  # autotune's bucket on trial: one at a time per group
        self.tuned_calls = 0  # autotuned collectives that took the general path (a trial's count of calls)

    def __repr__(self) -> str:
        return f"<mcrdl.Group {self.name} ranks={list(self.ranks)}>"

    def group_rank(self, global_rank: int) -> int:
        try:
            return self._index[global_rank]
        except KeyError:
            raise ValueError(f"rank {global_rank} is not in group {self.name} "
                             f"(ranks {list(self.ranks)})") from None


def _load_table(spec: Union[None, str, dict, TuningTable], live) -> Optional[TuningTable]:
    """A tuning table from a path, a dict, a table, or ``MCRDL_TUNING_TABLE``."""
    spec = spec if spec is not None else settings.get("MCRDL_TUNING_TABLE")
    if isinstance(spec, str):
        return TuningTable.load(spec, REGISTRY, live)
    if isinstance(spec, dict):
        return TuningTable.from_dict(spec, REGISTRY, live)
    return spec


POINT_TO_POINT = frozenset({"send", "recv", "isend", "irecv"})


def _abort_mpi_job(comm, why: str = "a communication operation failed") -> None:
    print(f"mcrdl: {why}, so MPI_Finalize could wait forever for a missing peer: aborting "
          "the MPI job instead", file=sys.stderr, flush=True)
    comm.Abort(1)


#: Environment variables in which launchers give the number of processes they started.
LAUNCH_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


def _gpu_id(local_rank: int) -> Optional[str]:
    """The UUID of the GPU this rank uses by mcrdl's convention (local rank
    modulo the GPUs it sees: ranks given one GPU each by
    ``CUDA_VISIBLE_DEVICES`` see different ones), or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    try:
        uuid = str(torch.cuda.get_device_properties(local_rank % torch.cuda.device_count()).uuid)
    except Exception:  # (a torch without device UUIDs): unknown, assumed not shared
        return None
    return uuid if uuid.strip("0-") else None  # all zeros (some ROCm devices): unknown


def shares_a_gpu(gpus: Sequence[Optional[str]]) -> bool:
    """Do two of a host's ranks use the same GPU (by UUID; None: unknown)?"""
    known = [g for g in gpus if g is not None]
    return len(set(known)) < len(known)


def _check_launch_size(world_size: int, MPI) -> None:
    """A launcher of one MPI implementation (say MPICH's Hydra) starting ranks
    whose mpi4py loaded another (say Open MPI) makes each rank a world of its
    own: every rank would run alone, believing it is rank 0. Refuse that."""
    for var in LAUNCH_SIZE_VARS:
        launched = os.environ.get(var, "")
        if launched.isdigit() and int(launched) != world_size:
            library = library_name(MPI)
            raise RuntimeError(
                f"the launcher started {launched} processes ({var}={launched}) but MPI reports a world "
                f"of {world_size}: the launcher and the MPI library mpi4py loaded ({library}) are "
                "different implementations. Launch with that library's mpiexec (mcrdl run --mpiexec "
                "PATH), or make mpi4py load the launcher's MPI")


def _not_created(group: Group, missing: list) -> str:
    return (f"new_group {group.name} (ranks {list(group.ranks)}): ranks {missing} did not create it "
            f"within {group.timeout:g} s; every rank must create groups in the same order (as with "
            "torch.distributed.new_group)")


def _check_in(store, group: Group) -> None:
    """Every member of ``group`` writes the ranks it means by the group's name, then
    reads the others': a different view (groups created in another order) or a
    member absent past the group's timeout raises, naming the ranks."""
    mine = json.dumps(group.ranks)
    me = group.ranks[group.rank]
    store.set(f"members/{me}", mine)
    deadline = time.monotonic() + group.timeout
    for r in group.ranks:
        key = f"members/{r}"
        if r == me:
            continue
        try:
            store.wait([key], timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except RuntimeError:  # the store's timeout (DistStoreError)
            missing = [m for m in group.ranks if not store.check([f"members/{m}"])]
            raise CommTimeoutError(_not_created(group, missing)) from None
        theirs = store.get(key).decode()
        if theirs != mine:
            raise RuntimeError(
                f"new_group {group.name}: rank {r} created it as ranks {theirs}, rank {me} as "
                f"{mine}: groups were created in a different order on different ranks (every rank "
                "must make the same new_group calls in the same order)")


class Runtime:
    """Everything one initialised job holds. Created by
    :func:`mcrdl.init_process_group`, dropped by :func:`mcrdl.destroy_process_group`."""

    # (csrc/driver.cpp's drive reads debug, engine, observer and world at their slots' offsets)
    __slots__ = ("_abort_at_exit", "_failing_alike", "_group_count", "autotune", "backends", "control_backend",
                 "ctx", "debug", "default_backend", "dying", "engine", "groups", "health", "local_cpus",
                 "local_rank", "local_size", "logger", "mpi_comm", "mpi_missing", "observer", "rank", "recorder",
                 "selector", "shared_gpu", "store", "store_host", "timeout", "traced", "unavailable", "wait_policy",
                 "watchdog", "world", "world_size")

    def __init__(self, backends: Optional[Iterable[str]], default_backend: Optional[str],
                 timeout: float, op_backends: Optional[Mapping[str, str]],
                 tuning_table: Union[None, str, dict, TuningTable], debug: Optional[bool],
                 comms_log: Optional[bool] = None, store=None, rank: Optional[int] = None,
                 world_size: Optional[int] = None, autotune: Optional[bool] = None):
        if isinstance(backends, str):  # "mpi,gloo"
            backends = [name.strip() for name in backends.split(",") if name.strip()]
        requested = list(REGISTRY) if backends is None else list(backends)
        for name in requested:
            if name not in REGISTRY:
                raise ValueError(f"unknown backend {name!r} (registered: {', '.join(REGISTRY)})")
        # Everything decidable locally is checked before the rendezvous, so a bad
        # argument fails on every rank at once instead of stranding the others.
        default = default_backend or settings.get("MCRDL_DEFAULT_BACKEND")
        if default is not None and default not in REGISTRY:
            raise ValueError(f"default backend {default!r} is not a registered backend "
                             f"(registered: {', '.join(REGISTRY)})")
        table = _load_table(tuning_table, live=None)
        if op_backends is None and settings.get("MCRDL_OP_BACKENDS"):
            op_backends = parse_op_backends(settings.get("MCRDL_OP_BACKENDS"))
        Selector(dict.fromkeys(REGISTRY), next(iter(REGISTRY)), op_backends)  # names and ops
        tuning = Autotuner.settings(autotune)
        beat = settings.get("MCRDL_HEARTBEAT_S")
        wait = wait_policy_from_env()
        self.timeout = timeout
        self.engine = Engine()
        self.mpi_comm = None
        self.store = None
        self._group_count = 0  # mcrdl.new_group calls (every rank makes them, in the same order)
        self.local_cpus: Optional[int] = None  # known when MPI launched the job: _local_from_mpi
        self.shared_gpu = False  # this host's ranks would share a GPU (MPI-launched jobs: _local_from_mpi)
        #: why MPI is not live though asked for (no MPI launcher, and no PMI service either)
        self.mpi_missing: Optional[str] = None
        self.store_host: Optional[int] = None  # the rank whose process serves the store (rendezvous)
        launched = any("launcher" in REGISTRY[n].needs for n in requested)  # (MPI's communicator)
        if store is None:
            self._launch(launched)
        else:
            self._join(store, rank, world_size, launched)
        self.health = self.watchdog = None
        self.backends: dict[str, Backend] = {}
        self._failing_alike = False  # a failed start that every rank raises together
        try:
            self._start(requested, backends is not None, default, table, tuning, beat, wait,
                        op_backends, debug, comms_log)
        except BaseException:
            self._abandon()
            raise

    def _start(self, requested: list, named: bool, default: Optional[str], table, tuning, beat: float,
               wait: str, op_backends, debug: Optional[bool], comms_log: Optional[bool]) -> None:
        """After the rendezvous: the backends, the world group and what watches them."""
        timeout = self.timeout
        #: "spin" or "yield": how waits use the CPU (MCRDL_WAIT, work.set_wait_policy)
        self.wait_policy = set_wait_policy(wait, self.local_size, self.local_cpus)
        self.unavailable: dict[str, str] = {}
        if self.store is None and (any("store" in REGISTRY[n].needs for n in requested)
                                   or (beat > 0 and self.world_size > 1)):
            self._failing_alike = True  # make_store raises on every rank alike
            self.ensure_store()
            self._failing_alike = False
        if self.store is not None and beat > 0 and self.world_size > 1:
            self.health = Health(self.store, self.rank, beat, self.store_host)
        self._abort_at_exit = False
        #: why this rank is ending on an uncaught exception (api's excepthook), else None
        self.dying: Optional[str] = None
        # the watchdog's key travels over MPI when it is live, never through the store,
        # which anyone who reaches it can read (torch's TCPStore has no authentication);
        # sent whether or not this rank's watchdog is on, so no rank waits in the bcast
        secret = None
        if self.store is not None and self.world_size > 1 and self.mpi_comm is not None:
            secret = self.mpi_comm.bcast(secrets.token_bytes(32) if self.rank == 0 else None, root=0)
        if self.store is not None and self.world_size > 1 and settings.get("MCRDL_WATCHDOG"):
            single_host = self.local_size == self.world_size
            self.watchdog = Watchdog(self.store, self.rank, self.world_size,
                                     lambda: rendezvous.listen(rendezvous.store_address(single_host)),
                                     self._peer_died, timeout, secret, settings.get("MCRDL_FROZEN_S"))
        self.engine.on_failure = self._on_failure
        ctx = self.ctx = Context(self.rank, self.world_size, timeout, self.mpi_comm, self.store,
                                 self.shared_gpu, self.mpi_missing, self.local_size)
        failed = None  # a backend's start raised: every rank must hear of it, not wait below
        for name in requested:
            reason = REGISTRY[name].unavailable_reason(ctx)
            if reason is None:
                try:
                    self.backends[name] = REGISTRY[name](ctx)
                except BackendUnavailable as exc:
                    self.unavailable[name] = str(exc)
                except Exception as exc:
                    failed = exc
                    break
            else:
                self.unavailable[name] = reason
                if named:
                    warnings.warn(f"mcrdl: backend {name!r} requested but not started: {reason}")
        if self.mpi_comm is not None and self.world_size > 1:
            self._keep_backends_live_everywhere(failed)
        if failed is not None:
            raise failed
        for name in list(self.backends):
            try:
                self.backends[name].join()
            except BackendUnavailable as exc:
                self.backends.pop(name).shutdown()
                self.unavailable[name] = str(exc)
        if not self.backends:
            raise RuntimeError("mcrdl: no backend could start: " + "; ".join(
                f"{n}: {r}" for n, r in self.unavailable.items()))
        # a device's own library (CUDA: NCCL) unless a default was named (else the first live one)
        device_defaults = {} if default is not None else {
            d: n for n, b in reversed(self.backends.items()) for d in b.default_for}
        default = default or next(iter(self.backends))
        if default not in self.backends:
            raise ValueError(f"default backend {default!r} is not live (live: {', '.join(self.backends)}"
                             + "".join(f"; {n}: {r}" for n, r in self.unavailable.items()) + ")")
        self.default_backend = default
        #: the backend of the runtime's own small collectives (agreements, the logger's exchange)
        self.control_backend = next((n for n, b in self.backends.items() if "cpu" in b.devices
                                     and b.ops == frozenset(OPS)), default)
        if table is not None:  # again, now that we know which backends are live
            table = TuningTable.from_dict(table.to_dict(), REGISTRY, self.backends, table.source)
        self.selector = Selector(self.backends, default, op_backends, table, device_defaults)
        #: in-situ autotuning (mcrdl.autotune), or None
        self.autotune = None if tuning is None else Autotuner(self.selector, **tuning)
        self.debug = settings.get("MCRDL_DEBUG") if debug is None else bool(debug)
        if comms_log is None:
            comms_log = settings.get("MCRDL_COMMS_LOG")
        self.logger = None
        #: the flight recorder (mcrdl.features.flight_recorder), on when TORCH_FR_BUFFER_SIZE > 0
        self.recorder = None
        kept = buffer_size()
        if kept:
            self.recorder = FlightRecorder(self.rank, kept, dump_prefix())
            self.recorder.on_signal()
            if self.watchdog is not None:
                self.watchdog.on_dump = lambda asker: self.dump_flight_recorder(
                    f"asked by rank {asker}", confirm=True)
        self.groups: list[Group] = []
        self.world = self.new_group(range(self.world_size), timeout, name="world", world=True)
        if comms_log:  # an observer: the API reports each op to it
            from .features.logger import CommsLogger
            self.logger = CommsLogger(self.rank, self.world_size,
                                      lambda data: self.control_allgather(self.world, data),
                                      None if self.autotune is None else self.autotune.report)
        #: what the API reports each op to (mcrdl.features.profiler): None
        #: when nothing observes; ``traced`` while a torch profiler records
        self.observer = observers(self.logger, self.recorder)
        self.traced = observers(self.logger, self.recorder, PROFILER)

    def _abandon(self) -> None:
        """A start that failed after the rendezvous: unless every rank fails alike,
        peers may still be starting and waiting for this rank, so MPI_Finalize at
        exit could wait for them forever; the MPI job is aborted at exit instead
        (after the error is printed)."""
        if self.watchdog is not None:
            self.watchdog.stop(leaving=False)
        if self.health is not None:
            self.health.stop()
        for backend in self.backends.values():
            backend.shutdown()
        if self.mpi_comm is not None and self.world_size > 1 and not self._failing_alike:
            atexit.register(_abort_mpi_job, self.mpi_comm, f"rank {self.rank} failed to start")

    def _keep_backends_live_everywhere(self, failed: Optional[BaseException]) -> None:
        """Drop the backends that did not start on every rank (say a GPU on some
        nodes only): making a group is collective for some of them (MPI), so
        one live on some ranks only would hang the first ``new_group``. When a
        backend's start raised on another rank (``failed`` here), raise too."""
        report = None if failed is None else f"{type(failed).__name__}: {failed}"
        gathered = self.mpi_comm.allgather((sorted(self.backends), report))
        errors = [(r, e) for r, (_, e) in enumerate(gathered) if e is not None]
        self._failing_alike = bool(errors)  # every rank raises below: none waits for another
        if errors and failed is None:
            raise RuntimeError("mcrdl: a backend failed to start on " + "; ".join(
                f"rank {r}: {e}" for r, e in errors))
        everywhere = [names for names, _ in gathered]
        for name in [n for n in self.backends if not all(n in names for names in everywhere)]:
            missing = [r for r, names in enumerate(everywhere) if name not in names]
            self.backends.pop(name).shutdown()
            self.unavailable[name] = f"not live on every rank (not on ranks {missing})"
            warnings.warn(f"mcrdl: backend {name!r} is left out: it did not start on ranks {missing}")

    # -- launch and rendezvous ---------------------------------------------------
    def _launch(self, want_mpi: bool) -> None:
        """Identity from the launcher: MPI (mpiexec/srun), torchrun's environment (then MPI
        over the store, :mod:`mcrdl.pmi`), or a single process."""
        from .rank_env import srun_without_pmi, torchrun_env  # (not at import: `python -m mcrdl.rank_env`)

        env = os.environ
        if srun_without_pmi(env):  # srun --mpi=none: Slurm's variables say what torchrun's would
            env.update(torchrun_env(env))
            if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
                raise RuntimeError("mcrdl: srun started this task without PMI, and rank 0's node "
                                   "could not be found (scontrol show hostnames failed): use "
                                   "srun --mpi=pmi2, or set MASTER_ADDR and MASTER_PORT")
        if mpi_launched() or not ("RANK" in env and "WORLD_SIZE" in env):
            MPI = init_launched()
            self.mpi_comm = MPI.COMM_WORLD
            self.rank, self.world_size = self.mpi_comm.Get_rank(), self.mpi_comm.Get_size()
            _check_launch_size(self.world_size, MPI)
            self._local_from_mpi(MPI)
        else:
            self.rank, self.world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
            self.local_rank = int(env.get("LOCAL_RANK", 0))
            self.local_size = int(env.get("LOCAL_WORLD_SIZE", 1))
            if want_mpi:
                self.ensure_store()
                self._mpi_over_store()

    def _mpi_over_store(self) -> None:
        """MPI over the store's ranks, when no MPI launcher started them (:mod:`mcrdl.pmi`);
        where it cannot start, rank 0 says why once and the job runs on the rest."""
        MPI, why = pmi.bring_up(self.store, self.rank, self.world_size, self.timeout)
        if MPI is None:
            self.mpi_missing = f"MPI could not start {why}"
            if self.rank == 0:
                print(f"mcrdl: MPI is not live: it could not start {why}. The job runs on the "
                      "other backends; to have MPI, fix that or launch with `mcrdl run` / mpiexec.",
                      file=sys.stderr, flush=True)
            return
        self.mpi_comm = MPI.COMM_WORLD
        self._local_from_mpi(MPI)

    def _local_from_mpi(self, MPI) -> None:
        """This host's ranks: local rank and size, and the CPUs they may run on
        together. A launcher that binds each rank to its own core (Open MPI's
        default) leaves each one CPU, yet no two share one: the wait policy
        must count the union, not this rank's mask."""
        local = self.mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.local_rank, self.local_size = local.Get_rank(), local.Get_size()
        facts = local.allgather((os.sched_getaffinity(0), _gpu_id(self.local_rank)))
        local.Free()
        self.local_cpus = len(set().union(*(cpus for cpus, _ in facts)))
        self.shared_gpu = shares_a_gpu([gpu for _, gpu in facts])

    def _join(self, store, rank: Optional[int], world_size: Optional[int], want_mpi: bool) -> None:
        """Identity and rendezvous from a caller's store (torch's ``init_method``/``store=``:
        TCPStore, FileStore, HashStore, PrefixStore...). MPI is live too: the launcher's when
        an MPI launcher started a world of the same size (its ranks renumbered to the
        caller's), else one started over the store (:mod:`mcrdl.pmi`)."""
        if not (isinstance(rank, int) and isinstance(world_size, int) and 0 <= rank < world_size):
            raise ValueError(f"init_process_group: with store=, rank and world_size must be given "
                             f"(0 <= rank < world_size), got rank={rank!r}, world_size={world_size!r}")

        self.rank, self.world_size = rank, world_size
        self.store = rendezvous.fresh_keys(store, rank, world_size, self.timeout, lambda late: (
            f"init_process_group: ranks {late} did not join within {self.timeout:g} s"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.local_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if not want_mpi:
            return
        if not mpi_launched():
            self._mpi_over_store()
            return
        MPI = init_launched()
        if MPI.COMM_WORLD.Get_size() != world_size:
            self.mpi_missing = (f"the MPI launcher started {MPI.COMM_WORLD.Get_size()} processes but "
                                f"this job's world has {world_size}")
            warnings.warn(f"mcrdl: MPI not used: {self.mpi_missing}")
            return
        self.mpi_comm = MPI.COMM_WORLD.Split(0, rank)  # MPI rank = the caller's rank
        self._local_from_mpi(MPI)

    def ensure_store(self):
        """The job's rendezvous store, made now if this job has none yet (collective:
        every rank calls it)."""
        if self.store is None:
            self.store, self.store_host = rendezvous.make_store(self.rank, self.world_size, self.local_size,
                                                                self.timeout, self.mpi_comm)
        return self.store

    # -- groups -------------------------------------------------------------------
    def new_group(self, ranks: Iterable[int], timeout: Optional[float] = None,
                  name: Optional[str] = None, store=None, world: bool = False) -> Group:
        """A group of ``ranks``. Only its members build anything, with every live
        backend (MPI: ``Comm.Create_group``; gloo/nccl: a process group on the
        group's store), as in torch: so it may be called on the members alone
        (torch's backend creator, with ``name`` and ``store`` given) or on every
        rank in the same order (``mcrdl.new_group``; non-members get a group
        with rank -1). Members first check in on the store with the group's
        timeout: a member missing or seeing other ranks under this name is an
        error naming them, never a hang or a crossed group."""
        ranks = sorted(set(int(r) for r in ranks))
        if not ranks:
            raise ValueError("new_group: ranks is empty")
        bad = [r for r in ranks if not 0 <= r < self.world_size]
        if bad:
            raise ValueError(f"new_group: ranks {bad} are outside the world of {self.world_size}")
        seconds = self.timeout if timeout is None else _seconds(timeout)
        if not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"new_group: timeout must be a positive number of seconds or a "
                             f"timedelta, got {timeout!r}")
        if name is None:
            name = f"group{self._group_count}"
            self._group_count += 1
        group = Group(ranks, self.rank, seconds, name, self)
        if group.rank >= 0:
            given = store is not None
            if not given and self.store is not None:
                import torch.distributed as dist

                store = dist.PrefixStore(f"groups/{name}/", self.store)
            if store is not None:
                _check_in(store, group)
            if given:  # torch's, for a group it makes: it outlives torchrun's restarts, and torch
                # reuses a group's name after re-initialising; the check-in above meets
                # an earlier start's keys only with the same view
                store = rendezvous.fresh_keys(store, group.rank, len(group.ranks), group.timeout,
                                              lambda late: _not_created(group, [group.ranks[r] for r in late]))
            declined = []
            for bname, backend in self.backends.items():
                why = backend.group_unsupported(group.ranks, world)
                if why is None:
                    group.handles[bname] = backend.new_group(group.ranks, group.rank, store, seconds)
                else:
                    declined.append((bname, why))
            group.declined = tuple(declined)
            group.declined_async = group.declined + tuple(
                (bname, "its async calls would take a core from the caller's compute (a spinning wait on a "
                        "thread), so selected async calls go to the next library")
                for bname, backend in self.backends.items() if not backend.async_calls and bname in group.handles)
        self.groups.append(group)
        return group

    def destroy_group(self, group: Group) -> None:
        """Release ``group``'s handles (idempotent; the world lives until shutdown).
        Its plans go too: they hold the handles, and a torch process group that
        outlives shutdown is destroyed during interpreter teardown, where its
        worker threads can abort the process."""
        for bname, handle in group.handles.items():
            if bname in self.backends:
                self.backends[bname].destroy_group(handle)
        group.handles.clear()
        group.plans.clear()
        if group in self.groups:
            self.groups.remove(group)

    # -- control collectives (agreement, fingerprints, the logger's exchange) ----------
    def _control(self, g: Group, start, what: str) -> None:
        """Run a small blocking collective on the control backend (the first live
        one, in registry order, with every op on CPU tensors: MPI where it is live),
        not logged and not fingerprinted."""
        name = self.control_backend
        pending = start(self.backends[name], g.handles[name])
        self.engine.run(what, name, pending, (), (), (), g, (), False)

    def control_max(self, g: Group, value: Union[int, list[int]]) -> Union[int, list[int]]:
        """The maximum of ``value`` (an int, or each item of a list) over the group's ranks."""
        t = torch.tensor(value if isinstance(value, list) else [value], dtype=torch.int64)
        self._control(g, lambda b, h: b.all_reduce(h, t, ReduceOp.MAX), "agreement")
        return t.tolist() if isinstance(value, list) else int(t[0])

    def control_allgather(self, g: Group, data: bytes) -> list[bytes]:
        """Every group rank's ``data`` (any lengths), in group rank order."""
        n = self.control_max(g, len(data))
        mine = torch.zeros(n + 8, dtype=torch.uint8)
        mine[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        mine[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = torch.empty(g.size * (n + 8), dtype=torch.uint8)
        self._control(g, lambda b, h: b.all_gather_into_tensor(h, out, mine), "fingerprint exchange")
        raw = out.numpy().tobytes()
        rows = [raw[i * (n + 8):(i + 1) * (n + 8)] for i in range(g.size)]
        return [r[8:8 + int.from_bytes(r[:8], "little")] for r in rows]

    def dump_flight_recorder(self, why: str, ask_peers: bool = False, confirm: bool = False) -> Optional[str]:
        """Dump the flight recorder (None when it is off); ``ask_peers``: every
        other rank dumps too, and this one waits (at most FR_WAIT_S) until they
        have; ``confirm``: count this dump for such a wait."""
        if self.recorder is None:
            return None
        key = "flight_recorder/dumps"
        asked = ask_peers and self.watchdog is not None and self.store is not None
        before = self.store.add(key, 0) if asked else 0
        if asked:
            self.watchdog.ask_all_to_dump()
        path = self.recorder.dump(why)
        if confirm and self.store is not None:
            self.store.add(key, 1)
        deadline = time.monotonic() + FR_WAIT_S
        while asked and self.store.add(key, 0) < before + self.world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        return path

    def _peer_died(self, rank: int, how: str) -> None:
        """The watchdog saw ``rank``'s process end or freeze (called on its thread)."""
        self.engine.note_death(rank, how)
        if self.mpi_comm is not None:  # MPICH ends the job soon: say who first
            # (one write, so that ranks sharing the launcher's stderr do not interleave a line)
            sys.stderr.write(f"mcrdl: rank {self.rank}: {how}\n")
            sys.stderr.flush()
            if not self._abort_at_exit:  # MPI_Finalize would wait for the dead rank forever
                self._abort_at_exit = True
                atexit.register(_abort_mpi_job, self.mpi_comm)
        self.dump_flight_recorder(how)
        time.sleep(DEATH_GRACE_S)
        self.engine.fail_for_death(rank)

    def _on_failure(self, work) -> str:
        """A work timed out or its library failed; returns what the health
        check says of its peers, and where the flight recorder dumped.

        After a failed collective, or a library error (a peer's connection
        broke), a peer may be dead or stuck and MPI_Finalize would then wait
        for it forever: the MPI job is aborted at exit instead. A point-to-point
        op that timed out was withdrawn and leaves nothing behind."""
        timed_out = isinstance(work._error, CommTimeoutError)
        dumped = None
        if self.recorder is not None:
            path = self.dump_flight_recorder(f"{work.op} on backend '{work.backend}' "
                                             f"{'timed out' if timed_out else 'failed'}", ask_peers=True)
            dumped = f"every rank's flight recorder dumped ({path}; read them with torchfrtrace)"
        if (self.mpi_comm is not None and not self._abort_at_exit
                and (work.op not in POINT_TO_POINT or not timed_out)):
            self._abort_at_exit = True
            atexit.register(_abort_mpi_job, self.mpi_comm)  # runs before mpi4py's MPI_Finalize
        return "; ".join(filter(None, (self._peers_verdict(work.group, timed_out, work.op in POINT_TO_POINT),
                                       dumped)))

    def _peers_verdict(self, group, timed_out: bool, point_to_point: bool) -> str:
        """What the watchdog, else the heartbeats, say of ``group``'s members."""
        dead = self.engine.deaths(group)
        if dead:  # the watchdog already knows: no need to look at heartbeats
            return "; ".join(dead)
        if group is None or self.health is None:
            return ""
        # the library may see a broken connection before the watchdog hears of the
        # death: its word, once it comes, ends the heartbeats' settle window
        verdict = self.health.describe(group.ranks, group.name, self.debug, settle=not timed_out,
                                       heard=lambda: bool(self.engine.deaths(group)),
                                       point_to_point=point_to_point)
        return "; ".join(self.engine.deaths(group)) or verdict

    def shutdown(self) -> None:
        """Release every group handle, backend and the store now (a torch process
        group still alive when the interpreter exits can abort the process)."""
        if self.watchdog is not None:  # first: peers must not take what follows for a death
            self.watchdog.stop(leaving=self.dying is None)
            self.watchdog = None
        if self.dying is not None and self.mpi_comm is not None:  # peers may wait in an op with us
            _abort_mpi_job(self.mpi_comm, f"rank {self.rank} ends on {self.dying}")
        if self.recorder is not None:
            self.recorder.close()
        if self.health is not None:
            self.health.stop()
            self.health = None
        self.engine.shutdown()
        for group in reversed(list(self.groups)):
            self.destroy_group(group)
        for backend in self.backends.values():
            backend.shutdown()
        self.groups.clear()
        self.backends.clear()
        self.selector = None
        self.world = None
        # Groups the user still holds point here (Group.owner): drop the store so
        # its threads stop now, not during interpreter teardown.
        self.ctx.store = self.store = None

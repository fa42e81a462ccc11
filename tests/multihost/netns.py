"""Several hosts on one machine: network namespaces joined by veth pairs and a bridge.

``hosts(n)`` creates n hosts ``mcrdl-h0`` .. ``mcrdl-h{n-1}``. Each is a network
namespace with loopback up and one interface, ``mcrdl0`` (the same name on every
host, as ``eth0`` would be on a cluster), holding ``10.77.0.{k+1}/24``; its veth
peer ``mcrdl-v{k}`` sits on the bridge ``mcrdl-br0`` in the root namespace. With
``delay``/``rate``, every host's interface gets a ``tc`` qdisc: ``netem`` for a
delay (D each way is a round trip of 2D), ``tbf`` for a rate alone. ``/etc/netns/mcrdl-hK/hosts`` (which ``ip
netns exec`` mounts over ``/etc/hosts``) names every host, and commands run
with the host's name as hostname (own UTS namespace), so name resolution works
as on a cluster. Processes share the filesystem, so the repository's venv is
the same everywhere; they run as root.

Jobs start the usual way, through MPICH's ``mpiexec`` on host 0 with a host
list, Hydra's ssh launcher pointed at ``nsexec.sh`` (an ssh stand-in that runs
the command in the named namespace). Everything is removed on exit, also on
failure, and left-overs of a crashed run are removed before anything is made.

Command line (as root, from the repository root)::

    python -m tests.multihost.netns run -n 4 [--delay 1ms] [--rate 1gbit] -- PROGRAM ARGS...
        `mcrdl run` of PROGRAM (x.py, -m module, or a venv tool) with one rank
        per host; prints the job's output and the bytes each host sent/received.
    python -m tests.multihost.netns torchrun -n 2 -- PROGRAM ARGS...
        the same under `torchrun --nnodes=N` (one agent per host, host 0 the
        rendezvous; MPI started over torchrun's store).
    python -m tests.multihost.netns check      # can this machine run it? (exit 0/1)
    python -m tests.multihost.netns cleanup    # remove left-overs of a crashed run
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

HERE = Path(__file__).resolve().parent
NSEXEC = HERE / "nsexec.sh"
PREFIX = "mcrdl-h"            # namespace (= host) names: mcrdl-h0, mcrdl-h1, ...
BRIDGE = "mcrdl-br0"
ROOT_VETH = "mcrdl-v{}"        # root-namespace end of host k's veth pair
IFACE = "mcrdl0"               # the host's end, inside its namespace
SUBNET = "10.77.0"             # host k is SUBNET.{k+1}/24
LOCK = "/run/mcrdl-netns.lock"
PROBE_LOCK = "/run/mcrdl-netns-probe.lock"  # the probes' own: each pytest-xdist worker probes at collection
MAX_HOSTS = 16

# What a job needs to use the hosts' network (the same names a user sets on a cluster):
# gloo's interface, and UCX's (the mpich wheel's default netmod is ch4:ucx) plus
# libfabric's tcp provider for MPIR_CVAR_CH4_NETMOD=ofi. The rendezvous store binds
# the address of GLOO_SOCKET_IFNAME's interface on rank 0 (no MCRDL_MASTER_ADDR needed).
JOB_ENV = {
    "GLOO_SOCKET_IFNAME": IFACE,
    "UCX_NET_DEVICES": IFACE,
    "UCX_TLS": "tcp,self",
    "FI_TCP_IFACE": IFACE,
    "PYTHONUNBUFFERED": "1",
}

_NS_RE = re.compile(rf"^{re.escape(PREFIX)}\d+$")
_PROBE_NS_RE = re.compile(r"^mcrdl-probeq?$")  # unavailable_reason / qdisc_available
_LINK_RE = re.compile(rf"^(?:{re.escape(BRIDGE)}|{re.escape(ROOT_VETH.format(''))}\d+|mcrdl-probe(?:0|br))$")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def unavailable_reason() -> Optional[str]:
    """Why this machine cannot run the harness, or None when it can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root (creates network namespaces, veth pairs and a bridge)"
    missing = [t for t in ("ip", "unshare") if shutil.which(t) is None]
    if missing:
        return f"missing tools: {', '.join(missing)} (iproute2, util-linux)"
    with _probing():
        return _probe()


@contextlib.contextmanager
def _probing():
    """One probe at a time on this machine (they reuse fixed names)."""
    with open(PROBE_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _probe() -> Optional[str]:
    probe = "mcrdl-probe"
    proc = _ip("netns", "add", probe, check=False)
    if proc.returncode != 0:
        return f"`ip netns add` fails here: {proc.stderr.strip()}"
    try:
        proc = subprocess.run(["ip", "netns", "exec", probe, "unshare", "--uts", "true"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            return f"`ip netns exec ... unshare --uts` fails here: {proc.stderr.strip()}"
        proc = _ip("link", "add", "mcrdl-probe0", "type", "veth", "peer", "name", "mcrdl-probe1",
                   check=False)
        if proc.returncode != 0:
            return f"cannot create veth pairs: {proc.stderr.strip()}"
        _ip("link", "del", "mcrdl-probe0", check=False)
        proc = _ip("link", "add", "mcrdl-probebr", "type", "bridge", check=False)
        if proc.returncode != 0:
            return f"cannot create a bridge: {proc.stderr.strip()}"
        _ip("link", "del", "mcrdl-probebr", check=False)
    finally:
        _ip("netns", "del", probe, check=False)
    return None


# -- inventory and cleanup --------------------------------------------------------------
def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.split()]
    return [n for n in names if _NS_RE.match(n) or _PROBE_NS_RE.match(n)]


def _links() -> list[str]:
    return sorted(n for n in os.listdir("/sys/class/net") if _LINK_RE.match(n))


def _etc_dirs() -> list[str]:
    return sorted(d for d in glob.glob(f"/etc/netns/{PREFIX}*") if _NS_RE.match(os.path.basename(d)))


def leftovers() -> list[str]:
    """Everything of the harness's that exists now (empty after a clean exit)."""
    return ([f"netns {n}" for n in _namespaces()] + [f"link {n}" for n in _links()]
            + [f"dir {d}" for d in _etc_dirs()])


def _kill_in(ns: str) -> None:
    """SIGKILL every process in namespace ``ns`` (all of them started by the harness)."""
    for pid in _ip("netns", "pids", ns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


#: Did this process create /etc/netns (so cleanup may remove it)?
_made_etc_netns = False


def cleanup() -> list[str]:
    """Remove every namespace, link and /etc/netns entry of the harness (idempotent;
    kills the processes still inside its namespaces). Returns what was removed."""
    with _probing():  # (a probe's namespace is removed only once the probe is done)
        return _cleanup()


def _cleanup() -> list[str]:
    removed = leftovers()
    for ns in _namespaces():
        _kill_in(ns)
        _ip("netns", "del", ns, check=False)
    for link in _links():
        _ip("link", "del", link, check=False)
    for d in _etc_dirs():
        shutil.rmtree(d, ignore_errors=True)
    if _made_etc_netns:
        with contextlib.suppress(OSError):
            os.rmdir("/etc/netns")  # the harness made it: gone again if nothing else is in it
    # A namespace goes (taking its veth end, and so the peer) once its last process is
    # reaped; wait a little so a new run does not meet half-removed links.
    deadline = time.monotonic() + 10
    while (_links() or _namespaces()) and time.monotonic() < deadline:
        for link in _links():
            _ip("link", "del", link, check=False)
        time.sleep(0.1)
    return removed


# -- the hosts ------------------------------------------------------------------------------
def in_host(host: str, argv: Sequence[str]) -> list[str]:
    """Command line running ``argv`` on ``host`` (its namespace, its hostname)."""
    return ["ip", "netns", "exec", host, "unshare", "--uts", "sh", "-c",
            'hostname "$0" && exec "$@"', host, *argv]


def _job_env(base: dict, extra: Optional[dict]) -> dict:
    merged = {**os.environ, **base, **(extra or {})}
    return {k: v for k, v in merged.items() if v is not None}


@dataclass
class Cluster:
    hosts: list[str]
    addrs: list[str]
    delay: Optional[str] = None
    rate: Optional[str] = None
    env: dict = field(default_factory=lambda: dict(JOB_ENV))

    def counters(self) -> dict[str, dict[str, int]]:
        """Bytes and packets each host's interface sent and received so far (read on the
        root-namespace end of its veth pair: what it receives, the host sent)."""
        out = {}
        for k, host in enumerate(self.hosts):
            stats = Path("/sys/class/net") / ROOT_VETH.format(k) / "statistics"
            read = lambda name: int((stats / name).read_text())
            out[host] = {"sent": read("rx_bytes"), "received": read("tx_bytes"),
                         "sent_packets": read("rx_packets"), "received_packets": read("tx_packets")}
        return out

    def kill_all(self) -> None:
        """Kill every process running on the hosts."""
        for host in self.hosts:
            _kill_in(host)

    def launch_command(self, program: Sequence[str], nprocs: Optional[int] = None,
                       timeout: Optional[float] = None, extra: Sequence[str] = ()) -> list[str]:
        """``mcrdl run`` of ``program`` over the hosts (one rank per host by default),
        with Hydra's ssh launcher pointed at nsexec.sh. Runs on host 0."""
        cmd = [sys.executable, "-m", "mcrdl.cli", "run", "-n", str(nprocs or len(self.hosts)),
               "--hosts", ",".join(self.hosts),
               "--extra", " ".join(["-launcher", "ssh", "-launcher-exec", str(NSEXEC), *extra])]
        if timeout:
            cmd += ["--timeout", str(timeout)]
        return cmd + ["--", *program]

    def torchrun(self, program: Sequence[str], timeout: float = 300, env: Optional[dict] = None,
                 port: int = 29500, per_host: int = 1) -> "JobResult":
        """Run ``program`` under ``torchrun --nnodes=N``: one agent per host (started
        there through ``mcrdl run --launcher torchrun``), ``per_host`` ranks each, host 0 the
        rendezvous; MPI starts over torchrun's store (mcrdl.pmi). Outputs are
        concatenated in host order."""
        before = self.counters()
        full_env = _job_env(self.env, env)
        start = time.monotonic()
        procs = []
        for k, host in enumerate(self.hosts):
            cmd = [sys.executable, "-m", "mcrdl.cli", "run", "--launcher", "torchrun", "-n", str(per_host),
                   "--timeout", str(timeout),
                   "--extra", f"--nnodes={len(self.hosts)} --node-rank={k} "
                              f"--master-addr={self.addrs[0]} --master-port={port}", "--", *program]
            procs.append(subprocess.Popen(in_host(host, cmd), stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, env=full_env))
        watchdog = threading.Timer(timeout + 30, self.kill_all)
        watchdog.daemon = True
        watchdog.start()
        try:
            outs = [p.communicate()[0] for p in procs]
        finally:
            watchdog.cancel()
        rc = next((p.returncode for p in procs if p.returncode), 0)
        seconds = time.monotonic() - start
        after = self.counters()
        traffic = {h: {k: after[h][k] - before[h][k] for k in after[h]} for h in self.hosts}
        return JobResult(rc, "".join(outs), traffic, seconds)

    def run(self, program: Sequence[str], nprocs: Optional[int] = None, timeout: float = 300,
            env: Optional[dict] = None, extra: Sequence[str] = (), echo: bool = False) -> "JobResult":
        """Run ``program`` as a job over the hosts (``mcrdl run`` kills it after
        ``timeout`` s); its output (echoed as it comes with ``echo``) and the bytes
        each host's interface moved meanwhile. ``env`` adds variables (None: unset)."""
        before = self.counters()
        full_env = _job_env(self.env, env)
        start = time.monotonic()
        proc = subprocess.Popen(in_host(self.hosts[0], self.launch_command(program, nprocs, timeout, extra)),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env)
        # Backstop for `mcrdl run --timeout`: whatever still runs on the hosts (e.g. a
        # proxy holding the output pipe open) is killed a little later.
        watchdog = threading.Timer(timeout + 30, self.kill_all)
        watchdog.daemon = True
        watchdog.start()
        lines = []
        try:
            for line in proc.stdout:
                lines.append(line)
                if echo:
                    print(line, end="", flush=True)
            rc = proc.wait()
        finally:
            watchdog.cancel()
        seconds = time.monotonic() - start
        after = self.counters()
        traffic = {h: {k: after[h][k] - before[h][k] for k in after[h]} for h in self.hosts}
        return JobResult(rc, "".join(lines), traffic, seconds)


@dataclass
class JobResult:
    returncode: int
    output: str
    traffic: dict  # host -> {"sent", "received", "sent_packets", "received_packets"} during the job
    seconds: float

    def traffic_lines(self) -> list[str]:
        return [f"{h}: sent {t['sent']:,} B ({t['sent_packets']:,} packets), "
                f"received {t['received']:,} B ({t['received_packets']:,} packets)"
                for h, t in self.traffic.items()]


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


_RATE_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
               "bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12}


def rate_bytes(rate: str) -> float:
    """Bytes per second of a tc rate such as ``1gbit``, ``100mbit`` or ``50mbps``."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-z]*)\s*", rate.lower())
    if not m or (m.group(2) or "bit") not in _RATE_UNITS:
        raise ValueError(f"rate {rate!r}: expected a number and one of {', '.join(_RATE_UNITS)}")
    return float(m.group(1)) * _RATE_UNITS[m.group(2) or "bit"]


def shaping(delay: Optional[str], rate: Optional[str]) -> list[str]:
    """The root qdisc of every host's interface: ``netem`` for a delay (with its
    rate, if any); a token bucket (``tbf``) for a rate alone, which also works on
    kernels built without sch_netem. The bucket holds 1 ms of traffic (at least one
    64 KiB GSO packet) and queues up to 100 ms."""
    if delay:
        return ["netem", "limit", "100000", "delay", delay] + (["rate", rate] if rate else [])
    per_s = rate_bytes(rate)
    burst = max(64 << 10, int(per_s / 1000))
    return ["tbf", "rate", rate, "burst", str(burst), "limit", str(max(1 << 20, int(per_s / 10)))]


def qdisc_available(kind: str) -> bool:
    """Whether this kernel has qdisc ``kind`` (tried on a throw-away veth pair in a
    throw-away namespace)."""
    ns = "mcrdl-probeq"
    with _probing():
        _ip("netns", "add", ns, check=False)
        try:
            _ip("-n", ns, "link", "add", "q0", "type", "veth", "peer", "name", "q1", check=False)
            args = shaping("1ms", None) if kind == "netem" else shaping(None, "1gbit")
            return subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "q0", "root", *args],
                                  capture_output=True).returncode == 0
        finally:
            _ip("netns", "del", ns, check=False)


def _create(n: int, delay: Optional[str], rate: Optional[str]) -> Cluster:
    global _made_etc_netns
    _made_etc_netns = _made_etc_netns or not os.path.isdir("/etc/netns")
    hosts = [f"{PREFIX}{k}" for k in range(n)]
    addrs = [f"{SUBNET}.{k + 1}" for k in range(n)]
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("link", "set", BRIDGE, "up")
    etc_hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for a, h in zip(addrs, hosts))
    for k, (host, addr) in enumerate(zip(hosts, addrs)):
        _ip("netns", "add", host)
        os.makedirs(f"/etc/netns/{host}", exist_ok=True)
        _write(f"/etc/netns/{host}/hosts", etc_hosts)
        # no IPv6 chatter (router solicitations, MLD) in the byte counts
        subprocess.run(["ip", "netns", "exec", host, "sh", "-c",
                        "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; "
                        "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6"], capture_output=True)
        veth = ROOT_VETH.format(k)
        _ip("link", "add", veth, "type", "veth", "peer", "name", IFACE, "netns", host)
        _ip("link", "set", veth, "master", BRIDGE)
        _ip("link", "set", veth, "up")
        _ip("-n", host, "link", "set", "lo", "up")
        _ip("-n", host, "addr", "add", f"{addr}/24", "dev", IFACE)
        _ip("-n", host, "link", "set", IFACE, "up")
        if delay or rate:
            qdisc = ["tc", "-n", host, "qdisc", "add", "dev", IFACE, "root", *shaping(delay, rate)]
            proc = subprocess.run(qdisc, capture_output=True, text=True)
            if proc.returncode != 0:
                hint = " (this kernel has no sch_netem: --delay cannot work here)" if delay else ""
                raise RuntimeError(f"{' '.join(qdisc)}: {proc.stderr.strip()}{hint}")
    _wait_reachable(hosts, addrs)
    return Cluster(hosts, addrs, delay, rate)


def _wait_reachable(hosts: list[str], addrs: list[str], seconds: float = 10) -> None:
    """Host 0 reaches every other host's address by TCP (a refused connection counts:
    the address answered). Bridge ports and DAD can take a moment."""
    probe = ("import socket,sys,time\n"
             "for a in sys.argv[1:]:\n"
             "    end=time.time()+%s\n"
             "    while True:\n"
             "        s=socket.socket(); s.settimeout(1)\n"
             "        try: s.connect((a,9)); break\n"
             "        except ConnectionRefusedError: break\n"
             "        except OSError:\n"
             "            if time.time()>end: sys.exit('unreachable: '+a)\n"
             "            time.sleep(0.1)\n"
             "        finally: s.close()\n" % seconds)
    proc = subprocess.run(["ip", "netns", "exec", hosts[0], sys.executable, "-c", probe, *addrs[1:]],
                          capture_output=True, text=True, timeout=seconds * len(addrs) + 10)
    if proc.returncode != 0:
        raise RuntimeError(f"namespace hosts not reachable from {hosts[0]}: {proc.stderr.strip()}")


@contextlib.contextmanager
def hosts(n: int, delay: Optional[str] = None, rate: Optional[str] = None) -> Iterator[Cluster]:
    """n namespace hosts for the duration of the block (see the module docstring);
    one harness at a time per machine (a lock file), removed on exit or failure."""
    if not 1 <= n <= MAX_HOSTS:
        raise ValueError(f"hosts: n must be 1..{MAX_HOSTS}, got {n}")
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(f"netns harness cannot run here: {reason}")
        try:
            stale = cleanup()
            if stale:
                print(f"netns: removed left-overs of an earlier run: {', '.join(stale)}", file=sys.stderr)
            yield _create(n, delay, rate)
        finally:
            cleanup()


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.multihost.netns", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name, helptext in (("run", "run PROGRAM with mcrdl run (mpiexec), one rank per namespace host"),
                           ("torchrun", "run PROGRAM under torchrun --nnodes=N, one agent and rank per host")):
        r = sub.add_parser(name, help=helptext)
        r.add_argument("-n", "--hosts", type=int, default=2, help="number of hosts (= ranks), default 2")
        r.add_argument("--delay", help="tc netem delay on every host's interface, e.g. 1ms (needs sch_netem)")
        r.add_argument("--rate", help="rate limit of every host's interface, e.g. 1gbit (tc tbf; netem with --delay)")
        r.add_argument("--timeout", type=float, default=600, help="kill the job after this many seconds")
        r.add_argument("program", nargs=argparse.REMAINDER, help="-- x.py args | -m module args | tool args")
    sub.add_parser("check", help="say whether this machine can run the harness")
    sub.add_parser("cleanup", help="remove left-overs of an earlier (crashed) run")
    args = p.parse_args(argv)
    if args.command == "check":
        reason = unavailable_reason()
        print(reason or "ok: network namespaces, veth pairs and bridges work here")
        return 1 if reason else 0
    if args.command == "cleanup":
        with open(LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            removed = cleanup()
        print("removed: " + ", ".join(removed) if removed else "nothing to remove")
        return 0
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        p.error(f"{args.command}: no program (put it after --)")
    with hosts(args.hosts, args.delay, args.rate) as cluster:
        shaped = ", ".join(x for x in (args.delay and f"delay {args.delay}",
                                       args.rate and f"rate {args.rate}") if x) or "no shaping"
        print(f"netns: {len(cluster.hosts)} hosts {', '.join(f'{h}={a}' for h, a in zip(cluster.hosts, cluster.addrs))}"
              f" ({shaped}); job env: {' '.join(f'{k}={v}' for k, v in cluster.env.items())}", flush=True)
        if args.command == "torchrun":
            result = cluster.torchrun(program, timeout=args.timeout)
            print(result.output, end="")
        else:
            result = cluster.run(program, timeout=args.timeout, echo=True)
        print(f"netns: job exited {result.returncode} after {result.seconds:.1f} s; interface traffic:")
        for line in result.traffic_lines():
            print("  " + line)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())

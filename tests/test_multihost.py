"""Several hosts for real: network namespaces as hosts (tests/multihost/netns.py),
one rank per host, launched by MPICH's mpiexec through Hydra's ssh launcher.

Needs root (namespaces, veth pairs, a bridge); skipped otherwise, saying why.
The rendezvous-binding test on one host needs nothing special."""
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from conftest import JOBS, JobOutput, read_verdicts, run_job
from multihost import netns

REASON = netns.unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"multi-host harness: {REASON}")


def test_store_binds_loopback_on_one_host():
    """All ranks on one host: the rendezvous store listens on 127.0.0.1 only."""
    out = run_job(2, "store_job.py", "127.0.0.1", timeout=120)
    assert "listens on ['127.0.0.1']" in out and out.count("OK store") == 2, out[-3000:]


def test_store_binds_master_addr_with_env_rendezvous(tmp_path):
    """Ranks started by hand with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (no
    MPI, no torchrun agent): rank 0's store listens on MASTER_ADDR only, not on
    every interface as torch's TCPStore would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, str(JOBS / "store_job.py"), "127.0.0.1"], cwd=JOBS,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    out = "".join(outs)
    assert all(p.returncode == 0 for p in procs), out[-3000:]
    assert "listens on ['127.0.0.1']" in out and out.count("OK store") == 2, out[-3000:]


def test_store_failure_on_rank_0_reaches_every_rank():
    """MCRDL_MASTER_ADDR that is not rank 0's address: every rank fails at init
    with the reason (none is left waiting for the store)."""
    out = run_job(2, "store_job.py", "-", timeout=60, env={"MCRDL_MASTER_ADDR": "203.0.113.7"},
                  expect_rc=None)
    assert out.count("rank 0 could not start the rendezvous store") >= 2, out[-3000:]
    assert "cannot listen on '203.0.113.7'" in out and "OK store" not in out


def _job(cluster, program, timeout=240, **kw):
    result = cluster.run(program, timeout=timeout, **kw)
    assert result.returncode == 0, f"{program} exited {result.returncode}:\n{result.output[-6000:]}"
    return result


def _checked_job(cluster, program, tmp_path, timeout=240):
    """``program`` (a tests/jobs/ job) over the hosts, with its ranks' verdicts
    (tests/jobs/verdicts.py: the hosts share this filesystem): its JobResult and
    its JobOutput, whose ``require`` names a failed check, rank and line."""
    directory = tmp_path / "verdicts"
    directory.mkdir()
    result = cluster.run(program, timeout=timeout, env={"TEST_VERDICTS": str(directory)})
    out = JobOutput(result.output)
    out.verdicts, out.rc = read_verdicts(directory), result.returncode
    return result, out


def _moved(result, at_least):
    """Every host's interface sent and received at least ``at_least`` bytes."""
    for host, t in result.traffic.items():
        assert t["sent"] >= at_least and t["received"] >= at_least, (host, result.traffic_lines())


@needs_netns
@pytest.mark.parametrize("n", [2, 4])
def test_jobs_across_namespace_hosts(n, tmp_path):
    with netns.hosts(n) as cluster:
        # the store binds the chosen interface's address on rank 0's host, nothing else
        r = _job(cluster, [str(JOBS / "store_job.py"), cluster.addrs[0]], timeout=120)
        assert f"rank 0 on {cluster.hosts[0]}: store port" in r.output, r.output[-3000:]
        assert r.output.count("OK store") == n
        # the correctness suite's core job: every op x dtype x size x sync/async, both backends
        r, out = _checked_job(cluster, [str(JOBS / "ops_job.py"), "mpi", "gloo"], tmp_path)
        out.require(["ops finished"], range(n))
        assert r.returncode == 0 and "on ['mpi', 'gloo']" in r.output, r.output[-3000:]
        _moved(r, 1_000_000)  # the checks' data went over the veths (~3 MB per host and backend for 2)
        # a tiny bench sweep with result checks, every variant
        out = tmp_path / "bench.json"
        r = _job(cluster, ["-m", "mcrdl.cli", "bench", "--quick", "--ops", "all_reduce,all_to_all,p2p",
                           "--sizes", "4,1M", "--check", "--json", str(out)])
        doc = json.loads(out.read_text())
        assert doc["metadata"]["hosts"] == cluster.hosts  # each rank saw its own hostname
        assert {x["check"] for x in doc["results"]} == {"ok"}, r.output[-3000:]
        _moved(r, 10 << 20)  # 1 MiB messages x iterations x variants
    assert netns.leftovers() == []


@needs_netns
def test_store_address_rules_across_hosts():
    """Which address rank 0's store binds on a multi-host job: MCRDL_MASTER_ADDR
    (a second address of host 0 here), else GLOO_SOCKET_IFNAME's interface (the
    other tests), else the hostname's address; a wrong one fails on every rank."""
    with netns.hosts(2) as cluster:
        subprocess.run(["ip", "-n", cluster.hosts[0], "addr", "add", "10.77.0.101/24", "dev", netns.IFACE],
                       check=True)
        store_job = str(JOBS / "store_job.py")
        r = _job(cluster, [store_job, "10.77.0.101"], timeout=120, env={"MCRDL_MASTER_ADDR": "10.77.0.101"})
        assert r.output.count("OK store") == 2
        # no interface named: the hostname (mcrdl-h0 -> 10.77.0.1; gloo resolves it too)
        r = _job(cluster, [store_job, "10.77.0.1"], timeout=120, env={"GLOO_SOCKET_IFNAME": None})
        assert r.output.count("OK store") == 2
        # host 1's address is not host 0's: both ranks fail, with the reason
        r = cluster.run([store_job, "-"], timeout=60, env={"MCRDL_MASTER_ADDR": cluster.addrs[1]})
        assert r.returncode != 0 and r.output.count("could not start the rendezvous store") >= 2, r.output[-3000:]
    assert netns.leftovers() == []


@needs_netns
def test_torchrun_nnodes_across_namespace_hosts():
    """torchrun --nnodes=2, one agent per host. The store is torchrun's own, and it
    listens on every interface (torch's choice, kept); MPI starts over it across the
    hosts (mcrdl.pmi: its business cards travel through the store), and every op runs
    on both backends."""
    with netns.hosts(2) as cluster:
        r = cluster.torchrun([str(JOBS / "store_job.py"), "::"], timeout=120)
        assert r.returncode == 0 and r.output.count("OK store") == 2, r.output[-4000:]
        r = cluster.torchrun([str(JOBS / "ops_job.py")], timeout=300)
        counts = re.findall(r"OK (\d+) checks on \['mpi', 'gloo'\]", r.output)
        assert r.returncode == 0 and len(counts) == 2 and counts[0] == counts[1], r.output[-4000:]
        _moved(r, 1_000_000)
        # two ranks per host: MPI's node map from the hostnames (shared memory within a
        # host, the network between them), every op on MPI with a subgroup across hosts
        r = cluster.torchrun([str(JOBS / "ops_job.py"), "mpi"], timeout=400, per_host=2)
        counts = re.findall(r"OK (\d+) checks on \['mpi'\]", r.output)
        assert r.returncode == 0 and len(counts) == 4, r.output[-4000:]
        _moved(r, 500_000)
    assert netns.leftovers() == []


def _latencies(path):
    return {(x["op"], x["bytes"], x["variant"]): x["max_us"] for x in json.loads(path.read_text())["results"]}


@needs_netns
def test_rate_limit_shows_in_time(tmp_path):
    """100 Mbit/s on every host's interface (tc tbf): 1 MiB between two hosts takes
    >= 1 MiB / 12.5 MB/s = 84 ms on either backend (~ 2 ms without the limit)."""
    out = tmp_path / "bench.json"
    with netns.hosts(2, rate="100mbit") as cluster:
        _job(cluster, ["-m", "mcrdl.cli", "bench", "--ops", "p2p", "--sizes", "1M", "--variants", "mpi,gloo",
                       "--iters", "2", "--large-iters", "2", "--warmup", "1", "--rounds", "1",
                       "--json", str(out)])
    lat = _latencies(out)
    assert len(lat) == 2 and all(us >= 0.8 * (1 << 20) / 12.5e6 * 1e6 for us in lat.values()), lat
    assert netns.leftovers() == []


@needs_netns
@pytest.mark.skipif(REASON is None and not netns.qdisc_available("netem"),
                    reason="this kernel has no sch_netem (tc netem), so no delay can be added")
def test_netem_delay_shows_in_latency(tmp_path):
    """1 ms each way on every host's interface: a 4-byte exchange takes >= 1 ms."""
    out = tmp_path / "bench.json"
    with netns.hosts(2, delay="1ms") as cluster:
        _job(cluster, ["-m", "mcrdl.cli", "bench", "--ops", "p2p,all_reduce", "--sizes", "4",
                       "--variants", "mpi,gloo", "--iters", "10", "--rounds", "1", "--json", str(out)])
    lat = _latencies(out)
    assert all(us >= 1000 for us in lat.values()), lat
    assert netns.leftovers() == []


@needs_netns
def test_everything_removed_after_failure():
    """A failed job, a process left running on a host and an exception in the block:
    all namespaces, links and /etc/netns entries are gone afterwards, the process too.
    Left-overs of a crashed run are removed before the next one starts."""
    subprocess.run(["ip", "netns", "add", "mcrdl-h9"], check=True)  # a "crashed" run's
    subprocess.run(["ip", "link", "add", "mcrdl-v9", "type", "veth", "peer", "name", "mcrdl-v9p"], check=True)
    assert "netns mcrdl-h9" in netns.leftovers() and "link mcrdl-v9" in netns.leftovers()
    sleeper = None
    with pytest.raises(RuntimeError, match="induced"):
        with netns.hosts(2) as cluster:
            assert "netns mcrdl-h9" not in netns.leftovers()  # removed before creating
            sleeper = subprocess.Popen(netns.in_host(cluster.hosts[1], ["sleep", "300"]))
            r = cluster.run([str(JOBS / "ops_job.py"), "no-such-backend"], timeout=60)
            assert r.returncode != 0
            raise RuntimeError("induced failure")
    assert sleeper.wait(timeout=10) != 0  # killed by the cleanup
    deadline = time.monotonic() + 10
    while netns.leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert netns.leftovers() == []


@needs_netns
def test_cli_run_and_cleanup():
    proc = subprocess.run([sys.executable, "-m", "tests.multihost.netns", "run", "-n", "2", "--timeout", "60",
                           "--", str(JOBS / "store_job.py"), "10.77.0.1"],
                          capture_output=True, text=True, timeout=120, cwd=JOBS.parents[1])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mcrdl-h0: sent" in proc.stdout and proc.stdout.count("OK store") == 2
    proc = subprocess.run([sys.executable, "-m", "tests.multihost.netns", "cleanup"],
                          capture_output=True, text=True, timeout=60, cwd=JOBS.parents[1])
    assert proc.returncode == 0 and "nothing to remove" in proc.stdout

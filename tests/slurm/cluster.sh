#!/usr/bin/env bash
# A one-host Slurm cluster (munged, slurmctld, slurmd) from Debian's packages,
# for tests/test_slurm.py and by hand:
#   tests/slurm/cluster.sh up DIR     # install if missing (root), configure in DIR, start
#   SLURM_CONF=DIR/slurm.conf srun -n 2 hostname
#   tests/slurm/cluster.sh down DIR
# Everything it writes is under DIR (its slurm.conf, state, logs), except munge's
# own key and socket, which the package places. The node claims 8 CPUs so that
# 4 ranks fit on a 2-core machine (oversubscribed: correctness, not timing).
set -euo pipefail
cmd=${1:?usage: cluster.sh up|down DIR}
dir=$(realpath -m "${2:?usage: cluster.sh up|down DIR}")

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

down() {
    for pidfile in "$dir"/slurmd.pid "$dir"/slurmctld.pid; do
        [[ -f $pidfile ]] && kill "$(cat "$pidfile")" 2>/dev/null || true
    done
    rm -f "$dir"/slurmd.pid "$dir"/slurmctld.pid
}

if [[ $cmd == down ]]; then down; exit 0; fi
[[ $cmd == up ]] || { echo "cluster.sh: unknown command $cmd (up|down)" >&2; exit 2; }

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    [[ $(id -u) == 0 ]] || { echo "cluster.sh: slurm-wlm and munge are not installed, and installing them needs root" >&2; exit 3; }
    export DEBIAN_FRONTEND=noninteractive
    { apt-get install -y -q slurm-wlm munge || { apt-get update -q && apt-get install -y -q slurm-wlm munge; }; } \
        >"$dir.apt.log" 2>&1 \
        || { echo "cluster.sh: apt-get install slurm-wlm munge failed (see $dir.apt.log)" >&2; exit 3; }
fi

mkdir -p "$dir"/state "$dir"/spool
host=$(hostname -s)
cat >"$dir/slurm.conf" <<CONF
ClusterName=mcrdl
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=pmi2
ReturnToService=2
SchedulerType=sched/backfill
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
KillWait=5
NodeName=$host NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF

if ! pgrep -x munged >/dev/null; then
    mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
    [[ -s /etc/munge/munge.key ]] || { mungekey --create 2>/dev/null || /usr/sbin/create-munge-key -f; }
    if [[ $(id -u) == 0 ]]; then runuser -u munge -- munged; else munged; fi
fi
down  # a cluster left in DIR by an earlier run
export SLURM_CONF=$dir/slurm.conf
slurmctld -i
slurmd
for _ in $(seq 1 60); do  # the node is up once sinfo calls it idle
    if sinfo -h -o %T 2>/dev/null | grep -qx idle; then echo "$dir/slurm.conf"; exit 0; fi
    sleep 0.5
done
echo "cluster.sh: the node did not come up in 30 s; logs: $dir/slurmctld.log $dir/slurmd.log" >&2
tail -n 20 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 || true
down
exit 4

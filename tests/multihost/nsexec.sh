#!/bin/sh
# An ssh stand-in for MPICH's Hydra launcher, used by tests/multihost/netns.py:
#   mpiexec -launcher ssh -launcher-exec tests/multihost/nsexec.sh -hosts mcrdl-h0,mcrdl-h1 ...
# Hydra calls it like ssh: `nsexec.sh [ssh options] HOST COMMAND...`. It runs COMMAND
# (a shell command line, as ssh would hand it to the remote shell) inside the
# network namespace HOST, with HOST as the hostname (its own UTS namespace), so
# every "host" has its own interfaces, addresses and name. Needs root.
while [ $# -gt 0 ]; do
  case "$1" in
    -[BbcDEeFIiJLlmOopQRSWw]) shift 2 ;;   # ssh options that take an argument
    -*) shift ;;                           # flags (Hydra passes -x)
    *) break ;;
  esac
done
host=$1
shift
case "$host" in
  mcrdl-h[0-9]|mcrdl-h[0-9][0-9]) ;;
  *) echo "nsexec.sh: '$host' is not one of the harness's namespace hosts (mcrdl-hN)" >&2; exit 255 ;;
esac
exec ip netns exec "$host" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
